"""A run's fingerprint, to show that a change to the code left what it computes alone: the SHA-256
of the final weights, and of metrics.jsonl and rollouts.jsonl as sorted JSON without the timing fields.

    python t3rl.py --max-steps 1 --limit 3 --run-name before      # on the old code, then the new
    python -m bench.identity runs/before runs/after
"""
import argparse
import hashlib
import json
from pathlib import Path


def fingerprint(run: Path) -> dict:
    weights = (run / "checkpoint" / "model" / "model.safetensors").read_bytes()
    out = {"weights": hashlib.sha256(weights).hexdigest()}
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        rows = [json.loads(line) for line in (run / name).read_text().splitlines()]
        rows = [{k: v for k, v in row.items() if not k.startswith(("seconds/", "grpo/seconds"))}
                for row in rows]
        out[name] = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("runs", nargs="+", type=Path, help="run folders to fingerprint")
    prints = [fingerprint(run) for run in parser.parse_args().runs]
    for run, print_ in zip(parser.parse_args().runs, prints):
        print(run, json.dumps(print_, indent=1))
    if len(prints) > 1:
        print("identical" if all(p == prints[0] for p in prints) else "DIFFERENT")


if __name__ == "__main__":
    main()
