"""t3rl: Tool-verified Test-Time Reinforcement Learning (T3RL), on top of TTRL, in one readable loop.

Test-time RL trains a model on unlabeled test questions. For each question q:

    y_1..y_N ~ pi_theta(. | q)                     sample N rollouts                     (sampler.py)
    a_i = extract(y_i)                             the final answer of each rollout      (verifier.py)
    v_i = [ run(program_i) == a_i ]                a verifier LLM writes program_i that
                                                   recomputes the answer; the sandbox runs it (verifier.py, sandbox.py)
    w_i = (1 - v_i) + v_i * omega                  verified rollouts carry omega votes    (voting.py)
    label = argmax_a  sum_i w_i * 1[a_i == a]      the pseudo-label (omega = 1 is TTRL's majority vote)
    r_i = 1[a_i == label]                          the reward; ground truth is never used here
    keep M of the N rollouts at random, GRPO update on them                               (grpo.py)

Run it:
    python t3rl.py                                  # CPU, offline: embedded 0.5B model, demo benchmark
    accelerate launch t3rl.py --bench math500       # the paper's setting on GPUs
"""
import argparse
import json
import math
import os
import sys
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from model import ModelLoadError, load_model  # noqa: F401  (load_model is part of t3rl's public API)

ROOT = Path(__file__).resolve().parent

# ----------------------------------------------------------------------------------------------------------------
# Benchmarks

# name -> (Hub dataset, config, split); the demo benchmark ships with the repository as data/demo.jsonl
HUB_BENCHES = {
    "math500": ("HuggingFaceH4/MATH-500", "default", "test"),
    "aime2024": ("HuggingFaceH4/aime_2024", "default", "train"),
    "amc": ("AI-MO/aimo-validation-amc", "default", "train"),
}
BENCHES = [*HUB_BENCHES, "demo"]
ROWS_API = "https://datasets-server.huggingface.co/rows"


class BenchError(ValueError):
    """A benchmark could not be found or read; the message says where and what to do."""


def read_jsonl(path: Path) -> list[dict]:
    """Records {id, problem, answer, ...} from a JSON-lines file; errors name the file and the line."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise BenchError(f"{path}:{lineno}: invalid JSON ({err.msg}); fix or delete that line") from None
            if not isinstance(rec, dict):
                raise BenchError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for key in ("problem", "answer"):
                if rec.get(key) in (None, ""):
                    raise BenchError(f"{path}:{lineno}: record has no '{key}'; every line needs 'problem' and 'answer'")
            rec["answer"] = str(rec["answer"])
            rec.setdefault("id", f"{path.stem}-{lineno}")
            records.append(rec)
    if not records:
        raise BenchError(f"{path}: no records; the file is empty")
    return records


def fetch_hub_rows(dataset: str, config: str, split: str, page: int = 100) -> list[dict]:
    """All rows of a Hub dataset split through the Hub's rows API (plain JSON, no extra package)."""
    rows, offset, total = [], 0, None
    while total is None or offset < total:
        query = urllib.parse.urlencode(dict(dataset=dataset, config=config, split=split, offset=offset, length=page))
        with urllib.request.urlopen(f"{ROWS_API}?{query}", timeout=30) as resp:
            body = json.load(resp)
        total = body["num_rows_total"]
        rows += [r["row"] for r in body["rows"]]
        offset += page
        if not body["rows"]:
            break
    return rows


def hub_records(name: str, rows: list[dict]) -> list[dict]:
    """Map a Hub benchmark's rows to {id, problem, answer, ...} (MATH-500 keeps level and subject)."""
    records = []
    for i, row in enumerate(rows):
        rec = {"id": str(row.get("unique_id") or row.get("id") or f"{name}-{i}"),
               "problem": row["problem"], "answer": str(row["answer"])}
        rec.update({k: row[k] for k in ("level", "subject") if k in row})
        records.append(rec)
    return records


def load_bench(name: str, fetch=fetch_hub_rows) -> list[dict]:
    """Benchmark records, from $T3RL_DATA_DIR/<name>.jsonl, else data/<name>.jsonl, else the Hub (saved once)."""
    if name not in BENCHES:
        raise BenchError(f"--bench {name}: unknown benchmark; choose one of {', '.join(BENCHES)}")
    local = ROOT / "data" / f"{name}.jsonl"
    data_dir = os.environ.get("T3RL_DATA_DIR")
    if data_dir and (Path(data_dir) / f"{name}.jsonl").is_file():
        return read_jsonl(Path(data_dir) / f"{name}.jsonl")
    if local.is_file():
        return read_jsonl(local)
    dataset, config, split = HUB_BENCHES[name]
    print(f"[t3rl] downloading {name} from the Hugging Face Hub ({dataset}, split {split}) ...", file=sys.stderr)
    try:
        rows = fetch(dataset, config, split)
    except OSError as err:
        raise BenchError(f"--bench {name}: not found locally and the Hub is unreachable ({err}); put the file at "
                         f"{local} or set T3RL_DATA_DIR to a folder holding {name}.jsonl "
                         f"(one JSON object per line with 'problem' and 'answer')") from None
    records = hub_records(name, rows)
    tmp = local.with_name(f"{local.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    os.replace(tmp, local)
    return records
