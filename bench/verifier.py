"""Measurement of verifier.py: recall and false-verify rate of the offline verifiers on the same
rollouts.

--measure verifies a correct and a wrong short solution to each of 60 MATH-500 problems (levels 1-5;
`--bench knk`: puzzles, wrong = one person flipped) with each verifier model (default: coder-0.5b,
the cpu policy verifying itself, and coder-1.5b, the paper's verifier model), prints recall,
false-verify rate, precision, statuses and costs, and logs every completion; --rescore LOG scores a
log's completions again without sampling; --demo shows one verification step by step. --steps RUN
verifies each training step's saved rollouts of a run twice with its verifier, every rollout (as
--verify-budget says) and lazily (--lazy-verify: only what can change the vote), and prints seconds,
prompts, tokens and whether the labels agree. --solutions measures verify_batch's options on
human-written MATH solutions: the right trace and the same trace with its last box changed;
--memory RUN verifies a run's later episodes again without its verdict memory.

    python -m bench.verifier --measure [--bench knk] [--problems 60]
                             [--verifiers coder-0.5b coder-1.5b]
    python -m bench.verifier --solutions 8 --verifiers coder-1.5b --max-new-tokens 1024
                             [--programs 1] [--no-repair]
    python -m bench.verifier --memory runs/RUN     # a run trained with --verdict-memory
    python -m bench.verifier --demo
    python -m bench.verifier --steps runs/RUN
"""
import argparse
import dataclasses
import json
import os
import re
import time
from contextlib import nullcontext
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import torch

import sampler
import t3rl
from answers import _boxes, _fraction_str, answer_key, extract_answer, same_answer
from config import Config, resumed_config
from extensions import knk
from extensions.programs import FURTHEST, REPRODUCED, programs_written
from machinery.benchmarks import load_bench
from machinery.model import load_model
from machinery.runs import read_jsonl_rows
from sandbox import SandboxPool
from verifier import (MATH, SANDBOX_TIMEOUT, STATUSES, ToVerify, VerifierPrompt, VerifierReply,
                      model_verifier)
from voting import weighted_vote

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOLUTION = ("Working through the problem step by step, the computation gives {answer}.\n\n"
            "The final answer is $\\boxed{{{answer}}}$.")
DATA_DIR = os.environ.get("T3RL_DATA_DIR", os.path.join(REPO, "..", "shared", "data"))
# self-verification of the cpu policy, and the paper's verifier model
MEASURED = ("coder-0.5b", "coder-1.5b")


def verify_batch(problems, texts, answers, call, domain, *, programs=1, repair=False, budget=0,
                 omega=None, pool=None):
    """A Verification per rollout, as a run with these verifier options verifies a step's rollouts
    (t3rl.verify_function; rollouts of one problem vote together; lazily at omega where given)."""
    batch = [ToVerify(p, t, a, p, None) for p, t, a in zip(problems, texts, answers)]
    cfg = Config(verifier_programs=programs, verifier_repair=repair, verify_budget=budget,
                 lazy_verify=omega is not None, omega=omega or 1.0)
    with SandboxPool(timeout=SANDBOX_TIMEOUT) if pool is None else nullcontext(pool) as pool:
        return t3rl.verify_function(cfg, call, pool, domain)(batch, [None] * len(batch))


