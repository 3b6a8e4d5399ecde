r"""Tool verification (T3RL): does a program that the verifier writes from the problem compute the rollout's answer?

For question x and rollout y_i with answer a_i, a verifier LLM turns the rollout into a short program that
recomputes the answer from the problem (the rollout is only a hint; VERIFIER_SYSTEM forbids copying the
candidate in), the sandbox runs it, and

    t_i = the tool's result (for Python: the last non-empty line the program prints)
    v_i = 1[ the program ran cleanly  and  t_i ~ a_i  and  it did not hard-code a_i ]

~ is tool_agrees: is_equiv on t_i as printed, on sympy's LaTeX of it, on the value after a label
('The answer is 9') and on Python spellings (x**2, pi, I, [1, 2]); a float printed at machine precision
matches a rational answer within relative 1e-9. Hard-coding (print(1320) when the trace says 1320) is
decided on the program's AST by guard.py. Every rollout gets one status:

    verified    v_i = 1                          no_answer   a_i is None: no verifier call spent
    mismatch    ran, printed something else      no_code     the completion holds no code block
    exec_error  raised, or hit a sandbox limit   timeout     ran past the sandbox's time limit
    hardcoded   the printed value is a_i copied  skipped     no verdict of it could change the vote (lazy)

verify_batch verifies a whole training step at once: one call of `verifier` (any callable, list of
VerifierPrompt -> list of VerifierReply; model_verifier wraps a model in one batched sampler.generate call)
and one call of the domain's tool (python_tool: one sandbox run_many). verification_rounds says which
rollouts go in each call: all of them; or, with a budget K, K per answer class (the rest inherit their
class's verdict); or, lazily (omega given), only the classes whose verdicts can still change the weighted
vote, in one or two calls (the label and rewards are those of verifying everything). A domain (domains.py)
brings the prompts, the tool and the agreement test: Python for math, SMT-LIB2 and z3 for Knights and
Knaves (knk.py).

`python -m bench.verifier --measure` scores the offline verifiers' recall and false-verify rate.
"""
import hashlib
import re
import time
from dataclasses import dataclass
from fractions import Fraction

from answers import answer_key, computed_float_equiv, is_equiv
from sandbox import default_pool
from voting import answer_classes, undecided_classes


def verify_batch(problems, rollouts, answers, verifier, domain, sandbox=None, *, budget=0, omega=None,
                 groups=None, seeds=None):
    """Tool-verify each rollout: one Verification per rollout, in order.

    problems, rollouts, answers: one entry per rollout (a None answer is no_answer, without a verifier call).
    groups: one key per rollout; rollouts with the same key vote together (None: the problem's text, so two
    questions with the same text need keys of their own). seeds: one per rollout, the verifier's sampling
    seed for its program (VerifierPrompt.seed; None: none). verifier: list of VerifierPrompt -> list of
    VerifierReply (or str). domain: a domains.Domain (its prompts, tool and agreement test). sandbox: passed
    to the tool (None: a default pool). budget, omega: which rollouts are sent (verification_rounds); the rest
    inherit a verdict (budget) or are "skipped" (v = 0; omega: whatever they would show, the label and rewards
    do not change).
    """
    groups, seeds = groups or problems, seeds or [None] * len(problems)
    if not len(problems) == len(rollouts) == len(answers) == len(groups) == len(seeds):
        raise ValueError(f"verify_batch: problems ({len(problems)}), rollouts ({len(rollouts)}), answers "
                         f"({len(answers)}), groups ({len(groups)}) and seeds ({len(seeds)}) need one entry "
                         f"per rollout")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget={budget!r}: pass K >= 1 rollouts per answer class, or 0 to verify all")
    results = [None] * len(rollouts)
    for classes in verification_rounds(groups, answers, results, domain, budget, omega):
        sent = sorted(i for members in classes for i in (members[:budget] if budget else members))
        if sent:
            verdicts = verify_rollouts([problems[i] for i in sent], [rollouts[i] for i in sent],
                                       [answers[i] for i in sent], verifier, domain, sandbox,
                                       [seeds[i] for i in sent])
            for i, verdict in zip(sent, verdicts):
                results[i] = verdict
            inherit_verdicts(classes, results, budget)
    for i, answer in enumerate(answers):
        if answer is None:
            results[i] = Verification(v=0, status="no_answer", result=None)
        elif results[i] is None:
            results[i] = Verification(v=0, status="skipped", result=None)
    return results


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
    inferred: bool = False         # True: not sent to the verifier; the outcome of its answer class (budget)


