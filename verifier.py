r"""Verifying rollouts: answer checking (same answer?) and tool verification (computed by a program?).

Answer checking. Every reward in test-time RL comes from comparing answers, so the comparison must be
exact in both directions: a false "equal" rewards a wrong rollout, a false "not equal" splits one answer
into two vote classes and punishes a right one.

Three layers, cheapest first:

1. extract_answer(text): the content of the last \boxed{...} / \fbox{...}, else a trailing
   "the answer is X".
2. answer_key(ans): a canonical spelling, computed with string rules only. Presentation is removed
   (\left, \dfrac, $, \text units, degree signs, thousands separators, "x =", choice letters with text),
   plain numbers become exact reduced fractions (0.5, \frac12, 0.\overline{3}, 142.0, 025), inequalities
   become intervals, column vectors become tuples, lists of roots become sorted sets (\pm expanded).
   Equal keys mean equal answers; two plain numbers with different keys are different answers.
3. is_equiv(pred, gold): equal keys, else a symbolic comparison of the two keys with math-verify
   (sympy). Decimals reach sympy as exact fractions, so a rounded decimal never equals an exact value.
   Sympy can hang (or spend minutes in C code) on adversarial input, and a thread cannot be stopped, so
   the symbolic step runs in a helper process: it interrupts itself with SIGALRM, and if it does not
   answer within the hard limit it is killed and restarted. That works from any thread and in forked
   children. A timed-out comparison counts as "not equal". Results are cached.

same_answer(a, b) is the class test for voting: weighted_vote(answers, verified, omega,
key=answer_key, same=is_equiv) buckets by key and merges the buckets that only sympy can tell are equal.

Tool verification (T3RL). For question x and rollout y_i with answer a_i = extract_answer(y_i), a
verifier LLM compiles the computation into a short Python program (VERIFIER_SYSTEM: recompute from the
problem, the rollout is only a hint; never print the candidate; one ```python block; math, sympy, numpy,
fractions only; print only the result), the sandbox runs it, and

    t_i = last non-empty line the program prints
    v_i = 1[ the program ran cleanly  and  its printed value is computed  and  t_i ~ a_i ]

where ~ is is_equiv (plus: Python spellings x**2, pi, I, [1, 2] are read as x^2, \pi, i, 1, 2; a float
printed at machine precision matches a rational answer within relative 1e-9). Every rollout gets one status:

    verified    v_i = 1                          no_answer   a_i is None: no verifier call spent
    mismatch    ran, printed something else      no_code     the completion holds no code block
    exec_error  raised, or hit a memory/output   timeout     ran past the sandbox's time limit
                limit, or was killed             hardcoded   the last print shows only literals

"hardcoded" is the weak-verifier failure the paper shows (Figure 11): a program that copies the
trace's answer into print(1320) verifies anything. It is decided on the AST: the last print(...) in
the source shows only numbers, strings, f-strings of those, names assigned only such literals, or
calls of the program's own functions that return only such literals.

verify_batch(problems, rollouts, answers, verifier, sandbox=None, tool=python_tool, budget=0) runs a
whole training step at once: one call of `verifier` (any callable, list of user messages -> list of
completions; model_verifier wraps a model in one batched sampler.generate call) and one call of `tool`
(python_tool: one sandbox run_many). A rollout's reasoning enters the prompt cut to its last
MAX_ROLLOUT_CHARS = 4000 characters (the end holds the answer; ~1.2k tokens), so a prompt stays bounded
by that, the problem and the ~250-token system prompt. The tool is any function (programs, sandbox) -> [ToolRun(status, result, output, seconds)], so
another one (an SMT solver for logic puzzles, with its own prompt) fits without changing the rest.
budget K > 0 verifies only the first K rollouts of each answer class of a problem; the others inherit
the majority outcome of those K (a tie counts as unverified) and are marked inferred. Costs per rollout:
verifier tokens (VerifierText.num_tokens) and seconds (the batch's wall time split evenly over the
rollouts sent), and the program's run time.

`python verifier.py --bench-equiv` measures is_equiv on the labelled set data/equiv_cases.jsonl
against bare math-verify and plain string matching. `python verifier.py --measure` verifies correct
and wrong answers to 30 MATH-500 problems with the embedded 0.5B model as verifier; `--demo` shows one
verification step by step.
"""

import ast
import functools
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction

from sandbox import default_pool
from voting import answer_classes

EQUIV_TIME_LIMIT_S = 2.0
EQUIV_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "equiv_cases.jsonl")


# ----------------------------------------------------------------------------------------------------
# Extracting the final answer

_BOX = re.compile(r"\\(?:boxed|fbox)\s*(\{)?")
_ANSWER_IS = re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)