def math500_by_level(count, path=os.path.join(DATA_DIR, "math500.jsonl")):
    """`count` MATH-500 problems spread evenly over levels 1-5 (the first ones of each level in file
    order)."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: not found; set T3RL_DATA_DIR to the folder holding "
                         f"math500.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    per_level = -(-count // 5)
    return [r for level in range(1, 6)
            for r in [r for r in rows if int(r["level"]) == level][:per_level]]


def wrong_answer(problem, gold):
    """A plausible wrong answer: gold + 1 when gold is a number; else gold with its last digit
    changed (\\frac{\\sqrt{3}}{2} -> \\frac{\\sqrt{3}}{3}, same form); else the first number in the
    problem that is not gold."""
    try:
        return _fraction_str(Fraction(answer_key(gold)) + 1)
    except (ValueError, ZeroDivisionError):
        pass
    digits = list(re.finditer(r"\d", gold))
    if digits:
        d = digits[-1]
        bumped = gold[:d.start()] + str((int(d.group()) + 1) % 10) + gold[d.end():]
        if not same_answer(bumped, gold):
            return bumped
    return next((n for n in re.findall(r"\d+", problem) if not same_answer(n, gold)), "0")


def offline_verifier(name, max_new_tokens, seed):
    """A model_verifier around a --model value, loaded in bfloat16 (as the loop loads its
    verifier)."""
    model, tokenizer = load_model(name, dtype=torch.bfloat16)
    return model_verifier(model.requires_grad_(False), tokenizer, max_new_tokens=max_new_tokens,
                          seed=seed)


def verifier_scores(results, kinds):
    """Recall (verified share of correct answers), false-verify rate (of wrong ones), precision
    (right share of the verified) and the status counts per kind of answer."""
    verified = {kind: sum(r.v for r, k in zip(results, kinds) if k == kind)
                for kind in ("correct", "wrong")}
    total = {kind: kinds.count(kind) for kind in ("correct", "wrong")}
    status = {kind: {s: sum(r.status == s for r, k in zip(results, kinds) if k == kind)
                     for s in STATUSES}
              for kind in ("correct", "wrong")}
    both = verified["correct"] + verified["wrong"]
    return dict(recall=verified["correct"] / total["correct"],
                false_verify=verified["wrong"] / total["wrong"],
                precision=verified["correct"] / both if both else None, status=status)


def knk_puzzles(count, path=knk.KNK_PATH):
    """The first `count` puzzles of data/knk.jsonl, each with a wrong answer: one person (the k-th,
    cycling) flipped."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][:count]
    for k, r in enumerate(rows):
        world = knk.parse_assignment(r["answer"])
        flipped = r["names"][k % len(r["names"])]
        r["wrong"] = knk.canonical(r["names"], {**world, flipped: not world[flipped]})
    return rows


def measure_rollouts(count, bench="math500"):
    """A correct and a wrong short solution per problem: (problems, rollouts, answers, kinds,
    levels)."""
    columns = ([], [], [], [], [])
    for r in knk_puzzles(count) if bench == "knk" else math500_by_level(count):
        wrong = r["wrong"] if bench == "knk" else wrong_answer(r["problem"], r["answer"])
        for kind, answer in (("correct", r["answer"]), ("wrong", wrong)):
            for column, value in zip(columns, (r["problem"], SOLUTION.format(answer=answer), answer,
                                               kind, int(r["level"]))):
                column.append(value)
    return columns


def solution_rollouts(per_level, path=os.path.join(DATA_DIR, "math500_solutions_dev.jsonl")):
    """Human-written MATH solutions, the first `per_level` of each level 1-5 in file order: the
    right trace and the same trace with its last box changed to wrong_answer's value, as
    (problems, rollouts, answers, kinds, levels)."""
    if not os.path.isfile(path):
        raise SystemExit(f"{path}: not found; set T3RL_DATA_DIR to the folder holding "
                         f"math500_solutions_dev.jsonl")
    records = {r["id"]: r for r in map(json.loads, open(os.path.join(DATA_DIR, "math500.jsonl")))}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    columns = ([], [], [], [], [])
    for level in range(1, 6):
        for row in [r for r in rows if int(r["level"]) == level][:per_level]:
            problem, gold, trace = records[row["id"]]["problem"], records[row["id"]]["answer"], \
                row["solution"]
            start, end, _ = _boxes(trace)[-1]
            wrong = trace[:start] + "\\boxed{" + wrong_answer(problem, gold) + "}" + trace[end:]
            for kind, text in (("correct", trace), ("wrong", wrong)):
                for column, value in zip(columns, (problem, text, extract_answer(text), kind,
                                                   level)):
                    column.append(value)
    return columns


