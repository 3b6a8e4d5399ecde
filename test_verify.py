"""Tool verification (verifier.verify_batch): a scripted verifier writes the programs, the sandbox runs them."""
import os

import pytest

from sandbox import SandboxPool
from verifier import (MAX_ROLLOUT_CHARS, VERIFIER_SYSTEM, ToolRun, extract_code, hardcoded, model_verifier,
                      python_tool, verify_batch, verifier_prompt)

PROBLEM = "What is the sum of the integers from 1 to 10?"
ROLLOUT = "Pairing 1+10, 2+9, ... gives 5 pairs of 11, so the sum is $\\boxed{55}$."


def block(code):
    return f"Here is the program.\n```python\n{code}\n```\nIt prints the result."


class ScriptedVerifier:
    """Answers each batch with the given completions, in order, and records what it was asked."""

    def __init__(self, *completions):
        self.completions = list(completions)
        self.batches = []

    def __call__(self, prompts):
        self.batches.append(list(prompts))
        out, self.completions = self.completions[:len(prompts)], self.completions[len(prompts):]
        return out


class CountingPool:
    """A real sandbox pool that counts run_many calls."""

    def __init__(self, pool):
        self.pool, self.calls = pool, 0

    def run_many(self, codes, timeout=None):
        self.calls += 1
        return self.pool.run_many(codes, timeout)


@pytest.fixture(scope="module")
def verify_pool():
    with SandboxPool(timeout=2.0) as p:
        yield p


def verify_one(completion, answer, pool):
    verifier = ScriptedVerifier(completion)
    return verify_batch([PROBLEM], [ROLLOUT], [answer], verifier, sandbox=pool)[0]


# -------------------------------------------------------------------------------------------- statuses

def test_computed_right_answer_is_verified(verify_pool):
    r = verify_one(block("print(sum(range(1, 11)))"), "55", verify_pool)
    assert (r.v, r.status, r.result) == (1, "verified", "55")


def test_printing_the_candidate_literally_is_hardcoded(verify_pool):
    r = verify_one(block("# the trace says 55\nprint(55)"), "55", verify_pool)
    assert (r.v, r.status) == (0, "hardcoded")


def test_computed_wrong_answer_is_a_mismatch(verify_pool):
    r = verify_one(block("print(sum(range(1, 10)))"), "55", verify_pool)
    assert (r.v, r.status, r.result) == (0, "mismatch", "45")


def test_result_is_the_last_nonempty_line(verify_pool):
    r = verify_one(block("print('checking', 10)\nprint(sum(range(1, 11)))\nprint()"), "55", verify_pool)
    assert (r.status, r.result) == ("verified", "55")


def test_equivalent_spelling_is_verified(verify_pool):
    r = verify_one(block("from fractions import Fraction\nprint(Fraction(110, 4))"), "\\frac{55}{2}", verify_pool)
    assert r.status == "verified"


def test_machine_float_matches_rational_answer(verify_pool):
    r = verify_one(block("print(1 / 3)"), "\\frac{1}{3}", verify_pool)
    assert r.status == "verified"


def test_rounded_decimal_does_not_match(verify_pool):
    r = verify_one(block("print(round(1 / 3, 2))"), "\\frac{1}{3}", verify_pool)
    assert r.status == "mismatch"


def test_sympy_output_is_compared_symbolically(verify_pool):
    r = verify_one(block("import sympy\nprint(sympy.sqrt(8) / 4)"), "\\frac{\\sqrt{2}}{2}", verify_pool)
    assert r.status == "verified"


def test_sympy_imaginary_unit_is_read_as_i(verify_pool):
    r = verify_one(block("import sympy\nprint(sympy.expand((2 + 3 * sympy.I) * 3))"), "6+9i", verify_pool)
    assert r.status == "verified"


def test_completion_without_code_is_no_code(verify_pool):
    r = verify_one("The candidate is right, the answer is 55.", "55", verify_pool)
    assert (r.v, r.status, r.code) == (0, "no_code", None)


def test_crashing_program_is_exec_error(verify_pool):
    r = verify_one(block("print(55 / 0)"), "55", verify_pool)
    assert (r.v, r.status) == (0, "exec_error")


def test_syntax_error_is_exec_error(verify_pool):
    r = verify_one(block("print(sum(range(1, 11))"), "55", verify_pool)
    assert (r.v, r.status) == (0, "exec_error")


def test_hanging_program_is_timeout(verify_pool):
    r = verify_one(block("while True:\n    pass"), "55", verify_pool)
    assert (r.v, r.status) == (0, "timeout")


def test_missing_answer_is_no_answer_without_a_verifier_call(verify_pool):
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"))
    results = verify_batch([PROBLEM, PROBLEM], ["no box here", ROLLOUT], [None, "55"], verifier, sandbox=verify_pool)
    assert [r.status for r in results] == ["no_answer", "verified"]
    assert len(verifier.batches[0]) == 1


# -------------------------------------------------------------------------------------------- batching

def test_one_verifier_call_and_one_sandbox_run_per_batch(verify_pool):
    verifier = ScriptedVerifier(*[block(f"print({k} * 11)") for k in range(4)])
    counting = CountingPool(verify_pool)
    results = verify_batch([PROBLEM] * 4, [ROLLOUT] * 4, ["0", "11", "22", "34"], verifier, sandbox=counting)
    assert (len(verifier.batches), counting.calls) == (1, 1)
    assert [r.v for r in results] == [1, 1, 1, 0]


def test_programs_run_in_the_sandbox_not_in_process(verify_pool):
    r = verify_one(block("import os\nprint(os.getpid())"), "55", verify_pool)
    assert r.result is not None and r.result != str(os.getpid())


