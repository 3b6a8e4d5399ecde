"""runs.py: the run folder, checkpoints and their repair, trackers, a launched run's shared name."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import t3rl
import verifier
from config import parse_config
from machinery import model as models
from machinery import runs
from helpers import (
    QUESTIONS,
    ROOT,
    copy_run,
    final_weights,
    interrupted_at_update,
    rows,
    tensorboard_scalars,
    tiny_argv,
    without_timing,
    write_bench,
)


def test_run_folder_has_config_metrics_rollouts_checkpoint_and_plot(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    pools = []

    class RecordedPool(t3rl.SandboxPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)
    monkeypatch.setattr(t3rl, "SandboxPool", RecordedPool)
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2)))
    assert [pool.timeout for pool in pools] == [verifier.SANDBOX_TIMEOUT]
    assert json.loads((run / "config.json").read_text())["n_votes"] == 4
    metrics = rows(run, "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["eval", "train", "train", "eval"]
    assert {"label_accuracy", "majority_label_accuracy", "verified_ratio", "status", "grpo/loss"} <= set(metrics[1])
    rollouts = rows(run, "rollouts.jsonl")
    assert len(rollouts) == 2 * 2 * 4 and sum(r["kept"] for r in rollouts) == 2 * 2 * 2
    assert {r["status"] for r in rollouts} <= {"verified", "mismatch", "skipped"}  # the preset verifies lazily
    assert all((r["status"] == "verified") == (r["answer"] == "2") for r in rollouts if r["status"] != "skipped")
    assert (run / "checkpoint" / "model" / "model.safetensors").is_file() and (run / "curves.png").stat().st_size > 1000


def train_until_interrupted(monkeypatch, argv, update: int):
    """Run t3rl.train on argv and press Ctrl-C in the middle of its update-th GRPO update."""
    with interrupted_at_update(monkeypatch, update), pytest.raises(KeyboardInterrupt):
        t3rl.train(parse_config(argv))


@pytest.mark.parametrize("update", [4, 1])
def test_report_to_tensorboard_logs_every_row_and_a_resumed_run_continues_it(tiny_dir, tmp_path, monkeypatch, patched,
                                                                             update):
    """Step 3 (index 2) is logged after the checkpoint at 2, then step 4 dies: the resumed run logs step 3 again.
    Dying in step 1, before any checkpoint, the resumed run logs the first evaluation again."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    train_until_interrupted(monkeypatch, tiny_argv(tiny_dir, tmp_path / "out", eval_samples=0, report_to="tensorboard"),
                            update=update)
    run = tmp_path / "out" / "run"
    logged = tensorboard_scalars(run / "t3rl")
    assert (max(step for step, _ in logged["label_accuracy"]) == 3 if update == 4
            else [step for step, _ in logged["greedy@1"]] == [0])
    t3rl.train(parse_config(["--resume", str(run)]))

    scalars = tensorboard_scalars(run / "t3rl")
    expected = {}
    for row in rows(run, "metrics.jsonl"):
        for key, value in runs.tracker_row(row).items():
            expected.setdefault(key, []).append((row["step"] + (row["kind"] == "train"), value))
    assert "status/verified" in expected and "greedy@1" in expected and "grpo/loss" in expected
    assert scalars.keys() == expected.keys()
    for key, points in expected.items():  # every row once, at its step, with its value (to float32 precision)
        assert [step for step, _ in scalars[key]] == [step for step, _ in points], key
        assert [value for _, value in scalars[key]] == pytest.approx([value for _, value in points], rel=1e-6), key
    hparams = [path.read_text() for path in (run / "t3rl").glob("*/hparams.yml")]  # one per start
    assert len(hparams) == 2 and all("n_votes: 4" in h and "report_to: tensorboard" in h for h in hparams)


def resume(run: Path, finished_run: Path, monkeypatch) -> Path:
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    return t3rl.train(parse_config(["--resume", str(run)]))


