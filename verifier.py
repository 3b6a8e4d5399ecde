r"""Tool verification (T3RL): does a program the verifier writes from the problem compute the
rollout's answer?

For question x and rollout y_i with answer a_i, a verifier LLM turns the rollout into a short
program that recomputes the answer from the problem (the rollout is only a hint; VERIFIER_SYSTEM
forbids copying the candidate in), the sandbox runs it, and

    t_i = the tool's result (for Python: the last non-empty line the program prints)
    v_i = 1[ the program ran cleanly  and  t_i ~ a_i  and  it did not hard-code a_i ]

~ is the domain's agreement test (math: machinery/python_tool.py's tool_agrees, is_equiv on t_i as
printed and as sympy's LaTeX of it); hard-coding is decided on the program's AST (guard.py). With
k programs per rollout, v_i = 1 when any reproduces a_i; a failed program
gets one repair turn (machinery/verdicts.py). Every rollout gets a status:
    verified    v_i = 1 (repaired: after repair)  no_answer   a_i is None: no verifier call spent
    mismatch    ran, printed something else      no_code     the completion holds no code block
    exec_error  raised, or hit a sandbox limit   timeout     ran past the sandbox's time limit
    hardcoded   the printed value is a_i copied  skipped     no verdict of it could change the
                                                             vote (lazy)

verify_batch verifies a whole step at once: one call of `verifier` (list of VerifierPrompt -> list
of VerifierReply; model_verifier wraps a model in one batched sampler.generate call) and one call of
the domain's tool (math: one sandbox run_many of the programs); with a budget or lazily,
machinery/lazy_verify.py says which rollouts go into each call. A domain (machinery/domains.py)
brings the prompts, the tool and the agreement test. Details and measurements: docs/verifier.md.
"""
import hashlib
import re
import time
from dataclasses import dataclass



def verify_batch(problems, rollouts, answers, verifier, domain, sandbox=None, *, budget=0,
                 omega=None, groups=None, seeds=None, programs=3, repair=True, memory=None):
    """Tool-verify each rollout: one Verification per rollout, in order.

    problems, rollouts, answers: one entry per rollout (a None answer is no_answer, without a
    verifier call). groups: one key per rollout; rollouts with the same key vote together (None: the
    problem's text, so two questions with the same text need keys of their own). seeds: one per
    rollout, the verifier's sampling seed for its program (VerifierPrompt.seed; None: none).
    verifier: list of VerifierPrompt -> list of VerifierReply (or str). domain: a domains.Domain
    (its prompts, tool and agreement test). sandbox: passed to the tool (None: a default pool).
    budget, omega: which rollouts are sent (verification_rounds); the rest inherit a verdict
    (budget) or are "skipped" (v = 0; omega: whatever they would show, the label and rewards do not
    change). programs: k programs per rollout, v = 1 when any reproduces a_i; repair: a program that
    fails gets one more turn with its error (machinery/verdicts.py). memory: a
    verdicts.VerdictMemory whose settled answer classes (groups
    are its question ids) keep their verdict without a verifier call; the caller teaches it.
    """
    groups, seeds = groups or problems, seeds or [None] * len(problems)
    if not len(problems) == len(rollouts) == len(answers) == len(groups) == len(seeds):
        raise ValueError(f"verify_batch: problems ({len(problems)}), rollouts ({len(rollouts)}), "
                         f"answers ({len(answers)}), groups ({len(groups)}) and seeds "
                         f"({len(seeds)}) need one entry per rollout")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget={budget!r}: pass K >= 1 rollouts per answer class, "
                         f"or 0 to verify all")
    # which rollouts, call by call
    from machinery.lazy_verify import inherit_verdicts, verification_rounds
    results = [None] * len(rollouts)
    for i, known in memory.recall(groups, answers, results) if memory is not None else []:
        results[i] = Verification(v=known["v"], status=known["status"], result=known["result"],
                                  inferred=True, remembered=True)
    for classes in verification_rounds(groups, answers, results, domain, budget, omega):
        classes = [members for members in classes if any(results[i] is None for i in members)]
        sent = sorted(i for members in classes for i in (members[:budget] if budget else members)
                      if results[i] is None)
        if sent:
            verdicts = verify_rollouts([problems[i] for i in sent], [rollouts[i] for i in sent],
                                       [answers[i] for i in sent], verifier, domain, sandbox,
                                       [seeds[i] for i in sent], programs=programs,
                                       repair=repair)
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
    v: float                       # 1 when the tool's result is equivalent to the rollout's answer
    status: str                    # one of STATUSES_VERIFY
    result: str | None             # the tool's result t_i
    code: str | None = None        # the verifier's program (None: no verifier call for it)
    completion: str | None = None  # the verifier's whole completion
    output: str = ""               # what the program printed
    # verifier tokens generated for this rollout (None: the verifier does not say)
    tokens: int | None = 0
    # verifier generation time for this rollout: the batch's wall time / rollouts sent
    seconds: float = 0.0
    tool_seconds: float = 0.0      # time the program ran
    # True: not sent to the verifier; the outcome of its answer class (budget; memory: remembered)
    inferred: bool = False
    repaired_from: str | None = None  # a repaired program's verdict: the first one's status
    remembered: bool = False       # the verdict of its answer class in an earlier step (memory)
    # each program's {"status", "v", "repaired_from", "tokens"} (programs > 1; --replay re-votes)
    programs: list | None = None