STATUSES_VERIFY = ("verified", "mismatch", "no_answer", "no_code", "exec_error", "timeout", "hardcoded", "skipped")


def verify_rollouts(problems, rollouts, answers, verifier, domain, sandbox, seeds):
    """One verifier call and one tool call for these rollouts (every answer given): a Verification each."""
    start = time.perf_counter()
    replies = verifier([verifier_prompt(problem, rollout, domain, seed)
                        for problem, rollout, seed in zip(problems, rollouts, seeds)])
    seconds = (time.perf_counter() - start) / len(problems)
    if len(replies) != len(problems):
        raise ValueError(f"the verifier returned {len(replies)} completions for {len(problems)} prompts")
    replies = [reply if isinstance(reply, VerifierReply) else VerifierReply(str(reply)) for reply in replies]
    programs = [domain.extract_program(reply.text) for reply in replies]
    with_code = [k for k, program in enumerate(programs) if program is not None]
    runs = dict(zip(with_code, domain.tool([programs[k] for k in with_code], sandbox)))
    results = []
    for k, reply in enumerate(replies):
        run = runs.get(k)
        status = verdict_status(run, programs[k], problems[k], answers[k], domain)
        results.append(Verification(v=int(status == "verified"), status=status, result=run and run.result,
                                    code=programs[k], completion=reply.text, output=run.output if run else "",
                                    tokens=reply.tokens, seconds=seconds, tool_seconds=run.seconds if run else 0.0))
    return results


def verdict_status(run, program, problem, answer, domain) -> str:
    """A rollout's status from the tool's run of its program (None: the completion held no program)."""
    if run is None:
        return "no_code"
    if run.status == "ok" and domain.agrees(run, answer):  # unless the program copied a_i in
        return "hardcoded" if domain.hardcoded and domain.hardcoded(program, problem, answer) else "verified"
    if run.status == "ok":
        return "mismatch"
    return {"error": "exec_error", "timeout": "timeout", "hardcoded": "hardcoded"}[run.status]


# ----------------------------------------------------------------------------------------------------
# Which rollouts to verify: all, K per answer class (a budget), or only what can change the vote (lazy)

# A second verifier call pays again for prefilling the prompts' shared start and for its own decode tail:
# about five prompts' worth for the 1.5B verifier on a CPU (python -m bench.verifier --steps RUN). Lazy
# verification makes one only when it can spare more prompts than this.
LAZY_SECOND_CALL = 8