def assert_same_run(run: Path, reference: Path):
    assert without_timing(rows(run, "metrics.jsonl")) == without_timing(rows(reference, "metrics.jsonl"))
    assert rows(run, "rollouts.jsonl") == rows(reference, "rollouts.jsonl")
    a, b = final_weights(run), final_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", final=False)
    state = (run / "checkpoint" / "state.pt").read_bytes()
    (run / "checkpoint" / "state.pt").write_bytes(state[:len(state) // 2])  # a disk that filled up
    resume(run, finished_run, monkeypatch)
    err = capsys.readouterr().err
    assert "checkpoint/state.pt is damaged" in err and "moved it to checkpoint.damaged/" in err
    assert "resuming after step 2" in err
    assert_same_run(run, finished_run)  # steps 3 and 4 computed again, to the same numbers and weights
    assert (run / "checkpoint.damaged" / "model").is_dir()
    # the resumed run finished: its final model kept, no optimizer state, no fallback
    assert (run / "checkpoint" / "model").is_dir() and not (run / "checkpoint" / "state.pt").exists()
    assert not (run / "checkpoint.old").exists()


def test_a_finished_run_keeps_its_final_model_and_drops_the_optimizer_state(tiny_dir, tmp_path, monkeypatch,
                                                                           patched):
    """A finished run cannot resume: it keeps its last checkpoint's model, a --model folder, and drops the
    AdamW state and the fallback checkpoint, which only a resume reads."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    before, finish = [], runs.finish_run
    monkeypatch.setattr(runs, "finish_run", lambda run_dir: (
        before.append(torch.load(run_dir / "checkpoint" / "state.pt", weights_only=False)["step"]),
        before.append(torch.load(run_dir / "checkpoint.old" / "state.pt", weights_only=False)["step"]),
        finish(run_dir)))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=4, save_every=2)))
    assert before == [4, 2]  # the step-2 checkpoint was the fallback until the run finished
    assert not (run / "checkpoint.old").exists() and not (run / "checkpoint" / "state.pt").exists()
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["model"]
    final = models.load_model(str(run / "checkpoint" / "model"))[0]
    assert torch.equal(final.model.embed_tokens.weight, final_weights(run)["model.embed_tokens.weight"])


def test_the_final_evaluation_runs_without_the_optimizer_state(tiny_dir, tmp_path, monkeypatch, patched):
    """The last checkpoint holds AdamW's moments, so the final evaluation runs without them (they were
    the main job's peak memory); the evaluations before it still have them."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    held, log_evaluation = [], t3rl.log_evaluation

    def recording(learner, records, step, log, coverage, final=False):
        moments = [s for s in learner.optimizer.state.values() if "exp_avg" in s]
        grads = [p.grad for p in learner.policy.parameters() if p.grad is not None]
        held.append((step, final, len(moments), len(grads)))
        return log_evaluation(learner, records, step, log, coverage, final=final)

    monkeypatch.setattr(t3rl, "log_evaluation", recording)
    t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, eval_every=1)))
    assert [(step, final) for step, final, _, _ in held] == [(0, False), (1, False), (2, True)]
    assert held[1][2] > 0  # mid-run: AdamW's moments are there
    assert held[2][2:] == (0, 0)  # final: neither moments nor gradients


def test_resume_maps_the_optimizer_state_from_its_file_instead_of_reading_it_whole(finished_run):
    """state.pt is loaded memory-mapped: on every process its pages come in as the optimizer takes
    them, rather than the whole file (18.5 GB at the paper's size) at once."""
    checkpoint, state = runs.load_checkpoint(finished_run)
    moments = [t for s in state["optimizer"]["state"].values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.numel() > 1]
    assert moments and {mapped_file(t.data_ptr()) for t in moments} == {str(checkpoint / "state.pt")}


def mapped_file(address: int) -> str | None:
    """The file this process has mapped at `address` (/proc/self/maps), or None (anonymous memory)."""
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return rest[4] if len(rest) > 4 else None
    return None