def _braced(text, start):
    """The content of the brace group opening at text[start] == '{', or None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i]
    return None


def extract_answer(text):
    r"""The final answer in a model's output: the last \boxed{...} (or \fbox, or "\boxed 5"),
    else a trailing "the answer is X". None when there is none."""
    if text is None:
        return None
    for m in reversed(list(_BOX.finditer(text))):
        if m.group(1):
            content = _braced(text, m.start(1))
        else:
            token = re.match(r"[^\s$]+", text[m.end():])
            content = token.group(0) if token else None
        if content is not None and content.strip():
            return content.strip()
    sentences = _ANSWER_IS.findall(text)
    if not sentences:
        return None
    answer = sentences[-1].split("\n")[0].strip()
    answer = re.sub(r"\.?\s*$", "", answer).strip()  # the full stop ending the sentence
    answer = answer.strip("$").strip()
    answer = re.sub(r"^\\\(|\\\)$", "", answer).strip()
    return answer or None


# ----------------------------------------------------------------------------------------------------
# Canonical keys (string rules only)

_UNICODE = {"\u2212": "-", "\u221e": r"\infty", "\u2264": r"\le ", "\u2265": r"\ge ", "\u00b0": r"^\circ",
            "\u00d7": r"\times ", "\u00b7": r"\cdot ", "\u03c0": r"\pi ", "\u00b1": r"\pm ", "\u222a": r"\cup ",
            "\u2009": r"\,", "\u202f": r"\,", "\u00a0": " "}
_SPACING = re.compile(r"(?<!\\)\\[,;:! ]|\\q?quad\b|~")
_UNITS = (r"(?:square\s+|sq\.?\s+|cubic\s+)?(?:units?|cm|mm|km|m|meters?|metres?|inch(?:es)?|in|feet|foot|ft|"
          r"yards?|miles?|mph|seconds?|minutes?|hours?|days?|years?|cents?|dollars?|degrees?|pounds?|"
          r"grams?|kg|liters?|people|students|ways|sq)")
_TRAILING_UNIT = re.compile(r"(?<=[\d}).])\s*(?:\\text\{\s*" + _UNITS + r"\s*\}|\\text\{\s*[a-zA-Z ]+\}|\s"
                            + _UNITS + r"\b)\s*(?:\^\{?[23]\}?)?\s*$")
_CHOICE = re.compile(r"^(?:\\text\{\s*)?\(([A-E])\)")
_NUMBER = re.compile(r"^([-+]?)(\d*)(?:\.(\d*))?(?:\\overline\{(\d+)\}|\\overline(\d))?$")
_FRAC = re.compile(r"^([-+]?)(\d*)\\frac\{([-+]?\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}$")
_SLASH = re.compile(r"^([-+]?)(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)$")
_SCIENTIFIC = re.compile(r"^([-+]?\d*\.?\d+)(?:\\times|\\cdot)10\^\{?([-+]?\d+)\}?$|^([-+]?\d*\.?\d+)e([-+]?\d+)$")
_RELATION = {r"\leq": "<=", r"\leqslant": "<=", r"\le": "<=", r"\geq": ">=", r"\geqslant": ">=", r"\ge": ">=",
             r"\lt": "<", r"\gt": ">", "=<": "<=", "=>": ">="}
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


def _unwrap(s):
    r"""Remove what surrounds an answer: $...$, \(...\), \boxed{}, \displaystyle, a final full stop."""
    while True:
        before = s
        s = re.sub(r"(?<!\d)\.$", "", s.strip()).strip()
        s = re.sub(r"^\$+|\$+$", "", s).strip()
        s = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", s).strip()
        m = re.match(r"^\\(?:boxed|fbox)\s*\{", s)
        if m and _braced(s, m.end() - 1) == s[m.end():-1]:
            s = s[m.end():-1]
        s = s.replace(r"\displaystyle", "")
        if s == before:
            return s


def _as_fraction(sign, whole, num, den):
    if Fraction(den) == 0:
        return None
    value = Fraction(num) / Fraction(den)
    if whole:
        value += int(whole)
    return -value if sign == "-" else value


def _number(s):
    r"""The exact value of a plain number spelling (25, 025, 142.0, .5, 0.\overline{3}, \frac{3}{4}, 3/4,
    1\frac{4}{5}, 6.72\times10^{-5}), or None."""
    if len(s) > 1000:  # int() refuses more than 4300 digits; such a spelling is no plain answer anyway
        return None
    m = _NUMBER.match(s)
    if m and (m.group(2) or m.group(3) or m.group(4) or m.group(5)):
        sign, whole, decimals, repeat = m.group(1), m.group(2) or "0", m.group(3) or "", m.group(4) or m.group(5)
        value = Fraction(int(whole + decimals), 10 ** len(decimals))
        if repeat:
            value += Fraction(int(repeat), (10 ** len(repeat) - 1) * 10 ** len(decimals))
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
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _exact_decimals(s):
    r"""Write decimals inside an expression as exact fractions, so that sympy never rounds."""
    def exact(m):
        value = Fraction(m.group(0))
        return str(value.numerator) if value.denominator == 1 else rf"\frac{{{value.numerator}}}{{{value.denominator}}}"
    return re.sub(r"(?<![\d.])\d*\.\d+(?![\d.])", exact, s)


def _clean(s):
    r"""Presentation-free spelling of one answer (no outer structure handled here)."""
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    s = _unwrap(s)
    s = re.sub(r"\\(?:left|right)\s*[.]", "", s)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:textbf|textrm|textit|mathrm|mathbf|mbox|operatorname|textnormal)\s*\{", r"\\text{", s)
    s = re.sub(r"\{[bB]matrix\}", "{pmatrix}", s)
    # thousands separators: "10,\!080", "10\,080", "10{,}080", thin spaces
    s = re.sub(r"(?<=\d)(?:,\s*\\!|\{,\}|\\,|\\!|\\ |\\;)\s*(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|\\circ|\\degree|\\text\{\s*degrees?\s*\}", "", s)
    s = re.sub(r"\s*(?:\\?%|\\text\{\s*percent\s*\}|percent)$", "%", s)
    s = re.sub(r"\\\$|\$", "", s)
    s = re.sub(r"^\\text\{\s*\}", "", s)
    while True:
        stripped = _TRAILING_UNIT.sub("", s)
        if stripped == s:
            break
        s = stripped
    s = _SPACING.sub(" ", s)
    return s.strip()


def _plain_thousands(s):
    """'1,000' and '58,500' are numbers; '1, 000' and '1,-2' are lists."""
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        return s.replace(",", "")
    return s


def _canonical_atom(s):
    r"""Key of one value: a number as an exact fraction, else a tidy expression."""
    s = "".join(s.split())
    s = re.sub(r"^(\d+)_\{(\d+)\}$", r"\1_\2", s)
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)
    value = _number(s)
    if value is not None:
        return _fraction_str(value)
    if s.endswith("%") and _number(s[:-1]) is not None:
        return _fraction_str(_number(s[:-1])) + "%"
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
    """'x > 2' -> '(2,\\infty)', '-2 <= x <= 7' -> '[-2,7]', or None when s is no such inequality."""
    rel = r"(<=|>=|<|>)"
    chain = re.fullmatch(r"(.+?)" + rel + r"([a-zA-Z])" + rel + r"(.+)", s)
    if chain:
        lo, r1, _, r2, hi = chain.groups()
        if r1[0] != r2[0] or re.search(r"[<>=]", lo + hi):
            return None
        if r1[0] == ">":
            lo, hi, r1, r2 = hi, lo, r2.replace(">", "<"), r1.replace(">", "<")
        return ("[" if r1 == "<=" else "(") + f"{lo},{hi}" + ("]" if r2 == "<=" else ")")
    one = re.fullmatch(r"([a-zA-Z])" + rel + r"(.+)|(.+?)" + rel + r"([a-zA-Z])", s)
    if not one or re.search(r"[<>=]", (one.group(3) or "") + (one.group(4) or "")):
        return None
    if one.group(1):
        r, bound = one.group(2), one.group(3)
    else:
        bound, r = one.group(4), {"<": ">", ">": "<", "<=": ">=", ">=": "<="}[one.group(5)]
    if r[0] == "<":
        return r"(-\infty," + bound + ("]" if r == "<=" else ")")
    return ("[" if r == ">=" else "(") + bound + r",\infty)"


def _structure(s):
    """Key of a cleaned answer with its outer structure: matrix, tuple, interval, union, set, list."""
    s = "".join(s.split())
    s = re.sub(r"^[a-zA-Z]\\in(?=.)", "", s)  # 'x \in [-2,7]'
    m = re.fullmatch(r"(.*?)\\begin\{pmatrix\}(.*)\\end\{pmatrix\}", s)
    factor = _number(_canonical_atom(m.group(1))) if m and m.group(1) else 1
    if m and factor is not None:
        rows = [[_canonical_atom(c) for c in row.split("&")] for row in m.group(2).split(r"\\") if row]
        if factor != 1:  # 1/49 (16, 48, 24): multiply out a number factored from plain-number entries
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
    items = _split_top(m.group(1) if m else _plain_thousands(s), ",")
    if len(items) == 1 and not m and r"\pm" not in s:
        return _assignment_value(_canonical_atom(items[0]))
    variables = {re.match(r"([a-zA-Z])=", i).group(1) if re.match(r"[a-zA-Z]=[^=]+$", i) else None for i in items}
    if len(variables) == 1 and None not in variables:
        items = [i[2:] for i in items]
    expanded = []
    for item in items:
        if item.count(r"\pm") == 1:
            expanded += [item.replace(r"\pm", "+"), item.replace(r"\pm", "-")]
        else:
            expanded.append(item)
    return r"\{" + ",".join(sorted(_canonical_atom(i) for i in expanded)) + r"\}"


def _assignment_value(s):
    """'x=5' -> '5'; 'y=2x+3' -> '2x+3'; equations with more on the left stay."""
    m = re.fullmatch(r"[a-zA-Z]=([^=]+)", s)
    return _canonical_atom(m.group(1)) if m else s


def _interval_or_none(s):
    r"""Key of '(a,b]' style intervals/tuples and of one-variable inequalities, else None."""
    inequality = _inequality_interval(s) if re.search(r"[<>]", s) else None
    if inequality:
        s = inequality
    m = re.fullmatch(r"([(\[])(.*)([)\]])", s)
    if not m:
        return None
    inner = _split_top(m.group(2), ",")
    if len(inner) < 2:
        return None
    return m.group(1) + ",".join(_canonical_atom(c) for c in inner) + m.group(3)


@functools.lru_cache(maxsize=1 << 16)
def _key(ans):
    s = _clean(ans)
    choice = _CHOICE.match(s)
    if choice:
        return choice.group(1)
    return _structure(_relations(s))


def answer_key(ans):
    r"""Canonical spelling of an answer; equivalent spellings such as 0.5 and \frac12, 1,000 and 1000,
    (1,2,3) and a column vector, 'x > 2' and (2,\infty) get the same key. None for None."""
    if ans is None:
        return None
    if isinstance(ans, (int, float)) and not isinstance(ans, bool):
        ans = str(ans)
    if not isinstance(ans, str):
        raise TypeError(f"answer must be a string (or None), got {type(ans).__name__}: {ans!r}")
    return _key(ans)


# ----------------------------------------------------------------------------------------------------
# Symbolic equivalence in a helper process (sympy can hang; a process can be killed, a thread cannot)

def _symbolic_equal(pred_key, gold_key):
    from math_verify import parse, verify
    gold = parse(f"${gold_key}$", parsing_timeout=None)
    pred = parse(f"${pred_key}$", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def _serve_symbolic():
    """Body of the helper process: answer each '[pred_key, gold_key, seconds]' line with true/false."""
    import logging
    import signal
    import math_verify  # noqa: F401  (import before 'ready' so that the first comparison is not slow)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print from a library must not corrupt the replies

    class Overrun(BaseException):
        """Not an Exception, so that math-verify's own `except Exception` cannot swallow it."""

    def interrupt(signum, frame):
        raise Overrun

    signal.signal(signal.SIGALRM, interrupt)
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        pred_key, gold_key, seconds = json.loads(line)
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                equal = _symbolic_equal(pred_key, gold_key)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (Overrun, Exception):  # out of time, or sympy choked on strange input: not shown equal
            equal = False
        replies.write(json.dumps(equal) + "\n")
        replies.flush()


