r"""Answer checking: which final answer a rollout gives, and whether two answers are the same.

Every reward in test-time RL comes from comparing answers, so the comparison must be exact in both
directions: a false "equal" rewards a wrong rollout, a false "not equal" splits one answer into two
vote classes and punishes a right one.

Three layers, cheapest first:

1. extract_answer(text): the final answer a response states (a "final answer is" sentence, the last
   \boxed{...}, an "answer is" sentence, a short response's math span; rules in its docstring).
2. answer_key(ans): a canonical spelling, computed with string rules only. Presentation is removed
   (\left, \dfrac, $, \text units, degree signs, thousands separators, "x =", choice letters with
   text), plain numbers become exact reduced fractions (0.5, \frac12, 0.\overline{3}, 142.0, 025),
   inequalities become intervals, column vectors become tuples, lists of roots become sorted sets
   (\pm expanded). Equal keys mean equal answers; two plain numbers with different keys are
   different answers.
3. is_equiv(pred, gold): equal keys, else a symbolic comparison of the two keys with math-verify
   (sympy). Decimals reach sympy as exact fractions, so a rounded decimal never equals an exact
   value. The symbolic step runs in a helper process that is killed when it overruns its hard limit
   (docs/answers.md); a timed-out comparison counts as "not equal". Results are cached.

same_answer(a, b) is the class test for voting: weighted_vote(answers, verified, omega,
key=answer_key, same=same_answer) buckets by key and joins the buckets that only sympy can tell are
equal.
"""

import functools
import re
from fractions import Fraction

EQUIV_TIME_LIMIT_S = 2.0
# longer than any real answer: compared as its text, so that no rule runs on a degenerate rollout's
# 100,000 characters (several rules take time quadratic in the length)
MAX_ANSWER_CHARS = 1000
# a decimal with this many significant digits is a printed double, not a human rounding
MACHINE_DIGITS = 15


# --------------------------------------------------------------------------------------------------
# Extracting the final answer

_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_FINAL_ANSWER = re.compile(r"final answer\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*", re.IGNORECASE)
# $$...$$ and \[...\] may span lines, $...$ and \(...\) may not; "\$" is a dollar sign, not a
# delimiter
_MATH_SPAN = re.compile(r"\$\$((?s:.+?))\$\$|(?<!\\)\$((?:\\\$|[^$\n])+?)(?<!\\)\$"
                        r"|\\\(([^\n]+?)\\\)|\\\[((?s:.+?))\\\]")
# what may stand between boxes that together give one answer: "\boxed{-2} and \boxed{1}",
# "\boxed{1},\boxed{2}"
_BOX_JOINER = re.compile(r"(?:\s|[,;.$~&]|\\[()\[\],;:! ]|\\q?quad\b|\\text\{[^{}\d]{0,30}\}"
                         r"|\b(?:and|or)\b)*")
SHORT_RESPONSE_CHARS = 200
_EMPHASIS = re.compile(r"^[*_\s]+")  # markdown around a stated answer: "**Final Answer:** 25"
_POINTING_BACK = {"above", "below", "shown", "see", "boxed", "box", "correct", "indeed", "as", "is",
                  "it", "this", "that", "the", "in"}


def closing_braces(text, start=0):
    """The index of each '{' from text[start] on -> the index of the '}' that closes it (unclosed
    ones are left out): every brace group of the text in one pass (a group closes where it does
    whatever came before it)."""
    closing, open_braces = {}, []
    for i, c in enumerate(text[start:], start):
        if c == "{":
            open_braces.append(i)
        elif c == "}" and open_braces:
            closing[open_braces.pop()] = i
    return closing


def _boxes(text):
    """(start, end, content) of every closed, non-empty \boxed{...} / \fbox{...} / "\boxed 5",
    outermost only."""
    matches = list(_BOX.finditer(text))
    found, closing = [], closing_braces(text, matches[0].start()) if matches else {}
    for m in matches:
        if found and m.start() < found[-1][1]:
            continue  # a box inside the previous one
        if m.group(1):
            end = closing.get(m.start(1))
            content, end = (text[m.start(1) + 1:end], end + 1) if end else (None, None)
        else:
            token = re.match(r"[^\s$]+", text[m.end():])
            content, end = (token.group(0), m.end() + token.end()) if token else (None, None)
        if content is not None and content.strip():
            found.append((m.start(), end, content.strip()))
    return found


