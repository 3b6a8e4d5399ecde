"""t3rl.py: the loop's steps, episodes and monitors."""
import torch

import config
import metrics
import t3rl
from helpers import QUESTIONS, rows, tiny_argv, write_bench
from verifier import VERIFIER_SYSTEM, VerifierPrompt


def test_episodes_pass_over_every_question_in_a_seeded_order():
    cfg = config.Config(episodes=3, questions_per_step=3, max_steps=0)
    records = [{"id": str(i)} for i in range(7)]
    batches = t3rl.question_batches(records, cfg)
    assert len(batches) == 9
    for episode in range(3):
        ids = sorted(r["id"] for b in batches[episode * 3:(episode + 1) * 3] for r in b)
        assert ids == sorted(r["id"] for r in records)
    assert batches == t3rl.question_batches(records, cfg)


def test_self_verifier_answers_each_prompt_and_no_verify_builds_none(tiny_dir, tmp_path):
    cfg = config.parse_config(tiny_argv(tiny_dir, tmp_path))
    verify = t3rl.build_verifier(cfg, torch.device("cpu"))
    [reply] = verify([VerifierPrompt(VERIFIER_SYSTEM, "Is 2 + 2 = 4?")])
    assert isinstance(reply.text, str) and 0 < reply.tokens <= cfg.verifier_max_new_tokens
    assert t3rl.build_verifier(config.parse_config(tiny_argv(tiny_dir, tmp_path, verify=False)), "cpu") is None


def test_step_metrics_report_verifier_precision_and_recall_against_gold(tiny_dir, tmp_path, monkeypatch, patched):
    golds = ["0", "1", "2", "2"]  # fake answers are 0, 1 or 2, and the scripted verifier verifies only "2"
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, golds)])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    # 64 rollouts: enough that right-but-unverified and verified-but-wrong rollouts both occur
    run = t3rl.train(config.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, questions_per_step=4,
                                                   n_votes=8)))
    gold = {f"q{i}": g for i, g in enumerate(golds)}
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    pooled = {"verified": 0, "right": 0, "both": 0}
    for m in train_rows:
        step = [r for r in rows(run, "rollouts.jsonl") if r["step"] == m["step"]]
        verified = [r for r in step if r["v"]]
        right = [r for r in step if r["answer"] == gold[r["id"]]]
        both = [r for r in verified if r["answer"] == gold[r["id"]]]
        assert m["verifier_precision"] == (len(both) / len(verified) if verified else None)
        assert m["verifier_recall"] == (len(both) / len(right) if right else None)
        pooled = {"verified": pooled["verified"] + len(verified), "right": pooled["right"] + len(right),
                  "both": pooled["both"] + len(both)}
        recall = "-" if m["verifier_recall"] is None else f"{m['verifier_recall']:.2f}"
        assert f" rec {recall} |" in metrics.format_step(m, 2)
    assert 0 < pooled["both"] < pooled["right"] and pooled["both"] < pooled["verified"]  # neither score is trivial
    table = metrics.summary(run)
    assert f"verifier precision{pooled['both'] / pooled['verified']:>20.3f}" in table
    assert f"verifier recall{pooled['both'] / pooled['right']:>23.3f}" in table


def test_a_run_without_the_verifier_reports_no_verifier_precision_or_recall(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, ["0", "1", "2", "2"])])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(config.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, verify=False)))
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    assert sum(m["correct_rollouts"] for m in train_rows) > 0  # a recall of 0 / that would be defined, and wrong
    for m in train_rows:
        assert m["status"] == {} and m["verifier_precision"] is None and m["verifier_recall"] is None
        assert " prec - rec - |" in metrics.format_step(m, 2)
    table = metrics.summary(run)
    assert f"verifier precision{'-':>20}" in table and f"verifier recall{'-':>23}" in table