def test_truncated_weights_are_a_damaged_checkpoint(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    assert runs.checkpoint_damage(run / "checkpoint") is None
    weights = run / "checkpoint" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert runs.checkpoint_damage(run / "checkpoint") == "checkpoint/model/model.safetensors is truncated"


def test_a_weights_file_whose_header_length_is_garbage_is_a_damaged_checkpoint(finished_run, tmp_path):
    """A damaged length (bit rot: far past the file's end) is damage, not an attempt to read 2^63 bytes."""
    run = copy_run(finished_run, tmp_path / "run")
    weights = run / "checkpoint" / "model" / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])
    assert runs.checkpoint_damage(run / "checkpoint") == "checkpoint/model/model.safetensors has a damaged header"


def test_resume_drops_torn_last_lines_and_a_stale_checkpoint_old(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", upto=2)
    for name, torn in (("metrics.jsonl", '{"kind": "train", "st'), ("rollouts.jsonl", '{"step": 2, "id": "q')):
        with open(run / name, "a") as fh:
            fh.write(torn)  # a kill in the middle of an append
    for leftover in ("checkpoint.old", "checkpoint.tmp"):
        (run / leftover / "model").mkdir(parents=True)
        (run / leftover / "model" / "junk.bin").write_bytes(b"0" * 100)
    monkeypatch.setattr(runs, "finish_run", lambda run_dir: None)  # keep the one that replaced it
    resume(run, finished_run, monkeypatch)
    err = capsys.readouterr().err
    assert "metrics.jsonl:" in err and "rollouts.jsonl:" in err and err.count("dropped a half-written last line") == 2
    assert_same_run(run, finished_run)
    assert not (run / "checkpoint.tmp").exists()
    assert torch.load(run / "checkpoint.old" / "state.pt", weights_only=False)["step"] == 2


@pytest.mark.parametrize("writer", ["torch.save", "safetensors"])
def test_a_full_disk_at_a_checkpoint_ends_the_run_in_one_line_and_it_resumes(finished_run, tmp_path, monkeypatch,
                                                                             patched, writer):
    """torch.save on a full disk raises RuntimeError mid-file, safetensors its SafetensorError: the run ends in
    one line naming the run and the resume, the half-written checkpoint.tmp is removed (its space back), and the
    last checkpoint stays whole."""
    import transformers.modeling_utils
    from safetensors import SafetensorError
    run = copy_run(finished_run, tmp_path / "out" / "run", upto=2)
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    save = torch.save if writer == "torch.save" else transformers.modeling_utils.safe_save_file

    def full_disk(obj, path, **options):
        save(obj, path, **options)  # the file exists, as a write cut off by the disk leaves it
        if writer == "torch.save":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3951805312 vs 3951805204")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with monkeypatch.context() as disk:
        if writer == "torch.save":
            disk.setattr(torch, "save", full_disk)
        else:
            disk.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
        disk.setattr(runs.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100 << 30, 100 << 30, 0))
        with pytest.raises(SystemExit) as stop:
            t3rl.main(["--resume", str(run)])
    message = str(stop.value.code)
    assert message == (f"error: {run}: cannot write the checkpoint of step 4 (the disk is full); free space there "
                       f"and continue with: python t3rl.py --resume {run}")
    assert not (run / "checkpoint.tmp").exists() and runs.checkpoint_damage(run / "checkpoint") is None
    assert torch.load(run / "checkpoint" / "state.pt", weights_only=False)["step"] == 2
    resume(run, finished_run, monkeypatch)
    assert_same_run(run, finished_run)


