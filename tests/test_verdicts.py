"""machinery/verdicts.py: the repair turn, several programs per rollout and the verdict memory, with
scripted verifiers (what a test needs of the 1.5B is which program it writes)."""
import json
from types import SimpleNamespace

import pytest

from config import Config
from helpers import ScriptedVerifier
from machinery import verdicts
from machinery.domains import MATH
from sandbox import SandboxPool
from verifier import verify_batch

PROBLEM = "What is the sum of the integers from 1 to 10?"
ROLLOUT = "Pairing 1+10, 2+9, ... gives 5 pairs of 11, so the sum is $\\boxed{55}$."
RIGHT, WRONG, RAISES = "print(sum(range(1, 11)))", "print(sum(range(1, 10)))", "print(55 / 0)"


def block(code):
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(timeout=2.0) as p:
        yield p


def test_failed_programs_get_one_repair_call_that_shows_their_error(pool):
    """Two rollouts whose programs raise and print nothing: one more verifier call holds both repair
    prompts, each with its program's error, and the verdicts say they were repaired."""
    verifier = ScriptedVerifier(block(RAISES), block("x = 55"), block(RIGHT), block(WRONG))
    results = verify_batch([PROBLEM] * 2, [ROLLOUT] * 2, ["55", "55"], verifier, MATH, pool,
                           repair=True, programs=1)
    assert [len(batch) for batch in verifier.batches] == [2, 2]
    first, second = verifier.batches[1]
    assert "ZeroDivisionError" in first.user and "55 / 0" in first.user
    assert "(it printed nothing)" in second.user and "x = 55" in second.user
    assert [(r.v, r.status, r.repaired_from) for r in results] == [(1, "repaired", "exec_error"),
                                                                  (0, "mismatch", "mismatch")]


def test_without_repair_a_raising_program_is_an_exec_error_and_one_call(pool):
    verifier = ScriptedVerifier(block(RAISES))
    result = verify_batch([PROBLEM], [ROLLOUT], ["55"], verifier, MATH, pool, repair=False,
                          programs=1)[0]
    assert (result.v, result.status, result.repaired_from) == (0, "exec_error", None)
    assert len(verifier.batches) == 1


def test_the_hardcoding_guard_judges_a_repaired_program(pool):
    verifier = ScriptedVerifier(block(RAISES), block("print(55)"))
    result = verify_batch([PROBLEM], [ROLLOUT], ["55"], verifier, MATH, pool, repair=True,
                          programs=1)[0]
    assert (result.v, result.status, result.repaired_from) == (0, "hardcoded", "exec_error")


def test_a_mismatch_that_printed_a_value_is_not_repaired(pool):
    verifier = ScriptedVerifier(block(WRONG))
    result = verify_batch([PROBLEM], [ROLLOUT], ["55"], verifier, MATH, pool, repair=True,
                          programs=1)[0]
    assert (result.status, len(verifier.batches)) == ("mismatch", 1)


def test_repair_shows_the_last_lines_of_a_long_error_only():
    run = SimpleNamespace(status="exec_error", code="print(1)",
                          output="\n".join(f"line {k}" for k in range(100)))
    user, seed = verdicts.repair_prompt(PROBLEM, run, MATH, seed=3)
    assert "line 99" in user and "line 92" in user and "line 91\n" not in user


def test_k_programs_per_rollout_with_their_own_seeds_and_one_reproducing_is_enough(pool):
    """Three programs per rollout, each seeded apart (the first with the rollout's own seed), in one
    call; v is 1 when one of them reproduces a_i."""
    verifier = ScriptedVerifier(block(RIGHT), block(WRONG), block("print(5 * 11)"))
    result = verify_batch([PROBLEM], [ROLLOUT], ["55"], verifier, MATH, pool, seeds=[7],
                          programs=3, repair=False)[0]
    seeds = [p.seed for p in verifier.batches[0]]
    assert len(verifier.batches) == 1 and seeds[0] == 7 and len(set(seeds)) == 3
    assert result.v == 1 and result.status == "verified"
    assert [p["status"] for p in result.programs] == ["verified", "mismatch", "verified"]