class _SymbolicWorker:
    """One helper process per Python process, started on first use, killed when it overruns."""

    def __init__(self):
        self.lock = threading.Lock()
        self.process = None

    def _start(self):
        here = os.path.dirname(os.path.abspath(__file__))
        module = os.path.splitext(os.path.basename(__file__))[0]
        code = f"import sys; sys.path.insert(0, {here!r}); import {module}; {module}._serve_symbolic()"
        self.process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, bufsize=0)
        if self._reply(timeout=120) != b"ready":
            self._stop()
            raise RuntimeError("the sympy helper process of verifier.py did not start; "
                               "check that math-verify is installed (pip install math-verify)")

    def _stop(self):
        self.process.kill()
        self.process.wait()
        self.process = None

    def _reply(self, timeout):
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        return self.process.stdout.readline().strip() if ready else None

    def equal(self, pred_key, gold_key, limit):
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                self._start()
            request = json.dumps([pred_key, gold_key, 0.75 * limit]) + "\n"
            try:
                self.process.stdin.write(request.encode())
            except BrokenPipeError:  # it died since the check above: once more with a fresh one
                self._stop()
                self._start()
                self.process.stdin.write(request.encode())
            reply = self._reply(limit)
            if reply is None or not reply:  # overran its limit (stuck in C code) or died
                self._stop()
                return False
            return reply == b"true"

    def forget_after_fork(self):
        """In a forked child the parent's helper is not ours: start a fresh one when needed."""
        self.lock = threading.Lock()
        self.process = None