def measure_solutions(per_level, max_new_tokens, seed, name, options, log_path):
    """--solutions: verify the right and the changed-box trace of human MATH solutions with one
    verifier and the verify_batch options given; print accuracy (mean of recall and 1 -
    false-verify), recall, false-verify, the exec_error share of right traces, statuses, prompts,
    tokens and seconds, and log every verdict with its programs."""
    problems, rollouts, answers, kinds, levels = solution_rollouts(per_level)
    model_call, prompts = offline_verifier(name, max_new_tokens, seed), []

    def counting(batch):
        prompts.append(len(batch))
        return model_call(batch)
    start = time.perf_counter()
    results = verify_batch(problems, rollouts, answers, counting, MATH, **options)
    wall = time.perf_counter() - start
    scores = verifier_scores(results, kinds)
    right = kinds.count("correct")
    failed = sum(scores["status"]["correct"][s] for s in ("exec_error", "timeout"))
    print(f"{name}, {max_new_tokens} verifier tokens, seed {seed}, options {options}: "
          f"{len(results)} traces ({right} right, {right} with a changed box), levels 1-5")
    right_at = {lv: [r.v for r, k, x in zip(results, kinds, levels) if k == "correct" and x == lv]
                for lv in range(1, 6)}
    by_level = {lv: sum(v) / len(v) for lv, v in right_at.items()}
    print_measure([(name, scores, by_level, sum(r.tokens or 0 for r in results) / len(results),
                    wall / len(results))])
    programs = [p["status"] for r, k in zip(results, kinds) if k == "correct"
                for p in r.details.get("programs") or [dict(status=r.status)]]
    raised = sum(status in ("exec_error", "timeout") for status in programs)
    print(f"accuracy {(scores['recall'] + 1 - scores['false_verify']) / 2:.1%}  recall "
          f"{scores['recall']:.1%}  false-verify {scores['false_verify']:.1%}  exec_error+timeout "
          f"{failed / right:.1%} of right traces (no program ran cleanly), "
          f"{raised / len(programs):.1%} of their programs  prompts {sum(prompts)} in "
          f"{len(prompts)} calls  "
          f"tokens {sum(r.tokens or 0 for r in results)}  {wall:.0f} s")
    if options.get("programs", 1) > 1 or options.get("repair"):
        print_derived(results, kinds)
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "w") as f:
        for i, r in enumerate(results):
            f.write(json.dumps(dict(options=options, kind=kinds[i], level=levels[i],
                                    answer=answers[i], v=r.v, status=r.status, result=r.result,
                                    repaired_from=r.details.get("repaired_from"),
                                    programs=r.details.get("programs"),
                                    tokens=r.tokens, completion=r.completion,
                                    output=r.output[-2000:])) + "\n")


def print_derived(results, kinds):
    """The options apart, on this run's own programs: the first program alone, before and after its
    repair, and all k programs before and after theirs (a repaired program's first attempt had
    failed: v = 0, its status the one it was repaired from)."""
    def first(p):
        return (p["repaired_from"] or p["status"],
                0 if p["repaired_from"] else int(p["status"] in REPRODUCED))

    def final(p):
        return p["status"], int(p["status"] in REPRODUCED)
    print(f"\n{'derived from these programs':<34}{'accuracy':>9}{'recall':>8}{'false-verify':>13}"
          f"{'exec_error':>11}{'prompts':>8}")
    for title, count, attempt in (
            ("1 program, no repair", 1, first), ("1 program + repair", 1, final),
            ("k programs, no repair", None, first), ("k programs + repair", None, final)):
        v, failed, prompts = [], 0, 0
        for r, kind in zip(results, kinds):
            programs = (r.details.get("programs")
                        or [dict(status=r.status, repaired_from=r.details.get("repaired_from"))])
            outcomes = [attempt(p) for p in programs[:count]]
            reproduced = [x for _, x in outcomes]
            v.append(max(reproduced))
            prompts += len(outcomes) + (attempt is final) * sum(p["repaired_from"] is not None
                                                                for p in programs[:count])
            failed += (kind == "correct" and not any(reproduced) and min(
                (s for s, _ in outcomes), key=FURTHEST.index) in ("exec_error", "timeout"))
        recall = sum(x for x, k in zip(v, kinds) if k == "correct") / kinds.count("correct")
        false = sum(x for x, k in zip(v, kinds) if k == "wrong") / kinds.count("wrong")
        print(f"{title:<34}{(recall + 1 - false) / 2:>9.1%}{recall:>8.1%}{false:>13.1%}"
              f"{failed / kinds.count('correct'):>11.1%}{prompts:>8}")


def logged_verifier(log_path, name):
    """A verifier that replays verifier `name`'s completions from a --measure log, in their order,
    so new program handling can be scored on the same generations without sampling again."""
    with open(log_path) as f:
        rows = [row for row in map(json.loads, f) if row["verifier"] == name]
    if not rows:
        raise SystemExit(f"--rescore {log_path}: no completions of verifier {name} in it")
    replay = lambda prompts: [VerifierReply(row["completion"], row["tokens"])  # noqa: E731
                              for row in rows]
    return replay, sum(row.get("seconds", 0.0) for row in rows) / len(rows)


