r"""Tool verification (T3RL): does a program the verifier LLM writes from the problem compute the
rollout's answer?

For a problem x and a rollout y_i with answer a_i, the verifier turns the rollout into a short
program that recomputes the answer from the problem (the rollout is only a hint; VERIFIER_SYSTEM
forbids copying the candidate in), the sandbox runs it, and

    t_i = the program's result (the last non-empty line it prints)
    v_i = 1[ it ran cleanly  and  t_i ~ a_i  and  it did not copy a_i in ]

~ is tool_agrees (answers.is_equiv on t_i as printed and as sympy's LaTeX of it); copying is
decided on the program's AST (machinery/guard.py). `verify_batch` does it for a step's rollouts in
one verifier call and one sandbox batch, the paper's one program per rollout. Every rollout gets a
status:
    verified    v_i = 1                          no_answer   a_i is None: no verifier call
    mismatch    ran, printed something else      no_code     the reply holds no code block
    exec_error  raised, or hit a sandbox limit   timeout     ran past the time limit
    hardcoded   the printed value is a_i copied
Beyond the paper, each at its one call in t3rl.setup: several programs and repair
(extensions/programs.py), verifying some rollouts for their class (extensions/budget.py), the
verdict memory (extensions/memory.py), Knights and Knaves' SMT tool (extensions/knk.py).
"""
import hashlib
import math
import re
import textwrap
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Callable

import sampler
from answers import answer_key, computed_float_equiv, extract_answer, is_equiv, same_answer
from machinery.guard import hardcoded

SANDBOX_TIMEOUT = 5.0   # seconds a program may run
TEMPERATURE, TOP_P = 0.6, 0.95   # the verifier's sampling: the paper's
MAX_ROLLOUT_CHARS = 4000   # the end of a long rollout holds its answer: its last 4000 characters


@dataclass(frozen=True)
class ToVerify:
    """One rollout to verify, and what it belongs to."""
    problem: str
    text: str
    answer: str | None
    question: str        # its question's id: rollouts of one question vote together
    seed: int | None     # its program's sampling seed (run, step, question, rollout)
    step: int = -1       # the training step it was sampled at (-1: an evaluation)


@dataclass
class Verification:
    """The verdict on one rollout."""
    v: int                         # 1: a program reproduced the rollout's answer
    status: str                    # one of STATUSES
    result: str | None             # the program's result t_i
    code: str | None = None        # the program (None: no verifier call for it)
    completion: str | None = None  # the verifier's whole reply
    output: str = ""               # what the program printed
    tokens: int | None = 0         # verifier tokens generated for it (None: the verifier says not)
    seconds: float = 0.0           # the verifier call's wall time / rollouts sent
    tool_seconds: float = 0.0      # time the program ran
    inferred: bool = False         # its class's verdict, not its own (extensions: budget, memory)
    # what an extension records of how it reached the verdict, logged with the rollout
    # (extensions/programs.py: repaired_from, programs; memory.py: remembered; budget.py:
    # class_verdict)
    details: dict = field(default_factory=dict)


STATUSES = ("verified", "repaired", "mismatch", "no_answer", "no_code", "exec_error", "timeout",
            "hardcoded", "skipped")


def verify_batch(rollouts: list, known: list, verifier, pool, domain=None) -> list:
    """A Verification per rollout: `known` ones kept, every other one verified by one program, all
    of them in one verifier call and one sandbox batch (a rollout without an answer: no_answer).
    verifier: [VerifierPrompt] -> [VerifierReply]; domain: what to prompt, run and compare
    (MATH)."""
    domain = domain or MATH
    return verify_unknown(rollouts, known, lambda todo: run_programs(
        [(r, verifier_prompt(r, domain)) for r in todo], verifier, pool, domain))


def verify_unknown(rollouts: list, known: list, verify) -> list:
    """A Verification per rollout: `known` ones kept, one without an answer no_answer, the others
    from verify([ToVerify]) -> [Verification] in one call, each with its share of the call's
    time."""
    todo = [i for i, (r, k) in enumerate(zip(rollouts, known))
            if k is None and r.answer is not None]
    started = time.perf_counter()
    verdicts = verify([rollouts[i] for i in todo])
    seconds = (time.perf_counter() - started) / max(len(todo), 1)
    results = list(known)
    for i, verdict in zip(todo, verdicts):
        results[i] = replace(verdict, seconds=seconds)
    return [Verification(0, "no_answer", None) if r.answer is None else result
            for r, result in zip(rollouts, results)]


