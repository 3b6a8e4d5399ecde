"""The benchmarks: questions {id, problem, answer, ...} from a local JSON-lines file or the Hugging
Face Hub.

load_bench(name) reads a .jsonl file named so, else $T3RL_DATA_DIR/<name>.jsonl, else
data/<name>.jsonl, else downloads the Hub dataset through huggingface_hub (so HF_TOKEN, an
HF_ENDPOINT mirror, HF_HUB_OFFLINE and the Hub cache apply as in every other Hub tool). Without the
Hub it says where to put the file instead.
"""
import json
import math
import os
import sys
from pathlib import Path

from huggingface_hub import snapshot_download

from config import BENCHES
from machinery.runs import DataError, first_line, jsonl_objects

# the repository, whose data/ holds the bundled benchmarks
ROOT = Path(__file__).resolve().parent.parent


# name -> (Hub dataset, its files that hold the split); the demo benchmark ships with the repository
# as data/demo.jsonl
HUB_BENCHES = {
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl"),
    "aime2024": ("HuggingFaceH4/aime_2024", "data/train-*"),
    "amc": ("AI-MO/aimo-validation-amc", "data/train-*"),
}


class BenchError(DataError):
    """A benchmark could not be found; the message says where and what to do."""


def load_bench(name: str) -> list[dict]:
    """Benchmark records, from a .jsonl file `name`, else $T3RL_DATA_DIR/<name>.jsonl, else
    data/<name>.jsonl, else the Hugging Face Hub."""
    if name.endswith(".jsonl"):
        if not Path(name).is_file():
            raise BenchError(f"--bench {name}: no such file; pass a .jsonl file of questions "
                             f"that exists, or one of {', '.join(BENCHES)}")
        return read_jsonl(Path(name))
    if name not in BENCHES:
        raise BenchError(f"--bench {name}: unknown benchmark; choose one of {', '.join(BENCHES)}")
    local = ROOT / "data" / f"{name}.jsonl"
    data_dir = os.environ.get("T3RL_DATA_DIR")
    if data_dir and (Path(data_dir) / f"{name}.jsonl").is_file():
        return read_jsonl(Path(data_dir) / f"{name}.jsonl")
    if local.is_file():
        return read_jsonl(local)
    if name not in HUB_BENCHES:  # shipped in data/ only
        raise BenchError(f"--bench {name}: {local} is missing; restore it (git checkout data/) or "
                         f"put {name}.jsonl in T3RL_DATA_DIR")
    dataset, files = HUB_BENCHES[name]
    print(f"[t3rl] {name}: no local file, loading {dataset} through the Hugging Face Hub client",
          file=sys.stderr)
    try:
        rows = download_hub_rows(dataset, files)
    except OSError as err:
        # the client's errors (offline, unreachable, not found, gated) are all OSErrors
        reason = first_line(err)
        where = "not found locally" if not data_dir else (
            f"not found in T3RL_DATA_DIR={data_dir}"
            f"{'' if Path(data_dir).is_dir() else ' (no such folder)'} nor in data/")
        raise BenchError(f"--bench {name}: {where} and not available from the Hub ({reason}); "
                         f"put the file at {local} or set T3RL_DATA_DIR to a folder holding "
                         f"{name}.jsonl "
                         f"(one JSON object per line with 'problem' and 'answer')") from None
    return hub_records(name, rows)


def read_jsonl(path: Path) -> list[dict]:
    """Benchmark records {id, problem, answer, ...} from a JSON-lines file; errors name the file and
    the line."""
    records, line_of = [], {}
    for lineno, rec in jsonl_objects(path):
        for key in ("problem", "answer"):
            if rec.get(key) in (None, ""):
                raise DataError(f"{path}:{lineno}: record has no '{key}'; "
                                f"every line needs 'problem' and 'answer'")
        if not isinstance(rec["problem"], str):
            raise DataError(f"{path}:{lineno}: 'problem' is a {type(rec['problem']).__name__}, "
                            f"not a string; write the question as a JSON string")
        answer = rec["answer"]  # a number is its spelling; a list or true has none to compare
        if not _plain_value(answer):
            raise DataError(f"{path}:{lineno}: 'answer' is {json.dumps(answer)[:40]}; write it "
                            f"as a JSON string as the solution states it, such as \"1, 2\"")
        rec["answer"] = str(answer)
        level = rec.get("level")  # by_level groups and sorts the questions by it
        if level is not None and not _plain_value(level):
            raise DataError(f"{path}:{lineno}: 'level' is {json.dumps(level)[:40]}; write it as "
                            f"a number or a string, or leave it out")
        try:  # a lone surrogate ("\ud800") is valid JSON but no text: the tokenizer refuses it
            json.dumps(rec, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise DataError(f"{path}:{lineno}: holds a lone surrogate escape (\\ud800-\\udfff), "
                            f"which is no character; fix or delete that line") from None
        rec["id"] = str(f"{path.stem}-{lineno}" if rec.get("id") is None else rec["id"])
        if rec["id"] in line_of:
            raise DataError(f"{path}:{lineno}: id '{rec['id']}' is already used on line "
                            f"{line_of[rec['id']]}; give every question its own id")
        line_of[rec["id"]] = lineno
        records.append(rec)
    if not records:
        raise DataError(f"{path}: no records; the file is empty")
    return records


def _plain_value(value) -> bool:
    """A string or a finite number (not a bool, a list or NaN): what an answer or a level may be."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool) and \
        (not isinstance(value, float) or math.isfinite(value))


def download_hub_rows(dataset: str, files: str) -> list[dict]:
    """The rows of a Hub dataset's split, through huggingface_hub: the user's HF_TOKEN, HF_ENDPOINT
    (a mirror), HF_HUB_OFFLINE and cache (HF_HOME) apply as in every other Hub tool. JSON lines or
    Parquet (read by pyarrow)."""
    folder = Path(snapshot_download(dataset, repo_type="dataset", allow_patterns=files))
    paths = sorted(folder.glob(files))
    if not paths:
        raise FileNotFoundError(f"{dataset} has no file matching {files}")
    rows = []
    for path in paths:
        if path.suffix == ".parquet":
            import pyarrow.parquet
            rows += pyarrow.parquet.read_table(path).to_pylist()
        else:
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
                     if line.strip()]
    return rows


def hub_records(name: str, rows: list[dict]) -> list[dict]:
    """Map a Hub benchmark's rows to {id, problem, answer, ...} (MATH-500 keeps level and
    subject)."""
    records = []
    for i, row in enumerate(rows):
        qid = row.get("unique_id", row.get("id"))
        rec = {"id": f"{name}-{i}" if qid is None else str(qid), "problem": row["problem"],
               "answer": str(row["answer"])}
        rec.update({k: row[k] for k in ("level", "subject") if k in row})
        records.append(rec)
    return records