def test_a_rollout_no_program_reproduced_has_the_status_of_the_one_that_got_furthest(pool):
    """One of three programs ran and printed another value: the rollout is a mismatch that shows
    that program, not the first one's exec_error; it is an exec_error when none ran cleanly."""
    verifier = ScriptedVerifier(block(RAISES), block(WRONG), block(RAISES), block(RAISES),
                                block("while True: pass"), block(RAISES))
    ran, raised = verify_batch([PROBLEM] * 2, [ROLLOUT] * 2, ["55"] * 2, verifier, MATH, pool,
                               programs=3, repair=False)
    assert [p["status"] for p in ran.programs] == ["exec_error", "mismatch", "exec_error"]
    assert (ran.v, ran.status, ran.code.strip()) == (0, "mismatch", WRONG)
    assert [p["status"] for p in raised.programs] == ["exec_error", "timeout", "exec_error"]
    assert (raised.v, raised.status, raised.code.strip()) == (0, "exec_error", RAISES)


def memory(attempts=2):
    return verdicts.VerdictMemory(MATH, attempts)


def step(mem, answers, completions, pool, number, **options):
    """One step's verification of question q0's rollouts through the memory, which then learns."""
    verifier = ScriptedVerifier(*completions)
    n = len(answers)
    results = verify_batch([PROBLEM] * n, [ROLLOUT] * n, answers, verifier, MATH, pool,
                           groups=["q0"] * n, memory=mem, repair=False, programs=1, **options)
    mem.learn(mem.lessons(number, ["q0"] * n, answers, results))
    return results, verifier


def test_one_step_settles_no_class_and_two_that_agree_do(pool):
    """A class's verdict is kept without a verifier call only once two steps in a row agreed on it;
    after one step every rollout is verified afresh, the right answer's failed class included."""
    mem = memory()
    step(mem, ["55", "54"], [block(RAISES), block(WRONG)], pool, 0)  # both fail once
    results, verifier = step(mem, ["55", "54"], [block(RIGHT), block(WRONG)], pool, 1)
    assert [len(batch) for batch in verifier.batches] == [2]  # one failure settles nothing
    assert [(r.v, r.remembered) for r in results] == [(1, False), (0, False)]
    # 54 failed twice in a row: kept; 55 failed, then reproduced: verified afresh
    results, verifier = step(mem, ["55", "54", "\\frac{108}{2}"], [block(RIGHT)], pool, 2)
    assert [len(batch) for batch in verifier.batches] == [1]
    assert [(r.v, r.remembered) for r in results] == [(1, False), (0, True), (0, True)]
    # 55 reproduced twice in a row: kept, for every spelling of its class
    results, verifier = step(mem, ["55", "\\frac{110}{2}"], [], pool, 3)
    assert verifier.batches == [] and [(r.v, r.remembered) for r in results] == [(1, True), (1, True)]


def test_a_kept_verdict_is_the_last_steps_and_a_disagreeing_step_unsettles_nothing_kept(pool):
    """Lessons come only from rollouts verified afresh: a kept class learns nothing more, so it keeps the
    verdict its last two steps agreed on, and a step's verdict on a class is one row, v = 1 when any of
    its rollouts was reproduced."""
    mem = memory()
    step(mem, ["55", "55"], [block(WRONG), block(RIGHT)], pool, 0)
    step(mem, ["55"], [block(RIGHT)], pool, 1)
    assert [row["v"] for _, row in mem.entry("q0", "55")["outcomes"]] == [1, 1]
    results, _ = step(mem, ["55"], [], pool, 2)
    assert results[0].remembered and mem.entry("q0", "55")["outcomes"][-1][0] == 1
    with pytest.raises(ValueError, match="at least 2 steps"):
        verdicts.VerdictMemory(MATH, 1)


def test_lazy_verification_with_a_memory_asks_only_what_can_change_the_label(pool):
    mem = memory()
    step(mem, ["55"], [block(RIGHT)], pool, 0)
    step(mem, ["55"], [block(RIGHT)], pool, 1)
    # 55 kept (weight 5) against one open 54 (at most 5, and fewer rollouts): decided
    results, verifier = step(mem, ["55", "54"], [], pool, 2, omega=5.0)
    assert verifier.batches == [] and [r.status for r in results] == ["verified", "skipped"]


