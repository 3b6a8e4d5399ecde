"""t3rl.py: the loop's steps, episodes and monitors."""
import dataclasses
import functools
import json
import re
import statistics
import time

import pytest
import torch
from accelerate import Accelerator

import config
import sampler
import t3rl
import verifier
from config import parse_config
from extensions import budget, kv_fast
from helpers import QUESTIONS, ScriptedVerifier, final_weights, make_tiny_model, rows, tiny_argv, write_bench
from machinery import metrics
from machinery import model as models
from machinery.model import load_model
from sampler import Completion
from verifier import VERIFIER_SYSTEM, VerifierPrompt


def test_episodes_pass_over_the_questions_in_a_seeded_order_of_whole_steps():
    """Each episode is a fresh seeded order of the benchmark cut into whole steps (verl drops the last
    partial batch): 7 questions at 3 a step are 2 steps an episode, 6 of the 7 in each."""
    cfg = config.Config(episodes=3, questions_per_step=3, max_steps=0)
    records = [{"id": str(i)} for i in range(7)]
    batches = t3rl.question_batches(records, cfg)
    assert len(batches) == 6 and {len(b) for b in batches} == {3}
    episodes = [sorted(r["id"] for b in batches[e * 2:(e + 1) * 2] for r in b) for e in range(3)]
    assert all(len(set(ids)) == 6 for ids in episodes) and len({tuple(ids) for ids in episodes}) > 1
    assert batches == t3rl.question_batches(records, cfg)
    assert len(t3rl.question_batches(records, config.Config(episodes=3, questions_per_step=3, max_steps=4))) == 4


def test_aime_at_8_a_step_is_3_steps_an_episode_drawn_from_all_30():
    """AIME 2024 under TTRL's scripts: 30 questions at 8 a step are 3 steps an episode, not 4; every step
    has 8 questions and the episodes together draw from all 30."""
    records = [{"id": str(i)} for i in range(30)]
    batches = t3rl.question_batches(records, config.Config(episodes=80, questions_per_step=8, max_steps=0))
    assert len(batches) == 3 * 80 and {len(b) for b in batches} == {8}
    assert len({r["id"] for b in batches for r in b}) == 30


def test_a_benchmark_smaller_than_a_step_is_refused_in_one_line():
    with pytest.raises(config.OptionError, match=r"--questions-per-step 8: the benchmark has 5 questions, so no "
                                                 r"step is left; lower --questions-per-step or raise --limit"):
        t3rl.question_batches([{"id": str(i)} for i in range(5)], config.Config(questions_per_step=8))


def test_self_verifier_answers_each_prompt(tiny_dir, tmp_path):
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path))
    verify = t3rl.build_verifier(cfg, torch.device("cpu"))
    [reply] = verify([VerifierPrompt(VERIFIER_SYSTEM, "Is 2 + 2 = 4?")])
    assert isinstance(reply.text, str) and 0 < reply.tokens <= cfg.verifier_max_new_tokens


