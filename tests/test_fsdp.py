"""--parallel fsdp (extensions/fsdp.py): real torchrun processes on CPUs (gloo) train as DDP's do on
the same seeds, with a process that has no question, with processes that hold different numbers of
micro-batches, and from a checkpoint; the checkpoint is a --model folder as DDP's is."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from config import Config, OptionError, parse_config
from grpo import Rollouts, plan_batches
from machinery import model as models
from helpers import (QUESTIONS, ROOT, copy_run, final_weights, make_tiny_model, rows, tiny_argv,
                     without_timing, write_bench)

LAUNCHED = """import sys
sys.path.insert(0, {root!r})
from pathlib import Path
import torch.distributed as dist
import dataclasses
import t3rl
import verifier
from machinery import runs
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
runs.finish_run = lambda run_dir: None  # a test cuts the run back to it
t3rl.build_verifier = lambda cfg, device, **kw: (lambda prompts: ["```python\\nprint(1 + 1)\\n```" for _ in prompts])
real_step, seen = t3rl.grpo_step, set()


def recorded(model, *args, **kwargs):  # what the update trains: sharded or not, and how much is here
    sharded = any(hasattr(p, "to_local") for p in model.parameters())  # DTensor shards
    local = sum((p.to_local() if sharded else p).numel() for p in model.parameters())
    seen.add(f"sharded {{sharded}}, {{local}} of {{sum(p.numel() for p in model.parameters())}}")
    return real_step(model, *args, **kwargs)


t3rl.grpo_step = recorded
t3rl.main()
# a file per process: the processes' stdout lines may interleave in the one pipe they share
Path(f"done-{{dist.get_rank()}}.txt").write_text(
    f"process {{dist.get_rank()}} of {{dist.get_world_size()}} done: {{'; '.join(sorted(seen))}}")
"""


def sharp_dir(tmp_path_factory, tokenizer, tied: bool):
    """The tiny model with peaked next-token distributions, its head tied to the embedding (the
    final norm scaled 5x: more would leave every rollout alike) or untied (the head scaled 20x):
    DDP's and FSDP's updates differ by float rounding (summation order), which cannot flip a token
    drawn in float32 from such distributions. Hidden size 32: a checkpoint of the 152k-token
    embedding and its AdamW state is 70 MB."""
    folder = tmp_path_factory.mktemp(f"sharp-{'tied' if tied else 'untied'}")
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied, hidden_size=32,
                            intermediate_size=64)
    with torch.no_grad():
        (model.model.norm.weight if tied else model.lm_head.weight).mul_(5.0 if tied else 20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def launch(model_dir, tmp_path, processes: int, out: str, *argv, **options):
    """A run of `processes` torchrun processes; its folder and each process's line (its rank, the
    world size, what its update trained)."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(root=str(ROOT)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={processes}", str(script),
           *(argv or tiny_argv(model_dir, tmp_path / out, sample_dtype="float32", **options))]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [re.fullmatch(r"process (\d+) of (\d+) done: (.*)", path.read_text()).groups()
             for path in sorted(tmp_path.glob("done-*.txt"))]
    for path in tmp_path.glob("done-*.txt"):
        path.unlink()  # the next launch in this folder writes its own
    assert sorted((rank, world) for rank, world, _ in lines) == \
        [(str(rank), str(processes)) for rank in range(processes)]
    return tmp_path / out / "run", {int(rank): trained for rank, _, trained in lines}


def assert_sharded(trained: dict, processes: int):
    """Every process trained a shard of the policy, and the shards add up to it."""
    parts = [re.fullmatch(r"sharded True, (\d+) of (\d+)", trained[rank]) for rank in range(processes)]
    assert all(parts), trained
    local, total = [int(p[1]) for p in parts], int(parts[0][2])
    assert sum(local) == total and max(local) < total