def learner_at(run_dir, **options):
    cfg = Config(**{"verdict_memory": True, "verdict_attempts": 2, **options})
    return SimpleNamespace(cfg=cfg, run_dir=run_dir, verdicts=None,
                           accelerator=SimpleNamespace(is_main_process=True))


def test_a_resumed_run_remembers_the_steps_before_its_checkpoint_only(tmp_path):
    """verdicts.jsonl keeps every step's lessons; resuming at step 2 keeps those of steps 0 and 1 and
    drops the later ones, which the resumed run computes again."""
    lessons = [{"step": s, "id": "q0", "answer": a, "v": v, "status": st, "result": a}
               for s, a, v, st in [(0, "55", 1, "verified"), (0, "54", 0, "mismatch"),
                                   (1, "55", 1, "verified"), (2, "54", 0, "mismatch")]]
    (tmp_path / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lessons))
    mem = verdicts.memory_of(learner_at(tmp_path), 2, MATH)
    assert [e["answer"] for e in mem.classes["q0"]] == ["55", "54"]
    assert [json.loads(line)["step"] for line in open(tmp_path / "verdicts.jsonl")] == [0, 0, 1]
    remembered = mem.recall(["q0"] * 2, ["55", "54"], [None] * 2)
    assert [(i, e["v"]) for i, e in remembered] == [(0, 1)]  # 54 failed in one step of the two
    assert verdicts.memory_of(learner_at(tmp_path, verdict_memory=False), 2, MATH) is None


def test_programs_written_counts_repairs_and_no_inherited_verdict(pool):
    verifier = ScriptedVerifier(block(RAISES), block(RIGHT), block(RIGHT), block(RIGHT))
    results = verify_batch([PROBLEM] * 3, [ROLLOUT] * 3, ["55"] * 3, verifier, MATH, pool,
                           repair=True, budget=1, programs=1)
    assert [verdicts.programs_written(r) for r in results] == [2, 0, 0]
    assert results[1].inferred and results[0].status == "repaired"


def test_verify_batch_defaults_are_what_a_training_step_runs():
    """bench/ and other callers of verify_batch get the verifier of the loop's defaults."""
    import inspect
    defaults = {k: p.default for k, p in inspect.signature(verify_batch).parameters.items()}
    cfg = Config()
    assert (defaults["programs"], defaults["repair"]) == (cfg.verifier_programs, cfg.verifier_repair)


def test_bench_memory_verifies_the_later_episodes_again_without_the_memory(tiny_dir, tmp_path, monkeypatch):
    """bench.verifier --memory RUN: every rollout answers 2, whose class a program reproduces in
    episodes 1 and 2; episode 3 reuses that verdict without a program, and verified again without the
    memory it writes one program a question, with the same labels."""
    import t3rl
    from bench import verifier as bench_verifier
    from helpers import QUESTIONS, tiny_argv, write_bench
    from machinery import domains
    from machinery.options import parse_config
    from verifier import VerifierReply

    def writes_two(prompts):  # "print(1 + 1)" reproduces the answer 2, in 7 tokens
        asked.append(len(prompts))
        return [VerifierReply(block("print(1 + 1)"), 7) for _ in prompts]
    asked = []
    write_bench(tmp_path / "data", QUESTIONS[:2])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(domains, "extract_answer", lambda text: "2")
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device: writes_two)
    run = t3rl.train(parse_config(tiny_argv(
        tiny_dir, tmp_path / "out", episodes=3, max_steps=0, limit=2, questions_per_step=2,
        eval_samples=0, verifier_programs=1, verifier_repair=False, lazy_verify=False)))
    metrics = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r.get("kind") == "train"]
    assert [(r["programs_written"], r["verdicts_reused"]) for r in metrics] == [(2, 0), (2, 0), (0, 8)]
    asked.clear()
    totals = bench_verifier.memory_replay(run, verifier=writes_two)
    assert asked == [2, 2]  # episodes 2 and 3, verified again: one program per question (budget 1)
    assert (totals[1]["memory"], totals[3]["memory"], totals[3]["afresh"]) == (14, 0, 14)
    assert totals[3]["same"] == totals[3]["questions"] == 2