def _math_spans(text):
    r"""(start, end, content) of every $...$, $$...$$, \(...\), \[...\] span."""
    return [(m.start(), m.end(), next(g for g in m.groups() if g is not None).strip())
            for m in _MATH_SPAN.finditer(text)]


def _last_run(text, spans):
    """Start and content of the last span, joined with the spans just before it that only connectors
    separate."""
    spans = [span for span in spans if span[2]]
    if not spans:
        return None, None
    run = [spans[-1]]
    for span in reversed(spans[:-1]):
        if not _BOX_JOINER.fullmatch(text[span[1]:run[0][0]]):
            break
        run.insert(0, span)
    return run[0][0], ", ".join(content for _, _, content in run)


def _sentence_answer(text, match):
    """What follows an "answer is" match (markdown emphasis around it left out): its leading math
    span, joined with the spans after it that only connectors separate ("$x=3$ or $x=5$"), else the
    sentence up to its full stop."""
    rest = _EMPHASIS.sub("", text[match.end():])
    spans = _math_spans(rest)
    if spans and spans[0][0] == 0:
        run = [spans[0]]
        for span in spans[1:]:
            between = rest[run[-1][1]:span[0]]
            if "." in between or not _BOX_JOINER.fullmatch(between):
                break
            run.append(span)
        if len(run) > 1 and re.match(r"\s*[A-Za-z]", rest[run[-1][1]:]):
            run = run[:-1]  # its last span is the sentence's subject: '$5$, and $5^2 = 25$ confirms
        return ", ".join(content for _, _, content in run if content) or None
    answer = re.split(r"\.(?:\s|$)|\n|\sI hope\b", rest)[0]
    return answer.strip().strip("$*_").strip() or None


def extract_answer(text):
    r"""The final answer in a model's output, or None when it states none. The rules, first match
    wins:

    1. A "final answer is X" / "Final Answer: X" sentence after the last box (Minerva's "Final
       Answer: The final answer is $X$. I hope it is correct.", or a conclusion that overrides a
       mid-solution box): X is the sentence's leading math span ($X$, \(X\), ...) with the spans
       that only connectors join to it ("$x=3$ or $x=5$"), else the sentence up to its full stop;
       markdown emphasis around X is left out. Words after a box without a digit or math that
       point back or run to three ("is in the box above", "see above") leave the box.
    2. The last \boxed{...} (or \fbox{...}, or "\boxed 5"); empty and unclosed boxes do not count.
       Boxes just before it that only connectors separate (commas, "and", "or", \quad, $, a short
       \text{...} without digits) belong to the same answer: "\boxed{-2} and \boxed{1}" gives
       "-2, 1".
    3. The last "the answer is X" / "final answer: X" sentence, read as in rule 1.
    4. A short response (at most SHORT_RESPONSE_CHARS characters, e.g. "Answer: $9$" or "We find
       $x<3$."): its last math span, joined with the spans before it like boxes ("$1$ and $2$").
       Unmarked prose ("the number is 10") gives no answer, and a long solution that never marks its
       answer has none, so that a truncated rollout does not vote with an intermediate value.
    An answer with nothing in it once spacing and markup go ("\text{}", "\,", ".") is none."""
    answer = _stated_answer(text)
    return answer if answer is not None and _key(answer) else None


def _stated_answer(text):
    if text is None:
        return None
    box_start, boxed = _last_run(text, _boxes(text))
    finals = [m for m in _FINAL_ANSWER.finditer(text) if box_start is None or m.start() > box_start]
    final = _sentence_answer(text, finals[-1]) if finals else None
    # a blank sentence and words that point back ("in the box above", "shown above", "correct")
    # leave the box; "C", "(C)", "five", "\pi" replace it
    words = re.findall(r"[a-z]+", final.lower()) if final else []
    if final and _key(final) and (
            boxed is None or re.search(r"[\d\\]", final)
            or not (len(words) >= 3 or set(words) <= _POINTING_BACK)
            or _MATH_SPAN.match(_EMPHASIS.sub("", text[finals[-1].end():]))):
        return final
    if boxed is not None:
        return boxed
    sentences = list(_ANSWER_IS.finditer(text))
    if sentences:
        return _sentence_answer(text, sentences[-1])
    short = text.strip()
    if len(short) > SHORT_RESPONSE_CHARS:
        return None
    return _last_run(short, _math_spans(short))[1]


