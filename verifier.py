r"""Tool verification (T3RL): is a rollout's answer computed by a program the verifier writes from the problem?

Tool verification (T3RL). For question x and rollout y_i with answer a_i = extract_answer(y_i), a
verifier LLM compiles the computation into a short Python program (VERIFIER_SYSTEM: recompute from the
problem, the rollout is only a hint; never print the candidate; one ```python block; math, sympy, numpy,
fractions only; print only the result), the sandbox runs it, and

    t_i = last non-empty line the program prints
    v_i = 1[ the program ran cleanly  and  its printed value is computed  and  t_i ~ a_i ]

where ~ is is_equiv, applied to t_i as printed and to sympy's LaTeX of it (sqrt(3)/3, (3, pi/2) and
x**2 + 2*x are what sympy prints; the LaTeX is computed in the sandbox, since sympify evaluates text), to the
value after a label ('The answer is 9'), and with Python spellings x**2, pi, I, [1, 2] read as x^2, \pi, i,
1, 2; a float printed at machine precision matches a rational answer within relative 1e-9. Every rollout
gets one status:

    verified    v_i = 1                          no_answer   a_i is None: no verifier call spent
    mismatch    ran, printed something else      no_code     the completion holds no code block
    exec_error  raised, or hit a memory/output   timeout     ran past the sandbox's time limit
                limit, or was killed             hardcoded   the printed value is the candidate copied in
    skipped     not verified: no verdict of it could change the vote (verify_batch(..., omega=))

"hardcoded" is the weak-verifier failure the paper shows (Figure 11): a program that copies the
trace's answer into print(1320) verifies anything. hardcoded(code, problem, answer) decides it on the AST
with a small taint analysis: a literal worth the candidate answer that the problem text does not supply
(1320, '1320', Fraction(3, 4)) flows into the last print(...), through int(), Fraction(), sympy.Integer(),
arithmetic, indexing, variables or the program's own functions.

verify_batch(problems, rollouts, answers, verifier, sandbox=None, tool=python_tool, budget=0, omega=None) runs a
whole training step at once: one call of `verifier` (up to two with omega, below; any callable, list of user messages -> list of
completions; model_verifier wraps a model in one batched sampler.generate call) and one call of `tool`
(python_tool: one sandbox run_many). A rollout's reasoning enters the prompt cut to its last
MAX_ROLLOUT_CHARS = 4000 characters (the end holds the answer; ~1.2k tokens), so a prompt stays bounded
by that, the problem and the ~250-token system prompt. The tool is any function (programs, sandbox) -> [ToolRun(status, result, output, seconds)].

Each domain brings its prompt, tool and agreement test (DOMAINS; verify_batch(..., domain=)): "math" as
above, "knk" (Knights and Knaves, knk.py) where the verifier writes an SMT-LIB2 script, z3 solves it in the
sandbox, and v_i = 1 when the solver's assignment is the only one and equals the rollout's; a script whose
assertions fix someone's role as a bare fact is "hardcoded".
budget K > 0 verifies only the first K rollouts of each answer class of a problem; the others inherit
the majority outcome of those K (a tie counts as unverified) and are marked inferred. omega (the vote's)
verifies only the classes whose verdicts can still change the weighted vote (voting.undecided_classes), in
one or two verifier calls, so the label and rewards are those of verifying everything, at fewer prompts. Costs per rollout:
verifier tokens (VerifierText.num_tokens) and seconds (the batch's wall time split evenly over the
rollouts sent), and the program's run time.

Answer checking (extract_answer, answer_key, is_equiv, same_answer) lives in answers.py.

`python verifier.py --measure` (bench/verifier_measure.py) scores the offline verifiers' recall and
false-verify rate on correct and wrong answers; `--demo` shows one verification step by step.
"""

import ast
import inspect
import json
import re
import time
from dataclasses import dataclass
from fractions import Fraction