def test_step_metrics_report_verifier_precision_and_recall_against_gold(tiny_dir, tmp_path, monkeypatch, patched):
    golds = ["0", "1", "2", "2"]  # fake answers are 0, 1 or 2, and the scripted verifier verifies only "2"
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, golds)])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    # 64 rollouts: enough that right-but-unverified and verified-but-wrong rollouts both occur
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, questions_per_step=4,
                                                   n_votes=8)))
    gold = {f"q{i}": g for i, g in enumerate(golds)}
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    pooled = {"verified": 0, "judged": 0, "both": 0}
    inherited = 0
    for m in train_rows:
        step = [r for r in rows(run, "rollouts.jsonl") if r["step"] == m["step"]]
        # the rollouts the verifier judged: not skipped (lazy), not inheriting their class's verdict (budget 1)
        asked = [r for r in step if r["status"] not in ("skipped", "no_answer") and not r["inherited"]]
        verified = [r for r in asked if r["v"]]
        right = [r for r in asked if r["answer"] == gold[r["id"]]]
        judged = right  # recall: of the right rollouts it was asked about
        both = [r for r in verified if r["answer"] == gold[r["id"]]]
        inherited += sum(r["v"] and r["inherited"] for r in step)
        assert m["inherited_verified_rollouts"] == sum(r["v"] and r["inherited"] for r in step)
        # the budget's monitor: the verifier calls it spared, by inheriting and by skipping
        assert all(r.get("class_verdict", False) == bool(r["inherited"]) for r in step)  # its own mark
        assert m["extensions"]["budget"] == {"inherited": sum(bool(r["inherited"]) for r in step),
                                             "skipped": sum(r["status"] == "skipped" for r in step)}
        assert m["verifier_precision"] == (len(both) / len(verified) if verified else None)
        assert m["verifier_recall"] == (len(both) / len(judged) if judged else None)
        pooled = {"verified": pooled["verified"] + len(verified), "judged": pooled["judged"] + len(judged),
                  "both": pooled["both"] + len(both)}
        recall = "-" if m["verifier_recall"] is None else f"{m['verifier_recall']:.2f}"
        assert f" rec {recall} |" in metrics.format_step(m, 2)
    assert 0 < pooled["both"] < pooled["judged"] and pooled["both"] < pooled["verified"]  # neither score is trivial
    assert inherited > 0  # verdicts a class inherited occurred, and the scores above left them out
    assert f"budget inherited{sum(m['extensions']['budget']['inherited'] for m in train_rows):>22}" in \
        metrics.summary(run)
    table = metrics.summary(run)
    assert f"verifier precision{pooled['both'] / pooled['verified']:>20.3f}" in table
    assert f"verifier recall{pooled['both'] / pooled['judged']:>23.3f}" in table


def test_ttrl_with_lazy_verification_still_runs_the_verifier_for_its_monitors(tiny_dir, tmp_path, monkeypatch,
                                                                              patched):
    """At omega 1 no verdict can change the label, so laziness would skip every rollout; the cpu preset's
    --omega 1 (TTRL) verifies them instead, for the verifier's precision and recall on TTRL's rollouts."""
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, ["0", "1", "2", "2"])])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, omega=1))
    assert cfg.lazy_verify and cfg.verifier_model != "none"
    run = t3rl.train(cfg)
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    statuses = {s for m in train_rows for s in m["status"]}
    assert "skipped" not in statuses and "verified" in statuses
    assert any(m["verifier_precision"] is not None for m in train_rows)
    assert all(m["label_accuracy"] == m["majority_label_accuracy"] for m in train_rows)  # omega 1 is TTRL


def test_a_policy_whose_source_is_bfloat16_trains_float32_master_weights(tiny_dir, tmp_path, monkeypatch, patched):
    """An offline model's cache is bfloat16 (coder-1.5b): the policy still trains in float32, so a step at the
    cpu preset's lr 2e-6, below bfloat16's spacing near the weights, moves them."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    real_load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda spec, dtype=None, option="--model": real_load(
        spec, dtype or torch.bfloat16, option))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, lr=2e-6, n_votes=8,
                                            n_train=4, save_every=2)))
    assert sum(r["reward"] for r in rows(run, "rollouts.jsonl") if r["kept"]) > 0
    after = final_weights(run)
    start = make_tiny_model(after["model.embed_tokens.weight"].shape[0]).state_dict()
    name = "model.layers.0.mlp.up_proj.weight"
    assert after[name].dtype == torch.float32
    assert (after[name] != start[name]).float().mean() > 0.5  # in bfloat16 these steps round away


def test_the_loop_keeps_two_questions_with_one_text_apart_when_it_verifies(pool, monkeypatch):
    """Two ids, one text: each question's lazy verification is its own (keyed by its id)."""
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)
    problem = "What is the sum of the integers from 1 to 10?"
    records = [{"id": "a", "problem": problem}, {"id": "b", "problem": problem}]
    answers = [["55", "55", "55", "54"], ["54", "53"]]
    groups = [[Completion([1], [2], f"\\boxed{{{a}}}", "eos") for a in group] for group in answers]
    program = ScriptedVerifier(*["```python\nprint(sum(range(1, 11)))\n```"] * 6)
    paper = functools.partial(verifier.verify_batch, verifier=program, pool=pool, domain=verifier.MATH)
    verdicts = t3rl.verify_groups(budget.budgeted(paper, 0, 5.0, verifier.MATH), 0, records, groups, answers, 0)
    assert [r.status for r in verdicts[1]] == ["mismatch", "mismatch"]  # by text: skipped behind a's 55