# --------------------------------------------------------------------------------------------------
# Canonical keys (string rules only)

_UNICODE = str.maketrans({
    "\u2212": "-", "\u221e": r"\infty", "\u2264": r"\le ", "\u2265": r"\ge ", "\u00b0": r"^\circ",
    "\u00d7": r"\times ", "\u00b7": r"\cdot ", "\u03c0": r"\pi ", "\u00b1": r"\pm ",
    "\u222a": r"\cup ", "\u2009": r"\,", "\u202f": r"\,", "\u00a0": " "})
_SPACING = re.compile(r"(?<!\\)\\[,;:! ]|\\q?quad|~")
_UNITS = (r"(?:square\s+|sq\.?\s+|cubic\s+)?(?:units?|cm|mm|km|m|meters?|metres?|inch(?:es)?|in|"
          r"feet|foot|ft|yards?|miles?|mph|seconds?|minutes?|hours?|days?|years?|cents?|dollars?|"
          r"degrees?|pounds?|grams?|kg|liters?|people|students|ways|sq)")
_TRAILING_UNIT = re.compile(r"(?<=[\d}).])\s*(?:\\text\{\s*" + _UNITS
                            + r"\s*\}|\\text\{\s*[a-zA-Z ]+\}|\s"
                            + _UNITS + r"\b)\s*(?:\^\{?[23]\}?)?\s*$")
_CHOICE = re.compile(r"^(?:\\text\{\s*)?\(([A-E])\)")
_NUMBER = re.compile(r"^([-+]?)(\d*)(?:\.(\d*))?(?:\\overline\{(\d+)\}|\\overline(\d))?$")
_FRAC = re.compile(r"^([-+]?)(\d*)\\frac\{([-+]?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}$")
_SLASH = re.compile(r"^([-+]?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)$")
_SCIENTIFIC = re.compile(r"^([-+]?\d*\.?\d+)(?:\\times|\\cdot)10\^\{?([-+]?\d+)\}?$"
                         r"|^([-+]?\d*\.?\d+)e([-+]?\d+)$")
_RELATION = {r"\leq": "<=", r"\leqslant": "<=", r"\le": "<=", r"\geq": ">=", r"\geqslant": ">=",
             r"\ge": ">=", r"\lt": "<", r"\gt": ">", "=<": "<=", "=>": ">=", r"\neq": "!=",
             r"\ne": "!="}
_INFINITY = re.compile(r"\\infty|\\inf\b|\binf(?:inity)?\b|\boo\b")