_worker = _SymbolicWorker()
os.register_at_fork(after_in_child=_worker.forget_after_fork)


_NUMBER_KEY = re.compile(r"-?\d+(?:/\d+)?")
_PLAIN = re.compile(r"-?\d+(?:/\d+)?%?|[A-E]|[a-z]{3,}")
_EQUATION = re.compile(r"(?<![<>!])=")
_IN_BASE = re.compile(r"(\d+)_(\d+)")


def _decided_by_strings(key_a, key_b):
    """True/False when the keys alone decide, None when sympy has to.

    Two different plain numbers, choice letters or words differ; an equation (what is left after
    answer_key took 'x =' off) differs from a value. 9% equals 9 (the question asked "what
    percent?") and 0.09. A number in a base (52_8) equals the same digits written without the base (the
    question names the base), but not the digits in another base."""
    if key_a == key_b:
        return True
    percents = [k for k in (key_a, key_b) if k.endswith("%") and _NUMBER_KEY.fullmatch(k[:-1])]
    if len(percents) == 1:
        other = key_b if percents[0] == key_a else key_a
        value = Fraction(percents[0][:-1])
        return _NUMBER_KEY.fullmatch(other) is not None and Fraction(other) in (value, value / 100)
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
    return _worker.equal(pred_key, gold_key, limit)


def is_equiv(pred, gold, timeout=EQUIV_TIME_LIMIT_S):
    r"""True when the answer `pred` is mathematically the same as `gold`. None is never equal.

    At most `timeout` seconds per call (plus ~2 s once, to start the helper process); a comparison
    that runs out of time counts as not equal, and that result is cached like any other."""
    if pred is None or gold is None:
        return False
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return _keys_equiv(answer_key(pred), answer_key(gold), float(timeout))