def test_a_run_without_the_verifier_reports_no_verifier_precision_or_recall(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, ["0", "1", "2", "2"])])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, verifier_model="none")))
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    assert sum(m["correct_rollouts"] for m in train_rows) > 0  # a recall of 0 / that would be defined, and wrong
    for m in train_rows:
        assert m["status"] == {} and m["verifier_precision"] is None and m["verifier_recall"] is None
        assert " prec - rec - |" in metrics.format_step(m, 2)
    table = metrics.summary(run)
    assert f"verifier precision{'-':>20}" in table and f"verifier recall{'-':>23}" in table


def _recorded_evaluation(tiny_dir, tmp_path, monkeypatch, **options):
    """evaluate() on 12 questions with the tiny model, every sampler call recorded: (its Sampling and progress,
    its texts). Answers are the texts themselves and 'right' is an even length, so accuracies follow what was
    sampled."""
    calls = []
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path, verifier_model="none", **options))

    def recording_generate(*args, **kwargs):
        out = sampler.generate(*args, backend=cfg.backend, **kwargs)
        calls.append((args[4], kwargs["progress"], [[c.text for c in group] for group in out]))
        return out
    text_domain = dataclasses.replace(verifier.MATH, extract=lambda text, problem: text, same=lambda a, b: a == b,
                                      key=lambda a: a, equiv=lambda a, gold: len(a) % 2 == 0)
    policy, tokenizer = load_model(str(tiny_dir))
    learner = t3rl.Learner(cfg, Accelerator(cpu=True), policy, policy, tokenizer, None, None, text_domain,
                           tmp_path, generate=recording_generate)
    learner.sample = functools.partial(t3rl.sample_groups, learner)
    records = [{"id": f"q{i}", "problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(12)]
    per_question = t3rl.evaluate(learner, records)
    return metrics.eval_metrics(per_question, cfg.eval_samples), calls


def test_evaluation_samples_at_the_papers_temperature_not_trainings(tiny_dir, tmp_path, monkeypatch):
    """TTRL trains at temperature 1.0 and evaluates at 0.6 / top-p 0.95: the k evaluation runs reach the
    sampler at those, greedy@1 at temperature 0."""
    _, calls = _recorded_evaluation(tiny_dir, tmp_path, monkeypatch, temperature=1.0, top_p=1.0, eval_samples=2)
    assert {progress: (s.temperature, s.top_p) for s, progress, _ in calls} == {
        "greedy": (0.0, 1.0), "eval": (t3rl.EVAL_TEMPERATURE, t3rl.EVAL_TOP_P)}
    assert (t3rl.EVAL_TEMPERATURE, t3rl.EVAL_TOP_P) == (0.6, 0.95)


def test_avg_at_k_is_the_mean_of_k_single_seeded_runs(tiny_dir, tmp_path, monkeypatch):
    """avg@2 with seed 5 samples, for run j, exactly what a single-run evaluation with seed 5 + j samples, and
    its value and spread are the mean and std of those single runs' accuracies."""
    many, calls = _recorded_evaluation(tiny_dir, tmp_path / "k2", monkeypatch, seed=5, eval_samples=2)
    sampled = [text for _, progress, texts in calls if progress == "eval" for text in texts]  # run-major
    singles = []
    for j in range(2):
        single, single_calls = _recorded_evaluation(tiny_dir, tmp_path / f"k1-{j}", monkeypatch, seed=5 + j,
                                                    eval_samples=1)
        assert [t for _, progress, texts in single_calls if progress == "eval" for t in texts] == \
            sampled[12 * j:12 * (j + 1)]
        singles.append(single["avg@1"])
    assert len({tuple(map(tuple, sampled[12 * j:12 * (j + 1)])) for j in range(2)}) == 2  # two different runs
    assert many["avg@2"] == pytest.approx(statistics.fmean(singles))
    assert many["avg@2_std"] == pytest.approx(statistics.pstdev(singles))
    assert 0 < many["greedy@1"] + many["avg@2"] and {"maj@2", "no_answer@2", "greedy_no_answer"} <= many.keys()


def test_a_run_logs_its_best_evaluation_beside_the_final_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    evals = [{"kind": "eval", "step": 0, "greedy@1": 0.5, "avg@4": 0.40, "avg@4_std": 0.02},
             {"kind": "eval", "step": 2, "greedy@1": 0.4, "avg@4": 0.55, "avg@4_std": 0.03},
             {"kind": "eval", "step": 4, "final": True, "greedy@1": 0.6, "avg@4": 0.50, "avg@4_std": 0.01}]
    best = metrics.best_evals(evals)
    assert best == {"best/greedy@1": 0.6, "best/greedy@1/step": 4, "best/avg@4": 0.55, "best/avg@4/step": 2}
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in evals))
    table = metrics.summary(run)
    assert "Pass@1 = avg@4 +- std over 4 runs: before 0.400 +- 0.020, final 0.500 +- 0.010, best 0.550 at step 2" in table
    assert [line.split() for line in table.splitlines() if line.startswith("avg@4 ")] == [["avg@4", "0.400", "0.500", "0.550", "2"]]


