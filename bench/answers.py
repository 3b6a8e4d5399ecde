"""Benchmark of answers.py: is_equiv against bare math-verify and plain string matching on the labelled
answer pairs of data/equiv_cases.jsonl (accuracy, false positives and negatives, milliseconds per call, per
category, and every case either gets wrong).

    python -m bench.answers
"""
import argparse
import json
import logging
import os
import statistics
import time

from tqdm import tqdm

import answers
from answers import EQUIV_TIME_LIMIT_S, answer_key, is_equiv
from machinery.symbolic import worker

EQUIV_CASES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "equiv_cases.jsonl")


def _string_match(pred, gold):
    return pred.strip() == gold.strip()


def _bare_math_verify(pred, gold):
    from math_verify import parse, verify
    return verify(parse(rf"\boxed{{{gold}}}"), parse(rf"\boxed{{{pred}}}"))


def _is_equiv_uncached(pred, gold):
    answers._key.cache_clear()
    answers._keys_equiv.cache_clear()
    return is_equiv(pred, gold)


def _run_checker(check, cases, desc):
    """What `check` said on each case, and the milliseconds each call took."""
    said, times = [], []
    for case in tqdm(cases, desc=desc, leave=False):
        start = time.perf_counter()
        said.append(bool(check(case["pred"], case["gold"])))
        times.append(1000 * (time.perf_counter() - start))
    return said, times


def bench_equiv(path=EQUIV_CASES):
    """Accuracy, false positives/negatives and ms per call of three answer checkers side by side, then
    math-verify and is_equiv per category, then every case either of them gets wrong."""
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    with open(path) as f:
        cases = [json.loads(line) for line in f]
    worker.equal("x", "x", EQUIV_TIME_LIMIT_S)  # start the helper process outside the timings
    checkers = {"string match": _string_match, "math-verify": _bare_math_verify, "is_equiv": _is_equiv_uncached}
    results = {name: _run_checker(check, cases, name) for name, check in checkers.items()}
    equal = sum(c["equal"] for c in cases)
    print(f"{len(cases)} labelled cases ({equal} equal, {len(cases) - equal} not equal) from {path}")
    print(f"{'checker':<14}{'accuracy':>10}{'false +':>9}{'false -':>9}{'median ms':>11}{'max ms':>9}")
    for name, (said, times) in results.items():
        false_pos = sum(s and not c["equal"] for s, c in zip(said, cases))
        false_neg = sum(c["equal"] and not s for s, c in zip(said, cases))
        print(f"{name:<14}{100 * (1 - (false_pos + false_neg) / len(cases)):>9.1f}%{false_pos:>9}{false_neg:>9}"
              f"{statistics.median(times):>11.2f}{max(times):>9.1f}")
    symbolic_ms = [t for t, c in zip(results["is_equiv"][1], cases)
                   if answers._decided_by_strings(answer_key(c["pred"]), answer_key(c["gold"])) is None]
    timing = (f": median {statistics.median(symbolic_ms):.2f} ms, max {max(symbolic_ms):.1f} ms"
              if symbolic_ms else "")
    print(f"is_equiv sent {len(symbolic_ms)} of {len(cases)} cases to sympy{timing}; the rest were decided by "
          f"answer_key alone")
    print(f"\n{'category':<16}{'cases':>6}{'math-verify':>13}{'is_equiv':>10}   (right; false positives in brackets)")
    for category in sorted({c["category"] for c in cases}):
        rows = [i for i, c in enumerate(cases) if c["category"] == category]
        cells = []
        for name in ("math-verify", "is_equiv"):
            said = results[name][0]
            right = sum(said[i] == cases[i]["equal"] for i in rows)
            false_pos = sum(said[i] and not cases[i]["equal"] for i in rows)
            cells.append(f"{right}" + (f" ({false_pos})" if false_pos else ""))
        print(f"{category:<16}{len(rows):>6}{cells[0]:>13}{cells[1]:>10}")
    for name in ("math-verify", "is_equiv"):
        print(f"\n{name} errors:")
        for s, case in zip(results[name][0], cases):
            if s != case["equal"]:
                print(f"  {'FP' if s else 'FN'} [{case['category']}] pred={case['pred']!r} gold={case['gold']!r}")


def main():
    parser = argparse.ArgumentParser(description="measure answers.is_equiv on data/equiv_cases.jsonl")
    parser.add_argument("--cases", default=EQUIV_CASES, help="a JSONL file of {pred, gold, equal, category}")
    bench_equiv(parser.parse_args().cases)


if __name__ == "__main__":
    main()
