"""extensions/memory.py: the verdict memory, with scripted verifiers."""
import dataclasses
import functools
import json

import pytest

import t3rl
import verifier as verifier_module
from bench import verifier as bench_verifier
from config import parse_config
from extensions import budget
from extensions.memory import VerdictMemory, open_memory, remembering
from helpers import QUESTIONS, RAISES, RIGHT, WRONG, ScriptedVerifier, rollouts, tiny_argv, write_bench
from verifier import MATH, VerifierReply, verify_batch


def block(code):
    return f"```python\n{code}\n```"


def memory(attempts=2):
    return VerdictMemory(MATH, attempts)


def step(mem, answers, completions, verify_pool, number, omega=None):
    """One training step's verification of question q0's rollouts through the memory, which learns
    what it showed (omega: lazily, at that omega)."""
    verifier = ScriptedVerifier(*completions)
    paper = functools.partial(verify_batch, verifier=verifier, pool=verify_pool, domain=MATH)
    remembered = remembering(budget.budgeted(paper, 0, omega, MATH), mem, gather=lambda rows: rows)
    return remembered(rollouts(*answers, step=number), [None] * len(answers)), verifier


def test_one_step_settles_no_class_and_two_that_agree_do(verify_pool):
    """A class's verdict is kept without a verifier call only once two steps in a row agreed on it;
    after one step every rollout is verified afresh, the right answer's failed class included."""
    mem = memory()
    step(mem, ["55", "54"], [block(RAISES), block(WRONG)], verify_pool, 0)  # both fail once
    results, verifier = step(mem, ["55", "54"], [block(RIGHT), block(WRONG)], verify_pool, 1)
    assert [len(batch) for batch in verifier.batches] == [2]  # one failure settles nothing
    assert [(r.v, r.details.get("remembered", False)) for r in results] == [(1, False), (0, False)]
    # 54 failed twice in a row: kept; 55 failed, then reproduced: verified afresh
    results, verifier = step(mem, ["55", "54", "\\frac{108}{2}"], [block(RIGHT)], verify_pool, 2)
    assert [len(batch) for batch in verifier.batches] == [1]
    assert [(r.v, r.details.get("remembered", False)) for r in results] == [(1, False), (0, True), (0, True)]
    # 55 reproduced twice in a row: kept, for every spelling of its class
    results, verifier = step(mem, ["55", "\\frac{110}{2}"], [], verify_pool, 3)
    assert verifier.batches == [] and [(r.v, r.details.get("remembered", False)) for r in results] == [(1, True), (1, True)]


def test_one_step_settles_no_class_even_when_it_spells_its_answer_two_ways(verify_pool):
    """55 and 50+5 are one class that only sympy joins (their keys differ): one step's two fresh verdicts
    on it are one outcome, so the next step verifies the class afresh."""
    mem = memory()
    step(mem, ["55", "50+5"], [block(RIGHT), block(RIGHT)], verify_pool, 0)
    assert [row["v"] for _, row in mem.entry("q0", "55")["outcomes"]] == [1]
    results, verifier = step(mem, ["55"], [block(RIGHT)], verify_pool, 1)
    assert [len(batch) for batch in verifier.batches] == [1]
    assert [(r.v, r.details.get("remembered", False)) for r in results] == [(1, False)]


def test_a_kept_verdict_is_the_last_steps_and_a_disagreeing_step_unsettles_nothing_kept(verify_pool):
    """Lessons come only from rollouts verified afresh: a kept class learns nothing more, so it keeps the
    verdict its last two steps agreed on, and a step's verdict on a class is one row, v = 1 when any of
    its rollouts was reproduced."""
    mem = memory()
    step(mem, ["55", "55"], [block(WRONG), block(RIGHT)], verify_pool, 0)
    step(mem, ["55"], [block(RIGHT)], verify_pool, 1)
    assert [row["v"] for _, row in mem.entry("q0", "55")["outcomes"]] == [1, 1]
    results, _ = step(mem, ["55"], [], verify_pool, 2)
    assert results[0].details["remembered"] and mem.entry("q0", "55")["outcomes"][-1][0] == 1
    with pytest.raises(ValueError, match="at least 2 steps"):
        VerdictMemory(MATH, 1)