def assert_trained_alike(ddp, fsdp):
    """Same rollouts and metrics, the update's statistics and the weights to float tolerance: the
    two sum the processes' gradients in different orders (an all-reduce against a reduce-scatter per
    micro-batch), and AdamW moves a weight by about lr whatever its gradient's size, so a gradient at
    rounding level shows as a small fraction of lr (1e-3 here)."""
    key = lambda r: (r["step"], r["id"], r["index"])  # noqa: E731
    assert sorted(rows(ddp, "rollouts.jsonl"), key=key) == sorted(rows(fsdp, "rollouts.jsonl"), key=key)
    a, b = without_timing(rows(ddp, "metrics.jsonl")), without_timing(rows(fsdp, "metrics.jsonl"))
    assert all(r["grpo/grad_norm"] > 0 for r in b if r["kind"] == "train")  # every update moves the weights
    plain = lambda r: {k: v for k, v in r.items() if not k.startswith("grpo/")}  # noqa: E731
    assert [plain(r) for r in a] == [plain(r) for r in b]
    for ra, rb in zip(a, b):
        assert {k: pytest.approx(v, rel=1e-3, abs=1e-6) for k, v in ra.items() if k.startswith("grpo/")} == \
            {k: v for k, v in rb.items() if k.startswith("grpo/")}
    w1, w2 = final_weights(ddp), final_weights(fsdp)
    assert w1.keys() == w2.keys()
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-5) for k in w1)