def verification_rounds(groups, answers, results, domain, budget=0, omega=None):
    """The verifier calls of one batch: yields, call by call, the answer classes (lists of rollout indices)
    whose rollouts go into it; the caller fills `results` in before asking for the next call. groups: one
    key per rollout, the same for the rollouts that vote together.

    omega None: one call, every answered rollout. omega given (lazy verification): only the classes whose
    verdicts can still change the weighted vote at this omega (voting.undecided_classes), every one that can
    still win in one call; or, when that spares more than LAZY_SECOND_CALL prompts, in two calls: first the
    likeliest winning class of each problem, then every class that can still beat it. budget K > 0: of each
    class only the first K are sent (inherit_verdicts gives the others their class's verdict)."""
    by_problem = {}  # group key -> its answered rollouts' indices
    for i, answer in enumerate(answers):
        if answer is not None:
            by_problem.setdefault(groups[i], []).append(i)

    def classes_of(indices, open_only):
        """A problem's answer classes (rollout indices); open_only: those whose verdicts can change its vote."""
        group = [answers[i] for i in indices]
        local = (undecided_classes(group, [None if results[i] is None else results[i].v for i in indices], omega,
                                   **domain.classes) if open_only else answer_classes(group, **domain.classes))
        return [[indices[m] for m in members] for members in local]

    if omega is None:  # every answered rollout; classes matter only to a budget
        yield [members for indices in by_problem.values()
               for members in (classes_of(indices, False) if budget else [indices])]
        return
    undecided = [classes_of(indices, True) for indices in by_problem.values()]
    second_call_spares = sum(min(len(m), budget or len(m)) for group in undecided for m in group[1:])
    if second_call_spares > LAZY_SECOND_CALL:
        yield [group[0] for group in undecided if group]  # the likeliest winners; then what can beat them
        yield [members for indices in by_problem.values() for members in classes_of(indices, True)]
    else:  # every class that can win: the vote is settled after one call
        yield [members for group in undecided for members in group]


def inherit_verdicts(classes, results, budget):
    """budget K > 0: the rollouts of a class after its first K take the majority outcome of those K (a tie
    counts as unverified), marked inferred."""
    for members in classes if budget else []:
        outcomes = [results[i] for i in members[:budget]]
        v = int(2 * sum(r.v for r in outcomes) > len(outcomes))
        like = next(r for r in outcomes if r.v == v)
        for i in members[budget:]:
            results[i] = Verification(v=v, status=like.status, result=like.result, inferred=True)


# ----------------------------------------------------------------------------------------------------
# The verifier: prompts in, programs out

@dataclass(frozen=True)
class VerifierPrompt:
    """One verifier request: its domain's system prompt and the user message for one rollout, and the seed of
    what it is about (the run, step, question and rollout; None: its text alone seeds it)."""
    system: str
    user: str
    seed: int | None = None


@dataclass(frozen=True)
class VerifierReply:
    """One verifier completion and the tokens it took (None: the verifier does not say)."""
    text: str
    tokens: int | None = None


MAX_ROLLOUT_CHARS = 4000  # the end of a rollout holds its answer: longer ones keep their last 4000 characters


def verifier_prompt(problem, rollout, domain, seed=None) -> VerifierPrompt:
    """The request for one rollout; its reasoning is cut to the last MAX_ROLLOUT_CHARS characters (~1.2k
    tokens), so a prompt stays bounded by that, the problem and the system prompt."""
    if len(rollout) > MAX_ROLLOUT_CHARS:
        rollout = "[... beginning cut ...]\n" + rollout[-MAX_ROLLOUT_CHARS:]
    return VerifierPrompt(domain.verifier_system,
                          domain.verifier_user.format(problem=problem.strip(), rollout=rollout.strip()), seed)


