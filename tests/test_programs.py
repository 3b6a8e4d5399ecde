"""extensions/programs.py: several programs per rollout and the repair turn, with scripted verifiers
(what a test needs of the 1.5B is which program it writes)."""
import functools
from types import SimpleNamespace

from extensions import budget, programs
from helpers import RAISES, RIGHT, WRONG, ScriptedVerifier, rollouts
from verifier import MATH, verifier_prompt


def block(code):
    return f"```python\n{code}\n```"


def several(batch, verifier, verify_pool, programs, repair):
    return globals()["programs"].several(batch, [None] * len(batch), verifier, verify_pool, MATH, programs, repair)


def test_failed_programs_get_one_repair_call_that_shows_their_error(verify_pool):
    """Two rollouts whose programs raise and print nothing: one more verifier call holds both repair
    prompts, each with its program's error, and the verdicts say they were repaired."""
    verifier = ScriptedVerifier(block(RAISES), block("x = 55"), block(RIGHT), block(WRONG))
    results = several(rollouts("55", "55"), verifier, verify_pool, programs=1, repair=True)
    assert [len(batch) for batch in verifier.batches] == [2, 2]
    first, second = verifier.batches[1]
    assert "ZeroDivisionError" in first.user and "55 / 0" in first.user
    assert "(it printed nothing)" in second.user and "x = 55" in second.user
    assert [(r.v, r.status, r.details.get("repaired_from")) for r in results] == [(1, "repaired", "exec_error"),
                                                                  (0, "mismatch", "mismatch")]


def test_without_repair_a_raising_program_is_an_exec_error_and_one_call(verify_pool):
    verifier = ScriptedVerifier(block(RAISES))
    result = several(rollouts("55"), verifier, verify_pool, programs=1, repair=False)[0]
    assert (result.v, result.status, result.details.get("repaired_from")) == (0, "exec_error", None)
    assert len(verifier.batches) == 1


def test_the_hardcoding_guard_judges_a_repaired_program(verify_pool):
    verifier = ScriptedVerifier(block(RAISES), block("print(55)"))
    result = several(rollouts("55"), verifier, verify_pool, programs=1, repair=True)[0]
    assert (result.v, result.status, result.details.get("repaired_from")) == (0, "hardcoded", "exec_error")


def test_a_mismatch_that_printed_a_value_is_not_repaired(verify_pool):
    verifier = ScriptedVerifier(block(WRONG))
    result = several(rollouts("55"), verifier, verify_pool, programs=1, repair=True)[0]
    assert (result.status, len(verifier.batches)) == ("mismatch", 1)


def test_repair_shows_the_last_lines_of_a_long_error_only():
    run = SimpleNamespace(status="exec_error", code="print(1)",
                          output="\n".join(f"line {k}" for k in range(100)))
    rollout = rollouts("55")[0]
    prompt = programs.repair_prompt((rollout, verifier_prompt(rollout, MATH)), run, MATH)
    assert "line 99" in prompt.user and "line 92" in prompt.user and "line 91\n" not in prompt.user


def test_k_programs_per_rollout_with_their_own_seeds_and_one_reproducing_is_enough(verify_pool):
    """Three programs per rollout, each seeded apart (the first with the rollout's own seed), in one
    call; v is 1 when one of them reproduces a_i."""
    verifier = ScriptedVerifier(block(RIGHT), block(WRONG), block("print(5 * 11)"))
    result = several(rollouts("55", seed=7), verifier, verify_pool, programs=3, repair=False)[0]
    seeds = [p.seed for p in verifier.batches[0]]
    assert len(verifier.batches) == 1 and seeds[0] == 7 and len(set(seeds)) == 3
    assert result.v == 1 and result.status == "verified"
    assert [p["status"] for p in result.details["programs"]] == ["verified", "mismatch", "verified"]


def test_a_rollout_no_program_reproduced_has_the_status_of_the_one_that_got_furthest(verify_pool):
    """One of three programs ran and printed another value: the rollout is a mismatch that shows
    that program, not the first one's exec_error; it is an exec_error when none ran cleanly."""
    verifier = ScriptedVerifier(block(RAISES), block(WRONG), block(RAISES), block(RAISES),
                                block("while True: pass"), block(RAISES))
    ran, raised = several(rollouts("55", "55"), verifier, verify_pool, programs=3, repair=False)
    assert [p["status"] for p in ran.details["programs"]] == ["exec_error", "mismatch", "exec_error"]
    assert (ran.v, ran.status, ran.code.strip()) == (0, "mismatch", WRONG)
    assert [p["status"] for p in raised.details["programs"]] == ["exec_error", "timeout", "exec_error"]
    assert (raised.v, raised.status, raised.code.strip()) == (0, "exec_error", RAISES)


def test_programs_written_counts_repairs_and_no_inherited_verdict(verify_pool):
    verifier = ScriptedVerifier(block(RAISES), block(RIGHT), block(RIGHT), block(RIGHT))
    repairing = functools.partial(programs.several, verifier=verifier, pool=verify_pool, domain=MATH, programs=1,
                                  repair=True)
    results = budget.budgeted(repairing, 1, None, MATH)(rollouts("55", "55", "55"), [None] * 3)
    assert [programs.programs_written(r) for r in results] == [(2, 1), (0, 0), (0, 0)]
    assert programs.monitor(None, None, results) == {"written": 2, "repairs": 1}
    assert results[1].inferred and results[0].status == "repaired"