def measure(count, max_new_tokens, seed, names=MEASURED, *, bench="math500",
            log_path="runs/verifier-measure.jsonl", rescore=None):
    """Verify a correct and a wrong short solution per problem with each verifier in `names`, on the
    same rollouts; print recall, false-verify rate, precision, status counts and costs, and log
    every program. bench: math500 (levels 1-5, Python programs) or knk (puzzles, SMT-LIB2 scripts
    for z3). rescore: a log of an earlier run, whose completions are scored again instead of
    sampling new ones."""
    problems, rollouts, answers, kinds, levels = measure_rollouts(count, bench)
    what = ("knk puzzles (wrong: one person flipped)" if bench == "knk"
            else "MATH-500 problems of levels 1-5")
    print(f"{len(rollouts)} rollouts: {len(rollouts) // 2} {what}, a correct and a wrong answer "
          f"each; " +
          (f"completions replayed from {rescore}" if rescore
           else f"up to {max_new_tokens} verifier tokens, seed {seed}"))
    rows = []
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    for name in names:
        verifier, seconds = logged_verifier(rescore, name) if rescore else (
            offline_verifier(name, max_new_tokens, seed), None)
        start = time.perf_counter()
        # a log holds one completion per rollout: rescoring replays it as one program, unrepaired
        results = verify_batch(problems, rollouts, answers, verifier, t3rl.bench_domain(bench),
                               **(dict(programs=1, repair=False) if rescore else {}))
        wall = time.perf_counter() - start
        del verifier
        by_level = {level: sum(r.v for r, k, lv in zip(results, kinds, levels)
                               if k == "correct" and lv == level) /
                    sum(k == "correct" and lv == level for k, lv in zip(kinds, levels))
                    for level in sorted(set(levels))}
        rows.append((name, verifier_scores(results, kinds), by_level,
                     sum(r.tokens for r in results) / len(results),
                     seconds if rescore else wall / len(results)))
        with open(log_path, "a") as f:
            for i, r in enumerate(results):
                f.write(json.dumps(dict(verifier=name, kind=kinds[i], level=levels[i],
                                        problem=problems[i], answer=answers[i], status=r.status,
                                        result=r.result, tokens=r.tokens, seconds=rows[-1][4],
                                        completion=r.completion, output=r.output[-2000:])) + "\n")
        print(f"{name}: {wall:.0f} s for {len(results)} rollouts", flush=True)
    print_measure(rows)
    print(f"\nevery completion, program output and status: {log_path}")


def print_measure(rows):
    """The --measure tables: status counts per verifier and kind of answer, then scores and
    costs."""
    shown = [s for s in STATUSES if s != "no_answer"]
    print(f"\n{'verifier':<16}{'answers':<9}" + "".join(f"{s:>11}" for s in shown))
    for name, scores, *_ in rows:
        for kind in ("correct", "wrong"):
            print(f"{name:<16}{kind:<9}"
                  + "".join(f"{scores['status'][kind][s]:>11}" for s in shown))
    print(f"\n{'verifier':<16}{'recall':>8}{'false-verify':>14}{'precision':>11}"
          f"{'tokens/rollout':>16}{'s/rollout':>11}"
          f"   recall by level " + "-".join(map(str, rows[0][2])))
    for name, scores, by_level, tokens, seconds in rows:
        precision = "-" if scores["precision"] is None else f"{scores['precision']:.0%}"
        print(f"{name:<16}{scores['recall']:>8.0%}{scores['false_verify']:>14.0%}{precision:>11}"
              f"{tokens:>16.0f}"
              f"{seconds:>11.1f}   " + " ".join(f"{x:.0%}" for x in by_level.values()))