def test_lazy_verification_with_a_memory_asks_only_what_can_change_the_label(verify_pool):
    mem = memory()
    step(mem, ["55"], [block(RIGHT)], verify_pool, 0)
    step(mem, ["55"], [block(RIGHT)], verify_pool, 1)
    # 55 kept (weight 5) against one open 54 (at most 5, and fewer rollouts): decided
    results, verifier = step(mem, ["55", "54"], [], verify_pool, 2, omega=5.0)
    assert verifier.batches == [] and [r.status for r in results] == ["verified", "skipped"]


def test_an_evaluation_verifies_afresh_and_teaches_nothing(verify_pool):
    """Rollouts of an evaluation (step -1) take no remembered verdict and leave the memory as it was."""
    mem = memory()
    step(mem, ["55"], [block(RIGHT)], verify_pool, 0)
    step(mem, ["55"], [block(RIGHT)], verify_pool, 1)
    verifier = ScriptedVerifier(block(WRONG))
    paper = functools.partial(verify_batch, verifier=verifier, pool=verify_pool, domain=MATH)
    [result] = remembering(paper, mem, gather=lambda rows: rows)(rollouts("55"), [None])
    assert (result.v, result.details.get("remembered", False), len(verifier.batches)) == (0, False, 1)
    assert len(mem.entry("q0", "55")["outcomes"]) == 2


def test_a_resumed_run_remembers_the_steps_before_its_checkpoint_only(tmp_path):
    """verdicts.jsonl keeps every step's lessons; resuming at step 2 keeps those of steps 0 and 1 and
    drops the later ones, which the resumed run computes again."""
    lessons = [{"step": s, "id": "q0", "answer": a, "v": v, "status": st, "result": a}
               for s, a, v, st in [(0, "55", 1, "verified"), (0, "54", 0, "mismatch"),
                                   (1, "55", 1, "verified"), (2, "54", 0, "mismatch")]]
    (tmp_path / "verdicts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lessons))
    mem = open_memory(tmp_path, 2, MATH, main=True)
    assert [e["answer"] for e in mem.classes["q0"]] == ["55", "54"]
    assert [json.loads(line)["step"] for line in open(tmp_path / "verdicts.jsonl")] == [0, 0, 1]
    remembered = mem.recall(["q0"] * 2, ["55", "54"], [None] * 2)
    assert [(i, e["v"]) for i, e in remembered] == [(0, 1)]  # 54 failed in one step of the two


def test_bench_memory_verifies_the_later_episodes_again_without_the_memory(tiny_dir, tmp_path, monkeypatch):
    """bench.verifier --memory RUN: every rollout answers 2, whose class a program reproduces in
    episodes 1 and 2; episode 3 reuses that verdict without a program, and verified again without the
    memory it writes one program a question, with the same labels."""

    def writes_two(prompts):  # "print(1 + 1)" reproduces the answer 2, in 7 tokens
        asked.append(len(prompts))
        return [VerifierReply(block("print(1 + 1)"), 7) for _ in prompts]
    asked = []
    write_bench(tmp_path / "data", QUESTIONS[:2])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(verifier_module, "MATH", dataclasses.replace(MATH, extract=lambda text, problem: "2"))
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: writes_two)
    run = t3rl.train(parse_config(tiny_argv(
        tiny_dir, tmp_path / "out", episodes=3, max_steps=0, limit=2, questions_per_step=2,
        eval_samples=0, verdict_memory=True, lazy_verify=False)))
    metrics = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r.get("kind") == "train"]
    # 7 tokens a program, one program a question until the memory reuses both classes' verdicts
    assert [(r["verifier_tokens"], r["extensions"]["memory"]["reused"]) for r in metrics] == [
        (14, 0), (14, 0), (0, 8)]
    asked.clear()
    totals = bench_verifier.memory_replay(run, verifier=writes_two)
    assert asked == [2, 2]  # episodes 2 and 3, verified again: one program per question (budget 1)
    assert (totals[1]["memory"], totals[3]["memory"], totals[3]["afresh"]) == (14, 0, 14)
    assert totals[3]["same"] == totals[3]["questions"] == 2
