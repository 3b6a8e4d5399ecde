"""The run: its accelerator, its folder (config.json, metrics.jsonl, rollouts.jsonl,
evaluations.jsonl, checkpoint/ and, until the run finishes, the one before it, checkpoint.old/),
its trackers, its logs.

Every file is replaced atomically (written aside, then renamed: `replacing`) or appended to, so a
kill at any moment leaves a folder that --resume can continue: resume drops a half-written last
JSONL line and the rows written after the checkpoint, sets a damaged newest checkpoint aside
(checkpoint.damaged/) and falls back to checkpoint.old/. Experiment trackers (--report-to, through
accelerate) get every metrics row as well, from the main process; their x axis is updates done: the
evaluation before training at 0, train row `step` s at s + 1.
"""
import ctypes
import ctypes.util
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, fields
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import get_available_trackers
from accelerate.utils import (DistributedDataParallelKwargs, InitProcessGroupKwargs, LoggerType,
                               broadcast_object_list, gather_object)
from safetensors import SafetensorError

from config import BEYOND_PAPER, Config, OptionError, flag
from grpo import bf16_supported
from verifier import TEMPERATURE, TOP_P

# The process group's timeout for every collective (NCCL's default: 10 minutes): the others wait at
# a barrier while the main process writes a checkpoint, 18.5 GB for the paper's 1.5B policy and its
# AdamW state, longer than that on slow storage. A hung collective shows after this long.
PROCESS_GROUP_TIMEOUT = timedelta(hours=1)
DISK_FULL_BYTES = 64 << 20  # a write that failed with less free than this failed for the space


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


class RunDirError(RuntimeError):
    """A run folder cannot be used as asked; the message names the folder or file and what to do."""