def demo(name, max_new_tokens, seed):
    """One problem, its rollout, the verifier's program, the sandbox output and the verdict."""
    record = math500_by_level(5)[0]
    rollout = SOLUTION.format(answer=record["answer"])
    result = verify_batch([record["problem"]], [rollout], [extract_answer(rollout)],
                          offline_verifier(name, max_new_tokens, seed), MATH)[0]
    for title, text in (("problem", record["problem"]), ("rollout", rollout),
                        ("program", result.code or result.completion),
                        ("sandbox output", result.output)):
        print(f"--- {title}\n{(text or '').strip()}\n")
    print(f"--- verdict\nv = {result.v} ({result.status}): tool result {result.result!r}, answer "
          f"{extract_answer(rollout)!r}; {result.tokens} verifier tokens in {result.seconds:.1f} s")


def replay_steps(run_dir, seed):
    """--steps: per step of the run, its rollouts verified by its verifier model (as its config
    says) with and without laziness, alternating, so the two share whatever else the machine
    does."""
    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    records = {rec["id"]: rec for rec in load_bench(cfg["bench"])}
    domain = t3rl.bench_domain(cfg["bench"])
    steps = {}
    for line in open(os.path.join(run_dir, "rollouts.jsonl")):
        row = json.loads(line)
        steps.setdefault(row["step"], []).append(row)
    name = cfg["model"] if cfg["verifier_model"] == "self" else cfg["verifier_model"]
    model, tokenizer = load_model(name, dtype=torch.bfloat16)
    # greedy, so that both ways write the same program for a rollout they both verify (up to
    # bfloat16 rounding, which depends on the batch) and differ only in which rollouts they verify
    greedy = lambda *a, **k: sampler.generate(*a[:4], dataclasses.replace(a[4], temperature=0.0),  # noqa
                                              **k)
    verify = model_verifier(model.requires_grad_(False), tokenizer,
                            cfg["verifier_max_new_tokens"], seed, greedy)
    # the weights are packed once, on the first call: not timed
    verify([VerifierPrompt("", "What is 1 + 1?")])
    print(f"{run_dir}: verifier {name} (greedy), omega {cfg['omega']}, "
          f"budget {cfg['verify_budget']}, "
          f"{cfg['verifier_max_new_tokens']} tokens; sample s is the run's own")
    print(f"{'step':>4} {'sample s':>9} {'all s':>7} {'lazy s':>7} {'lazy/all':>8} {'prompts':>9} "
          f"{'calls':>5} {'tokens':>11} {'labels':>6} on the same programs")
    metrics = {row["step"]: row
               for row in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
               if row.get("kind") == "train"}
    totals = [0.0, 0.0]
    for step, rows in sorted(steps.items()):
        group = ([records[row["id"]]["problem"] for row in rows], [row["text"] for row in rows],
                 [row["answer"] for row in rows], cfg, domain)
        written = {}  # prompt -> the program the first (every-class) pass wrote for it
        full_s, full_calls, full_t, full_labels = timed_pass(*group, None, verify, written)
        lazy_s, lazy_calls, lazy_t, lazy_labels = timed_pass(*group, cfg["omega"], verify)
        # laziness on the very programs of the first pass must elect the same labels: its exactness,
        # checked here apart from the verifier's own variation between two calls (bfloat16 rounding
        # depends on the batch)
        replayed = timed_pass(*group, cfg["omega"],
                              lambda prompts: [written[p] for p in prompts])[3]
        totals[0] += full_s
        totals[1] += lazy_s
        sample = metrics.get(step, {}).get("seconds/sample")
        print(f"{step:>4} {sample or 0:>9.1f} {full_s:>7.1f} {lazy_s:>7.1f} "
              f"{lazy_s / full_s:>8.2f} "
              f"{sum(full_calls):>4}/{sum(lazy_calls):<4} {len(lazy_calls):>5} "
              f"{full_t:>5}/{lazy_t:<5} "
              f"{'same' if full_labels == lazy_labels else 'differ':>6} "
              f"{'same' if full_labels == replayed else 'DIFFER'}")
    print(f"all steps: every rollout {totals[0]:.1f} s, lazily {totals[1]:.1f} s, "
          f"ratio {totals[1] / totals[0]:.2f}")