# "repaired": verified by a program that the verifier repaired after its first one failed
STATUSES_VERIFY = ("verified", "repaired", "mismatch", "no_answer", "no_code", "exec_error",
                   "timeout", "hardcoded", "skipped")


def verify_rollouts(problems, rollouts, answers, verifier, domain, sandbox, seeds, *, programs=3,
                    repair=True):
    """The verifier's programs for these rollouts (every answer given), in one verifier and one tool
    call, k = programs per rollout; with repair one more of each for the programs that failed. A
    Verification per rollout, from its programs' (machinery/verdicts.py combine)."""
    from machinery import verdicts
    start = time.perf_counter()
    asked = [(i, verifier_prompt(problems[i], rollouts[i], domain,
                                 verdicts.program_seed(seeds[i], j)))
             for i in range(len(problems)) for j in range(programs)]
    runs = run_programs(asked, problems, answers, verifier, domain, sandbox)
    failed = [n for n, run in enumerate(runs) if repair and verdicts.needs_repair(run, domain)]
    repairs = [(asked[n][0], VerifierPrompt(domain.verifier_system, *verdicts.repair_prompt(
        problems[asked[n][0]], runs[n], domain, asked[n][1].seed))) for n in failed]
    fixes = run_programs(repairs, problems, answers, verifier, domain, sandbox)
    for n, fix in zip(failed, fixes):
        runs[n] = verdicts.repaired(runs[n], fix)
    seconds = (time.perf_counter() - start) / len(problems)
    return [verdicts.combine(runs[i * programs:(i + 1) * programs], seconds)
            for i in range(len(problems))]


def run_programs(asked, problems, answers, verifier, domain, sandbox):
    """One verifier call for the (rollout, VerifierPrompt) pairs asked and one tool call for the
    programs it writes: a Verification per prompt."""
    if not asked:
        return []
    replies = verifier([prompt for _, prompt in asked])
    if len(replies) != len(asked):
        raise ValueError(f"the verifier returned {len(replies)} completions for {len(asked)} "
                         f"prompts")
    replies = [reply if isinstance(reply, VerifierReply) else VerifierReply(str(reply))
               for reply in replies]
    programs = [domain.extract_program(reply.text) for reply in replies]
    with_code = [k for k, program in enumerate(programs) if program is not None]
    runs = dict(zip(with_code, domain.tool([programs[k] for k in with_code], sandbox)))
    results = []
    for k, (reply, (i, _)) in enumerate(zip(replies, asked)):
        run = runs.get(k)
        status = verdict_status(run, programs[k], problems[i], answers[i], domain)
        results.append(Verification(
            v=int(status == "verified"), status=status, result=run and run.result, code=programs[k],
            completion=reply.text, output=run.output if run else "", tokens=reply.tokens,
            tool_seconds=run.seconds if run else 0.0))
    return results


def verdict_status(run, program, problem, answer, domain) -> str:
    """A rollout's status from the tool's run of its program
    (None: the completion held no program)."""
    if run is None:
        return "no_code"
    if run.status == "ok" and domain.agrees(run, answer):  # unless the program copied a_i in
        return ("hardcoded" if domain.hardcoded and domain.hardcoded(program, problem, answer)
                else "verified")
    if run.status == "ok":
        return "mismatch"
    return {"error": "exec_error", "timeout": "timeout", "hardcoded": "hardcoded"}[run.status]