def run_programs(asked: list, verifier, pool, domain) -> list:
    """One verifier call for the (rollout, VerifierPrompt) pairs asked, one sandbox batch for the
    programs it writes: a Verification per prompt."""
    if not asked:
        return []
    replies = verifier([prompt for _, prompt in asked])
    if len(replies) != len(asked):
        raise ValueError(f"the verifier gave {len(replies)} replies to {len(asked)} prompts")
    replies = [r if isinstance(r, VerifierReply) else VerifierReply(str(r)) for r in replies]
    programs = [domain.extract_program(reply.text) for reply in replies]
    with_code = [k for k, program in enumerate(programs) if program is not None]
    runs = dict(zip(with_code, domain.tool([programs[k] for k in with_code], pool)))
    results = []
    for k, (reply, (rollout, _)) in enumerate(zip(replies, asked)):
        run = runs.get(k)
        status = verdict_status(run, programs[k], rollout, domain)
        results.append(Verification(
            int(status == "verified"), status, run and run.result, programs[k], reply.text,
            run.output if run else "", reply.tokens, tool_seconds=run.seconds if run else 0.0))
    return results


def verdict_status(run, program, rollout: ToVerify, domain) -> str:
    """A rollout's status from the run of its program (None: the reply held no program)."""
    if run is None:
        return "no_code"
    if run.status == "ok" and domain.agrees(run, rollout.answer):  # unless it copied a_i in
        return ("hardcoded" if domain.hardcoded and domain.hardcoded(program, rollout.problem,
                                                                     rollout.answer)
                else "verified")
    return {"ok": "mismatch", "error": "exec_error", "timeout": "timeout",
            "hardcoded": "hardcoded"}[run.status]


# --------------------------------------------------------------------------------------------------
# The verifier: prompts in, programs out

@dataclass(frozen=True)
class VerifierPrompt:
    """One request: the domain's system prompt, the user message for one rollout, and its seed."""
    system: str
    user: str
    seed: int | None = None


@dataclass(frozen=True)
class VerifierReply:
    """One reply and the tokens it took (None: the verifier does not say)."""
    text: str
    tokens: int | None = None


def verifier_prompt(rollout: ToVerify, domain) -> VerifierPrompt:
    """The request for one rollout, its reasoning cut to its last MAX_ROLLOUT_CHARS characters."""
    text = rollout.text
    if len(text) > MAX_ROLLOUT_CHARS:
        text = "[... beginning cut ...]\n" + text[-MAX_ROLLOUT_CHARS:]
    user = domain.verifier_user.format(problem=rollout.problem.strip(), rollout=text.strip())
    return VerifierPrompt(domain.verifier_system, user, rollout.seed)


