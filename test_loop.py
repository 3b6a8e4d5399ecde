import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import t3rl
from conftest import make_tiny_model

ROOT = Path(__file__).resolve().parent
QUESTIONS = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 + 3?", "6"), ("What is 4 + 4?", "8")]


def fake_answer(text):
    """The tiny random model never writes \\boxed{}; give each rollout a deterministic answer from its text
    so that votes, rewards and the GRPO update are not all trivial."""
    return str(len(text) % 3)


def scripted_verifier(prompts):
    """A verifier that always writes the same program: rollouts answering 2 get verified."""
    return ["```python\nprint(1 + 1)\n```" for _ in prompts]


@pytest.fixture()
def tiny_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_bench(folder: Path, questions):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "problem": p, "answer": a}) + "\n" for i, (p, a) in enumerate(questions)))


def tiny_argv(tiny_dir, out_dir, **extra):
    options = dict(preset="cpu", model=str(tiny_dir), bench="demo", n_votes=4, n_train=2, questions_per_step=2,
                   max_steps=4, max_new_tokens=12, verifier_max_new_tokens=8, lr=1e-3, save_every=2,
                   eval_samples=2, out_dir=str(out_dir), run_name="run", backend="kv", sample_dtype="bfloat16",
                   bf16=False, grad_checkpointing=False)
    options.update(extra)
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    return [(flag(k) if v else "--no-" + k.replace("_", "-")) if isinstance(v, bool) else f"{flag(k)}={v}"
            for k, v in options.items()]


@pytest.fixture()
def patched(monkeypatch):
    monkeypatch.setattr(t3rl, "extract_answer", fake_answer)
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device: scripted_verifier if cfg.verify else None)


def rows(run_dir, name):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def without_timing(metrics):
    return [{k: v for k, v in r.items() if not k.startswith(("seconds/", "grpo/seconds"))} for r in metrics]