def test_the_no_answer_share_is_logged_per_step_and_at_evaluation(tiny_dir, tmp_path, monkeypatch, patched):
    """A rollout that states no answer cannot vote and gets reward 0; the step line and metrics say how many."""
    monkeypatch.setattr(verifier, "MATH", dataclasses.replace(
        verifier.MATH, extract=lambda text, problem: None if len(text) % 3 == 0 else "1"))
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2)))
    logged = rows(run, "rollouts.jsonl")
    for m in (m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"):
        step = [r for r in logged if r["step"] == m["step"]]
        assert m["no_answer_ratio"] == sum(r["answer"] is None for r in step) / len(step)
        assert f" no-ans {m['no_answer_ratio']:.2f} " in metrics.format_step(m, 2)
    assert 0 < sum(r["answer"] is None for r in logged) < len(logged)
    final = [m for m in rows(run, "metrics.jsonl") if m.get("final")][0]
    assert 0 <= final["no_answer@2"] <= 1 and "greedy_no_answer" in final


def test_a_run_refused_for_its_benchmark_leaves_no_run_folder(tmp_path, monkeypatch):
    write_bench(tmp_path / "data", QUESTIONS)  # 4 questions: no whole step of 8
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    with pytest.raises(SystemExit, match="--questions-per-step 8: the benchmark has 4 questions"):
        t3rl.main(["--questions-per-step", "8", "--out-dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_evaluations_cover_the_questions_the_run_reached(tiny_dir, tmp_path, monkeypatch, patched):
    """3 steps of 2 of 8 questions: every evaluation covers the 6 questions the steps visited, and says so."""
    write_bench(tmp_path / "data", [(f"What is {i} + {i}?", str(2 * i)) for i in range(8)])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", limit=0, episodes=1, max_steps=3)))
    trained = {r["id"] for r in rows(run, "rollouts.jsonl")}
    assert len(trained) == 6
    evals = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "eval"]
    assert [(m["questions"], m["trained_questions"]) for m in evals] == [(6, 6)] * 2
    per_question = rows(run, "evaluations.jsonl")
    for step in (0, 3):
        assert {r["id"] for r in per_question if r["step"] == step} == trained
    assert "evaluated on the 6 questions the run trains on (6 of them trained)" in \
        metrics.summary(run)


def test_a_run_that_only_evaluates_reports_its_evaluation_as_before_and_final(tiny_dir, tmp_path, monkeypatch,
                                                                              patched):
    """--episodes 0 (a baseline): its one evaluation is the run's before and its final, not a lost row."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", episodes=0)))
    [evaluation] = rows(run, "metrics.jsonl")
    assert evaluation["step"] == 0 and evaluation["final"]
    table = metrics.summary(run)
    assert "'before' is unknown" not in table
    assert f"{'greedy@1':<28}{evaluation['greedy@1']:>10.3f}{evaluation['greedy@1']:>10.3f}" in table


def test_the_time_line_gives_each_phase_in_minutes_and_shares_of_the_wall():
    line = metrics.time_line({"load": 60.0, "evaluation": 120.0, "sample": 30.0, "verify": 30.0,
                              "update": 150.0, "wall": 420.0})
    assert line == ("time 7.0 min: load 1.0 (14%), evaluation 2.0 (29%), sample 0.5 (7%), verify 0.5 (7%), "
                    "update 2.5 (36%), other 0.5 (7%)")


def test_a_run_ends_with_where_its_time_went(tiny_dir, tmp_path, monkeypatch, capsys, patched):
    """Each evaluation made 2 s slower: the printed evaluation time holds those seconds."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    real = t3rl.evaluate
    monkeypatch.setattr(t3rl, "evaluate", lambda *a, **k: (time.sleep(2), real(*a, **k))[1])
    started = time.time()
    t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, eval_cache="none")))
    wall = time.time() - started
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("time ")][-1]
    shares = dict((phase, int(share)) for phase, share in re.findall(r"(\w+) [\d.]+ \((\d+)%\)", line))
    assert list(shares) == ["load", "evaluation", "sample", "verify", "update", "other"]
    assert shares["evaluation"] >= 100 * 4 / wall - 1 and abs(sum(shares.values()) - 100) <= 3


