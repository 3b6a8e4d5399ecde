"""The run folder: config.json, metrics.jsonl, rollouts.jsonl, evaluations.jsonl, checkpoint/ and,
until the run finishes, the one before it, checkpoint.old/.

Every file is replaced atomically (written aside, then renamed; files.py) or appended to, so a kill
at any moment leaves a folder that --resume can continue: resume drops a half-written last JSONL
line and the rows written after the checkpoint, sets a damaged newest checkpoint aside
(checkpoint.damaged/) and falls back to checkpoint.old/. Experiment trackers (--report-to, through
accelerate) get every metrics row as well, from the main process; their x axis is updates done: the
evaluation before training at 0, train row `step` s at s + 1.
"""
import json
import os
import random
import shutil
import sys
import uuid
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch

from machinery import fsdp
from machinery.files import drop_torn_tail, keep_jsonl, read_jsonl_rows, write_atomically
from machinery.sampler_cpu import release_freed_memory
from machinery.update import bf16_supported

# The process group's timeout for every collective (NCCL's default: 10 minutes): the others wait at
# a barrier while the main process writes a checkpoint, 18.5 GB for the paper's 1.5B policy and its
# AdamW state, longer than that on slow storage. A hung collective shows after this long.
PROCESS_GROUP_TIMEOUT = timedelta(hours=1)


class RunDirError(RuntimeError):
    """A run folder cannot be used as asked; the message names the folder or file and what to do."""


def run_dir_of(cfg) -> Path:
    return Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / cfg.run_name


def run_started(run_dir: Path) -> bool:
    """Whether a folder holds a run's results (a folder with only config.json is a start that never
    ran)."""
    return any((run_dir / name).exists()
               for name in ("metrics.jsonl", "rollouts.jsonl", "checkpoint", "checkpoint.old"))