def memory_replay(run_dir, verifier=None):
    """--memory RUN: a run with --verdict-memory against verifying afresh, on its own rollouts.
    Every step in which a question comes back (its second episode on) has its saved rollouts
    verified again without the memory, by t3rl.verify_groups with the run's verifier, settings and
    seeds (verifier: another callable, for tests). Prints per step its episode, the verifier tokens
    and programs both ways, the verdicts the memory reused and the questions whose label is the
    same both ways, then per episode tokens a step and label accuracy against the gold (reported,
    never trained on). Returns the per-episode rows."""
    run_dir = Path(run_dir)
    cfg = resumed_config({"resume": str(run_dir)})
    if not (cfg.verdict_memory and cfg.verifier_model != "none"):
        raise SystemExit(f"--memory {run_dir}: the run has no verdict memory; pass a run trained "
                         f"with --verdict-memory")
    domain = t3rl.bench_domain(cfg.bench)
    records = {rec["id"]: rec for rec in load_bench(cfg.bench)}
    metrics = {row["step"]: row for row in read_jsonl_rows(run_dir / "metrics.jsonl")
               if row.get("kind") == "train"}
    steps = {}
    for row in read_jsonl_rows(run_dir / "rollouts.jsonl"):
        steps.setdefault(row["step"], {}).setdefault(row["id"], []).append(row)
    call = verifier or t3rl.build_verifier(cfg, torch.device("cpu"))
    seen, totals = {}, {}

    def right(labels, gold):  # for the report only
        return sum(label is not None and bool(domain.equiv(label, g))
                   for label, g in zip(labels, gold))
    print(f"{run_dir}: omega {cfg.omega}, {cfg.verifier_programs} programs, "
          f"repair {cfg.verifier_repair}, budget {cfg.verify_budget}, "
          f"lazy {cfg.lazy_verify}, {cfg.verifier_max_new_tokens} verifier tokens")
    print(f"{'step':>4}{'episode':>8}{'tokens mem/afresh':>19}{'programs mem/afresh':>21}"
          f"{'reused':>8}{'labels same':>13}")
    with SandboxPool(timeout=SANDBOX_TIMEOUT) as pool:
        verify = t3rl.verify_function(cfg, call, pool, domain)  # as the run's, without the memory
        for step, questions in sorted(steps.items()):
            episode = max(seen.get(qid, 0) for qid in questions) + 1
            for qid in questions:
                seen[qid] = seen.get(qid, 0) + 1
            row = metrics.get(step)
            if row is None:
                continue  # a step whose metrics were never written (a cut run)
            gold = [records[qid]["answer"] for qid in questions]
            kept = [rows[0]["label"] for rows in questions.values()]
            total = totals.setdefault(episode, dict(steps=0, memory=0, afresh=0, same=0,
                                                    questions=0, right_memory=0, right_afresh=0))
            afresh_tokens, afresh_programs, fresh = row["verifier_tokens"], None, kept
            if episode > 1:  # the memory may have spoken: verify again without it
                recs = [records[qid] for qid in questions]
                groups = [[SimpleNamespace(text=r["text"]) for r in rows]
                          for rows in questions.values()]
                answers = [[r["answer"] for r in rows] for rows in questions.values()]
                judged = t3rl.verify_groups(verify, cfg.seed, recs, groups, answers, step)
                fresh = [weighted_vote(ans, [res.v for res in ver], cfg.omega,
                                       **domain.classes).label
                         for ans, ver in zip(answers, judged)]
                flat = [res for ver in judged for res in ver]
                afresh_tokens = sum(res.tokens or 0 for res in flat)
                afresh_programs = sum(programs_written(res)[0] for res in flat)
            same = sum(a == b for a, b in zip(kept, fresh))
            for key, value in (("steps", 1), ("memory", row["verifier_tokens"]),
                               ("afresh", afresh_tokens), ("same", same),
                               ("questions", len(kept)), ("right_memory", right(kept, gold)),
                               ("right_afresh", right(fresh, gold))):
                total[key] += value
            programs = "-" if afresh_programs is None else afresh_programs
            print(f"{step:>4}{episode:>8}{row['verifier_tokens']:>10}/{afresh_tokens:<8}"
                  f"{replies(steps[step]):>11}/{programs!s:<9}"
                  f"{row['extensions']['memory']['reused']:>8}"
                  f"{same:>8}/{len(kept):<4}", flush=True)
    for episode, t in sorted(totals.items()):
        print(f"episode {episode}: verifier tokens per step {t['memory'] / t['steps']:.0f} with "
              f"the memory, {t['afresh'] / t['steps']:.0f} afresh; labels the same on "
              f"{t['same']} of {t['questions']}; label accuracy {t['right_memory']} / "
              f"{t['right_afresh']} of {t['questions']} (memory / afresh)")
    return totals