def final_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(run_dir / "checkpoint" / "model" / "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# configuration

def test_unknown_option_is_rejected(capsys):
    with pytest.raises(SystemExit):
        t3rl.parse_config(["--no-such-option", "1"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_cpu_preset_is_picked_without_gpu_and_explicit_options_win():
    cfg = t3rl.parse_config(["--n-votes", "16"])
    assert cfg.preset == "cpu" and cfg.model == "embedded" and cfg.bench == "demo"
    assert cfg.n_votes == 16 and cfg.n_train == t3rl.PRESETS["cpu"]["n_train"]


def test_paper_preset_follows_the_paper():
    cfg = t3rl.parse_config(["--preset", "paper", "--bench", "aime2024"])
    assert (cfg.n_votes, cfg.n_train, cfg.temperature, cfg.top_p) == (64, 32, 0.6, 0.95)
    assert (cfg.max_new_tokens, cfg.verifier_max_new_tokens, cfg.lr, cfg.kl_coef, cfg.omega) == (2560, 1024, 5e-7, 0.0, 5.0)
    assert (cfg.episodes, cfg.eval_samples) == (80, 16)
    assert t3rl.parse_config(["--preset", "paper", "--bench", "amc"]).episodes == 30


def test_omega_inf_and_no_verify_parse():
    cfg = t3rl.parse_config(["--omega", "inf", "--no-verify"])
    assert cfg.omega == float("inf") and cfg.verify is False


def test_help_lists_every_option_with_its_default():
    out = subprocess.run([sys.executable, "t3rl.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for name in t3rl.Config.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out
    assert "(default: 5.0)" in out and "--replay" in out


def test_episodes_pass_over_every_question_in_a_seeded_order():
    cfg = t3rl.Config(episodes=3, questions_per_step=3, max_steps=0)
    records = [{"id": str(i)} for i in range(7)]
    batches = t3rl.question_batches(records, cfg)
    assert len(batches) == 9
    for episode in range(3):
        ids = sorted(r["id"] for b in batches[episode * 3:(episode + 1) * 3] for r in b)
        assert ids == sorted(r["id"] for r in records)
    assert batches == t3rl.question_batches(records, cfg)


# ---------------------------------------------------------------------------------------------------------------
# the loop

def test_self_verifier_answers_each_prompt_and_no_verify_builds_none(tiny_dir, tmp_path):
    cfg = t3rl.parse_config(tiny_argv(tiny_dir, tmp_path))
    verify = t3rl.build_verifier(cfg, torch.device("cpu"))
    [completion] = verify(["Is 2 + 2 = 4?"])
    assert isinstance(completion, str) and 0 < completion.num_tokens <= cfg.verifier_max_new_tokens
    assert t3rl.build_verifier(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path, verify=False)), "cpu") is None


def test_ground_truth_never_reaches_rewards_or_parameters(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "real", QUESTIONS)
    write_bench(tmp_path / "garbage", [(p, "GARBAGE-" + a) for p, a in QUESTIONS])
    runs = []
    for name in ("real", "garbage"):
        monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / name))
        runs.append(t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / f"out-{name}", max_steps=2))))
    real, garbage = (rows(r, "rollouts.jsonl") for r in runs)
    assert [r["reward"] for r in real] == [r["reward"] for r in garbage]
    assert 0 < sum(r["reward"] for r in real) < len(real)  # the rewards are not trivial
    weights = [final_weights(r) for r in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    start = make_tiny_model(weights[0]["model.embed_tokens.weight"].shape[0]).state_dict()
    assert not torch.equal(weights[0]["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    # ... while the monitors, which may see the gold answers, do notice the difference
    assert rows(runs[0], "metrics.jsonl")[1]["ground_truth_ratio"] != rows(runs[1], "metrics.jsonl")[1]["ground_truth_ratio"]


def test_run_folder_has_config_metrics_rollouts_checkpoint_and_plot(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2)))
    assert json.loads((run / "config.json").read_text())["n_votes"] == 4
    metrics = rows(run, "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["eval", "train", "train", "eval"]
    assert {"label_accuracy", "majority_label_accuracy", "verified_ratio", "status", "grpo/loss"} <= set(metrics[1])
    rollouts = rows(run, "rollouts.jsonl")
    assert len(rollouts) == 2 * 2 * 4 and sum(r["kept"] for r in rollouts) == 2 * 2 * 2
    assert {r["status"] for r in rollouts} <= {"verified", "mismatch"}
    assert all((r["status"] == "verified") == (r["answer"] == "2") for r in rollouts)
    assert (run / "checkpoint" / "state.pt").is_file() and (run / "curves.png").stat().st_size > 1000


def test_interrupted_run_resumes_to_the_same_metrics(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    straight = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "a")))

    real_step, calls = t3rl.grpo_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)
    monkeypatch.setattr(t3rl, "grpo_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "b")))
    monkeypatch.setattr(t3rl, "grpo_step", real_step)
    resumed = t3rl.train(t3rl.parse_config(["--resume", str(tmp_path / "b" / "run")]))

    assert without_timing(rows(resumed, "metrics.jsonl")) == without_timing(rows(straight, "metrics.jsonl"))
    assert rows(resumed, "rollouts.jsonl") == rows(straight, "rollouts.jsonl")
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_replay_recomputes_labels_per_omega(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2)))
    capsys.readouterr()
    t3rl.main(["--replay", str(run), "--omega", "1", "5", "inf"])
    table = capsys.readouterr().out.splitlines()
    assert "4 rollout groups" in table[0] and [line.split()[0] for line in table[2:]] == ["1", "5", "inf"]
    assert table[2].split()[3] == "0"  # omega = 1 is the majority vote itself: no flips


def test_two_processes_train_like_one(tiny_dir, tmp_path):
    """accelerate launch --num_processes 2 sees the same questions and reaches the same metrics and weights."""
    write_bench(tmp_path / "data", QUESTIONS)
    script = tmp_path / "run_t3rl.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport t3rl, test_loop\n"
                      "t3rl.extract_answer = test_loop.fake_answer\nt3rl.main()\n")
    env = {**os.environ, "T3RL_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    argv = tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, eval_samples=0, verify=False)
    runs = {}
    for procs in (1, 2):
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", str(procs),
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script),
               *[a for a in argv if not a.startswith("--run-name")], f"--run-name=p{procs}"]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[procs] = tmp_path / "out" / f"p{procs}"
    one, two = (without_timing(rows(runs[p], "metrics.jsonl")) for p in (1, 2))
    # per-process GRPO statistics are averaged over processes, so only the monitors must agree exactly
    strip = lambda ms: [{k: v for k, v in m.items() if not k.startswith("grpo/")} for m in ms]  # noqa: E731
    assert strip(one) == strip(two)
    key = lambda r: (r["step"], r["id"], r["index"])  # noqa: E731
    assert sorted(rows(runs[1], "rollouts.jsonl"), key=key) == sorted(rows(runs[2], "rollouts.jsonl"), key=key)
    w1, w2 = final_weights(runs[1]), final_weights(runs[2])
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-6) for k in w1)