def same_answer(a, b):
    """is_equiv made symmetric, for voting: weighted_vote(..., key=answer_key, same=same_answer).
    The pair is ordered by key, so vote classes do not depend on the order of the rollouts."""
    if a is None or b is None:
        return False
    key_a, key_b = sorted((answer_key(a), answer_key(b)))
    return _keys_equiv(key_a, key_b, EQUIV_TIME_LIMIT_S)


# ----------------------------------------------------------------------------------------------------
# Tool verification: v_i = 1[the verifier's program runs cleanly and prints a_i]

VERIFIER_SYSTEM = """You are an expert mathematician and a careful Python programmer. You check a candidate \
solution to a math problem by writing a short Python program that computes the answer itself.

Rules:
1. Do NOT assume the candidate's reasoning is correct. Recompute the answer directly from the problem \
statement; use the reasoning only as a hint for how to approach the problem.
2. Never hard-code the candidate's final answer and never print it as a literal: the program must \
compute the result.
3. Answer with exactly one code block in the form ```python\\nCODE\\n```.
4. Import only these modules: math, sympy, numpy, fractions. Define every name you use, including sympy \
symbols (x = sympy.symbols('x')).
5. The program prints only the final result, once, at the end, e.g. print(result). Prefer exact values \
(integers, fractions.Fraction, sympy expressions) to rounded decimals."""

VERIFIER_USER = """Problem:
{problem}

Candidate solution (it may be wrong):
{rollout}

Write the Python program that computes the answer to the problem."""

MAX_ROLLOUT_CHARS = 4000  # the end of a rollout holds its answer: longer ones keep their last 4000 characters
STATUSES_VERIFY = ("verified", "mismatch", "no_answer", "no_code", "exec_error", "timeout", "hardcoded")

_FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_FENCE_ANY = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MACHINE_FLOAT = re.compile(r"[-+]?\d*\.\d{7,}(?:e[-+]?\d+)?|[-+]?\d+(?:\.\d*)?e[-+]?\d+", re.IGNORECASE)


def verifier_prompt(problem, rollout):
    """The user message for one rollout; its reasoning is cut to the last MAX_ROLLOUT_CHARS characters."""
    if len(rollout) > MAX_ROLLOUT_CHARS:
        rollout = "[... beginning cut ...]\n" + rollout[-MAX_ROLLOUT_CHARS:]
    return VERIFIER_USER.format(problem=problem.strip(), rollout=rollout.strip())


def extract_code(text):
    """The first ```python block of a verifier completion, else its first fenced block, else None.
    A block left open (the completion hit its token limit) runs to the end of the text."""
    for fence in (_FENCE_PYTHON, _FENCE_ANY):
        m = fence.search(text)
        if m and m.group(1).strip():
            return m.group(1)
    return None


# The hard-coding guard. Small verifiers copy the trace's final answer into print(...) (the paper's
# Figure 11); such a program "verifies" anything. It is refused when the last print shows only literals:
# numbers, strings (f-strings included), tuples/lists of them, names bound only to literals, or calls of
# the program's own functions that return only literals. Arithmetic on literals (print(11 * 120): the
# trace's claimed computation, redone) and other calls (print(math.comb(12, 3))) count as computing.

def _literal_bindings(tree):
    """name -> the values assigned to it, with None for a binding that is no plain assignment
    (loop targets, augmented assignment, with/as, walrus, unpacking of something computed, ...)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    bindings = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bindings.setdefault(node.id, []).append(_assigned_value(node, parents))
    return bindings


def _assigned_value(target, parents):
    parent = parents[target]
    if isinstance(parent, (ast.Assign, ast.AnnAssign)) and target is not parent.value:
        return parent.value
    if isinstance(parent, (ast.Tuple, ast.List)) and isinstance(parents[parent], ast.Assign):
        value = parents[parent].value
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(parent.elts):
            return value.elts[parent.elts.index(target)]
    return None


def _is_literal(node, bindings, returns, seen=frozenset()):
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _is_literal(node.operand, bindings, returns, seen)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(_is_literal(e, bindings, returns, seen) for e in node.elts)
    if isinstance(node, ast.JoinedStr):
        parts = [v.value if isinstance(v, ast.FormattedValue) else v for v in node.values]
        return all(_is_literal(part, bindings, returns, seen) for part in parts)
    if isinstance(node, ast.Name) and node.id not in seen and bindings.get(node.id):
        return all(v is not None and _is_literal(v, bindings, returns, seen | {node.id}) for v in bindings[node.id])
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in returns:
        name = node.func.id
        return name not in seen and bool(returns[name]) and all(
            v is not None and _is_literal(v, bindings, returns, seen | {name}) for v in returns[name])
    return False


def hardcoded(code):
    """True when the last print(...) of the program (in source order) shows only literals."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False  # it cannot run either; the tool reports it as an error
    prints = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "print" and node.args]
    if not prints:
        return False
    last = max(prints, key=lambda node: (node.lineno, node.col_offset))
    bindings = _literal_bindings(tree)
    returns = {f.name: [r.value for r in ast.walk(f) if isinstance(r, ast.Return)]
               for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    return all(_is_literal(arg, bindings, returns) for arg in last.args)


# The tool: a function (programs, sandbox) -> one ToolRun per program. Another tool (an SMT solver for
# logic puzzles) only has to keep this signature.

@dataclass
class ToolRun:
    """What the tool made of one program."""
    status: str          # "ok", "error", "timeout", or "hardcoded" (refused without being trusted)
    result: str | None   # the tool's answer t_i: the last non-empty line of stdout
    output: str          # everything the program printed (stdout, then stderr), for reading
    seconds: float       # time the program ran


def python_tool(codes, sandbox=None):
    """Run every program in the sandbox (one run_many call; None: sandbox.default_pool()), never in this
    process. Hard-coded programs run too, so that what they print can be read."""
    runs = (sandbox or default_pool()).run_many(codes) if codes else []
    tool_runs = []
    for code, run in zip(codes, runs):
        lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
        status = ("hardcoded" if hardcoded(code) else "ok" if run.status == "ok" else
                  "timeout" if run.status == "timeout" else "error")
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        tool_runs.append(ToolRun(status, lines[-1] if lines else None, output, run.duration))
    return tool_runs


def _python_spelling(result):
    """Python/sympy notation in the answer side's notation: x**2 -> x^2, pi -> \\pi, I -> i, [1, 2] -> 1, 2."""
    s = result.replace("**", "^")
    s = re.sub(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])", r"\\pi", s)
    s = re.sub(r"(?<![\\a-zA-Z])(?:(\d)\*)?I(?![a-zA-Z])", r"\1i", s)  # 9*I -> 9i
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1]
    return s