def model_verifier(model, tokenizer, max_new_tokens: int, seed=None, generate=None):
    """[VerifierPrompt] -> [VerifierReply] through one batched sampler call (generate: sampler's,
    or a backend's of the same signature), each prompt in the model's chat template at the paper's
    temperature and top-p. With a seed, each prompt samples with a seed of (seed, its own, its
    text): a program depends on what it verifies, not on the call it comes in, so a resumed run
    writes the programs an uninterrupted one would."""
    generate = generate or sampler.generate

    def verify_prompts(prompts):
        chats = [tokenizer.apply_chat_template([{"role": "system", "content": p.system},
                                                {"role": "user", "content": p.user}],
                                               tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        seeds = None if seed is None else [prompt_seed(seed, p) for p in prompts]
        groups = generate(model, tokenizer, chats, 1,
                          sampler.Sampling(max_new_tokens, TEMPERATURE, TOP_P),
                          seed=seeds, progress="verifier")
        return [VerifierReply(group[0].text, group[0].num_tokens) for group in groups]
    return verify_prompts


def prompt_seed(seed: int, prompt: VerifierPrompt) -> int:
    """The sampling seed of one verifier request: its verifier's seed, its own and its text."""
    text = f"{seed}|{prompt.seed}|{prompt.system}|{prompt.user}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


VERIFIER_SYSTEM = """You are an expert mathematician and a careful Python programmer. You check a \
candidate solution to a math problem by writing a short Python program that computes the answer \
itself.

Rules:
1. Do NOT assume the candidate's reasoning is correct. Recompute the answer directly from the \
problem statement; use the reasoning only as a hint for how to approach the problem.
2. Never hard-code the candidate's final answer and never print it as a literal: the program must \
compute the result.
3. Answer with exactly one code block in the form ```python\\nCODE\\n```.
4. Import only these modules: math, sympy, numpy, fractions. Define every name before you use it: \
each quantity the problem gives is a variable, each unknown a sympy symbol \
(x = sympy.symbols('x')).
5. Solve equations with sympy.solve and keep the solutions that meet the problem's conditions \
(real, positive, integer, in range); split absolute values and inequalities into cases. A figure \
drawn in Asymptote code ([asy] ... [/asy]) gives its coordinates and labels in that code.
6. The program prints only the final result, once, at the end, e.g. print(result), in the form the \
problem asks for: exact values (integers, fractions.Fraction, sympy expressions such as \
sympy.sqrt(2) or sympy.pi) rather than rounded decimals; a word or a name when the question asks \
for one.

Example. Problem: What is the sum of the solutions of $x^2 - 5x + 6 = 0$? Candidate: the roots are \
2 and 3, so the answer is $\\boxed{5}$. Program:
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

FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n`]*\n(.*?)(?:```|\Z)",
                          re.DOTALL | re.IGNORECASE)
FENCE_ANY = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text):
    """The first non-empty ```python block of a reply, else its first non-empty fenced block, else
    None; a block left open (the reply hit its token limit) runs to the end, and a block indented
    in a markdown list loses its indent."""
    for fence in (FENCE_PYTHON, FENCE_ANY):
        for m in fence.finditer(text):
            if m.group(1).strip():
                return textwrap.dedent(m.group(1))
    return None


# --------------------------------------------------------------------------------------------------
# The tool: (programs, pool) -> one ToolRun per program (extensions/knk.py brings another)

@dataclass
class ToolRun:
    """What the tool made of one program."""
    status: str               # ok, error, timeout, or hardcoded (a tool that decides it: knk's)
    result: str | None        # t_i: the last non-empty line of stdout
    output: str               # everything it printed (stdout, then stderr), for reading
    seconds: float
    latex: str | None = None  # sympy's LaTeX of a result that is a Python expression


# the modules at hand under the names programs give them by habit: a program that writes sp.solve
# after `import sympy` fails on a name, not on its mathematics
PYTHON_PRELUDE = "import math, fractions\nimport numpy, numpy as np\nimport sympy, sympy as sp\n"
# sympy prints sqrt(3)/3 or (3, pi/2), which the answer side's LaTeX parser reads poorly: sympy
# writes it in LaTeX, in the sandbox too (sympify evaluates untrusted text)
_PYTHON_EXPRESSION = re.compile(r"[A-Za-z*(\[{]")
_LATEX_SNIPPET = ("import sympy\nprint(sympy.latex(sympy.sympify({text!r}), mat_str='pmatrix', "
                  "mat_delim=''))")
_SPACED_VALUES = re.compile(r"(?<=[\d.])[ \t]+(?=[-+]?\d)")  # print(3, 4) -> '3 4'
_MACHINE_FLOAT = re.compile(r"[-+]?\d*\.\d{7,}(?:e[-+]?\d+)?|[-+]?\d+(?:\.\d*)?e[-+]?\d+",
                            re.IGNORECASE)


def python_tool(codes, pool) -> list:
    """Run every program after PYTHON_PRELUDE in the sandbox pool (one run_many), never in this
    process; then spell the results that are Python expressions in LaTeX (one more run_many)."""
    runs = pool.run_many([with_prelude(code) for code in codes]) if codes else []
    tool_runs = [ToolRun("ok" if r.status == "ok" else "timeout" if r.status == "timeout"
                         else "error", last_line(r.stdout),
                         r.stdout + ("\n" if r.stdout and r.stderr else "") + r.stderr, r.duration)
                 for r in runs]
    spell = [t for t in tool_runs
             if t.status == "ok" and t.result and _PYTHON_EXPRESSION.search(t.result)]
    if spell:
        snippets = [_LATEX_SNIPPET.format(text=value_text(t.result)) for t in spell]
        for t, run in zip(spell, pool.run_many(snippets)):
            t.latex = run.stdout.strip() if run.status == "ok" and run.stdout.strip() else None
    return tool_runs


def with_prelude(code: str) -> str:
    """PYTHON_PRELUDE before the program, after its `from __future__` imports (which must come
    first)."""
    future = re.match(r"(?:\s*(?:#[^\n]*|from\s+__future__\s+import[^\n]*)\n)*", code).end()
    return code[:future] + PYTHON_PRELUDE + code[future:]


def last_line(text: str) -> str | None:
    """The last non-empty line of text, stripped (None: there is none)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def value_text(result):
    """The value in a printed line: 'The answer is 9.' -> '9', 'Result: 14/3' -> '14/3'."""
    m = re.fullmatch(r"[A-Za-z][A-Za-z ,'()-]*?(?:\bis\s*:?|:|=)\s*(.+?)\.?", result)
    return m.group(1) if m else result


def python_spelling(result):
    """Python's notation in the answer side's: x**2 -> x^2, pi -> \\pi, I -> i, [1, 2] -> 1, 2,
    Fraction(1, 2) -> 1/2, np.int64(3) -> 3 (numpy 2's repr inside a container)."""
    s = re.sub(r"\bFraction\((-?\d+), (\d+)\)", r"\1/\2", result)
    s = re.sub(r"\bnp\.(?:u?int|float)\d*\(([^()]*)\)", r"\1", s)
    s = s.replace("**", "^")
    s = re.sub(r"(?<![\\a-zA-Z])pi(?![a-zA-Z])", r"\\pi", s)
    s = re.sub(r"(?<![\\a-zA-Z])(?:(\d)\*)?I(?![a-zA-Z])", r"\1i", s)  # 9*I -> 9i
    return s[1:-1] if s.startswith("[") and s.endswith("]") else s


def tool_agrees(result, answer, latex=None, labels=3) -> bool:
    """t_i ~ a_i: equivalent as printed, as sympy's LaTeX of it, or as the value after at most
    `labels` labels ('Result: x = 5' has two). Values printed apart ('3 4', numpy's [3 4]) are a
    list, not the number 34. A float printed with 7 or more decimals or an exponent (1/3 ->
    0.3333333333333333) is a computed double: it matches a rational answer within 1e-9 (relative;
    absolute below 1), another exact one at its printed precision; shorter decimals compare exactly
    (0.33 != 1/3)."""
    if result is None:
        return False
    result = _SPACED_VALUES.sub(", ", result)
    if is_equiv(result, answer) or (latex is not None and is_equiv(latex, answer)):
        return True
    if value_text(result) != result:
        return labels > 0 and tool_agrees(value_text(result), answer, labels=labels - 1)
    if python_spelling(result) != result and is_equiv(python_spelling(result), answer):
        return True
    if _MACHINE_FLOAT.fullmatch(result):
        try:
            value = Fraction(answer_key(answer))
        except (ValueError, ZeroDivisionError):
            return computed_float_equiv(result, answer)
        printed = float(result)
        return math.isfinite(printed) and \
            abs(Fraction(printed) - value) <= Fraction(1, 10 ** 9) * max(1, abs(value))
    return False


# --------------------------------------------------------------------------------------------------
# A domain: what the loop needs of a benchmark's answers and how its verifier checks them

@dataclass(frozen=True)
class Domain:
    name: str
    instruction: str           # the policy's system prompt
    extract: Callable          # (rollout text, problem) -> its final answer, or None
    same: Callable             # (answer, answer) -> in one vote class (voting's `same`)
    key: Callable              # answer -> a cheap class key (voting's `key`)
    equiv: Callable            # (answer, gold) -> right: evaluation and monitors only
    verifier_system: str
    verifier_user: str         # with {problem} and {rollout}
    extract_program: Callable  # reply -> the program, or None
    tool: Callable             # (programs, pool) -> a ToolRun each
    agrees: Callable           # (ToolRun, answer) -> the tool computed that answer
    hardcoded: Callable | None = None  # (program, problem, answer) -> it copied the answer in

    @property
    def classes(self) -> dict:
        """same= and key=, as voting's functions take them."""
        return dict(same=self.same, key=self.key)


MATH = Domain("math", "Please reason step by step, and put your final answer within \\boxed{}.",
              lambda text, problem: extract_answer(text), same_answer, answer_key, is_equiv,
              VERIFIER_SYSTEM, VERIFIER_USER,
              extract_code, python_tool, lambda run, answer: tool_agrees(run.result, answer,
                                                                          run.latex), hardcoded)