def open_run_dir(cfg) -> Path:
    """Create (or, with --resume, check) the run folder before any model loads: an unwritable
    --out-dir, a reused name or a finished run stop here, in one line."""
    run_dir = run_dir_of(cfg)
    if cfg.resume:
        for name in ("metrics.jsonl", "rollouts.jsonl", "evaluations.jsonl"):
            drop_torn_tail(run_dir / name)
        finished = [r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r.get("final")]
        if finished:
            raise RunDirError(f"--resume {run_dir}: the run is finished (final evaluation at step "
                              f"{finished[-1]['step']} in metrics.jsonl); read it with --replay "
                              f"{run_dir}, or start a new run with another --run-name")
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        # --eval-every / --save-every changed
        if {**asdict(cfg), "resume": saved.get("resume", "")} != saved:
            write_atomically(run_dir / "config.json",
                             json.dumps({**asdict(cfg), "resume": ""}, indent=2))
        return run_dir
    if run_started(run_dir):
        raise RunDirError(f"run folder {run_dir} already holds a run; continue it with --resume "
                          f"{run_dir}, or pick another --run-name (or --out-dir)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(run_dir / "config.json", json.dumps(asdict(cfg), indent=2))
    except OSError as err:
        raise RunDirError(f"--out-dir {cfg.out_dir}: cannot write the run folder {run_dir} "
                          f"({err.strerror or err}); pass a writable --out-dir") from None
    return run_dir


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler,
                    accelerator):
    """checkpoint/ = model and tokenizer (save_pretrained, a loadable --model folder) + optimizer,
    scheduler, RNG states and step. Written as checkpoint.tmp/, then swapped in; the one it replaces
    stays as checkpoint.old/, the fallback if the new one is ever found damaged. The other processes
    wait for it under PROCESS_GROUP_TIMEOUT. Under --parallel fsdp every process first takes part
    in gathering the full weights and optimizer state, so the folder is the one DDP writes."""
    trained = fsdp.trained_module(policy)
    weights, optimizer_state = (fsdp.full_state(trained, optimizer) if fsdp.is_sharded(trained)
                                else (None, optimizer.state_dict()))
    if accelerator.is_main_process:
        tmp, final, old = (run_dir / "checkpoint.tmp", run_dir / "checkpoint",
                           run_dir / "checkpoint.old")
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(trained).save_pretrained(tmp / "model", state_dict=weights)
        tokenizer.save_pretrained(tmp / "model")
        torch.save({"step": step, "optimizer": optimizer_state,
                    "scheduler": scheduler.state_dict(),
                    "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}},
                   tmp / "state.pt")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def finish_run(run_dir: Path) -> None:
    """A finished run cannot resume: once checkpoint/ is whole, keep its final model (checkpoint/model,
    a --model folder) and drop what only a resume reads, the optimizer's state (state.pt, twice the
    weights under AdamW) and the fallback checkpoint.old/. Call on the main process only."""
    if (run_dir / "checkpoint").is_dir() and checkpoint_damage(run_dir / "checkpoint") is None:
        shutil.rmtree(run_dir / "checkpoint.old", ignore_errors=True)
        (run_dir / "checkpoint" / "state.pt").unlink()


def drop_optimizer_state(optimizer) -> None:
    """Free the optimizer's state and gradients once the last checkpoint holds them: the final
    evaluation needs neither, and AdamW's two moments are twice the weights (the run's peak held
    them beside the samplers). A resume reads them from state.pt."""
    optimizer.zero_grad(set_to_none=True)
    getattr(optimizer, "optimizer", optimizer).state.clear()  # accelerate wraps the torch optimizer
    release_freed_memory()


def checkpoint_damage(checkpoint: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (a missing file, truncated weights), or None.
    Cheap: reads the safetensors headers, not the weights."""
    model_dir = checkpoint / "model"
    weights = sorted(model_dir.glob("*.safetensors"))
    for needed in (checkpoint / "state.pt", model_dir / "config.json",
                   *(weights or [model_dir / "model.safetensors"])):
        if not needed.is_file():
            return f"{needed.relative_to(checkpoint.parent)} is missing"
    for path in weights:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            try:
                header = json.loads(fh.read(size))
                end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
            except (ValueError, KeyError, TypeError):
                return f"{path.relative_to(checkpoint.parent)} has a damaged header"
        if path.stat().st_size < 8 + size + end:
            return f"{path.relative_to(checkpoint.parent)} is truncated"
    return None


def load_checkpoint(run_dir: Path) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint and its state (step, optimizer, scheduler, RNG). A damaged one
    is set aside as checkpoint.damaged/ (kept for inspection) and the previous one,
    checkpoint.old/, is used."""
    for name in ("checkpoint", "checkpoint.old"):
        checkpoint = run_dir / name
        if not checkpoint.exists():
            continue
        problem = checkpoint_damage(checkpoint)
        if problem is None:
            try:
                # memory-mapped: pages load as the optimizer takes them, not the whole file on
                # every process at once (18.5 GB for the paper's policy)
                return checkpoint, torch.load(checkpoint / "state.pt", weights_only=False,
                                              map_location="cpu", mmap=True)
            except Exception as err:
                # truncated or corrupt pickle: EOFError, RuntimeError, UnpicklingError, ...
                problem = f"{name}/state.pt is damaged ({type(err).__name__})"
        damaged = run_dir / "checkpoint.damaged"
        shutil.rmtree(damaged, ignore_errors=True)
        os.replace(checkpoint, damaged)
        print(f"[t3rl] {run_dir}: {problem}; moved it to {damaged.name}/ and falling back to the "
              f"previous checkpoint", file=sys.stderr)
    return None, None


def restore_state(state: dict, optimizer, scheduler, model) -> int:
    """Optimizer, schedule and RNG states from a checkpoint's state.pt; returns the steps done.
    model: the module the optimizer trains (under --parallel fsdp its state goes onto the
    shards)."""
    if fsdp.is_sharded(model):
        fsdp.restore_optimizer(model, optimizer, state["optimizer"])
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]


def drop_rows_after(run_dir: Path, start: int):
    """Rows written after the checkpoint of step `start` are computed again; from step 0 that is all
    of them."""
    keep_jsonl(run_dir / "metrics.jsonl",
               lambda r: start and (r["step"] < start
                                    or (r["kind"] == "eval" and r["step"] <= start)))
    keep_jsonl(run_dir / "rollouts.jsonl", lambda r: r["step"] < start)
    # an evaluation's question rows stay with its metrics row (a kill may fall between the two)
    evaluated = {r["step"] for r in read_jsonl_rows(run_dir / "metrics.jsonl")
                 if r["kind"] == "eval"}
    keep_jsonl(run_dir / "evaluations.jsonl", lambda r: r["step"] in evaluated)


def tracker_names(cfg) -> list[str]:
    return [name.strip() for name in cfg.report_to.split(",") if name.strip() not in ("", "none")]


@contextmanager
def tracking(accelerator, cfg, run_dir: Path, start: int):
    """Trackers started with the run's config for the body of the run, finished (flushed, closed)
    after it. A resumed run continues its tracker run: W&B by the run id kept in the run folder,
    TensorBoard in the same folder with what was logged after the checkpoint purged."""
    names = tracker_names(cfg)
    if accelerator.is_main_process and names:
        init_kwargs = {"tensorboard": {"purge_step": start + 1} if start else {}}
        if {"wandb", "all"} & set(names):
            id_file = run_dir / "wandb_id"
            if not id_file.is_file():
                id_file.write_text(uuid.uuid4().hex[:12])
            init_kwargs["wandb"] = {"name": run_dir.name, "id": id_file.read_text(),
                                    "resume": "allow", "dir": str(run_dir)}
        accelerator.init_trackers("t3rl", config=asdict(cfg), init_kwargs=init_kwargs)
    try:
        yield
    finally:
        # not accelerator.end_training(): it also ends the process group, which belongs to the
        # launcher
        for tracker in accelerator.trackers:
            tracker.finish()


def tracker_row(row: dict, prefix: str = "") -> dict:
    """A metrics row as trackers take it: its numbers under the same names, nested ones as
    'status/verified'."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update(tracker_row(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            flat[f"{prefix}{key}"] = value
    return flat


def run_banner(run_dir: Path, records, batches, accelerator, start: int, *, resume: str) -> str:
    processes = accelerator.num_processes
    return (f"run folder {run_dir}; {len(records)} questions, {len(batches)} steps, "
            f"{processes} process{'es' if processes > 1 else ''} on {accelerator.device.type}"
            + (f", resuming after step {start}" if start
               else ", no checkpoint yet: from step 0" if resume else ""))


def verifier_line(cfg) -> str:
    """What the run's verifier does, in one line (printed at the start; config.json holds each
    field)."""
    if not cfg.verify:
        return "no verifier (--no-verify): TTRL's majority vote"
    programs = cfg.verifier_programs
    which = ("every rollout verified" if not cfg.verify_budget and not cfg.lazy_verify
             else ", ".join(filter(None, [
                 f"{cfg.verify_budget} rollout(s) per answer class" if cfg.verify_budget else "",
                 "lazily" if cfg.lazy_verify else ""])))
    return (f"verifier {cfg.verifier_model}: {programs} program{'s' if programs > 1 else ''} per "
            f"rollout, "
            f"{'repair' if cfg.verifier_repair else 'no repair'}, "
            f"{'verdict memory' if cfg.verdict_memory else 'no memory'}, {which}, "
            f"{cfg.verifier_max_new_tokens} tokens at T {cfg.verifier_temperature:g} / top-p "
            f"{cfg.verifier_top_p:g}")


def precision_notes(cfg, device, asked: str) -> list[str]:
    """What a run says about its numerics, which t3rl sets itself: accelerate's mixed precision
    stays off whatever its config asks (`asked`: ACCELERATE_MIXED_PRECISION), the update takes
    bfloat16 autocast where the hardware runs it natively, sampling runs in --sample-dtype."""
    notes = []
    if asked != "no":
        notes.append(f"accelerate's config asks for mixed precision {asked}; t3rl keeps it off and "
                     f"sets its own: bfloat16 autocast in the update where the hardware has it "
                     f"(--no-bf16: none), sampling in {cfg.sample_dtype} (--sample-dtype)")
    if cfg.bf16 and not bf16_supported(device):
        hardware = "GPU" if device.type == "cuda" else device.type.upper()
        notes.append(f"this {hardware} has no native bfloat16: the update runs in float32, "
                     f"sampling in {cfg.sample_dtype}")
    return notes