@pytest.mark.slow
def test_three_processes_under_fsdp_train_as_ddp_with_a_process_without_questions(
        tmp_path_factory, tokenizer, tmp_path, monkeypatch, patched):
    """Steps of two questions on three processes: the third samples nothing and holds no rollout, and
    still joins every all-gather and reduce-scatter; two optimizer steps per step, the second
    against the sampling policy's log-probs (ratio != 1). The untied head is its own parameter."""
    model_dir = sharp_dir(tmp_path_factory, tokenizer, tied=False)
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    options = dict(max_steps=2, eval_samples=0, mini_batch_questions=1, seed=1)  # seed 0 keeps tied pairs
    ddp, plain = launch(model_dir, tmp_path, 3, "ddp", **options)
    fsdp, sharded = launch(model_dir, tmp_path, 3, "fsdp", parallel="fsdp", **options)
    assert set(plain.values()) == {f"sharded False, {plain[0].split()[-1]} of {plain[0].split()[-1]}"}
    assert_sharded(sharded, 3)
    assert_trained_alike(ddp, fsdp)
    train_rows = [r for r in rows(fsdp, "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["questions"], r["grpo/optimizer_steps"]) for r in train_rows] == [(2, 2), (2, 2)]
    assert any(abs(r["grpo/ratio"] - 1) > 1e-4 for r in train_rows)
    shutil.rmtree(tmp_path / "ddp"), shutil.rmtree(tmp_path / "fsdp")  # 140 MB of checkpoints


@pytest.mark.slow
def test_two_processes_under_fsdp_train_as_ddp_resume_exactly_and_save_a_model_folder(
        tmp_path_factory, tokenizer, tmp_path, monkeypatch, patched):
    """Three kept rollouts a question, one a micro-batch: process 0 runs two micro-batches of each
    mini-batch, process 1 one and a weight-0 one (lockstep); the head is tied to the embedding. The
    run resumed from its step-1 checkpoint ends with the same weights, bit for bit, and its
    checkpoint is a --model folder laid out as DDP's."""
    model_dir = sharp_dir(tmp_path_factory, tokenizer, tied=True)
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    options = dict(max_steps=2, eval_samples=0, n_train=3, micro_batch_rollouts=1)
    ddp, _ = launch(model_dir, tmp_path, 2, "ddp", **options)
    fsdp, sharded = launch(model_dir, tmp_path, 2, "fsdp", parallel="fsdp", save_every=1, **options)
    assert_sharded(sharded, 2)
    assert_trained_alike(ddp, fsdp)

    cut = copy_run(fsdp, tmp_path / "cut" / "run", upto=1)  # what a kill after the step-1 checkpoint leaves
    resumed, sharded = launch(model_dir, tmp_path, 2, "cut", "--resume", str(cut))
    assert_sharded(sharded, 2)
    assert [r["step"] for r in rows(resumed, "metrics.jsonl") if r["kind"] == "train"] == [0, 1]
    assert rows(resumed, "rollouts.jsonl") == rows(fsdp, "rollouts.jsonl")
    a, b = final_weights(fsdp), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    folder = fsdp / "checkpoint" / "model"
    assert sorted(p.name for p in folder.iterdir()) == \
        sorted(p.name for p in (ddp / "checkpoint" / "model").iterdir())
    loaded = models.load_model(str(folder))[0].state_dict()  # what --model loads
    assert "lm_head.weight" not in a and loaded["lm_head.weight"] is not None
    assert all(torch.equal(loaded[k], a[k]) for k in a) and a["model.norm.weight"].dtype == torch.float32
    for out in ("ddp", "fsdp", "cut"):  # 350 MB of checkpoints
        shutil.rmtree(tmp_path / out)


def plan_counts(batch, settings, processes, lockstep):
    """Each process's (micro-batches, their weights) per mini-batch."""
    advantages = torch.tensor([1.0, -1.0, 0.5] * (len(batch.rewards) // 3))
    plans = [plan_batches(batch, advantages, settings, type("A", (), {"process_index": rank, "num_processes": processes}),
                          lockstep=lockstep) for rank in range(processes)]
    return [[[b.weight for b in mini] for mini in p] for p in plans]


def test_lockstep_gives_every_process_as_many_micro_batches_at_the_same_weights():
    batch = Rollouts([[1, 2]] * 6, [[3], [4, 5], [6], [7, 8, 9], [1], [2]], [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    settings = Config(n_train=3, mini_batch_questions=1, micro_batch_rollouts=1, loss_agg="dapo")
    free, lockstep = (plan_counts(batch, settings, 2, lock) for lock in (False, True))
    assert [[len(mini) for mini in p] for p in free] == [[2, 2], [1, 1]]
    assert [[len(mini) for mini in p] for p in lockstep] == [[2, 2], [2, 2]]
    assert lockstep[0] == free[0] and [mini[-1] for mini in lockstep[1]] == [0.0, 0.0]
    assert [sum(p[k][i] for p in lockstep for i in range(len(p[k]))) for k in range(2)] == \
        [sum(p[k][i] for p in free for i in range(len(p[k]))) for k in range(2)]


def test_parallel_fsdp_is_asked_on_the_command_line_or_by_accelerates_config(tiny_dir, tmp_path, monkeypatch):
    argv = tiny_argv(tiny_dir, tmp_path)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(OptionError, match=r"^--parallel fsdp: shards the policy over processes, and this is one"):
        parse_config([*argv, "--parallel", "fsdp"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse_config(argv).parallel == "ddp" and parse_config([*argv, "--parallel", "fsdp"]).parallel == "fsdp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch passes for an FSDP config
    assert parse_config(argv).parallel == "fsdp"
    with pytest.raises(OptionError, match=r"^--parallel ddp: accelerate's config asks for FSDP"):
        parse_config([*argv, "--parallel", "ddp"])


def test_the_gpu_memory_check_counts_the_shards(monkeypatch):
    """Qwen3-4B (4,022,468,096 parameters) beside both engines at 0.3 of an 80 GiB GPU: DDP's 16 bytes a
    parameter do not fit, FSDP's shards on 8 processes do."""
    import types

    from extensions import engine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=80 * 2**30))
    policy = types.SimpleNamespace(parameters=lambda: [torch.empty(1).expand(4_022_468_096)])
    lines = []
    accelerator = types.SimpleNamespace(device=torch.device("cuda"), num_processes=8, print=lines.append)
    with pytest.raises(OptionError, match=r"trainer 59.9 GiB, -27.9 GiB left: does not fit"):
        engine.check_gpu_memory(policy, True, "ddp", accelerator)
    engine.check_gpu_memory(policy, True, "fsdp", accelerator)
    assert lines == ["[t3rl] GPU memory 80.0 GiB: policy's engine 24.0 GiB (asleep during the update), "
                     "verifier's engine 24.0 GiB, trainer 7.5 GiB, 24.5 GiB left"]