def replies(questions: dict) -> int:
    """The verifier replies a step of a run took, from its rollouts.jsonl rows ({question: rows}):
    each rollout judged by its own programs, each program and repair counted."""
    return sum(programs_written(SimpleNamespace(
        inferred=r["inherited"], code=r["program"] or "", completion=None,
        details={k: r[k] for k in ("programs", "repaired_from") if k in r}))[0]
        for rows in questions.values() for r in rows
        if r["status"] not in (None, "no_answer", "skipped"))


def timed_pass(problems, texts, answers, cfg, domain, omega, model_call, written=None):
    """One verification of a step's rollouts (lazily at omega, or every one with None): seconds, the
    prompts of each verifier call, verifier tokens and the step's labels. written: gets each
    prompt's completion."""
    calls = []

    def counting(prompts):
        calls.append(len(prompts))
        completions = model_call(prompts)
        if written is not None:
            written.update(zip(prompts, completions))
        return completions
    start = time.perf_counter()
    results = verify_batch(problems, texts, answers, counting, domain, budget=cfg["verify_budget"],
                           omega=omega, programs=cfg.get("verifier_programs", 1),
                           repair=cfg.get("verifier_repair", False))
    n = cfg["n_votes"]
    labels = [weighted_vote(answers[i:i + n], [r.v for r in results[i:i + n]], cfg["omega"],
                            **domain.classes).label
              for i in range(0, len(answers), n)]
    return time.perf_counter() - start, calls, sum(r.tokens or 0 for r in results), labels


def main():
    # the docstring's first paragraph, on one line
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--measure", action="store_true",
                        help="verify correct and wrong answers to MATH-500 problems with each "
                        "--verifiers model")
    parser.add_argument("--demo", action="store_true",
                        help="verify one rollout with the first --verifiers model")
    parser.add_argument("--steps", metavar="RUN",
                        help="verify a training run's saved rollouts step by step, every "
                        "rollout and lazily (--lazy-verify), with the run's verifier; print the "
                        "seconds of both")
    parser.add_argument("--solutions", type=int, metavar="PER_LEVEL",
                        help="verify the right and a changed-box trace of PER_LEVEL human MATH "
                        "solutions per level (math500_solutions_dev.jsonl) with the first "
                        "--verifiers model and the options below")
    parser.add_argument("--programs", type=int, default=3,
                        help="--solutions: programs per trace (default 3)")
    parser.add_argument("--repair", action=argparse.BooleanOptionalAction, default=True,
                        help="--solutions: the repair turn for failed programs")
    parser.add_argument("--log", default="runs/verifier-solutions.jsonl",
                        help="--solutions: where every verdict and program goes")
    parser.add_argument("--memory", metavar="RUN",
                        help="a run with --verdict-memory: its steps from the second episode on "
                        "verified again without the memory; verifier tokens per step and labels")
    parser.add_argument("--verifiers", nargs="+", default=list(MEASURED),
                        help=f"verifier models, any --model value (default: {' '.join(MEASURED)})")
    parser.add_argument("--problems", type=int, default=60,
                        help="--measure: number of problems, spread over levels 1-5")
    parser.add_argument("--bench", choices=["math500", "knk"], default="math500",
                        help="--measure: MATH-500 (Python programs) or knk puzzles (SMT-LIB2 "
                        "scripts for z3)")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="verifier generation limit (default 512)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed of the verifier (default 0)")
    parser.add_argument("--rescore", metavar="LOG",
                        help="--measure: score the completions logged by an earlier "
                        "run again (after a change to program handling) instead of sampling")
    args = parser.parse_args()
    if args.measure:
        measure(args.problems, args.max_new_tokens, args.seed, args.verifiers, bench=args.bench,
                log_path=("runs/verifier-rescore.jsonl" if args.rescore
                          else "runs/verifier-measure.jsonl"),
                rescore=args.rescore)
    elif args.solutions:
        measure_solutions(args.solutions, args.max_new_tokens, args.seed, args.verifiers[0],
                          dict(programs=args.programs, repair=args.repair), args.log)
    elif args.memory:
        memory_replay(args.memory)
    elif args.demo:
        demo(args.verifiers[0], args.max_new_tokens, args.seed)
    elif args.steps:
        replay_steps(args.steps, args.seed)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