def test_deleted_metrics_do_not_make_the_final_eval_the_before(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", final=False)
    (run / "metrics.jsonl").unlink()
    resume(run, finished_run, monkeypatch)
    table = capsys.readouterr().out
    assert "no step-0 evaluation" in table and "'before' is unknown" in table
    pass_at_1 = [line.split() for line in table.splitlines() if line.startswith("greedy@1")]
    assert pass_at_1 and pass_at_1[0][1] == "-"
    assert [r.get("final") for r in rows(run, "metrics.jsonl")] == [True]


def test_resume_lists_the_bookkeeping_options_it_may_change(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run", final=False)
    cfg = parse_config(["--resume", str(run), "--save-every", "1", "--lr", "0.001"])  # lr as saved: no change
    assert (cfg.save_every, cfg.lr, cfg.n_votes) == (1, 1e-3, 4)
    assert "[t3rl] --resume: --save-every 2 -> 1" in capsys.readouterr().err


LAUNCHED = """import sys
sys.path.insert(0, {root!r})
import time
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState
import config
import dataclasses
from config import parse_config
import t3rl
import verifier
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
rank = int(__import__("os").environ["RANK"])
time.strftime = lambda fmt: f"2026120{{rank}}-101500"  # each process's clock, its own run name
in_buckets, adamw_step = [], torch.optim.AdamW.step


def step(self, *args, **kwargs):  # are the gradients views into DDP's buckets, or copies of their own?
    grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
    in_buckets.append(len({{g.untyped_storage().data_ptr() for g in grads}}) < len(grads))
    return adamw_step(self, *args, **kwargs)


torch.optim.AdamW.step = step
run = t3rl.train(parse_config(sys.argv[1:]))
group = dist.distributed_c10d._get_default_group()
timeout = group._get_backend(torch.device("cpu")).options._timeout
print(f"process {{dist.get_rank()}} of {{dist.get_world_size()}}: run {{run}}, timeout "
      f"{{timeout.total_seconds():.0f}} s, mixed precision {{AcceleratorState().mixed_precision}}, "
      f"gradients in DDP's buckets {{in_buckets}}")
"""


@pytest.mark.slow
def test_every_process_of_a_launched_run_shares_its_name_timeout_and_precision(tiny_dir, tmp_path):
    """torchrun, 2 processes, an accelerate config asking for fp16: every process takes the main
    one's run folder, the process group waits out a long checkpoint save, accelerate's mixed
    precision stays off, each process's sandbox takes its share of the cores, and the gradients
    are views into DDP's all-reduce buckets, not a second copy (gradient_as_bucket_view)."""
    write_bench(tmp_path / "data", QUESTIONS)
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "T3RL_DATA_DIR": str(tmp_path / "data"),
           "ACCELERATE_MIXED_PRECISION": "fp16"}
    argv = tiny_argv(tiny_dir, tmp_path / "out", run_name="", max_steps=1, eval_samples=0,
                     verifier_model="none")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script), *argv],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "out" / "demo-ttrl-20261200-101500"
    seen = sorted(re.findall(r"process (\d) of (\d): (.*)", done.stdout))
    timeout = runs.PROCESS_GROUP_TIMEOUT.total_seconds()
    assert seen == [(str(rank), "2", f"run {run}, timeout {timeout:.0f} s, mixed precision no, "
                                     f"gradients in DDP's buckets [True]") for rank in range(2)]
    assert [p.name for p in (tmp_path / "out").iterdir()] == [run.name]
    assert [r["kind"] for r in rows(run, "metrics.jsonl")] == ["eval", "train", "eval"]
    workers = max(1, len(os.sched_getaffinity(0)) // 2)
    share = f"{workers} worker{'s' if workers > 1 else ''} per process"
    assert f"[t3rl] sandbox, {share}:" in done.stderr.splitlines()
    assert "[t3rl] accelerate's config asks for mixed precision fp16;" in done.stderr


def test_an_optimizer_state_of_another_shape_stops_the_resume_in_one_line():
    """A checkpoint whose optimizer state has other parameter groups (written by another t3rl version) cannot be
    loaded into this run's optimizer: one line, not a traceback."""
    model = torch.nn.Linear(2, 2)
    theirs = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}])
    mine = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(mine, lambda step: 1.0)
    state = {"optimizer": theirs.state_dict(), "scheduler": scheduler.state_dict(), "step": 1, "rng": None}
    with pytest.raises(runs.RunDirError, match=r"optimizer state does not fit .* start a new run$"):
        runs.restore_state(state, mine.load_state_dict, scheduler)



def test_runs_started_in_one_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # the first process claims
    monkeypatch.setattr(runs.time, "strftime", lambda fmt: "20260101-000000")
    cfg = parse_config(["--preset", "cpu", "--out-dir", str(tmp_path)])
    names = [runs.free_run_name(cfg) for _ in range(3)]
    assert names == ["demo-t3rl-w5-20260101-000000", "demo-t3rl-w5-20260101-000000-2",
                     "demo-t3rl-w5-20260101-000000-3"]
    assert all((tmp_path / name).is_dir() for name in names)