def tool_agrees(result, answer):
    """t_i equivalent to a_i. A float printed at machine precision (1/3 -> 0.3333333333333333) is a computed
    double: it matches a rational answer within relative 1e-9; shorter decimals compare exactly (0.33 != 1/3)."""
    if result is None:
        return False
    if is_equiv(result, answer):
        return True
    spelled = _python_spelling(result)
    if spelled != result and is_equiv(spelled, answer):
        return True
    if _MACHINE_FLOAT.fullmatch(result):
        try:
            value = Fraction(answer_key(answer))
        except (ValueError, ZeroDivisionError):
            return False
        return abs(float(result) - value) <= 1e-9 * max(1.0, abs(float(value)))
    return False


@dataclass
class Verification:
    """The verdict on one rollout."""
    v: int                 # 1 when the tool's result is equivalent to the rollout's answer
    status: str            # one of STATUSES_VERIFY
    result: str | None     # the tool's result t_i
    code: str | None       # the verifier's program
    completion: str | None # the verifier's whole completion
    output: str            # what the program printed
    tokens: int | None     # verifier tokens generated for this rollout (None: the verifier does not say)
    seconds: float         # verifier generation time for this rollout: the batch's wall time / rollouts sent
    tool_seconds: float    # time the program ran
    inferred: bool = False # True: not sent to the verifier; the outcome of its answer class (--verify-budget)


class VerifierText(str):
    """A verifier completion that also says how many tokens it took (a plain str otherwise)."""
    def __new__(cls, text, num_tokens):
        self = super().__new__(cls, text)
        self.num_tokens = num_tokens
        return self


def model_verifier(model, tokenizer, max_new_tokens=1024, temperature=0.6, top_p=0.95, seed=None, backend="kv"):
    """A verifier callable: list of user messages -> list of VerifierText, one batched sampler call.

    Each message is put in the model's chat template after VERIFIER_SYSTEM. With a seed, call k of the
    callable samples with seed + k, so repeated calls (training steps) differ but a run repeats."""
    from sampler import generate  # torch is needed only once a model verifier is built
    calls = 0

    def verify(messages):
        nonlocal calls
        chats = [tokenizer.apply_chat_template([{"role": "system", "content": VERIFIER_SYSTEM},
                                                {"role": "user", "content": m}], tokenize=False,
                                               add_generation_prompt=True) for m in messages]
        groups = generate(model, tokenizer, chats, n=1, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=None if seed is None else seed + calls, backend=backend,
                          progress="verifier" if backend == "kv" else None)
        calls += 1
        return [VerifierText(group[0].text, group[0].num_tokens) for group in groups]

    return verify


def _budget_plan(problems, answers, budget):
    """Which rollouts go to the verifier, and for each other one the rollouts whose outcome it inherits:
    per problem and answer class, the first `budget` rollouts are verified (all when budget is 0)."""
    if budget == 0:
        return [i for i, answer in enumerate(answers) if answer is not None], {}
    by_problem = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            by_problem.setdefault(problems[i], []).append(i)
    sent, heirs = [], {}
    for indices in by_problem.values():
        for members in answer_classes([answers[i] for i in indices], same_answer, answer_key):
            members = [indices[m] for m in members]
            chosen = members[:budget]
            sent += chosen
            heirs.update({i: chosen for i in members[len(chosen):]})
    return sorted(sent), heirs