@pytest.mark.parametrize("episodes,eval_samples,loaded", [(0, 0, False), (0, 2, True), (1, 0, True)])
def test_the_verifier_loads_only_when_the_run_trains_or_samples_answers_to_verify(
        tiny_dir, tmp_path, monkeypatch, episodes, eval_samples, loaded):
    """An evaluation-only run of greedy answers verifies nothing, so it loads no verifier (nor counts one in
    the engine's GPU memory check: config.builds_verifier)."""
    calls = []
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: calls.append(cfg) or (
        lambda prompts: ["no code"] * len(prompts)))
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path, episodes=episodes, eval_samples=eval_samples, max_steps=1,
                                 limit=2))
    assert config.builds_verifier(cfg) is loaded
    t3rl.train(cfg)
    assert len(calls) == int(loaded)


def test_each_backend_samples_with_its_own_generate(monkeypatch):
    """speed_path is the one backend table that setup, the study and bench/engine.py read: kv and hf sample
    through sampler.generate with that backend, kv-fast through its own module, which setup then serves."""
    used = []
    monkeypatch.setattr(sampler, "generate", lambda *args, backend: used.append(backend))
    for backend in ("kv", "hf"):
        generate, module = t3rl.speed_path(backend)
        generate("model", "tokenizer")
        assert module is None
    assert used == ["kv", "hf"]
    assert t3rl.speed_path("kv-fast") == (kv_fast.generate, kv_fast)