def model_verifier(model, tokenizer, max_new_tokens=1024, temperature=0.6, top_p=0.95, seed=None, backend="kv"):
    """A verifier callable around a model: list of VerifierPrompt -> list of VerifierReply, one batched
    sampler call, each prompt in the model's chat template. With a seed, each prompt samples with a seed of
    (seed, the prompt's seed, its text): what a program is depends on what it verifies, not on the call or
    the batch it comes in, so a resumed run writes the programs an uninterrupted one would."""
    from sampler import generate  # torch is needed only once a model verifier is built

    def verify(prompts):
        chats = [tokenizer.apply_chat_template([{"role": "system", "content": p.system},
                                                {"role": "user", "content": p.user}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        seeds = None if seed is None else [prompt_seed(seed, p) for p in prompts]
        groups = generate(model, tokenizer, chats, n=1, max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, seed=seeds, backend=backend,
                          progress="verifier" if backend == "kv" else None, frozen=True)
        return [VerifierReply(group[0].text, group[0].num_tokens) for group in groups]

    return verify


def prompt_seed(seed: int, prompt: VerifierPrompt) -> int:
    """The sampling seed of one verifier request: its verifier's seed, its own and its text."""
    text = f"{seed}|{prompt.seed}|{prompt.system}|{prompt.user}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


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


FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
FENCE_ANY = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_MACHINE_FLOAT = re.compile(r"[-+]?\d*\.\d{7,}(?:e[-+]?\d+)?|[-+]?\d+(?:\.\d*)?e[-+]?\d+", re.IGNORECASE)


def first_block(text, fences):
    """The first non-empty block of the first fence pattern that has one; a block left open (the completion
    hit its token limit) runs to the end of the text."""
    for fence in fences:
        m = fence.search(text)
        if m and m.group(1).strip():
            return m.group(1)
    return None


def extract_code(text):
    """The first ```python block of a verifier completion, else its first fenced block, else None."""
    return first_block(text, (FENCE_PYTHON, FENCE_ANY))


# ----------------------------------------------------------------------------------------------------
# The tool: a function (programs, sandbox) -> one ToolRun per program. Another tool (an SMT solver for
# logic puzzles, knk.py) only has to keep this signature.

@dataclass
class ToolRun:
    """What the tool made of one program."""
    status: str               # "ok", "error", "timeout", or "hardcoded" (a tool that decides it itself: knk's)
    result: str | None        # the tool's answer t_i: the last non-empty line of stdout
    output: str               # everything the program printed (stdout, then stderr), for reading
    seconds: float            # time the program ran
    latex: str | None = None  # sympy's LaTeX of a result that is a Python expression (None: no such spelling)


# The tool is a Python with the allowed modules at hand under the names programs give them by habit: a
# program that writes sp.solve after `import sympy` fails on a name, not on its mathematics.
PYTHON_PRELUDE = "import math, fractions\nimport numpy, numpy as np\nimport sympy, sympy as sp\n"

# sympy prints sqrt(3)/3, 2*x + 1 and (3, pi/2), which the answer side's LaTeX parser reads poorly; sympy
# itself turns them into LaTeX. sympify evaluates its text, and a program's output is untrusted, so this
# runs in the sandbox too.
_PYTHON_EXPRESSION = re.compile(r"[A-Za-z*(\[{]")
_LATEX_SNIPPET = "import sympy\nprint(sympy.latex(sympy.sympify({text!r})))"


def python_tool(codes, sandbox=None):
    """Run every program, after PYTHON_PRELUDE, in the sandbox (one run_many call; None: sandbox.default_pool()),
    never in this process, then spell the results that are Python expressions in LaTeX (a second run_many of
    one-line sympy snippets). verify_batch applies the hard-coding guard afterwards (it needs the problem and
    the answer)."""
    sandbox = sandbox or default_pool()
    runs = sandbox.run_many([PYTHON_PRELUDE + code for code in codes]) if codes else []
    tool_runs = []
    for run in runs:
        status = "ok" if run.status == "ok" else "timeout" if run.status == "timeout" else "error"
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        tool_runs.append(ToolRun(status, last_line(run.stdout), output, run.duration))
    spell = [t for t in tool_runs if t.status == "ok" and t.result and _PYTHON_EXPRESSION.search(t.result)]
    if spell:
        for t, run in zip(spell, sandbox.run_many([_LATEX_SNIPPET.format(text=_value_text(t.result)) for t in spell])):
            t.latex = run.stdout.strip() if run.status == "ok" and run.stdout.strip() else None
    return tool_runs


def last_line(text: str) -> str | None:
    """The last non-empty line of text, stripped (None: there is none): a program's result as it printed it."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


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


def tool_agrees(result, answer, latex=None):
    """t_i equivalent to a_i, as printed, as sympy's LaTeX of it (`latex`, ToolRun.latex), or as the value after
    a label ('The answer is 9'). A float printed at machine precision (1/3 -> 0.3333333333333333) is a computed
    double: it matches a rational answer within relative 1e-9, and another exact answer (70\\sqrt{2}, 2\\pi) at the
    double's precision (computed_float_equiv); shorter decimals compare exactly (0.33 != 1/3)."""
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
