"""Runs' fingerprints, to show that a change to the code left what it computes alone: the SHA-256
of the final weights, and of metrics.jsonl and rollouts.jsonl as sorted JSON without the timing
fields and without the fields that only some of the runs log (each named: bookkeeping a change
added or dropped, never a computed number the runs share).

    python t3rl.py --max-steps 1 --limit 3 --run-name before      # on the old code, then the new
    python -m bench.identity runs/before runs/after
"""
import argparse
import hashlib
import json
from pathlib import Path


FILES = ("metrics.jsonl", "rollouts.jsonl")


def logged(run: Path, name: str) -> list[dict]:
    rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(("seconds/", "grpo/seconds"))}
            for row in rows]


def fingerprint(run: Path, shared: dict) -> dict:
    """SHA-256 of the final weights and of each file's rows, keeping the fields in shared[file]."""
    weights = (run / "checkpoint" / "model" / "model.safetensors").read_bytes()
    out = {"weights": hashlib.sha256(weights).hexdigest()}
    for name in FILES:
        rows = [{k: v for k, v in row.items() if k in shared[name]} for row in logged(run, name)]
        out[name] = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("runs", nargs="+", type=Path, help="run folders to fingerprint")
    runs = parser.parse_args().runs
    fields = {name: [{k for row in logged(run, name) for k in row} for run in runs]
              for name in FILES}
    shared = {name: set.intersection(*sets) for name, sets in fields.items()}
    prints = [fingerprint(run, shared) for run in runs]
    for name, sets in fields.items():
        for run, keys in zip(runs, sets):
            if keys - shared[name]:
                print(f"{run}/{name}: left out, not in every run: {sorted(keys - shared[name])}")
    for run, print_ in zip(runs, prints):
        print(run, json.dumps(print_, indent=1))
    if len(prints) > 1:
        print("identical" if all(p == prints[0] for p in prints) else "DIFFERENT")


if __name__ == "__main__":
    main()