def _split_top(s, sep):
    """Split s at `sep` where it is not inside (), [], {}."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            start = i + len(sep)
            i = start
            continue
        i += 1
    parts.append(s[start:])
    return parts


def _strip_delimiters(s):
    r"""Remove what surrounds an answer: $...$, \(...\), \boxed{}, \displaystyle, a final full
    stop."""
    while True:
        before = s
        s = re.sub(r"(?<!\d)\.$", "", s.strip()).strip()
        s = re.sub(r"^\$+|\$+$", "", s).strip()
        s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
        m = re.match(r"^\\(?:boxed|fbox)\s*\{", s)
        if m and closing_braces(s, m.end() - 1).get(m.end() - 1) == len(s) - 1:
            s = s[m.end():-1]
        s = s.replace(r"\displaystyle", "")
        if s == before:
            return s


def _as_fraction(sign, whole, num, den):
    if Fraction(den) == 0:
        return None
    value = int(whole or 0) + Fraction(num) / Fraction(den)
    return -value if sign == "-" else value


def _number(s):
    r"""The exact value of a plain number spelling (25, 025, 142.0, .5, 0.\overline{3}, \frac{3}{4},
    3/4, 1\frac{4}{5}, 6.72\times10^{-5}), or None."""
    # int() refuses more than 4300 digits; such a spelling is no plain answer anyway
    if len(s) > MAX_ANSWER_CHARS:
        return None
    m = _NUMBER.match(s)
    if m and (m.group(2) or m.group(3) or m.group(4) or m.group(5)):
        sign, whole, decimals, repeat = (m.group(1), m.group(2) or "0", m.group(3) or "",
                                         m.group(4) or m.group(5))
        value = Fraction(int(whole + decimals), 10 ** len(decimals))
        if repeat:
            value += Fraction(int(repeat), (10 ** len(repeat) - 1) * 10 ** len(decimals))
        # a printed double: the fraction it rounds
        elif len((whole + decimals).lstrip("0")) >= MACHINE_DIGITS:
            simple = value.limit_denominator(10 ** 6)
            value = simple if abs(simple - value) <= abs(value) * Fraction(1, 10 ** 15) else value
        return -value if sign == "-" else value
    m = _FRAC.match(s)
    if m:
        return _as_fraction(*m.groups())
    m = _SLASH.match(s)
    if m:
        return _as_fraction(m.group(1), "", m.group(2), m.group(3))
    m = _SCIENTIFIC.match(s)
    if m:
        mantissa, exponent = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        if abs(int(exponent)) <= 1000:  # 1e999999999 would take minutes to write out exactly
            return Fraction(mantissa) * Fraction(10) ** int(exponent)
    return None


def _fraction_str(value):
    return (str(value.numerator) if value.denominator == 1
            else f"{value.numerator}/{value.denominator}")


def _exact_decimals(s):
    r"""Write decimals inside an expression as exact fractions, so that sympy never rounds."""
    def exact(m):
        value = Fraction(m.group(0))
        return (str(value.numerator) if value.denominator == 1
                else rf"\frac{{{value.numerator}}}{{{value.denominator}}}")
    return re.sub(r"(?<![\d.])\d*\.\d+(?![\d.])", exact, s)


def _strip_group(s):
    """A bare group, '{1,3}', is what it prints: its content (a \\choose inside keeps it)."""
    if s[:1] == "{" and closing_braces(s).get(0) == len(s) - 1 and \
            not re.search(r"\\(?:choose|over|atop|brace)(?![a-zA-Z])", s):
        return s[1:-1].strip()
    return s


def _strip_presentation(s):
    r"""Presentation-free spelling of one answer (no outer structure handled here)."""
    s = s.translate(_UNICODE)
    s = _strip_delimiters(s)
    s = _strip_group(s)
    s = re.sub(r"\\(?:left|right)\s*[.]", "", s)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    # Euler's e and the imaginary unit set upright: constants, not a unit or words to drop
    s = re.sub(r"\\(?:mathrm|text|rm|operatorname)\s*\{\s*([ei])\s*\}", r"\1", s)
    s = re.sub(r"\\(?:textbf|textrm|textit|mathrm|mathbf|mbox|operatorname|textnormal)\s*\{",
               r"\\text{", s)
    s = re.sub(r"\{[bB]matrix\}", "{pmatrix}", s)
    # thousands separators: "10,\!080", "10\,080", "10{,}080", thin spaces
    s = re.sub(r"(?<=\d)(?:,\s*\\!|\{,\}|\\,|\\!|\\ |\\;)\s*(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|\\degree|\\text\{\s*degrees?\s*\}", "", s)
    s = re.sub(r"\s*(?:\\?%|\\text\{\s*(?:percent(?:age)?|pct)\s*\}|percent(?:age)?|pct\.?)$", "",
               s)
    s = re.sub(r"\\\$|\$", "", s)
    s = re.sub(r"^\\text\{\s*\}", "", s)
    while _TRAILING_UNIT.search(s):
        s = _TRAILING_UNIT.sub("", s)
    s = re.sub(r"\s*\\text\{\s*and\s*\}\s*|\s+and\s+", ", ", s)  # "p=-1 \text{ and } p=2": a list
    # "or" written out, and in words between values outside any group ('x=-1 or x=2', not
    # '\text{yes or no}'): _structure reads it
    s = re.sub(r"\s*\\text\{\s*or\s*\}\s*", r"\\text{or}", s)
    if re.search(r"[\d=\\]", s):
        s = re.sub(r"\s+or\s+", lambda m: r"\text{or}" if s[:m.start()].count("{") ==
                   s[:m.start()].count("}") else m.group(0), s)
    s = _SPACING.sub(" ", s).strip()
    # '58,500' is a number; '32, 349' is a list
    if re.fullmatch(r"[-+]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _canonical_atom(s):
    r"""Key of one value (without whitespace: _structure took it out): a number as an exact
    fraction, else a tidy expression."""
    s = re.sub(r"^(\d+)_\{(\d+)\}$", r"\1_\2", s)
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)
    value = _number(s)
    if value is not None:
        return _fraction_str(value)
    s = re.sub(r"\\sqrt([^{\\\[])", r"\\sqrt{\1}", s)
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"_\{(\w)\}", r"_\1", s)
    s = _INFINITY.sub(r"\\infty", s)
    s = s.replace(r"+\infty", r"\infty")
    s = re.sub(r"\\cdot|\\times", "*", s)
    s = _exact_decimals(s)
    m = re.fullmatch(r"\\text\{([^{}]*)\}", s)
    if m:
        s = m.group(1)
    if re.fullmatch(r"[A-E]", s):
        return s
    if re.fullmatch(r"[A-Za-z]{3,}", s):
        return s.lower()
    return s


def _relations(s):
    """Rewrite \\le, \\geq, ... as <=, >=, ..."""
    for old, new in sorted(_RELATION.items(), key=lambda kv: -len(kv[0])):
        s = re.sub(re.escape(old) + r"(?![a-zA-Z])", new, s)
    return s


def _inequality_interval(s):
    """'x > 2' -> '(2,\\infty)', '-2 <= x <= 7' -> '[-2,7]', or None when s is no such
    inequality."""
    rel = r"(<=|>=|<|>)"
    chain = re.fullmatch(r"(.+?)" + rel + r"([a-zA-Z])" + rel + r"(.+)", s)
    if chain:
        lo, r1, _, r2, hi = chain.groups()
        if r1[0] != r2[0] or re.search(r"[<>=]", lo + hi):
            return None
        if r1[0] == ">":
            lo, hi, r1, r2 = hi, lo, r2.replace(">", "<"), r1.replace(">", "<")
        return ("[" if r1 == "<=" else "(") + f"{lo},{hi}" + ("]" if r2 == "<=" else ")")
    one = re.fullmatch(r"(-?)([a-zA-Z])" + rel + r"(.+)|(.+?)" + rel + r"(-?)([a-zA-Z])", s)
    if not one or re.search(r"[<>=]", (one.group(4) or "") + (one.group(5) or "")):
        return None
    flip = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}
    if one.group(2):
        negated, r, bound = one.group(1), one.group(3), one.group(4)
    else:
        negated, bound, r = one.group(7), one.group(5), flip[one.group(6)]
    if negated:  # -x > -1  is  x < 1
        value = _number(_canonical_atom(bound))
        bound, r = (_fraction_str(-value) if value is not None else f"-({bound})"), flip[r]
    if r[0] == "<":
        return r"(-\infty," + bound + ("]" if r == "<=" else ")")
    return ("[" if r == ">=" else "(") + bound + r",\infty)"


_NAME = r"[A-Za-z]+(?:_\{?\w+\}?)?'*"
_LABEL = (rf"{_NAME}(?:\({_NAME}(?:,{_NAME})*\))?|\({_NAME}(?:,{_NAME})+\)|\|{_NAME}\|"
          rf"|{_NAME}:{_NAME}|\\frac\{{{_NAME}\}}\{{{_NAME}\}}")
# a name (x, AB, x_1, f(x), (p,q), |AB|, A:B, \frac{NO}{BO}) = value
_LABELLED = re.compile(rf"({_LABEL})=([^=]+)")


def _roots_joined_by_or(s):
    """'x=-1 or x=2', '(1,2) or (3,4)', '\\pi or -\\pi': the roots, a list. Intervals ('x<1 or
    x>2', '(-\\infty,1) or (2,\\infty)') make a union, which _structure reads; 'x=1 or y=2' and
    'p \\lor q' stay as they are."""
    alternatives = [p for part in _split_top(s, r"\text{or}") for p in _split_top(part, r"\lor")]
    if len(alternatives) < 2:
        return s
    labels = {re.sub(r"_.*", "", m.group(1)) for m in map(_LABELLED.fullmatch, alternatives) if m}
    intervals = [_interval_or_none(_relations(a)) for a in alternatives]
    union = all(intervals) and any(re.search(r"[<>]|\\infty", a) or a[0] + a[-1] != "()"
                                   for a in alternatives)
    values = all(re.search(r"[\d=\\]", a) for a in alternatives)
    if len(labels) <= 1 and values and not union:
        return ",".join(alternatives)
    return s


def _structure(s):
    """Key of a cleaned answer with its outer structure: matrix, tuple, interval, union, set,
    list."""
    s = "".join(s.split())
    s = _roots_joined_by_or(_strip_group(re.sub(r"^[a-zA-Z]\\in(?=.)", "", s)))  # 'x \in [-2,7]'
    chain = _split_top(s, "=")
    if (len(chain) > 2 and len(_split_top(s, ",")) == 1 and chain[-1] and r"\text{or}" not in s
            and not re.search(r"[<>!]$", chain[-2])):  # 'x = 5+5+1 = 11': the last value
        s = chain[-1]
    label = _LABELLED.fullmatch(s)
    if label:  # 'x=5', '(p,q)=(3,2)', 'f(x)=1', 'a=4,-8,-10': the value
        s = label.group(2)
    m = re.fullmatch(r"(.*?)\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", s)
    factor = _number(_canonical_atom(m.group(1))) if m and m.group(1) else 1
    if m and factor is not None:
        rows = [[_canonical_atom(c) for c in row.split("&")]
                for row in m.group(2).split(r"\\") if row]
        # 1/49 (16, 48, 24): multiply out a number factored from plain-number entries
        if factor != 1:
            values = [[_number(c) for c in row] for row in rows]
            if any(v is None for row in values for v in row):
                return s
            rows = [[_fraction_str(factor * v) for v in row] for row in values]
        if len(rows) == 1 or all(len(r) == 1 for r in rows):
            return "(" + ",".join(c for r in rows for c in r) + ")"
        return r"\begin{pmatrix}" + r"\\".join("&".join(r) for r in rows) + r"\end{pmatrix}"
    m = re.fullmatch(r"\\langle(.*)\\rangle", s)
    if m:
        return "(" + ",".join(_canonical_atom(c) for c in _split_top(m.group(1), ",")) + ")"
    pieces = [p for part in _split_top(s, r"\cup") for p in _split_top(part, r"\text{or}")]
    pieces = [p for part in pieces for p in _split_top(part, r"\lor")]
    if len(pieces) > 1 or re.search(r"[<>]", s):
        intervals = [_interval_or_none(_relations(p)) for p in pieces]
        if all(intervals):
            return r"\cup".join(sorted(intervals))
    interval = _interval_or_none(s)
    if interval:
        return interval
    m = re.fullmatch(r"\\\{(.*)\\\}", s)
    items = _split_top(m.group(1) if m else s, ",")
    if len(items) == 1 and not m and r"\pm" not in s:
        return _canonical_atom(items[0])
    labelled = [_LABELLED.fullmatch(i) for i in items]
    names = {re.sub(r"_.*", "", l.group(1)) for l in labelled if l}
    if all(labelled) and len(names) == 1:  # 'x=1, x=-2', 'x_1=1, x_2=-2': the roots
        items = [l.group(2) for l in labelled]
    # 'AB=4, CD=5', 'y=2, x=1': a tuple in the order of the names
    elif all(labelled) and len(names) == len(items):
        return "(" + ",".join(_canonical_atom(l.group(2))
                              for l in sorted(labelled, key=lambda l: l.group(1))) + ")"
    expanded = []
    for item in items:
        if item.count(r"\pm") == 1:
            expanded += [item.replace(r"\pm", "+"), item.replace(r"\pm", "-")]
        else:
            expanded.append(item)
    return r"\{" + ",".join(sorted(_canonical_atom(i) for i in expanded)) + r"\}"


def _interval_or_none(s):
    r"""Key of '(a,b]' style intervals/tuples and of one-variable inequalities, else None."""
    if re.search(r"[<>]", s):
        s = _inequality_interval(s) or s
    m = re.fullmatch(r"([(\[])(.*)([)\]])", s)
    if not m:
        return None
    inner = _split_top(m.group(2), ",")
    if len(inner) < 2:
        return None
    return m.group(1) + ",".join(_canonical_atom(c) for c in inner) + m.group(3)


@functools.lru_cache(maxsize=1 << 16)
def _key(ans):
    if len(ans) > MAX_ANSWER_CHARS:
        return ans
    s = _strip_presentation(ans)
    choice = _CHOICE.match(s)
    if choice:
        return choice.group(1)
    return _structure(_relations(s))


def answer_key(ans):
    r"""Canonical spelling of an answer; equivalent spellings such as 0.5 and \frac12, 1,000 and
    1000, (1,2,3) and a column vector, 'x > 2' and (2,\infty) get the same key. None for None."""
    if ans is None:
        return None
    if isinstance(ans, (int, float)) and not isinstance(ans, bool):
        ans = str(ans)
    if not isinstance(ans, str):
        raise TypeError(f"answer must be a string (or None), got {type(ans).__name__}: {ans!r}")
    return _key(ans)


_PLAIN = re.compile(r"-?\d+(?:/\d+)?|[A-E]|[a-z]{3,}")
_EQUATION = re.compile(r"(?<![<>!])=")
_IN_BASE = re.compile(r"(\d+)_(\d+)")


def _is_tuple(key):
    """Whether a key is a tuple or an interval, '(1,2)', '[0,1)' (not '(1)(2)' or a union)."""
    if not re.fullmatch(r"[(\[].*[)\]]", key):
        return False
    depth = 0
    for c in key[1:-1]:
        depth += (c in "([{") - (c in ")]}")
        if depth < 0:
            return False
    return len(_split_top(key[1:-1], ",")) > 1


def _decided_by_strings(key_a, key_b):
    """True/False when the keys alone decide, None when sympy has to.

    An empty answer equals nothing. Two different plain numbers, choice letters or words differ; an
    equation (what is left after answer_key took 'x =' off) differs from a value, a tuple or an
    interval from a set or list, and a key past MAX_ANSWER_CHARS from any other. A number in a base
    (52_8) equals the same digits written without the base (the question names the base), but not
    the digits in another base."""
    if not key_a or not key_b:
        return False
    if key_a == key_b:
        return True
    if max(len(key_a), len(key_b)) > MAX_ANSWER_CHARS:
        return False
    if _is_tuple(key_a) != _is_tuple(key_b) and r"\{" in (key_a[:2], key_b[:2]):
        return False  # math-verify compares a tuple or interval with a set unordered: (2,1) = 1,2
    if _PLAIN.fullmatch(key_a) and _PLAIN.fullmatch(key_b):
        return False
    if (_EQUATION.search(key_a) is None) != (_EQUATION.search(key_b) is None):
        return False  # 'x+1=5' is no value; math-verify would compare its right side, 5
    based_a, based_b = _IN_BASE.fullmatch(key_a), _IN_BASE.fullmatch(key_b)
    if based_a and based_b:
        return False
    if based_a or based_b:
        return (based_a.group(1) if based_a else key_a) == (based_b.group(1) if based_b else key_b)
    return None


@functools.lru_cache(maxsize=1 << 16)
def _keys_equiv(pred_key, gold_key, limit):
    decided = _decided_by_strings(pred_key, gold_key)
    if decided is not None:
        return decided
    from machinery.symbolic import worker  # sympy in a helper process that can be killed
    return worker.equal(pred_key, gold_key, limit)


def is_equiv(pred, gold, timeout=EQUIV_TIME_LIMIT_S):
    r"""True when the answer `pred` is mathematically the same as `gold`. None is never equal.

    At most `timeout` seconds per call (plus, once, the helper process's start); a comparison
    that runs out of time counts as not equal, and that result is cached like any other."""
    if pred is None or gold is None:
        return False
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return _keys_equiv(answer_key(pred), answer_key(gold), float(timeout))


def computed_float_equiv(printed, answer, timeout=EQUIV_TIME_LIMIT_S):
    r"""A double a program printed at machine precision (98.99494936611666) against an exact answer
    that is not a plain number (70\sqrt{2}, 2\pi): math-verify's numeric comparison, which rounds to
    the printed precision. For a tool's computed values only; between answers is_equiv keeps
    98.99494936611666 != 70\sqrt{2}."""
    if printed is None or answer is None:
        return False
    from machinery.symbolic import worker
    return worker.equal(printed, answer_key(answer), float(timeout))


def same_answer(a, b):
    """is_equiv made symmetric, for voting: weighted_vote(..., key=answer_key, same=same_answer).
    The pair is ordered by key, so vote classes do not depend on the order of the rollouts."""
    if a is None or b is None:
        return False
    key_a, key_b = sorted((answer_key(a), answer_key(b)))
    return _keys_equiv(key_a, key_b, EQUIV_TIME_LIMIT_S)