def verify_batch(problems, rollouts, answers, verifier, sandbox=None, tool=python_tool, budget=0):
    """Tool-verify each rollout: one Verification per rollout, in order.

    problems, rollouts, answers: one entry per rollout (answers from extract_answer; None -> no_answer,
    without a verifier call). verifier: callable, list of user messages -> list of completions (see
    model_verifier). sandbox: passed to the tool (None: a default pool). budget K > 0: per problem and
    answer class only the first K rollouts are verified, the rest inherit the majority outcome of those K
    (ties: 0) and are marked inferred=True."""
    if not len(problems) == len(rollouts) == len(answers):
        raise ValueError(f"verify_batch: problems ({len(problems)}), rollouts ({len(rollouts)}) and answers "
                         f"({len(answers)}) need one entry per rollout")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget={budget!r}: pass K >= 1 rollouts per answer class, or 0 to verify all")
    sent, heirs = _budget_plan(problems, answers, budget)
    start = time.perf_counter()
    completions = verifier([verifier_prompt(problems[i], rollouts[i]) for i in sent]) if sent else []
    seconds = (time.perf_counter() - start) / max(1, len(sent))
    if len(completions) != len(sent):
        raise ValueError(f"the verifier returned {len(completions)} completions for {len(sent)} prompts")
    codes = {i: extract_code(text) for i, text in zip(sent, completions)}
    with_code = [i for i in sent if codes[i] is not None]
    runs = dict(zip(with_code, tool([codes[i] for i in with_code], sandbox)))
    results = [None] * len(rollouts)
    for i, text in zip(sent, completions):
        run = runs.get(i)
        if run is None:
            status = "no_code"
        elif run.status == "ok":
            status = "verified" if tool_agrees(run.result, answers[i]) else "mismatch"
        else:
            status = {"error": "exec_error", "timeout": "timeout", "hardcoded": "hardcoded"}[run.status]
        results[i] = Verification(int(status == "verified"), status, run and run.result, codes[i], str(text),
                                  run.output if run else "", getattr(text, "num_tokens", None), seconds,
                                  run.seconds if run else 0.0)
    for i, chosen in heirs.items():
        outcomes = [results[j] for j in chosen]
        v = int(2 * sum(r.v for r in outcomes) > len(outcomes))
        like = next(r for r in outcomes if r.v == v)
        results[i] = Verification(v, like.status, like.result, None, None, "", 0, 0.0, 0.0, inferred=True)
    for i, answer in enumerate(answers):
        if answer is None:
            results[i] = Verification(0, "no_answer", None, None, None, "", 0, 0.0, 0.0)
    return results


# ----------------------------------------------------------------------------------------------------
# Benchmark: python verifier.py --bench-equiv

def _string_match(pred, gold):
    return pred.strip() == gold.strip()


def _bare_math_verify(pred, gold):
    from math_verify import parse, verify
    return verify(parse(rf"\boxed{{{gold}}}"), parse(rf"\boxed{{{pred}}}"))


def _is_equiv_uncached(pred, gold):
    _key.cache_clear()
    _keys_equiv.cache_clear()
    return is_equiv(pred, gold)


def bench_equiv(path=EQUIV_CASES):
    """Accuracy, false positives/negatives and median ms per call of three answer checkers, side by side."""
    import logging
    import statistics
    import time
    from tqdm import tqdm
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    with open(path) as f:
        cases = [json.loads(line) for line in f]
    is_equiv("1", "2")  # start the helper process outside the timings
    checkers = {"string match": _string_match, "math-verify": _bare_math_verify, "is_equiv": _is_equiv_uncached}
    rows, errors = [], {}
    for name, check in checkers.items():
        times, false_pos, false_neg = [], [], []
        for case in tqdm(cases, desc=name, leave=False):
            start = time.perf_counter()
            said = bool(check(case["pred"], case["gold"]))
            times.append(1000 * (time.perf_counter() - start))
            if said and not case["equal"]:
                false_pos.append(case)
            elif case["equal"] and not said:
                false_neg.append(case)
        right = len(cases) - len(false_pos) - len(false_neg)
        rows.append((name, 100 * right / len(cases), len(false_pos), len(false_neg),
                     statistics.median(times), max(times)))
        errors[name] = false_pos + false_neg
        if name == "is_equiv":
            symbolic_ms = [t for t, c in zip(times, cases)
                           if _decided_by_strings(answer_key(c["pred"]), answer_key(c["gold"])) is None]
    equal = sum(c["equal"] for c in cases)
    print(f"{len(cases)} labelled cases ({equal} equal, {len(cases) - equal} not equal) from {path}")
    print(f"{'checker':<14}{'accuracy':>10}{'false +':>9}{'false -':>9}{'median ms':>11}{'max ms':>9}")
    for name, accuracy, false_pos, false_neg, median_ms, max_ms in rows:
        print(f"{name:<14}{accuracy:>9.1f}%{false_pos:>9}{false_neg:>9}{median_ms:>11.2f}{max_ms:>9.1f}")
    print(f"is_equiv sent {len(symbolic_ms)} of {len(cases)} cases to sympy: median {statistics.median(symbolic_ms):.2f} ms, "
          f"max {max(symbolic_ms):.1f} ms; the rest were decided by answer_key alone")
    for name in ("math-verify", "is_equiv"):
        by_category = {}
        for case in errors[name]:
            by_category.setdefault(case["category"], []).append(case)
        print(f"\n{name} errors by category: " + (", ".join(f"{c} {len(v)}" for c, v in sorted(by_category.items())) or "none"))
        for case in errors[name]:
            print(f"  {'FP' if not case['equal'] else 'FN'} [{case['category']}] pred={case['pred']!r} gold={case['gold']!r}")