def run_dir_of(cfg) -> Path:
    return Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / cfg.run_name


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in run_dir, pasted as it is (a name with a space)."""
    return f"python t3rl.py --resume {shlex.quote(str(run_dir))}"


def run_started(run_dir: Path) -> bool:
    """Whether a folder holds a run's results (a folder with only config.json is a start that never
    ran)."""
    try:
        return any((run_dir / name).exists()
                   for name in ("metrics.jsonl", "rollouts.jsonl", "checkpoint", "checkpoint.old"))
    except OSError as err:  # a folder the user may not enter
        raise RunDirError(f"{run_dir}: cannot be read ({err.strerror or err}); pass a --out-dir "
                          f"you can read and write") from None


def free_run_name(cfg) -> str:
    """bench-method-time, with a suffix when that folder exists (two runs started in one second).
    The first process claims the folder by creating it, so no other run takes the name; the others
    take its name (make_accelerator)."""
    method = ("ttrl" if cfg.verifier_model == "none" or cfg.omega == 1
              else f"t3rl-w{cfg.omega:g}") + ("-agent" if cfg.agent else "")
    name = f"{Path(cfg.bench).stem}-{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    if os.environ.get("RANK", "0") != "0":
        return name
    try:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    except OSError:  # an --out-dir it cannot write (a file, a dangling link): open_run_dir says so
        return name
    for suffix in itertools.count(1):
        candidate = name if suffix == 1 else f"{name}-{suffix}"
        try:
            (Path(cfg.out_dir) / candidate).mkdir()
        except FileExistsError:
            continue
        except OSError:
            pass
        return candidate


def on_main(accelerator, fn, *args):
    """fn(*args) on the main process while the others wait. Its RunDirError or DataError (an
    unwritable folder, a finished run, a damaged file, a full disk) is raised on every process, so
    each ends in the main one's line rather than at its next collective with the process group's
    error."""
    error = None
    if accelerator.is_main_process:
        try:
            fn(*args)
        except (RunDirError, DataError) as err:
            error = err
    error = broadcast_object_list([error])[0]
    if error is not None:
        raise error


def open_run_dir(cfg) -> Path:
    """Create (or, with --resume, check) the run folder before any model loads: an unwritable
    --out-dir, a reused name or a finished run stop here, in one line."""
    run_dir = run_dir_of(cfg)
    if cfg.resume:
        for name in ("metrics.jsonl", "rollouts.jsonl", "evaluations.jsonl"):
            drop_torn_tail(run_dir / name)
            check_steps(run_dir / name)
        finished = [r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r.get("final")]
        if finished:
            raise RunDirError(f"--resume {run_dir}: the run is finished (final evaluation at step "
                              f"{finished[-1]['step']} in metrics.jsonl); read it with python -m "
                              f"extensions.study --replay {shlex.quote(str(run_dir))}, or start a "
                              f"new run with another --run-name")
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        # --eval-every / --save-every changed
        if {**asdict(cfg), "resume": saved.get("resume", "")} != saved:
            write_atomically(run_dir / "config.json",
                             json.dumps({**asdict(cfg), "resume": ""}, indent=2))
        return run_dir
    if run_started(run_dir):
        raise RunDirError(f"run folder {run_dir} already holds a run; continue it with --resume "
                          f"{shlex.quote(str(run_dir))}, or pick another --run-name (or --out-dir)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(run_dir / "config.json", json.dumps(asdict(cfg), indent=2))
    except OSError as err:
        raise RunDirError(f"--out-dir {cfg.out_dir}: cannot write the run folder {run_dir} "
                          f"({err.strerror or err}); pass a writable --out-dir") from None
    return run_dir


def save_checkpoint(run_dir: Path, step: int, trained, tokenizer, optimizer, scheduler,
                    accelerator, full_state=None):
    """checkpoint/ = model and tokenizer (a --model folder) + optimizer, schedule, RNG states and
    step. Written as checkpoint.tmp/, then swapped in; the one it replaces stays as checkpoint.old/,
    the fallback if the new one is ever found damaged. The other processes wait for it (on_main)
    under PROCESS_GROUP_TIMEOUT. full_state: (trained, optimizer) -> (weights, optimizer state) in
    full, every process taking part (FSDP's shards); None: the module's and optimizer's own. A write
    the disk has no room for (or the OS refuses) ends the run in one line on every process, the last
    checkpoint kept."""
    weights, optimizer_state = full_state(trained, optimizer) if full_state else (None, None)

    def write():
        tmp, final, old = (run_dir / "checkpoint.tmp", run_dir / "checkpoint",
                           run_dir / "checkpoint.old")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            accelerator.unwrap_model(trained).save_pretrained(tmp / "model", state_dict=weights)
            tokenizer.save_pretrained(tmp / "model")
            torch.save({"step": step, "optimizer": optimizer_state or optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}},
                       tmp / "state.pt")
        # torch.save reports a full disk as RuntimeError, safetensors as its own error
        except (OSError, RuntimeError, SafetensorError) as err:
            full = shutil.disk_usage(run_dir).free < DISK_FULL_BYTES
            shutil.rmtree(tmp, ignore_errors=True)  # the space it took
            if not (full or isinstance(err, OSError)):
                raise
            raise RunDirError(f"{run_dir}: cannot write the checkpoint of step {step} "
                              f"({'the disk is full' if full else err.strerror or err}); free "
                              f"space there and continue with: {resume_command(run_dir)}") from None
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
    on_main(accelerator, write)


def finish_run(run_dir: Path) -> None:
    """A finished run cannot resume: once checkpoint/ is whole, keep its final model
    (checkpoint/model, a --model folder) and drop what only a resume reads, the optimizer's state
    (state.pt, twice the weights under AdamW) and the fallback checkpoint.old/. Call on the main
    process only."""
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


def release_freed_memory():
    """Hand what this process freed back to the system (glibc's malloc_trim): glibc keeps freed
    blocks below its mmap threshold for reuse, and they would count in the next phase's resident
    memory (1.4 GB after sampling the 0.5B policy, 2.2 GB after its update: bench.memory)."""
    if hasattr(_LIBC, "malloc_trim"):  # glibc's; musl has none
        _LIBC.malloc_trim(0)


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
            try:  # a damaged length, or a header that is not safetensors' {name: {data_offsets}}
                if size > path.stat().st_size:
                    raise ValueError(size)
                header = json.loads(fh.read(size))
                end = max(int(t["data_offsets"][1]) for k, t in header.items()
                          if k != "__metadata__")
            except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                return f"{path.relative_to(checkpoint.parent)} has a damaged header"
        if path.stat().st_size < 8 + size + end:
            return f"{path.relative_to(checkpoint.parent)} is truncated"
    return None


def load_checkpoint(run_dir: Path) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint and its state (step, optimizer, scheduler, RNG): checkpoint/,
    else the previous one, checkpoint.old/, the damaged one set aside as checkpoint.damaged/ (kept
    for inspection). (None, None) when the run wrote none yet; a RunDirError when every one it has
    is damaged (nothing moved: resuming from step 0 would drop the run's rows)."""
    problems = []
    for name in ("checkpoint", "checkpoint.old"):
        checkpoint = run_dir / name
        if not checkpoint.exists():
            continue
        problem = checkpoint_damage(checkpoint)
        if problem is None:
            try:
                # memory-mapped: pages load as the optimizer takes them, not the whole file on
                # every process at once (18.5 GB for the paper's policy)
                state = torch.load(checkpoint / "state.pt", weights_only=False,
                                   map_location="cpu", mmap=True)
                if not isinstance(state, dict) or STATE_KEYS - state.keys():
                    raise ValueError("not a t3rl state")
            except Exception as err:
                # truncated or corrupt pickle: EOFError, RuntimeError, UnpicklingError, ...
                problem = f"{name}/state.pt is damaged ({type(err).__name__})"
        if problem is None:
            if problems:
                damaged = run_dir / "checkpoint.damaged"
                shutil.rmtree(damaged, ignore_errors=True)
                os.replace(run_dir / "checkpoint", damaged)
                print(f"[t3rl] {run_dir}: {problems[0]}; moved it to {damaged.name}/ and resuming "
                      f"from the previous checkpoint, {name}/", file=sys.stderr)
            return checkpoint, state
        problems.append(problem)
    if problems:
        raise RunDirError(f"--resume {run_dir}: {'; '.join(problems)}; no checkpoint to resume "
                          f"from (nothing was changed): restore one from a copy, or start a new "
                          f"run")
    return None, None


STATE_KEYS = {"step", "optimizer", "scheduler", "rng"}  # what state.pt holds


def first_line(err: BaseException, limit: int | None = None) -> str:
    """An exception's first line (its type's name when it says nothing), for a one-line error."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:limit]


def restore_state(state: dict, load_optimizer, scheduler) -> int:
    """Optimizer (through load_optimizer: the optimizer's load_state_dict, or FSDP's scatter onto
    its shards), schedule and RNG states from a checkpoint's state.pt; returns the steps done."""
    try:
        load_optimizer(state["optimizer"])
    except ValueError as err:  # its parameter groups or sizes are not this optimizer's
        raise RunDirError(f"--resume: the checkpoint's optimizer state does not fit this run's "
                          f"optimizer ({first_line(err)}); resume with the t3rl version "
                          f"that wrote it, or start a new run") from None
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
        # a resume redoes the steps after its checkpoint (all of them, and the first evaluation,
        # when it had none)
        init_kwargs = {"tensorboard": {"purge_step": start + 1 if start else 0} if cfg.resume
                       else {}}
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


def announce(run_dir, records, batches, accelerator, start: int, cfg: Config, pool):
    """The main process drops the rows written after the step it resumes from, and prints the
    banner: the run folder, its size and processes, where it starts, its verifier, its sandbox."""
    if not accelerator.is_main_process:
        return
    drop_rows_after(run_dir, start)
    processes = accelerator.num_processes
    where = (f", resuming after step {start}" if start
             else ", no checkpoint yet: from step 0" if cfg.resume else "")
    print(f"[t3rl] run folder {run_dir}; {len(records)} questions, {len(batches)} steps, "
          f"{processes} process{'es' if processes > 1 else ''} on {accelerator.device.type}{where}"
          f"\n[t3rl] {verifier_line(cfg)}", file=sys.stderr)
    workers = f"{pool.workers} worker{'s' if pool.workers > 1 else ''}"
    print(f"[t3rl] sandbox, {workers} per process:\n{pool.report}", file=sys.stderr)


def verifier_line(cfg: Config) -> str:
    """The run's verifier and the options beyond the paper it sets, in one line (config.json holds
    each setting)."""
    beyond = [f"{flag(f.name)} {getattr(cfg, f.name)}" for f in fields(Config)
              if f.name in BEYOND_PAPER and getattr(cfg, f.name) != f.default]
    if cfg.verifier_model == "none":
        what = "no verifier (--verifier-model none): TTRL's majority vote"
    else:
        what = (f"verifier {cfg.verifier_model}, {cfg.verifier_max_new_tokens} tokens a program at "
                f"T {TEMPERATURE} / top-p {TOP_P}")
        what += "" if beyond else "; the paper's: one program per rollout, every rollout verified"
    return what + (f"; beyond the paper: {', '.join(beyond)}" if beyond else "")


def settle(cfg: Config, gpu: bool):
    """What the run fixes before it starts: the sampling dtype where it says auto (bfloat16 where
    the device runs it natively: a resume on another machine samples alike), and the trackers,
    which must be installed. OptionError otherwise."""
    if cfg.sample_dtype == "auto":
        native = bf16_supported(torch.device("cuda" if gpu else "cpu"))
        cfg.sample_dtype = "bfloat16" if native else "float32"
    for name in tracker_names(cfg):
        if name not in LoggerType.list():
            raise OptionError(f"--report-to {name}: choose from {', '.join(LoggerType.list())} "
                              f"or none")
        if name != "all" and name not in {str(t) for t in get_available_trackers()}:
            raise OptionError(f"--report-to {name}: the {name} package is not installed; pip "
                              f"install {name}")


def make_accelerator(cfg: Config, gpu: bool) -> Accelerator:
    """accelerate's Accelerator as t3rl runs it, every process on the main one's run name. t3rl sets
    its own numerics (grpo.py's bf16 autocast, the sampling dtype): the mixed precision an
    accelerate config may ask for would add an autocast and a GradScaler, so it stays off, with a
    line saying so. The process group waits out a checkpoint save (PROCESS_GROUP_TIMEOUT); DDP keeps
    the gradients in its all-reduce buckets (accelerate's default holds a second copy of them)."""
    handlers = [InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT),
                DistributedDataParallelKwargs(gradient_as_bucket_view=True)]
    accelerator = Accelerator(cpu=not gpu, mixed_precision="no", kwargs_handlers=handlers,
                              log_with=tracker_names(cfg) or None, project_dir=run_dir_of(cfg))
    # each process named the run by its own clock as it parsed its command line: rank 0's holds
    cfg.run_name = broadcast_object_list([cfg.run_name])[0]
    asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if accelerator.is_main_process and asked != "no":
        print(f"[t3rl] accelerate's config asks for mixed precision {asked}; t3rl keeps it off and "
              f"sets its own: bfloat16 autocast in the update where the hardware has it, sampling "
              f"in {cfg.sample_dtype}", file=sys.stderr)
    if accelerator.is_main_process and not bf16_supported(accelerator.device):
        print(f"[t3rl] this {accelerator.device.type.upper()} has no native bfloat16: the update "
              f"runs in float32, sampling in {cfg.sample_dtype}", file=sys.stderr)
    return accelerator


def metrics_logger(run_dir, accelerator):
    """log(row): the main process appends the row to metrics.jsonl and hands it to the trackers
    (--report-to), if any."""
    def log(row):
        if accelerator.is_main_process:
            append_jsonl(run_dir / "metrics.jsonl", [row])
            if accelerator.trackers:
                accelerator.log(tracker_row(row), step=row["step"] + (row["kind"] == "train"))
    return log


def log_rollouts(step, shard, groups, answers, verdicts, judged, run_dir, accelerator):
    """Every rollout of the step (text, answer, verdict, reward, kept) to rollouts.jsonl."""
    rows = []
    for rec, group, ans, ver, question in zip(shard, groups, answers, verdicts, judged):
        for i, (c, res) in enumerate(zip(group, ver)):  # res is None without a verifier
            rows.append({"step": step, "id": rec["id"], "index": i, "text": c.text,
                         "answer": ans[i], "v": question.v[i], "result": res and res.result,
                         "status": res and res.status, "inherited": res and res.inferred,
                         "reward": question.rewards[i], "label": question.vote.label,
                         "kept": i in question.keep, "program": res and res.code,
                         **(res.details if res else {}),
                         **({} if c.tool_calls is None else {"tool_calls": [
                             {"code": t.code, "status": t.status, "output": t.output}
                             for t in c.tool_calls]})})
    rows = gather_object(rows)
    if accelerator.is_main_process:
        append_jsonl(run_dir / "rollouts.jsonl", rows)


def check_prompts_fit(prompts: list, tokenizer, model, cfg: Config):
    """Stop before any sampling when a question's prompt plus --max-new-tokens exceeds the policy's
    context (skipping it silently would change the benchmark). prompts: (question id, prompt)."""
    context = getattr(model.config, "max_position_embeddings", None)
    for qid, prompt in prompts if context else []:
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > context:
            fix = f"lower --max-new-tokens to {context - n}, or " if n < context else ""
            raise DataError(f"question {qid} of --bench {cfg.bench}: its prompt ({n} tokens) + "
                            f"--max-new-tokens {cfg.max_new_tokens} exceeds the policy's context "
                            f"of {context} tokens; the run stops here: {fix}remove that question "
                            f"from the benchmark file")


REPEATED_SIGTERM_S = 10.0  # a launcher's repeated SIGTERM: within this, the cleanup goes on


@contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (a Slurm time limit, a launcher stopping the others when one fails) raises
    KeyboardInterrupt, so the run ends as after Ctrl-C: the pool and trackers close and the resume
    command is printed. Python takes signals in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    first = []

    def interrupt(signum, frame):
        # launchers may signal twice (torchrun forwards, Slurm signals every process): a repeat
        # within REPEATED_SIGTERM_S of the first lets the cleanup it started run to its end
        if first and time.monotonic() - first[0] < REPEATED_SIGTERM_S:
            return
        first[:] = [time.monotonic()]
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------------------
# Files that survive a kill: written aside and renamed, or appended (a kill cuts at most a last
# line)

class DataError(ValueError):
    """A data file (a benchmark, or a run's JSON-lines) cannot be read; the message names the file,
    the line and what to do."""


def _remove(path: Path):
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def replacing(dest: Path):
    """A temporary path beside dest (same folder: the rename is atomic) to write a file or a folder
    to; it replaces dest when the block ends, and is removed instead when the block raises."""
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    os.replace(tmp, dest)


def remove_stale(dest: Path):
    """What a killed replacing(dest) left beside it (a model's build: GBs). Only under a lock that
    keeps every other writer of dest out: a live one's temporary looks the same."""
    for stale in dest.parent.glob(f"{dest.name}.tmp-*"):
        _remove(stale)


def write_atomically(path: Path, text: str):
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def jsonl_objects(path: Path, torn_tail_ok: bool = False):
    """(line number, object) for each non-blank line of a JSON-lines file; errors name the file and
    the line. With torn_tail_ok, a last line without its newline that does not parse (what a kill
    during an append leaves) is dropped with a note instead."""
    lines = path.read_bytes().split(b"\n")
    for lineno, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8").removeprefix("\ufeff" if lineno == 1 else "")  # a BOM
            if not line.strip():
                continue
            obj = json.loads(line)
        # ValueError: also a number past Python's 4,300 digits; RecursionError: deep nesting
        except (ValueError, RecursionError) as err:
            if torn_tail_ok and lineno == len(lines):
                print(f"[t3rl] {path}:{lineno}: dropped a half-written last line "
                      f"(left by a kill during a write)", file=sys.stderr)
                return
            if isinstance(err, UnicodeDecodeError):
                raise DataError(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} "
                                f"at column {err.start + 1}); save the file as UTF-8") from None
            reason = getattr(err, "msg", None) or str(err).split(";")[0] or type(err).__name__
            raise DataError(f"{path}:{lineno}: invalid JSON ({reason}); "
                            f"fix or delete that line") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj


def read_jsonl_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (none when the file is missing): metrics.jsonl,
    rollouts.jsonl, study.jsonl."""
    return [row for _, row in jsonl_objects(path, torn_tail_ok=True)] if path.is_file() else []


def append_jsonl(path: Path, rows: list[dict]):
    with open(path, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_jsonl(path: Path, rows):
    """Replace a JSONL file with `rows`, atomically."""
    write_atomically(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def check_steps(path: Path):
    """Each row of a run's JSON-lines file says its step (a metrics row its kind too), which a
    resume reads to keep the rows before its checkpoint; a row edited by hand ends here in one
    line."""
    for lineno, row in jsonl_objects(path, torn_tail_ok=True) if path.is_file() else ():
        if type(row.get("step")) is not int or (path.name == "metrics.jsonl"
                                                 and row.get("kind") not in ("train", "eval")):
            raise DataError(f"{path}:{lineno}: a row without its step (a whole number) or kind; "
                            f"fix or delete that line")


def keep_jsonl(path: Path, keep):
    """Rewrite a JSONL file with only the rows `keep` accepts (resume drops what came after the
    checkpoint, and a torn last line with it)."""
    if path.is_file():
        write_jsonl(path, [r for r in read_jsonl_rows(path) if keep(r)])


def drop_torn_tail(path: Path):
    """Rewrite a JSONL file whose last line was cut by a kill during an append, without that line
    (a file that ends in a newline is left alone)."""
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                keep_jsonl(path, lambda row: True)