def test_prompt_holds_problem_and_rollout():
    prompt = verifier_prompt(PROBLEM, ROLLOUT)
    assert PROBLEM in prompt and ROLLOUT in prompt


def test_long_rollout_keeps_its_end():
    rollout = "step\n" * 5000 + "so the answer is \\boxed{55}"
    prompt = verifier_prompt(PROBLEM, rollout)
    assert "\\boxed{55}" in prompt and len(prompt) < MAX_ROLLOUT_CHARS + len(PROBLEM) + 500


def test_custom_tool_decides_the_verdict():
    def always_seven(codes, sandbox):
        return [ToolRun("ok", "7", "7\n", 0.0) for _ in codes]
    verifier = ScriptedVerifier(block("solver code"), block("solver code"))
    results = verify_batch([PROBLEM] * 2, [ROLLOUT] * 2, ["7", "8"], verifier, tool=always_seven)
    assert [r.status for r in results] == ["verified", "mismatch"]


# -------------------------------------------------------------------------------------------- budget

def test_budget_verifies_only_k_per_answer_class(verify_pool):
    answers = ["\\frac12", "0.5", "1/2", "2", "2", "2"]  # two classes: 1/2 (three spellings) and 2
    verifier = ScriptedVerifier(*[block("print(1 / 2)")] * 2 + [block("print(1 + 1)")] * 2)
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, sandbox=verify_pool, budget=2)
    assert len(verifier.batches[0]) == 4
    assert [r.inferred for r in results] == [False, False, True, False, False, True]


def test_budget_shares_the_majority_outcome_of_the_class(verify_pool):
    answers = ["55"] * 5
    verifier = ScriptedVerifier(block("print(55 + 0 * len('x'))"), block("print(54 + len('x'))"),
                                block("print(1 / 0)"))
    results = verify_batch([PROBLEM] * 5, [ROLLOUT] * 5, answers, verifier, sandbox=verify_pool, budget=3)
    assert [r.v for r in results] == [1, 1, 0, 1, 1]
    assert [r.status for r in results[3:]] == ["verified", "verified"]


def test_budget_tie_inherits_unverified(verify_pool):
    verifier = ScriptedVerifier(block("print(54 + len('x'))"), block("print(54)"))
    results = verify_batch([PROBLEM] * 3, [ROLLOUT] * 3, ["55"] * 3, verifier, sandbox=verify_pool, budget=2)
    assert results[2].v == 0 and results[2].inferred


def test_budget_keeps_problems_apart(verify_pool):
    other = "What is 5 times 11?"
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"), block("print(5 * 11)"))
    results = verify_batch([PROBLEM, PROBLEM, other], [ROLLOUT] * 3, ["55"] * 3, verifier, sandbox=verify_pool, budget=1)
    assert [r.inferred for r in results] == [False, True, False]


# -------------------------------------------------------------------------------------------- code and guard

def test_code_is_the_first_python_block():
    text = "```text\nnot code\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert extract_code(text).strip() == "print(1)"


def test_code_falls_back_to_the_first_fenced_block():
    assert extract_code("```\nprint(3)\n```").strip() == "print(3)"


def test_unclosed_block_runs_to_the_end():
    assert extract_code("```python\nx = 2\nprint(x * 3)").strip() == "x = 2\nprint(x * 3)"


@pytest.mark.parametrize("code", [
    "print(42)",
    "print('42')",
    "print(-7)",
    "x = 42\nprint(x)",
    "ans = 1320\nprint(ans)",
    "a = 3\nb = a\nprint(b)",
    "p, q = 1, 2\nprint(p, q)",
    "print(f'The answer is {42}')",
    "x = 5\nprint(f'{x}')",
    "import sympy\nn = sympy.Symbol('n')\nprint(sympy.solve(n - 1, n))\nresult = 7\nprint(result)",
    "def solve():\n    # the cube is 28\n    return 28\nprint(solve())",
])
def test_literal_output_is_hardcoded(code):
    assert hardcoded(code)


@pytest.mark.parametrize("code", [
    "a, b = 6, 7\nprint(a * b)",
    "import sympy\nx = sympy.Symbol('x')\nx = sympy.solve(x**2 - 4, x)\nprint(x)",
    "x = sum(range(10))\nprint(f'{x}')",
    "print(11 * 120)",
    "import math\nprint(math.comb(12, 3))",
    "x = 1\nfor i in range(5):\n    x = x * 2\nprint(x)",
    "n = 0\nn += 3\nprint(n)",
    "def f(k):\n    return k * k\nprint(f(9))",
    "print(",
])
def test_computed_output_is_not_hardcoded(code):
    assert not hardcoded(code)


# -------------------------------------------------------------------------------------------- model verifier

def test_model_verifier_returns_one_completion_per_prompt_with_token_counts(tiny_model, tokenizer):
    verifier = model_verifier(tiny_model, tokenizer, max_new_tokens=4, seed=0)
    texts = verifier([verifier_prompt(PROBLEM, ROLLOUT), verifier_prompt(PROBLEM, "no idea")])
    assert len(texts) == 2 and all(isinstance(t, str) and 1 <= t.num_tokens <= 4 for t in texts)


def test_model_verifier_puts_the_system_prompt_in_the_chat(tiny_model, tokenizer, monkeypatch):
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, **kw))
    model_verifier(tiny_model, tokenizer, max_new_tokens=1, seed=0)(["hello"])
    assert VERIFIER_SYSTEM in seen[0] and "hello" in seen[0]