def test_an_out_dir_that_cannot_be_read_ends_in_one_line(tmp_path, monkeypatch):
    """Path.exists raises on a folder the user may not enter (EACCES); root enters any, so it is faked."""
    def refused(path, **options):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(runs.Path, "exists", refused)
    cfg = parse_config(["--preset", "cpu", "--out-dir", str(tmp_path), "--run-name", "run"])
    with pytest.raises(runs.RunDirError, match="cannot be read \\(Permission denied\\); pass a --out-dir"):
        runs.open_run_dir(cfg)


def test_ctrl_c_before_the_run_folder_exists_offers_no_resume(tmp_path, monkeypatch):
    def interrupted(cfg):
        raise KeyboardInterrupt
    monkeypatch.setattr(t3rl, "check_models", interrupted)
    with pytest.raises(SystemExit) as stop:
        t3rl.main(["--preset", "cpu", "--out-dir", str(tmp_path)])
    assert stop.value.code == "interrupted"


def test_an_out_dir_that_is_a_dangling_link_ends_in_one_line(tmp_path, monkeypatch):
    """A scratch disk that is not mounted: the name is found at once, and the folder's creation says why not."""
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "runs").symlink_to(tmp_path / "not-mounted")
    cfg = parse_config(["--preset", "cpu", "--out-dir", str(tmp_path / "runs")])
    cfg.run_name = runs.free_run_name(cfg)
    with pytest.raises(runs.RunDirError, match=r"--out-dir .*/runs: cannot write the run folder .*; pass a writable"):
        runs.open_run_dir(cfg)


def test_a_sigterm_after_one_that_was_swallowed_still_interrupts(monkeypatch):
    """If the first KeyboardInterrupt is lost (raised inside a __del__, which Python only reports), SIGTERM must
    still stop the run later: only a repeat soon after the first is taken as the launcher's."""
    import signal
    import time
    monkeypatch.setattr(runs, "REPEATED_SIGTERM_S", 0.05)
    with runs.sigterm_as_ctrl_c():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt:
            pass  # swallowed
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_second_sigterm_does_not_cut_the_cleanup_the_first_started():
    import signal
    cleaned, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with runs.sigterm_as_ctrl_c():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a launcher's second signal, during the cleanup
                cleaned.append("trackers closed")
    assert cleaned == ["trackers closed"] and signal.getsignal(signal.SIGTERM) == before


MAIN_FAILS = """import errno, os, sys, time
sys.path.insert(0, {root!r})
import torch
import t3rl
if os.environ["RANK"] == "0" and {full_disk!r}:  # only the main process writes checkpoints
    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    torch.save = full_disk
try:
    t3rl.main()
except SystemExit as end:  # its line in one write (the two would interleave), then a wait: torchrun
    os.write(2, f"{{end.code}}\\n".encode())  # stops the rest once one process ends
    time.sleep(10)
    os._exit(1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("full_disk", [False, True])
def test_an_error_only_the_main_process_meets_ends_every_process_in_its_line(tiny_dir, tmp_path, full_disk):
    """torchrun, 2 processes: the main one opens the run folder (here an unwritable --out-dir) and writes
    the checkpoints (here on a full disk); its error reaches the other process, which ends with the same
    line instead of the process group's error at its next collective. Each process waits after its line,
    so that the first to end does not have torchrun stop the other before it wrote its own."""
    out_dir = tmp_path / ("runs" if full_disk else "a-file")
    if not full_disk:
        out_dir.write_text("")
    script = tmp_path / "launched.py"
    script.write_text(MAIN_FAILS.format(root=str(ROOT), full_disk=full_disk))
    argv = tiny_argv(tiny_dir, out_dir, verifier_model="none", max_steps=1, save_every=1, eval_samples=0)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *argv]
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert done.returncode != 0 and len(lines) == 2 and lines[0] == lines[1], done.stderr[-3000:]
    expected = "cannot write the checkpoint of step 1" if full_disk else "cannot write the run folder"
    assert expected in lines[0]
    assert "[rank1]" not in done.stderr and "Connection closed" not in done.stderr
