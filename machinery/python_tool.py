"""The math domain's tool: Python programs run in the sandbox after a prelude of the allowed
modules, their printed result read off the last line, and tool_agrees, the test t_i ~ a_i between
what a program printed and a rollout's answer (verifier.py's v_i; docs/verifier.md#the-python-tool).
"""
import re
from fractions import Fraction

from answers import answer_key, computed_float_equiv, is_equiv
from sandbox import default_pool
from verifier import ToolRun

_MACHINE_FLOAT = re.compile(r"[-+]?\d*\.\d{7,}(?:e[-+]?\d+)?|[-+]?\d+(?:\.\d*)?e[-+]?\d+",
                            re.IGNORECASE)


# The tool is a Python with the allowed modules at hand under the names programs give them by habit:
# a program that writes sp.solve after `import sympy` fails on a name, not on its mathematics.
PYTHON_PRELUDE = "import math, fractions\nimport numpy, numpy as np\nimport sympy, sympy as sp\n"

# sympy prints sqrt(3)/3, 2*x + 1 and (3, pi/2), which the answer side's LaTeX parser reads poorly;
# sympy itself turns them into LaTeX. sympify evaluates its text, and a program's output is
# untrusted, so this runs in the sandbox too.
_PYTHON_EXPRESSION = re.compile(r"[A-Za-z*(\[{]")
_LATEX_SNIPPET = "import sympy\nprint(sympy.latex(sympy.sympify({text!r})))"


def python_tool(codes, sandbox=None):
    """Run every program, after PYTHON_PRELUDE, in the sandbox (one run_many call; None:
    sandbox.default_pool()), never in this process, then spell the results that are Python
    expressions in LaTeX (a second run_many of one-line sympy snippets). verify_batch applies the
    hard-coding guard afterwards (it needs the problem and the answer)."""
    sandbox = sandbox or default_pool()
    runs = sandbox.run_many([PYTHON_PRELUDE + code for code in codes]) if codes else []
    tool_runs = []
    for run in runs:
        status = "ok" if run.status == "ok" else "timeout" if run.status == "timeout" else "error"
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        tool_runs.append(ToolRun(status, last_line(run.stdout), output, run.duration))
    spell = [t for t in tool_runs
             if t.status == "ok" and t.result and _PYTHON_EXPRESSION.search(t.result)]
    if spell:
        for t, run in zip(spell, sandbox.run_many([_LATEX_SNIPPET.format(text=_value_text(t.result))
                                                   for t in spell])):
            t.latex = run.stdout.strip() if run.status == "ok" and run.stdout.strip() else None
    return tool_runs


def last_line(text: str) -> str | None:
    """The last non-empty line of text, stripped (None: there is none):
    a program's result as it printed it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def _value_text(result):
    """The value in a printed line: 'The answer is 9.' -> '9', 'Result: 14/3' -> '14/3';
    else the line."""
    m = re.fullmatch(r"[A-Za-z][A-Za-z ,'()-]*?(?:\bis|:|=)\s*(.+?)\.?", result)
    return m.group(1) if m else result


def _python_spelling(result):
    """Python/sympy notation in the answer side's notation:
    x**2 -> x^2, pi -> \\pi, I -> i, [1, 2] -> 1, 2."""
    s = result.replace("**", "^")
    s = re.sub(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])", r"\\pi", s)
    s = re.sub(r"(?<![\\a-zA-Z])(?:(\d)\*)?I(?![a-zA-Z])", r"\1i", s)  # 9*I -> 9i
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1]
    return s


def tool_agrees(result, answer, latex=None):
    """t_i equivalent to a_i, as printed, as sympy's LaTeX of it (`latex`, ToolRun.latex), or as the
    value after a label ('The answer is 9'). A float printed at machine precision
    (1/3 -> 0.3333333333333333) is a computed double: it matches a rational answer within relative
    1e-9, and another exact answer (70\\sqrt{2}, 2\\pi) at the double's precision
    (computed_float_equiv); shorter decimals compare exactly (0.33 != 1/3)."""
    if result is None:
        return False
    if is_equiv(result, answer) or (latex is not None and is_equiv(latex, answer)):
        return True
    if _value_text(result) != result:
        return tool_agrees(_value_text(result), answer)
    spelled = _python_spelling(result)
    if spelled != result and is_equiv(spelled, answer):
        return True
    if _MACHINE_FLOAT.fullmatch(result):
        try:
            value = Fraction(answer_key(answer))
        except (ValueError, ZeroDivisionError):
            return computed_float_equiv(result, answer)
        return abs(float(result) - value) <= 1e-9 * max(1.0, abs(float(value)))
    return False
