"""verifier.py: tool verification; a scripted verifier writes the programs, the sandbox runs them."""
import dataclasses
import doctest
import os

import pytest

import verifier as verifier_module
from answers import is_equiv
from helpers import PROBLEM, ROLLOUT, ScriptedVerifier, verify_batch
from verifier import (
    MATH,
    MAX_ROLLOUT_CHARS,
    VERIFIER_SYSTEM,
    ToolRun,
    ToVerify,
    VerifierPrompt,
    extract_code,
    model_verifier,
    python_tool,
    tool_agrees,
    verifier_prompt,
)


def block(code):
    return f"Here is the program.\n```python\n{code}\n```\nIt prints the result."


class CountingPool:
    """A real sandbox pool that counts run_many calls."""

    def __init__(self, pool):
        self.pool, self.calls = pool, 0

    def run_many(self, codes, timeout=None):
        self.calls += 1
        return self.pool.run_many(codes, timeout)



def verify_one(completion, answer, pool, **options):
    verifier = ScriptedVerifier(completion)
    return verify_batch([PROBLEM], [ROLLOUT], [answer], verifier, MATH, pool, **options)[0]


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


@pytest.mark.parametrize("code,answer,status", [
    ("from fractions import Fraction\nprint(Fraction(110, 4))", "\\frac{55}{2}", "verified"),
    ("print(1 / 3)", "\\frac{1}{3}", "verified"),  # a machine float matches a rational answer
    ("print(round(1 / 3, 2))", "\\frac{1}{3}", "mismatch"),  # a rounded decimal does not
    ("import sympy\nprint(sympy.sqrt(8) / 4)", "\\frac{\\sqrt{2}}{2}", "verified"),
    ("import sympy\nprint(sympy.expand((2 + 3 * sympy.I) * 3))", "6+9i", "verified"),  # I is read as i
    ("import sympy\nprint(sympy.sqrt(51))", "\\sqrt{51}", "verified"),
    ("import sympy\nprint(sympy.sqrt(52))", "\\sqrt{51}", "mismatch"),
    ("import sympy\nprint(2 * sympy.sqrt(3) / 3)", "\\frac{2\\sqrt{3}}{3}", "verified"),
    ("import sympy\nprint((3, sympy.pi / 2))", "\\left( 3, \\frac{\\pi}{2} \\right)", "verified"),
    ("import sympy\nprint((3, sympy.pi / 3))", "\\left( 3, \\frac{\\pi}{2} \\right)", "mismatch"),
    ("import sympy\nx = sympy.symbols('x')\nprint(sympy.expand((x + 1) ** 2))", "x^2+2x+1", "verified"),
    ("import sympy\nx = sympy.symbols('x')\nprint(sympy.expand((x + 1) ** 3))", "x^2+2x+1", "mismatch"),
    ("n = 4 + 5\nprint(f'The answer is {n}.')", "9", "verified"),
    ("n = 4 + 6\nprint(f'The answer is {n}.')", "9", "mismatch"),
    ("print('The answer is:', 4 + 5)", "9", "verified"),  # a colon after the label
    ("print(3, 7)", "37", "mismatch"),  # values printed apart are a list, not 37
    ("import numpy as np\nprint(np.array([3, 7]))", "3, 7", "verified"),
    ("import numpy as np\nprint((np.int64(3), np.int64(4)))", "(3,4)", "verified"),  # numpy 2's repr
    ("from fractions import Fraction\nprint((Fraction(1, 2), Fraction(3, 4)))", "(\\frac12, \\frac34)",
     "verified"),
    ("import sympy\nprint(sympy.Matrix([1, 2]))", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", "verified"),
    ("from __future__ import annotations\nprint(sum(range(1, 11)))", "55", "verified"),
    ("print(1 / 3)", "1" * 400, "mismatch"),  # a double against an answer past float range
])
def test_printed_results_are_compared_by_value(verify_pool, code, answer, status):
    """Equivalent spellings verify, near misses do not; sympy prints sqrt(51), (3, pi/2), x**2 + 2*x + 1,
    compared through sympy's own LaTeX of them; a labelled print is read as its value."""
    assert verify_one(block(code), answer, verify_pool).status == status


def test_printed_text_is_turned_into_latex_inside_the_sandbox(verify_pool, tmp_path):
    """sympify evaluates text; a program can print code, so the LaTeX spelling runs in the sandbox, too."""
    target = tmp_path / "written-by-sympify"
    text = f"__import__('pathlib').Path('{target}').touch()"
    r = verify_one(block(f"print({text[:10]!r} + {text[10:]!r})"), "1", verify_pool)
    assert (r.status, r.result) == ("mismatch", text) and not target.exists()


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
    results = verify_batch([PROBLEM, PROBLEM], ["no box here", ROLLOUT], [None, "55"], verifier, MATH, verify_pool)
    assert [r.status for r in results] == ["no_answer", "verified"]
    assert len(verifier.batches[0]) == 1


def test_one_verifier_call_and_one_sandbox_run_per_batch(verify_pool):
    verifier = ScriptedVerifier(*[block(f"print(len('{'x' * k}') * 11)") for k in range(4)])
    counting = CountingPool(verify_pool)
    results = verify_batch([PROBLEM] * 4, [ROLLOUT] * 4, ["0", "11", "22", "34"], verifier, MATH, counting)
    assert (len(verifier.batches), counting.calls) == (1, 1)
    assert [r.v for r in results] == [1, 1, 1, 0]


def test_programs_run_in_the_sandbox_not_in_process(verify_pool):
    r = verify_one(block("import os\nprint(os.getpid())"), "55", verify_pool)
    assert r.result is not None and r.result != str(os.getpid())


def test_prompt_holds_problem_and_rollout():
    prompt = verifier_prompt(ToVerify(PROBLEM, ROLLOUT, "55", "q0", None), MATH)
    assert PROBLEM in prompt.user and ROLLOUT in prompt.user and prompt.system == VERIFIER_SYSTEM


def test_long_rollout_keeps_its_end():
    rollout = "step\n" * 5000 + "so the answer is \\boxed{55}"
    prompt = verifier_prompt(ToVerify(PROBLEM, rollout, "55", "q0", None), MATH)
    assert "\\boxed{55}" in prompt.user and len(prompt.user) < MAX_ROLLOUT_CHARS + len(PROBLEM) + 500


def test_custom_tool_decides_the_verdict():
    def always_seven(codes, sandbox):
        return [ToolRun("ok", "7", "7\n", 0.0) for _ in codes]
    verifier = ScriptedVerifier(block("solver code"), block("solver code"))
    results = verify_batch([PROBLEM] * 2, [ROLLOUT] * 2, ["7", "8"], verifier, dataclasses.replace(MATH, tool=always_seven))
    assert [r.status for r in results] == ["verified", "mismatch"]


def test_model_verifier_seeds_a_program_by_what_it_verifies_not_by_its_call(tiny_model, tokenizer):
    """The same request gets the same program in any call, batch or position; another seed, another."""
    verify = model_verifier(tiny_model, tokenizer, max_new_tokens=6, seed=0)
    a, b = (VerifierPrompt(VERIFIER_SYSTEM, text, seed=7) for text in ("first", "second"))
    alone = verify([b])[0].text
    assert verify([a, b])[1].text == alone and verify([b, a])[0].text == alone
    assert verify([VerifierPrompt(VERIFIER_SYSTEM, "second", seed=8)])[0].text != alone


def test_code_is_the_first_python_block():
    text = "```text\nnot code\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert extract_code(text).strip() == "print(1)"


def test_code_falls_back_to_the_first_fenced_block():
    assert extract_code("```\nprint(3)\n```").strip() == "print(3)"


def test_an_empty_or_inline_block_hides_no_later_block_and_an_indented_one_is_dedented():
    assert extract_code("```python\n\n```\n```python\nprint(5)\n```").strip() == "print(5)"
    assert extract_code("Use ```python``` like this:\n```python\nprint(6)\n```").strip() == "print(6)"
    assert extract_code("1. Compute:\n   ```python\n   x = 2\n   print(x)\n   ```") == "x = 2\nprint(x)\n"


def test_unclosed_block_runs_to_the_end():
    assert extract_code("```python\nx = 2\nprint(x * 3)").strip() == "x = 2\nprint(x * 3)"


def test_programs_find_the_allowed_modules_under_their_usual_names(verify_pool):
    run = python_tool(["x = sp.symbols('x')\nprint(sp.solve(x - 3, x)[0] + int(np.int64(1)) + math.floor(0.5))"],
                      verify_pool)[0]
    assert (run.status, run.result) == ("ok", "4")


def test_a_printed_double_verifies_an_irrational_answer_at_its_own_precision():
    assert tool_agrees("98.99494936611666", "70 \\sqrt{2}") and tool_agrees("6.283185307179586", "2\\pi")
    assert not tool_agrees("98.99494936611666", "70\\sqrt{3}")
    assert not tool_agrees("98.99", "70\\sqrt{2}")  # a rounded decimal is no computed double
    assert not is_equiv("98.99494936611666", "70\\sqrt{2}")  # between answers, decimals stay decimals


def test_a_value_after_labels_verifies_and_a_line_of_thousands_of_labels_does_not_crash():
    """A program's last line is anything it prints (64 KiB): 'a=' 30,000 times went one recursion
    deeper per label, and the RecursionError ended the run."""
    assert tool_agrees("Result: x = 5", "5") and tool_agrees("The answer is 9.", "9")
    assert not tool_agrees("a=" * 30000, "5") and not tool_agrees("x = " * 20000 + "3", "3")


def test_model_verifier_returns_one_completion_per_prompt_with_token_counts(tiny_model, tokenizer):
    verifier = model_verifier(tiny_model, tokenizer, max_new_tokens=4, seed=0)
    replies = verifier([verifier_prompt(ToVerify(PROBLEM, ROLLOUT, "55", "q0", None), MATH), verifier_prompt(ToVerify(PROBLEM, "no idea", "55", "q0", None), MATH)])
    assert len(replies) == 2 and all(isinstance(r.text, str) and 1 <= r.tokens <= 4 for r in replies)


def test_model_verifier_puts_the_system_prompt_in_the_chat(tiny_model, tokenizer, monkeypatch):
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, *a, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, *a, **kw))
    model_verifier(tiny_model, tokenizer, max_new_tokens=1, seed=0)([VerifierPrompt(VERIFIER_SYSTEM, "hello")])
    assert VERIFIER_SYSTEM in seen[0] and "hello" in seen[0]


def test_doctests_pass():
    failed, _ = doctest.testmod(verifier_module)
    assert failed == 0