import knk
from answers import answer_key, computed_float_equiv, is_equiv, same_answer
from sandbox import default_pool
from voting import answer_classes, undecided_classes

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
4. Import only these modules: math, sympy, numpy, fractions. Define every name before you use it: each \
quantity the problem gives is a variable, each unknown a sympy symbol (x = sympy.symbols('x')).
5. Solve equations with sympy.solve and keep the solutions that meet the problem's conditions (real, \
positive, integer, in range); split absolute values and inequalities into cases. A figure drawn in \
Asymptote code ([asy] ... [/asy]) gives its coordinates and labels in that code.
6. The program prints only the final result, once, at the end, e.g. print(result), in the form the problem \
asks for: exact values (integers, fractions.Fraction, sympy expressions such as sympy.sqrt(2) or sympy.pi) \
rather than rounded decimals; a word or a name when the question asks for one.

Example. Problem: What is the sum of the solutions of $x^2 - 5x + 6 = 0$? Candidate: the roots are 2 and 3, \
so the answer is $\\boxed{5}$. Program:
```python
import sympy
x = sympy.symbols('x')
solutions = sympy.solve(x**2 - 5*x + 6, x)
print(sum(solutions))
```"""

VERIFIER_USER = """Problem:
{problem}

Candidate solution (it may be wrong):
{rollout}