# ----------------------------------------------------------------------------------------------------
# python verifier.py --measure / --demo: the embedded 0.5B model as verifier

SOLUTION = ("Working through the problem step by step, the computation gives {answer}.\n\n"
            "The final answer is $\\boxed{{{answer}}}$.")
DATA_DIR = os.environ.get("T3RL_DATA_DIR", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared", "data"))


def easy_math500(count, path=os.path.join(DATA_DIR, "math500.jsonl")):
    """The first `count` MATH-500 problems of levels 1-3, in file order."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: not found; set T3RL_DATA_DIR to the folder holding math500.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if int(r["level"]) <= 3][:count]


def wrong_answer(problem, gold):
    """A plausible wrong answer: gold + 1 when gold is a number, else the first number in the problem
    that is not gold."""
    try:
        return _fraction_str(Fraction(answer_key(gold)) + 1)
    except (ValueError, ZeroDivisionError):
        pass
    return next((n for n in re.findall(r"\d+", problem) if not same_answer(n, gold)), "0")


def _embedded_verifier(max_new_tokens, seed):
    from model import load_model
    model, tokenizer = load_model("embedded")
    return model_verifier(model, tokenizer, max_new_tokens=max_new_tokens, seed=seed)


def measure(count, max_new_tokens, seed):
    """Verify a correct and a wrong short solution per problem; print verified shares and costs."""
    records = easy_math500(count)
    problems, rollouts, answers, kinds = [], [], [], []
    for r in records:
        for kind, answer in (("correct", r["answer"]), ("wrong", wrong_answer(r["problem"], r["answer"]))):
            problems.append(r["problem"])
            rollouts.append(SOLUTION.format(answer=answer))
            answers.append(answer)
            kinds.append(kind)
    verifier = _embedded_verifier(max_new_tokens, seed)
    print(f"verifying {len(rollouts)} rollouts ({count} MATH-500 problems of levels 1-3, a correct and a wrong "
          f"answer each) with the embedded model, one batched call of up to {max_new_tokens} new tokens ...")
    start = time.perf_counter()
    results = verify_batch(problems, rollouts, answers, verifier)
    wall = time.perf_counter() - start
    print(f"\n{'answers':<9}{'rollouts':>9}{'verified':>10}   " + "".join(f"{s:>11}" for s in STATUSES_VERIFY[1:]))
    for kind in ("correct", "wrong"):
        mine = [r for r, k in zip(results, kinds) if k == kind]
        counts = [sum(r.status == s for r in mine) for s in STATUSES_VERIFY[1:]]
        share = sum(r.v for r in mine) / len(mine)
        print(f"{kind:<9}{len(mine):>9}{share:>9.0%}   " + "".join(f"{c:>11}" for c in counts))
    tokens = [r.tokens for r in results]
    print(f"\nverifier: {sum(tokens) / len(tokens):.0f} tokens and {results[0].seconds:.1f} s per rollout "
          f"(batch wall time / rollouts); sandbox: {1000 * sum(r.tool_seconds for r in results) / len(results):.0f} ms "
          f"per program; whole batch {wall:.0f} s")


def demo(max_new_tokens, seed):
    """One problem, its rollout, the verifier's program, the sandbox output and the verdict."""
    record = easy_math500(1)[0]
    rollout = SOLUTION.format(answer=record["answer"])
    result = verify_batch([record["problem"]], [rollout], [extract_answer(rollout)],
                          _embedded_verifier(max_new_tokens, seed))[0]
    for title, text in (("problem", record["problem"]), ("rollout", rollout), ("program", result.code or
                        result.completion), ("sandbox output", result.output)):
        print(f"--- {title}\n{(text or '').strip()}\n")
    print(f"--- verdict\nv = {result.v} ({result.status}): tool result {result.result!r}, answer "
          f"{extract_answer(rollout)!r}; {result.tokens} verifier tokens in {result.seconds:.1f} s")


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench-equiv", action="store_true", help="measure is_equiv on data/equiv_cases.jsonl")
    parser.add_argument("--measure", action="store_true",
                        help="verify correct and wrong answers to MATH-500 problems with the embedded model")
    parser.add_argument("--demo", action="store_true", help="verify one rollout with the embedded model, step by step")
    parser.add_argument("--problems", type=int, default=30, help="--measure: number of problems (default 30)")
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="verifier generation limit (default 1024)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the verifier (default 0)")
    args = parser.parse_args()
    if args.bench_equiv:
        bench_equiv()
    elif args.measure:
        measure(args.problems, args.max_new_tokens, args.seed)
    elif args.demo:
        demo(args.max_new_tokens, args.seed)
    else:
        parser.print_help()