# --------------------------------------------------------------------------------------------------
# The verifier: prompts in, programs out

@dataclass(frozen=True)
class VerifierPrompt:
    """One verifier request: its domain's system prompt and the user message for one rollout, and
    the seed of what it is about
    (the run, step, question and rollout; None: its text alone seeds it)."""
    system: str
    user: str
    seed: int | None = None


@dataclass(frozen=True)
class VerifierReply:
    """One verifier completion and the tokens it took (None: the verifier does not say)."""
    text: str
    tokens: int | None = None


# the end of a rollout holds its answer: longer ones keep their last 4000 characters
MAX_ROLLOUT_CHARS = 4000


def verifier_prompt(problem, rollout, domain, seed=None) -> VerifierPrompt:
    """The request for one rollout; its reasoning is cut to the last MAX_ROLLOUT_CHARS characters
    (~1.2k tokens), so a prompt stays bounded by that, the problem and the system prompt."""
    if len(rollout) > MAX_ROLLOUT_CHARS:
        rollout = "[... beginning cut ...]\n" + rollout[-MAX_ROLLOUT_CHARS:]
    return VerifierPrompt(domain.verifier_system, domain.verifier_user.format(
        problem=problem.strip(), rollout=rollout.strip()), seed)


def model_verifier(model, tokenizer, max_new_tokens=1024, temperature=0.6, top_p=0.95, seed=None,
                   backend="kv"):
    """A verifier callable around a model: list of VerifierPrompt -> list of VerifierReply, one
    batched sampler call, each prompt in the model's chat template. With a seed, each prompt samples
    with a seed of (seed, the prompt's seed, its text): what a program is depends on what it
    verifies, not on the call or the batch it comes in, so a resumed run writes the programs an
    uninterrupted one would."""
    from sampler import generate  # torch is needed only once a model verifier is built

    def verify(prompts):
        chats = [tokenizer.apply_chat_template([{"role": "system", "content": p.system},
                                                {"role": "user", "content": p.user}],
                                               tokenize=False, add_generation_prompt=True)
                 for p in prompts]
        seeds = None if seed is None else [prompt_seed(seed, p) for p in prompts]
        groups = generate(model, tokenizer, chats, n=1, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, seed=seeds, backend=backend,
                          progress="verifier" if backend == "kv" else None, frozen=True)
        return [VerifierReply(group[0].text, group[0].num_tokens) for group in groups]

    return verify


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

# the repair turn (--verifier-repair): a program that raised, ran too long or printed nothing
REPAIR_USER = """Problem:
{problem}

This program should compute the answer to the problem:
```python
{program}
```
Running it gave:
```
{error}
```

Write the corrected Python program that computes the answer and prints it."""


FENCE_PYTHON = re.compile(r"```[ \t]*(?:python3?|py)\b[^\n]*\n(.*?)(?:```|\Z)",
                          re.DOTALL | re.IGNORECASE)
FENCE_ANY = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def first_block(text, fences):
    """The first non-empty block of the first fence pattern that has one; a block left open (the
    completion hit its token limit) runs to the end of the text."""
    for fence in fences:
        m = fence.search(text)
        if m and m.group(1).strip():
            return m.group(1)
    return None


def extract_code(text):
    """The first ```python block of a verifier completion, else its first fenced block,
    else None."""
    return first_block(text, (FENCE_PYTHON, FENCE_ANY))


# --------------------------------------------------------------------------------------------------
# The tool: a function (programs, sandbox) -> one ToolRun per program. Another tool (an SMT solver
# for logic puzzles, knk.py) only has to keep this signature.

@dataclass
class ToolRun:
    """What the tool made of one program."""
    # "ok", "error", "timeout", or "hardcoded" (a tool that decides it itself: knk's)
    status: str
    result: str | None        # the tool's answer t_i: the last non-empty line of stdout
    output: str               # everything the program printed (stdout, then stderr), for reading
    seconds: float            # time the program ran
    # sympy's LaTeX of a result that is a Python expression (None: no such spelling)
    latex: str | None = None