Write the Python program that computes the answer to the problem."""

MAX_ROLLOUT_CHARS = 4000  # the end of a rollout holds its answer: longer ones keep their last 4000 characters
STATUSES_VERIFY = ("verified", "mismatch", "no_answer", "no_code", "exec_error", "timeout", "hardcoded", "skipped")

_FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_FENCE_ANY = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MACHINE_FLOAT = re.compile(r"[-+]?\d*\.\d{7,}(?:e[-+]?\d+)?|[-+]?\d+(?:\.\d*)?e[-+]?\d+", re.IGNORECASE)


class VerifierPrompt(str):
    """A verifier's user message that also says which system prompt goes with it (its domain's)."""
    def __new__(cls, text, system):
        self = super().__new__(cls, text)
        self.system = system
        return self


def verifier_prompt(problem, rollout, domain="math"):
    """The user message for one rollout; its reasoning is cut to the last MAX_ROLLOUT_CHARS characters."""
    if len(rollout) > MAX_ROLLOUT_CHARS:
        rollout = "[... beginning cut ...]\n" + rollout[-MAX_ROLLOUT_CHARS:]
    return VerifierPrompt(DOMAINS[domain].user.format(problem=problem.strip(), rollout=rollout.strip()),
                          DOMAINS[domain].system)


def _first_block(text, fences):
    """The first non-empty block of the first fence pattern that has one; a block left open (the completion
    hit its token limit) runs to the end of the text."""
    for fence in fences:
        m = fence.search(text)
        if m and m.group(1).strip():
            return m.group(1)
    return None


def extract_code(text):
    """The first ```python block of a verifier completion, else its first fenced block, else None."""
    return _first_block(text, (_FENCE_PYTHON, _FENCE_ANY))


# The hard-coding guard. Small verifiers copy the trace's final answer into the program (the paper's
# Figure 11); such a program "verifies" anything. The failure is a data flow: the candidate's value enters
# the program as a literal that the problem does not supply, and reaches the printed result. So the guard
# is a small taint analysis on the AST. Sources: a literal equal to the candidate answer (1320, 1320.0,
# '1320', f'{1320}') or spelling it as a fraction (Fraction(3, 4) for 3/4), that the problem text does not
# contain. The taint follows data: calls (int(), Fraction(), sympy.Integer(), ...), subscripts, names
# through every assignment to them (tuple unpacking position by position, loops, augmented assignment,
# walrus), and the program's own functions through their returns. Arithmetic carries it only where it
# keeps the value (1320 * 1, 1320 + 0; not len(s) // 2 for the answer 2), and control flow does not carry
# it (`if x == 1320: print(x)` is a check, not a copy). A Python program whose printed result matches the
# candidate is refused when its last print(...) shows a tainted value. Recomputations from the problem's
# numbers stay clean: print(11 * 120) when the problem gives 11 and 120, print(math.comb(12, 3)).

_PROBLEM_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_EXACT_CALLS = {"Fraction", "Rational"}


def _value(text):
    """The exact value of a plain number answer or literal, else None."""
    try:
        return Fraction(answer_key(str(text)))
    except (ValueError, ZeroDivisionError, TypeError):
        return None


class _Taint:
    """Does an expression of the program carry the candidate answer, copied from outside the problem?"""

    def __init__(self, tree, problem, answer):
        self.numbers = {Fraction(n) for n in _PROBLEM_NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", problem))}
        self.problem = problem
        self.answer_key, self.answer_value = answer_key(answer), _value(answer)
        self.bindings, self.returns = {}, {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.returns[node.name] = [r.value for r in ast.walk(node) if isinstance(r, ast.Return) and r.value]
            for target, value in _assignments(node):
                self.bindings.setdefault(target, []).append(value)

    def _is_answer(self, constant):
        if isinstance(constant.value, str):
            return answer_key(constant.value) == self.answer_key
        if isinstance(constant.value, (int, float)) and not isinstance(constant.value, bool):
            return self.answer_value is not None and abs(Fraction(constant.value) - self.answer_value) <= \
                abs(self.answer_value) * Fraction(1, 10 ** 9)
        return False

    def _is_answer_fraction(self, node):
        """Fraction(3, 4) / sympy.Rational(3, 4) spelling the answer 3/4 with numbers the problem lacks."""
        if not (isinstance(node, ast.Call) and len(node.args) == 2 and self.answer_value is not None and
                getattr(node.func, "id", getattr(node.func, "attr", None)) in _EXACT_CALLS):
            return False
        parts = [a.value for a in node.args if isinstance(a, ast.Constant) and type(a.value) is int]
        return parts == [self.answer_value.numerator, self.answer_value.denominator] and \
            not {Fraction(p) for p in parts} <= self.numbers

    def _supplied(self, constant):
        """Does the problem give this literal: one of its numbers, or a word of its text ('east' when it asks
        "north, south, east or west?", a name it mentions)?"""
        value = _value(constant.value)
        if value is not None or not isinstance(constant.value, str):
            return value in self.numbers
        word = re.escape(constant.value.strip())
        return bool(word) and re.search(rf"(?<!\w){word}(?!\w)", self.problem, re.IGNORECASE) is not None

    def carries(self, node, seen=frozenset()):
        if isinstance(node, ast.Constant):
            return self._is_answer(node) and not self._supplied(node)
        if self._is_answer_fraction(node):
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in seen:
            return any(self.carries(v, seen | {node.id}) for v in self.bindings.get(node.id, []))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.returns \
                and node.func.id not in seen:
            if any(self.carries(v, seen | {node.func.id}) for v in self.returns[node.func.id]):
                return True
        if isinstance(node, ast.BinOp):  # 1320 * 1 and 1320 + 0 keep the value; len(s) // 2 makes a new one
            return (self.carries(node.left, seen) and _identity(node.op, node.right)) or \
                (self.carries(node.right, seen) and _identity(node.op, node.left, right_side=False))
        if isinstance(node, (ast.Subscript, ast.Attribute)):  # x[0] is x's value, not the index's
            return self.carries(node.value, seen)
        return any(self.carries(child, seen) for child in ast.iter_child_nodes(node)
                   if not isinstance(child, (ast.expr_context, ast.FunctionDef, ast.Lambda)))


def _identity(op, other, right_side=True):
    """Is `other` the literal that leaves the tainted operand's value unchanged under `op` (x * 1, x + 0, ...)?"""
    if not (isinstance(other, ast.Constant) and type(other.value) in (int, float)):
        return False
    if isinstance(op, ast.Mult) or (right_side and isinstance(op, (ast.Div, ast.FloorDiv, ast.Pow))):
        return other.value == 1
    return (isinstance(op, ast.Add) or (right_side and isinstance(op, ast.Sub))) and other.value == 0


def _assignments(node):
    """(name, value expression) for each name `node` binds; unpacking a literal tuple goes position by position."""
    if isinstance(node, ast.Assign):
        pairs = [(t, node.value) for t in node.targets]
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
        pairs = [(node.target, node.value)]
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        pairs = [(node.target, node.iter)]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        pairs = [(node.optional_vars, node.context_expr)]
    else:
        return []
    out = []
    while pairs:
        target, value = pairs.pop()
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            pairs += list(zip(target.elts, value.elts))
        else:
            out += [(n.id, value) for n in ast.walk(target) if isinstance(n, ast.Name)]
    return out


def hardcoded(code, problem, answer):
    """True when the value printed last by the program carries the candidate `answer` copied in as a literal
    that the `problem` text does not supply (see the comment above). A program that does not parse is not
    hard-coded: it cannot run either, and the tool reports the error."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    prints = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "print" and node.args]
    if not prints or answer is None:
        return False
    last = max(prints, key=lambda node: (node.lineno, node.col_offset))
    taint = _Taint(tree, problem, answer)
    return any(taint.carries(arg) for arg in last.args)


# The tool: a function (programs, sandbox) -> one ToolRun per program. Another tool (an SMT solver for
# logic puzzles) only has to keep this signature.

@dataclass
class ToolRun:
    """What the tool made of one program."""
    status: str          # "ok", "error", "timeout", or "hardcoded" (a tool that decides it itself: smt_tool)
    result: str | None   # the tool's answer t_i: the last non-empty line of stdout
    output: str          # everything the program printed (stdout, then stderr), for reading
    seconds: float       # time the program ran


class PrintedResult(str):
    """A program's last printed line that also carries sympy's LaTeX of it (None: no such spelling)."""
    def __new__(cls, text, latex=None):
        self = super().__new__(cls, text)
        self.latex = latex
        return self


# sympy prints sqrt(3)/3, 2*x + 1 and (3, pi/2), which the answer side's LaTeX parser reads poorly; sympy
# itself turns them into LaTeX. sympify evaluates its text, and a program's output is untrusted, so this
# runs in the sandbox too.
_PYTHON_EXPRESSION = re.compile(r"[A-Za-z*(\[{]")
_LATEX_SNIPPET = "import sympy\nprint(sympy.latex(sympy.sympify({text!r})))"


# The tool is a Python with the allowed modules at hand under the names programs give them by habit: a
# program that writes sp.solve after `import sympy` fails on a name, not on its mathematics.
PYTHON_PRELUDE = "import math, fractions\nimport numpy, numpy as np\nimport sympy, sympy as sp\n"


def python_tool(codes, sandbox=None):
    """Run every program, after PYTHON_PRELUDE, in the sandbox (one run_many call; None: sandbox.default_pool()),
    never in this process, then spell the results that are Python expressions in LaTeX (a second run_many of
    one-line sympy snippets). verify_batch applies the hard-coding guard afterwards (it needs the problem and
    the answer)."""
    sandbox = sandbox or default_pool()
    runs = sandbox.run_many([PYTHON_PRELUDE + code for code in codes]) if codes else []
    tool_runs = []
    for code, run in zip(codes, runs):
        lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
        status = "ok" if run.status == "ok" else "timeout" if run.status == "timeout" else "error"
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        tool_runs.append(ToolRun(status, lines[-1] if lines else None, output, run.duration))
    spell = [t for t in tool_runs if t.status == "ok" and t.result and _PYTHON_EXPRESSION.search(t.result)]
    if spell:
        for t, run in zip(spell, sandbox.run_many([_LATEX_SNIPPET.format(text=_value_text(t.result)) for t in spell])):
            t.result = PrintedResult(t.result, run.stdout.strip() if run.status == "ok" and run.stdout.strip() else None)
    return tool_runs


def _value_text(result):
    """The value in a printed line: 'The answer is 9.' -> '9', 'Result: 14/3' -> '14/3'; else the line."""
    m = re.fullmatch(r"[A-Za-z][A-Za-z ,'()-]*?(?:\bis|:|=)\s*(.+?)\.?", result)
    return m.group(1) if m else result


def _python_spelling(result):
    """Python/sympy notation in the answer side's notation: x**2 -> x^2, pi -> \\pi, I -> i, [1, 2] -> 1, 2."""
    s = result.replace("**", "^")
    s = re.sub(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])", r"\\pi", s)
    s = re.sub(r"(?<![\\a-zA-Z])(?:(\d)\*)?I(?![a-zA-Z])", r"\1i", s)  # 9*I -> 9i
    if s.startswith("[") and s.endswith("]"):
        s = s[1:-1]
    return s


def tool_agrees(result, answer):
    """t_i equivalent to a_i, as printed, as sympy's LaTeX of it (PrintedResult.latex), or as the value after
    a label ('The answer is 9'). A float printed at machine precision (1/3 -> 0.3333333333333333) is a computed
    double: it matches a rational answer within relative 1e-9, and another exact answer (70\\sqrt{2}, 2\\pi) at the
    double's precision (computed_float_equiv); shorter decimals compare exactly (0.33 != 1/3)."""
    if result is None:
        return False
    latex = getattr(result, "latex", None)
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


# ----------------------------------------------------------------------------------------------------
# Knights and Knaves: the verifier writes SMT-LIB2, z3 solves it in the sandbox.
#
# SMT-LIB2 rather than z3's Python API: the script is data, not a program. It cannot print an answer;
# the tool, not the script, calls the solver, reads the model and checks that it is the only one
# (block it, solve again: unsat). So the one way to "hard-code" is to assert facts, and that is decided
# on the solver's side: a top-level conjunct that on its own fixes one person's role. knk.py's generator
# keeps only statements that fix nobody on their own, so an encoding of the statements never does.

KNK_SYSTEM = """You are an expert in logic and a careful user of the Z3 SMT solver. You check a candidate \
solution to a Knights and Knaves puzzle by encoding the puzzle in SMT-LIB2, so that the solver finds who is \
a knight and who is a knave.

Rules:
1. Do NOT assume the candidate's reasoning is correct. Encode the puzzle from its statement; use the \
reasoning only as a hint for how to read the statements.
2. Declare one Bool constant per inhabitant, named exactly as in the puzzle, true meaning knight: \
(declare-const Zoey Bool).
3. For every statement assert that the speaker is a knight exactly when the statement is true: Zoey says \
that Oliver is a knave and Ethan is a knight -> (assert (= Zoey (and (not Oliver) Ethan))). "if P then Q" \
is (=> P Q); "P if and only if Q" is (= P Q); "or" is (or P Q). A claim about a person is that person's \
constant: "Oliver is a knight" and "Oliver is not a knave" are Oliver; "Oliver is a knave" and "Oliver is not a \
knight" are (not Oliver).
4. Never assert who is a knight or a knave as a fact (no (assert Zoey), no (assert (not Oliver))): the \
solver must derive it from the statements.
5. Answer with exactly one code block, fenced as smt2 like the example, that ends with (check-sat) and \
(get-model), and nothing after it.

Example. Puzzle: You meet 3 inhabitants: Zoey, Oliver, and Ethan. Zoey says that Ethan is a knight or Oliver \
is a knave. Oliver claims that Ethan is a knight or Zoey is a knave. Ethan states that Oliver is a knight and \
Zoey is a knave.
```smt2
(declare-const Zoey Bool)
(declare-const Oliver Bool)
(declare-const Ethan Bool)
; Zoey says that Ethan is a knight or Oliver is a knave
(assert (= Zoey (or Ethan (not Oliver))))
; Oliver claims that Ethan is a knight or Zoey is a knave
(assert (= Oliver (or Ethan (not Zoey))))
; Ethan states that Oliver is a knight and Zoey is a knave
(assert (= Ethan (and Oliver (not Zoey))))
(check-sat)
(get-model)
```"""

KNK_USER = """Puzzle:
{problem}

Candidate solution (it may be wrong):
{rollout}

Write the SMT-LIB2 script that encodes the puzzle."""

_FENCE_SMT = re.compile(r"```[ \t]*(?:smt2?|smt-?lib2?|lisp|scheme|z3)\b[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


def extract_smt(text):
    """The first ```smt2 (smt, smtlib, lisp, z3) block of a verifier completion, else its first fenced block,
    without the closing parentheses that close nothing."""
    script = _first_block(text, (_FENCE_SMT, _FENCE_ANY))
    return None if script is None else drop_unmatched_parens(script)


def drop_unmatched_parens(script):
    """The script without each `)` that closes nothing. Small verifiers miscount the parentheses at the end of
    an assert (`(assert (= Zoey (not Oliver))))`), and z3 then refuses the whole script; a closer at depth 0
    is outside every expression, so dropping it changes no command (comments and |quoted| symbols are skipped)."""
    kept, depth, i = [], 0, 0
    while i < len(script):
        c = script[i]
        skip_to = {";": "\n", "|": "|", '"': '"'}.get(c)
        if skip_to:
            end = script.find(skip_to, i + 1)
            end = len(script) if end < 0 else end + 1
            kept.append(script[i:end])
            i = end
            continue
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            depth = 0
        else:
            kept.append(c)
        i += 1
    return "".join(kept)


def smt_solve(script):
    """Runs in the sandbox (this function's source is sent there): z3's verdict on an SMT-LIB2 script.

    The script's own commands (check-sat, get-model) are ignored; its assertions are split at top-level
    `and`s into conjuncts. Returns {"verdict": "asserts facts", "facts": [names]} when a conjunct on its own
    forces some person's value; else {"verdict": "unsat" | "unknown"}; else the model over every Bool
    constant (declared or used), with "unique" when blocking it leaves the assertions unsatisfiable, "not unique"
    otherwise."""
    import re

    import z3
    conjuncts, todo = [], list(z3.parse_smt2_string(script))
    while todo:
        a = todo.pop(0)
        if z3.is_and(a):
            todo[:0] = a.children()
        else:
            conjuncts.append(a)

    def people(exprs):  # Bool constants the script declared, by name
        found, seen, todo = {}, set(), list(exprs)
        while todo:
            e = todo.pop()
            if e.get_id() not in seen:
                seen.add(e.get_id())
                if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED and z3.is_bool(e):
                    found[str(e)] = e
                todo += e.children()
        return found

    def satisfiable(*exprs):
        solver = z3.Solver()
        solver.add(*exprs)
        return solver.check() == z3.sat

    facts = sorted({name for c in conjuncts for name, x in people([c]).items()
                    if satisfiable(c, x) != satisfiable(c, z3.Not(x))})
    if facts:
        return {"verdict": "asserts facts", "facts": facts}
    solver = z3.Solver()
    solver.add(*conjuncts)
    verdict = solver.check()
    if verdict != z3.sat:
        return {"verdict": str(verdict)}
    declared = re.findall(r"\(declare-(?:const\s+([^\s()]+)|fun\s+([^\s()]+)\s*\(\s*\))\s+Bool\s*\)", script)
    everyone = {**{a or b: z3.Bool(a or b) for a, b in declared}, **people(conjuncts)}  # unconstrained ones too
    model = {name: z3.is_true(solver.model().eval(x, model_completion=True)) for name, x in everyone.items()}
    solver.add(z3.Or([x != z3.BoolVal(model[name]) for name, x in everyone.items()]))
    return {"verdict": "unique" if solver.check() == z3.unsat else "not unique", "model": model}


def smt_program(script):
    """The Python program the sandbox runs for one script: smt_solve's source, then one JSON line of verdict."""
    return f"{inspect.getsource(smt_solve)}\nimport json\nprint(json.dumps(smt_solve({script!r})))\n"


def smt_tool(scripts, sandbox=None):
    """Solve every script in the sandbox (one run_many call). The result t_i is the unique assignment in
    canonical form; "unsat", "unknown" or "not unique" otherwise (a mismatch); a script that asserts facts
    is refused ("hardcoded")."""
    runs = (sandbox or default_pool()).run_many([smt_program(s) for s in scripts]) if scripts else []
    tool_runs = []
    for run in runs:
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        lines = run.stdout.strip().splitlines()
        if run.status != "ok" or not lines:
            tool_runs.append(ToolRun("timeout" if run.status == "timeout" else "error", None, output, run.duration))
            continue
        found = json.loads(lines[-1])
        if found["verdict"] == "asserts facts":
            status, result = "hardcoded", "asserts " + ", ".join(found["facts"])
        else:
            model = found.get("model")
            status = "ok"
            result = knk.canonical(list(model), model) if found["verdict"] == "unique" else found["verdict"]
        tool_runs.append(ToolRun(status, result, output, run.duration))
    return tool_runs


def smt_agrees(result, answer):
    """The solver's unique assignment gives every person of the rollout's answer the same role (names
    compared case-insensitively; constants the script added beyond the people do not matter)."""
    solved = {name.lower(): role for name, role in knk.parse_assignment(result).items()}
    claimed = knk.parse_assignment(answer)
    return bool(claimed) and all(solved.get(name.lower()) == role for name, role in claimed.items())


# verify_batch takes the prompts, the script's extraction, the tool and its agreement test from the domain
@dataclass(frozen=True)
class Domain:
    system: str        # the verifier's system prompt
    user: str          # its user message, with {problem} and {rollout}
    extract: object    # completion -> the script, or None (no_code)
    tool: object       # (scripts, sandbox) -> one ToolRun per script
    agrees: object     # (tool result, rollout's answer) -> bool
    classes: dict      # same= and key= of the domain's answer classes, as voting's functions take them


DOMAINS = {"math": Domain(VERIFIER_SYSTEM, VERIFIER_USER, extract_code, python_tool, tool_agrees,
                          dict(same=same_answer, key=answer_key)),
           "knk": Domain(KNK_SYSTEM, KNK_USER, extract_smt, smt_tool, smt_agrees,
                         dict(same=knk.same_answer, key=knk.answer_key))}


@dataclass
class Verification:
    """The verdict on one rollout."""
    v: int                         # 1 when the tool's result is equivalent to the rollout's answer
    status: str                    # one of STATUSES_VERIFY
    result: str | None             # the tool's result t_i
    code: str | None = None        # the verifier's program (None: no verifier call for it)
    completion: str | None = None  # the verifier's whole completion
    output: str = ""               # what the program printed
    tokens: int | None = 0         # verifier tokens generated for this rollout (None: the verifier does not say)
    seconds: float = 0.0           # verifier generation time for this rollout: the batch's wall time / rollouts sent
    tool_seconds: float = 0.0      # time the program ran
    inferred: bool = False         # True: not sent to the verifier; the outcome of its answer class (--verify-budget)


class VerifierText(str):
    """A verifier completion that also says how many tokens it took (a plain str otherwise)."""
    def __new__(cls, text, num_tokens):
        self = super().__new__(cls, text)
        self.num_tokens = num_tokens
        return self


def model_verifier(model, tokenizer, max_new_tokens=1024, temperature=0.6, top_p=0.95, seed=None, backend="kv",
                   int8=False):
    """A verifier callable: list of user messages -> list of VerifierText, one batched sampler call.

    Each message is put in the model's chat template after its system prompt (VerifierPrompt.system; a plain
    string gets VERIFIER_SYSTEM). With a seed, call k of the
    callable samples with seed + k, so repeated calls (training steps) differ but a run repeats. int8: the kv
    sampler's products in 8-bit integers (sampler.Int8Linear, a CPU only; faster, but a weaker verifier)."""
    from sampler import generate  # torch is needed only once a model verifier is built
    calls = 0

    def verify(messages):
        nonlocal calls
        chats = [tokenizer.apply_chat_template([{"role": "system", "content": getattr(m, "system", VERIFIER_SYSTEM)},
                                                {"role": "user", "content": m}], tokenize=False,
                                               add_generation_prompt=True) for m in messages]
        groups = generate(model, tokenizer, chats, n=1, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=None if seed is None else seed + calls, backend=backend,
                          progress="verifier" if backend == "kv" else None, frozen=True, int8=int8)
        calls += 1
        return [VerifierText(group[0].text, group[0].num_tokens) for group in groups]

    return verify


# A second verifier call pays again for prefilling the prompts' shared start and for its own decode tail:
# about five prompts' worth for the 1.5B verifier on a CPU (python verifier.py --steps RUN). Lazy verification
# makes one only when it can spare more prompts than this.
LAZY_SECOND_CALL = 8


def verify_batch(problems, rollouts, answers, verifier, sandbox=None, tool=None, budget=0, domain="math",
                 omega=None):
    """Tool-verify each rollout: one Verification per rollout, in order.

    problems, rollouts, answers: one entry per rollout (answers from extract_answer; None -> no_answer,
    without a verifier call); a problem's rollouts vote together. verifier: callable, list of user messages ->
    list of completions (see model_verifier). domain: "math" (Python, VERIFIER_SYSTEM) or "knk" (SMT-LIB2,
    KNK_SYSTEM); see DOMAINS. tool: replaces the domain's tool. sandbox: passed to the tool (None: a default pool).

    budget K > 0: per problem and answer class only the first K rollouts are verified, the rest inherit the
    majority outcome of those K (ties: 0) and are marked inferred=True.
    omega: verify only what can change the weighted vote at this omega (voting.undecided_classes): every
    class that can still win, in one verifier call; or, when that spares more than LAZY_SECOND_CALL prompts,
    in two: first the likeliest winning class of each problem, then every class that can still beat it. The
    rest are "skipped" (v=0): whatever they would show, the label and the rewards are those of verifying
    everything."""
    if not len(problems) == len(rollouts) == len(answers):
        raise ValueError(f"verify_batch: problems ({len(problems)}), rollouts ({len(rollouts)}) and answers "
                         f"({len(answers)}) need one entry per rollout")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget={budget!r}: pass K >= 1 rollouts per answer class, or 0 to verify all")
    if domain not in DOMAINS:
        raise ValueError(f"verify_batch: domain {domain!r} is unknown; choose one of {', '.join(DOMAINS)}")
    kind = DOMAINS[domain]
    by_problem = {}  # problem -> its answered rollouts' indices
    for i, answer in enumerate(answers):
        if answer is not None:
            by_problem.setdefault(problems[i], []).append(i)
    results = [None] * len(rollouts)

    def verify(classes):
        """Verify the first `budget` rollouts of each class (all with budget 0); the others inherit."""
        sent = sorted(i for members in classes for i in (members[:budget] if budget else members))
        if not sent:
            return
        start = time.perf_counter()
        completions = verifier([verifier_prompt(problems[i], rollouts[i], domain) for i in sent])
        seconds = (time.perf_counter() - start) / len(sent)
        if len(completions) != len(sent):
            raise ValueError(f"the verifier returned {len(completions)} completions for {len(sent)} prompts")
        codes = {i: kind.extract(text) for i, text in zip(sent, completions)}
        with_code = [i for i in sent if codes[i] is not None]
        runs = dict(zip(with_code, (tool or kind.tool)([codes[i] for i in with_code], sandbox)))
        for i, text in zip(sent, completions):
            run = runs.get(i)
            if run is None:
                status = "no_code"
            elif run.status == "ok" and kind.agrees(run.result, answers[i]):  # unless the program copied a_i in
                status = "hardcoded" if domain == "math" and hardcoded(codes[i], problems[i], answers[i]) else "verified"
            elif run.status == "ok":
                status = "mismatch"
            else:
                status = {"error": "exec_error", "timeout": "timeout", "hardcoded": "hardcoded"}[run.status]
            results[i] = Verification(v=int(status == "verified"), status=status, result=run and run.result,
                                      code=codes[i], completion=str(text), output=run.output if run else "",
                                      tokens=getattr(text, "num_tokens", None), seconds=seconds,
                                      tool_seconds=run.seconds if run else 0.0)
        for members in classes if budget else []:
            outcomes = [results[i] for i in members[:budget]]
            v = int(2 * sum(r.v for r in outcomes) > len(outcomes))
            like = next(r for r in outcomes if r.v == v)
            for i in members[budget:]:
                results[i] = Verification(v=v, status=like.status, result=like.result, inferred=True)

    def classes_of(indices, open_only):
        """A problem's answer classes (rollout indices); open_only: those whose verdicts can change its vote."""
        group = [answers[i] for i in indices]
        local = (undecided_classes(group, [None if results[i] is None else results[i].v for i in indices], omega,
                                   **kind.classes) if open_only else answer_classes(group, **kind.classes))
        return [[indices[m] for m in members] for members in local]

    if omega is None:  # every answered rollout; classes matter only to a budget
        verify([members for indices in by_problem.values()
                for members in (classes_of(indices, False) if budget else [indices])])
    else:
        undecided = [classes_of(indices, True) for indices in by_problem.values()]
        prompts = lambda classes: sum(min(len(m), budget or len(m)) for m in classes)  # noqa: E731
        if prompts(c for group in undecided for c in group[1:]) > LAZY_SECOND_CALL:
            verify([group[0] for group in undecided if group])  # the likeliest winners; then what can beat them
            verify([members for indices in by_problem.values() for members in classes_of(indices, True)])
        else:  # every class that can win: the vote is settled after one call
            verify([members for group in undecided for members in group])
    for i, answer in enumerate(answers):
        if answer is None:
            results[i] = Verification(v=0, status="no_answer", result=None)
        elif results[i] is None:
            results[i] = Verification(v=0, status="skipped", result=None)
    return results


if __name__ == "__main__":
    from bench.verifier_measure import main
    main()
