"""The evidence study: does T3RL's verified vote pick the right pseudo-label more often than TTRL's
majority, and at what token cost? Measured on the same samples, without training.

  for each question q (gold g, hidden from every vote):
      y_1..y_K ~ pi(. | q)                       K = k_max rollouts, sampled once
      a_i = extract(y_i),  v_i = verify(q, y_i)  verified once, every rollout
  then, with no model, for k in 4, 8, 16, 32, 64 (up to K) and omega in 1, 2, 5, 10, inf:
      label_{q,k,omega} = weighted_vote(a_1..a_k, v_1..v_k, omega)   omega = 1 is TTRL's majority
      accuracy(k, omega) = mean_q 1[label ~ g], with paired 95% bootstrap intervals over questions,
      fixed / broke, and the tokens each vote costs

A study folder holds config.json, study.jsonl (one line per question), table.txt and study.png. A
killed study resumes at the next unfinished question; `--replay` recomputes the table and the PNG
from study.jsonl, loading no model. On a training run's folder, replay re-votes its saved rollouts
at each omega (the omega ablation). It takes t3rl.py's options:

  python -m extensions.study --bench math500 --limit 150 --n-votes 64   # sample, verify, report
  python -m extensions.study --resume runs/math500-study-20261130-170000 --n-votes 128  # grow it
  python -m extensions.study --replay runs/math500-study-20261130-170000    # report again
  python -m extensions.study --replay runs/demo-t3rl-w5-20261130-101500 --omega 1 5 inf

The design in full (the intervals, the token costs, --agent, growing a study):
docs/usage.md#the-evidence-study.
"""
import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import torch

import t3rl
from config import parse_config
from extensions import agent
from machinery import model
from machinery.benchmarks import load_bench
from machinery.metrics import group_metrics, levels_of
from machinery.runs import (DataError, RunDirError, append_jsonl, drop_torn_tail, jsonl_objects,
                            settle, write_jsonl)
from sampler import Sampling
from sandbox import SandboxPool
from verifier import SANDBOX_TIMEOUT, last_line, tool_agrees
from voting import weighted_vote

KS = (4, 8, 16, 32, 64)
OMEGAS = (1.0, 2.0, 5.0, 10.0, math.inf)
RESAMPLES = 2000
STUDY_FILE = "study.jsonl"


# --------------------------------------------------------------------------------------------------
# Questions and rollouts: sampled and verified once, one JSONL line per question

def open_study(cfg) -> Path:
    """The study's run folder, with its config.json: a new one, or the one --resume names. A folder
    holding a study with other settings is refused (resume it, or pick another --run-name)."""
    if cfg.verifier_model == "none" or cfg.verify_budget or cfg.lazy_verify:
        raise SystemExit("the study verifies every rollout: drop --verifier-model none, "
                         "--verify-budget and --lazy-verify")
    run_dir = Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / (
        cfg.run_name or f"{cfg.bench}-study-{time.strftime('%Y%m%d-%H%M%S')}")
    saved = run_dir / "config.json"
    before = run_config(run_dir) if saved.is_file() and not cfg.resume else {}
    changed = sorted(key for key, value in asdict(cfg).items()
                     if key in before and before[key] != value)
    if changed:
        raise SystemExit(f"{run_dir} holds a study with other {', '.join(changed)}: pass --resume "
                         f"{run_dir} to continue it (a larger --n-votes or --limit beside it grows "
                         f"it), or another --run-name")
    run_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({**asdict(cfg), "resume": ""}, indent=2))
    return run_dir


def stratified(records: list[dict], limit: int, seed: int) -> list[dict]:
    """`limit` questions spread evenly over MATH levels (a seeded shuffle within each level, then
    one question of each level in turn), so a study stopped early is still balanced. Without
    levels: the first `limit`."""
    levels = levels_of(records)
    if not levels:
        return records[:limit or None]
    pools = {lv: [r for r in records if r.get("level") == lv] for lv in levels}
    for lv, pool in pools.items():
        random.Random(f"{seed}|{lv}").shuffle(pool)
    order = [pools[lv][i] for i in range(max(map(len, pools.values()))) for lv in levels
             if i < len(pools[lv])]
    return order[:limit or None]


def question_row(rec: dict, group, answers, verdicts, agent=None) -> dict:
    """One question's line: its k_max rollouts (sampler Completions) with answers and verdicts
    (Verifications), and with --agent its k_max agent rollouts and their answers (agent: (group,
    answers))."""
    row = {"id": rec["id"], "gold": rec["answer"], "level": rec.get("level"),
           "subject": rec.get("subject"),
           "answers": answers, "v": [res.v for res in verdicts],
           "status": [res.status for res in verdicts],
           "result": [res.result for res in verdicts],
           "policy_tokens": [c.num_tokens for c in group],
           "verifier_tokens": [res.tokens or 0 for res in verdicts],
           "text": [c.text for c in group], "program": [res.code for res in verdicts]}
    if agent is not None:
        group, answers = agent
        row.update(agent_answers=answers, agent_tokens=[c.num_tokens for c in group],
                   agent_tool_tokens=[sum(c.tool_mask) for c in group],
                   agent_text=[c.text for c in group],
                   agent_calls=[[{"status": call.status, "output": call.output}
                                 for call in c.tool_calls]
                                for c in group])
    return row


def run_config(run_dir: Path) -> dict:
    """A run's or a study's config.json, with the bench and omega a report reads; one line when it
    is missing or damaged."""
    path = run_dir / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: no config.json there; pass a folder written by t3rl.py or "
                          f"the study") from None
    except (OSError, ValueError) as err:
        raise RunDirError(f"{path}: damaged ({err}); restore it from a copy") from None
    if not (isinstance(cfg, dict) and isinstance(cfg.get("bench"), str)
            and type(cfg.get("omega")) in (int, float)):
        raise RunDirError(f"{path}: no bench or omega in it; restore it from a copy")
    return cfg


ROLLOUT_FIELDS = ("answers", "v", "status", "result", "policy_tokens", "verifier_tokens", "text",
                  "program")
STUDY_FIELDS = ("id", "gold", "level", *ROLLOUT_FIELDS)  # what collect and report read of a line
AGENT_FIELDS = ("agent_answers", "agent_tokens", "agent_tool_tokens", "agent_text", "agent_calls")


def read_rows(run_dir: Path, fields=("id", "gold", "answers", "v")) -> list[dict]:
    """The finished questions of a study, each with `fields` (a line without one is named). A last
    line cut short by a kill is dropped (and cut from the file), so that question is sampled
    again."""
    path = run_dir / STUDY_FILE
    drop_torn_tail(path)
    rows = list(jsonl_objects(path, torn_tail_ok=True)) if path.is_file() else []
    for lineno, row in rows:
        missing = [key for key in fields if key not in row]
        if missing:
            raise DataError(f"{path}:{lineno}: no {', '.join(missing)} in it; delete that line "
                            f"(its question is sampled again) or restore the file from a copy")
    return [row for _, row in rows]


def collect(records: list[dict], run_dir: Path, sample_and_verify, batch_size: int,
            k_max: int) -> list[dict]:
    """Sample and verify what study.jsonl lacks: k_max rollouts for each question not in it, and
    rollouts have .. k_max - 1 for a question saved with only `have` (a study grown with a larger
    --n-votes), so the first `have` stay as they were and every k is still a nested subset.
    sample_and_verify(records, first, n) -> (groups, answers, verdicts, agent) gives n rollouts,
    numbered from `first`, per record (agent: None, or per record the (group, answers) of its agent
    rollouts); `batch_size` questions per call. New questions' lines are appended, grown ones
    replace the file (atomically), batch by batch."""
    path = run_dir / STUDY_FILE
    saved = {row["id"]: row for row in read_rows(run_dir, STUDY_FIELDS)}  # in file order

    def have(rec):
        return len(saved[rec["id"]]["answers"]) if rec["id"] in saved else 0

    todo = [(have(rec), rec) for rec in records if have(rec) < k_max]  # (rollouts it has, question)
    if saved:
        print(f"[study] {len(records) - len(todo)} of {len(records)} questions already have "
              f"{k_max} rollouts in {run_dir}; resuming", file=sys.stderr)
    for first, same_start in itertools.groupby(todo, key=lambda item: item[0]):
        same_start = [rec for _, rec in same_start]
        for start in range(0, len(same_start), batch_size):
            batch = same_start[start:start + batch_size]
            groups, answers, verdicts, agent = sample_and_verify(batch, first, k_max - first)
            rows = [question_row(*args)
                    for args in zip(batch, groups, answers, verdicts, agent or [None] * len(batch))]
            if first == 0:
                append_jsonl(path, rows)
            for row in rows:
                old = saved.get(row["id"])
                grown = [f for f in ROLLOUT_FIELDS + AGENT_FIELDS if f in row]
                saved[row["id"]] = (row if old is None
                                    else {**old, **{f: old[f] + row[f] for f in grown}})
            if first:
                write_jsonl(path, saved.values())
            print(f"[study] {sum(have(rec) == k_max for rec in records)}/{len(records)} questions "
                  f"sampled and verified", file=sys.stderr)
    return read_rows(run_dir)


# --------------------------------------------------------------------------------------------------
# Votes at every (k, omega), scored against the gold answers

def study_ks(k_max: int) -> list[int]:
    return sorted({k for k in KS if k < k_max} | {k_max})


def score(rows: list[dict], ks, omegas, classes: dict, equiv) -> dict:
    """c[(k, omega)]: [questions] 0/1 array, 1 when the vote over the first k rollouts at omega
    equals gold. classes: weighted_vote's key/same (which answers vote together); equiv(answer,
    gold): grading."""
    correct = {(k, w): np.zeros(len(rows)) for k in ks for w in omegas}
    for q, row in enumerate(rows):
        for k in ks:
            for w in omegas:
                label = weighted_vote(row["answers"][:k], row["v"][:k], omega=w, **classes).label
                correct[k, w][q] = float(label is not None and equiv(label, row["gold"]))
    return correct


def interval(values: np.ndarray, draws: np.ndarray) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of values ([questions]) over the resamples in
    draws ([resamples, n] question indices; n = the questions of the row)."""
    lo, hi = np.percentile(values[draws].mean(axis=1), [2.5, 97.5])
    return float(lo), float(hi)


def bootstrap_draws(n_questions: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[resamples, questions] indices, the same draws for every (k, omega), so differences are
    paired."""
    return np.random.default_rng(seed).integers(0, n_questions, size=(resamples, n_questions))


def token_costs(rows: list[dict], ks) -> dict:
    """k -> (policy tokens, verifier tokens generated, rollout tokens the verifier read), means per
    question over the first k rollouts. The verifier reads every rollout it is sent: all but those
    without an answer (and, in a lazy training run, those skipped)."""
    def read(r, k):
        return sum(p for p, s in zip(r["policy_tokens"][:k], r["status"][:k])
                   if s not in ("no_answer", "skipped"))
    return {k: (float(np.mean([sum(r["policy_tokens"][:k]) for r in rows])),
                float(np.mean([sum(r["verifier_tokens"][:k]) for r in rows])),
                float(np.mean([read(r, k) for r in rows]))) for k in ks}


# --------------------------------------------------------------------------------------------------
# The report: one table (stdout + table.txt) and one PNG (study.png)

def fmt_omega(w: float) -> str:
    return "TTRL" if w == 1 else f"w={w:g}"


def accuracy_table(correct, draws, ks, omegas, costs) -> list[str]:
    lines = [f"{'k':>3} {'vote':<6}{'label acc':>10} {'95% CI':<15}{'T3RL-TTRL':>10} {'95% CI':<17}"
             f"{'fixed':>6}{'broke':>6}{'policy tok':>12}{'verifier tok':>14}{'verifier read':>15}"]
    for k in ks:
        base = correct[k, 1.0]
        for w in omegas:
            c = correct[k, w]
            lo, hi = interval(c, draws)
            row = f"{k:>3} {fmt_omega(w):<6}{c.mean():>10.3f} [{lo:.3f}, {hi:.3f}] "
            policy, verifier, read = costs[k]
            if w == 1:
                row += f"{'':>10} {'':<17}{'':>6}{'':>6}{policy:>12.0f}{0:>14.0f}{0:>15.0f}"
            else:
                dlo, dhi = interval(c - base, draws)
                row += (f"{(c - base).mean():>+10.3f} [{dlo:+.3f}, {dhi:+.3f}]"
                        f"{int(((c == 1) & (base == 0)).sum()):>6}"
                        f"{int(((c == 0) & (base == 1)).sum()):>6}"
                        f"{policy:>12.0f}{verifier:>14.0f}{read:>15.0f}")
            lines.append(row)
    return lines


def level_table(rows, correct, ks, omega, seed: int, resamples: int) -> list[str]:
    """TTRL vs T3RL at `omega` per MATH level and for levels 4-5 together, each k."""
    levels = levels_of(rows)
    if not levels:
        return []
    groups = [(f"level {lv}", [r["level"] == lv for r in rows]) for lv in levels]
    groups.append(("levels 4-5", [r["level"] in (4, 5) for r in rows]))
    lines = ["", f"by MATH level, TTRL vs T3RL at omega {omega:g} "
                 f"(intervals resample the questions of the row)",
             f"{'questions':<11}{'n':>4}{'k':>4}{'TTRL':>7}{'T3RL':>7}{'T3RL-TTRL':>11} "
             f"{'95% CI':<17}{'fixed':>6}{'broke':>6}"]
    for name, mask in groups:
        idx = np.flatnonzero(mask)
        if not len(idx):
            continue
        # [resamples, n] indices of this row's questions
        draws = idx[bootstrap_draws(len(idx), seed, resamples)]
        for k in ks:
            t3, tt = correct[k, omega], correct[k, 1.0]
            lo, hi = interval(t3 - tt, draws)
            lines.append(f"{name:<11}{len(idx):>4}{k:>4}{tt[idx].mean():>7.3f}"
                         f"{t3[idx].mean():>7.3f}"
                         f"{(t3 - tt)[idx].mean():>+11.3f} [{lo:+.3f}, {hi:+.3f}]"
                         f"{int(((t3 == 1) & (tt == 0))[idx].sum()):>6}"
                         f"{int(((t3 == 0) & (tt == 1))[idx].sum()):>6}")
    return lines


def budget_lines(correct, draws, ks, omegas, costs) -> list[str]:
    """T3RL at each smaller k against TTRL at the largest k: the paper's 'T3RL@16 >= TTRL@64 at
    fewer tokens'."""
    top = ks[-1]
    lines = ["", f"T3RL at k against TTRL at k = {top} (paired over questions; "
                 f"tokens = policy + verifier generated; read: + the rollouts the verifier read)"]
    for k in ks[:-1]:
        for w in omegas:
            if w == 1:
                continue
            d = correct[k, w] - correct[top, 1.0]
            lo, hi = interval(d, draws)
            generated, top_tokens = costs[k][0] + costs[k][1], costs[top][0]
            lines.append(f"  T3RL@{k} {fmt_omega(w):<6} - TTRL@{top}: {d.mean():+.3f} "
                         f"[{lo:+.3f}, {hi:+.3f}]   tokens {generated:.0f} vs {top_tokens:.0f} "
                         f"({generated / top_tokens:.2f}x), read {generated + costs[k][2]:.0f} "
                         f"({(generated + costs[k][2]) / top_tokens:.2f}x)")
    return lines


def agent_lines(rows, correct, draws, ks, omega, classes, equiv) -> list[str]:
    """TTRL-Agent (the majority over the policy's own tool-using rollouts) beside TTRL and T3RL, on
    the same questions and seeds, and how the policy used its tool."""
    agent = {k: np.array([float((label := weighted_vote(r["agent_answers"][:k], [0] * k,
                                                        omega=1.0, **classes).label)
                                is not None and equiv(label, r["gold"])) for r in rows])
             for k in ks}
    calls = [len(made) for r in rows for made in r["agent_calls"]]
    statuses = {}
    for r in rows:
        for made in r["agent_calls"]:
            for call in made:
                statuses[call["status"]] = statuses.get(call["status"], 0) + 1
    right = [a is not None and equiv(a, r["gold"]) for r in rows for a in r["agent_answers"]]
    from_tool = [a is not None and any(tool_agrees(last_line(call["output"]), a) for call in made)
                 for r in rows for a, made in zip(r["agent_answers"], r["agent_calls"])]
    lines = ["", f"TTRL-Agent: the policy calls the interpreter in its own rollouts (--agent), "
                 f"majority vote; {len(calls)} rollouts, "
                 f"{sum(c > 0 for c in calls) / len(calls):.3f} of them call it, "
                 f"{np.mean(calls):.2f} calls per rollout "
                 f"({', '.join(f'{s} {n}' for s, n in sorted(statuses.items()))}); "
                 f"right {np.mean(right):.3f}, final answer printed by a call "
                 f"{np.mean(from_tool):.3f}; tokens per question at k = {ks[-1]}: "
                 f"{np.mean([sum(r['agent_tokens'][:ks[-1]]) for r in rows]):.0f} (tool output "
                 f"{np.mean([sum(r['agent_tool_tokens'][:ks[-1]]) for r in rows]):.0f})",
             f"{'k':>3} {'TTRL':>7} {'TTRL-Agent':>11} {'T3RL w=' + f'{omega:g}':>9}  "
             f"{'Agent-TTRL':>10} {'95% CI':<17}{'T3RL-Agent':>11} {'95% CI':<17}"]
    for k in ks:
        base, t3 = correct[k, 1.0], correct[k, omega]
        (lo, hi), (tlo, thi) = interval(agent[k] - base, draws), interval(t3 - agent[k], draws)
        lines.append(f"{k:>3} {base.mean():>7.3f} {agent[k].mean():>11.3f} {t3.mean():>9.3f}  "
                     f"{(agent[k] - base).mean():>+10.3f} [{lo:+.3f}, {hi:+.3f}]"
                     f"{(t3 - agent[k]).mean():>+11.3f} "
                     f"[{tlo:+.3f}, {thi:+.3f}]")
    return lines


def pass_line(right, ks) -> str:
    """pass@k: some rollout among the first k is right, the ceiling of every vote's label
    accuracy."""
    return "pass@k (the ceiling of any vote): " + ", ".join(
        f"k={k} {np.mean([any(rs[:k]) for rs in right]):.3f}" for k in ks)


def verdict_line(rows, right) -> str:
    """How the verifier did on all rollouts: verified share, precision, and the status counts."""
    v = [vi for r in rows for vi in r["v"]]
    right = [ok for rs in right for ok in rs]
    verified_right = sum(vi and ok for vi, ok in zip(v, right))
    statuses = {}
    for r in rows:
        for s in r["status"]:
            statuses[s] = statuses.get(s, 0) + 1
    precision = f"{verified_right / sum(v):.3f}" if sum(v) else "-"
    return (f"rollouts {len(v)}: right {sum(right) / len(v):.3f}, verified {sum(v) / len(v):.3f}, "
            f"verifier precision {precision}, recall {verified_right / max(1, sum(right)):.3f}; "
            + ", ".join(f"{s} {n}" for s, n in sorted(statuses.items())))


def plot(path: Path, correct, draws, ks, omegas, costs, title: str, read_omega: float):
    """Label accuracy against mean tokens per question: TTRL pays policy tokens, T3RL policy +
    verifier generated, and once more at read_omega with the rollout tokens the verifier reads added
    (its cost on a CPU)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in omegas:
        x = [costs[k][0] + (costs[k][1] if w != 1 else 0) for k in ks]
        y = [correct[k, w].mean() for k in ks]
        cis = [interval(correct[k, w], draws) for k in ks]
        err = [[yi - lo for yi, (lo, _) in zip(y, cis)], [hi - yi for yi, (_, hi) in zip(y, cis)]]
        label = ("TTRL (majority, policy tokens)" if w == 1
                 else f"T3RL omega={w:g} (policy + verifier tokens)")
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label,
                    linestyle="-" if w == 1 else "--")
        if w == 1:
            for xi, yi, k in zip(x, y, ks):
                ax.annotate(f"k={k}", (xi, yi), textcoords="offset points", xytext=(4, -12),
                            fontsize=8)
    ax.plot([sum(costs[k]) for k in ks], [correct[k, read_omega].mean() for k in ks], marker="x",
            linestyle=":", color="gray",
            label=f"T3RL omega={read_omega:g}, + the rollout tokens the verifier reads")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per question (mean): generated, and read by the verifier where said")
    ax.set_ylabel("pseudo-label accuracy (95% bootstrap CI)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(run_dir: Path, classes: dict, equiv, resamples: int = RESAMPLES) -> str:
    """Every number of the study from study.jsonl alone (classes, equiv: the benchmark's answer
    domain, as in score): returns the table, writes it to table.txt and the plot to study.png."""
    rows = read_rows(run_dir, STUDY_FIELDS)
    if not rows:
        raise SystemExit(f"{run_dir}: no {STUDY_FILE} with finished questions; "
                         f"run `python -m extensions.study` first")
    cfg = run_config(run_dir) if (run_dir / "config.json").is_file() else {}
    seed, omega = cfg.get("seed", 0), cfg.get("omega", 5.0)
    omega = omega if omega in OMEGAS and omega != 1 else 5.0
    ks = study_ks(min(len(r["answers"]) for r in rows))
    correct = score(rows, ks, OMEGAS, classes, equiv)
    # [questions][k_max]
    right = [[a is not None and equiv(a, r["gold"]) for a in r["answers"]] for r in rows]
    costs = token_costs(rows, ks)
    draws = bootstrap_draws(len(rows), seed, resamples)
    levels = levels_of(rows)
    title = (f"{run_dir.name}: {len(rows)} questions, k up to {ks[-1]}; "
             f"policy {cfg.get('model', '?')}, verifier {cfg.get('verifier_model', '?')}")
    per_level = ", ".join(f"level {lv}: {sum(r['level'] == lv for r in rows)}" for lv in levels)
    lines = [title,
             f"questions per MATH level: {per_level}" if levels
             else "no MATH levels in this benchmark",
             verdict_line(rows, right), pass_line(right, ks),
             f"label accuracy against the hidden gold; 95% bootstrap intervals over questions "
             f"({resamples} resamples, seed {seed}); tokens: mean generated per question; "
             f"verifier read: mean rollout tokens it read as prompts",
             ""]
    lines += accuracy_table(correct, draws, ks, OMEGAS, costs)
    lines += level_table(rows, correct, ks, omega, seed, resamples)
    lines += budget_lines(correct, draws, ks, OMEGAS, costs)
    if all("agent_answers" in r for r in rows):
        lines += agent_lines(rows, correct, draws, ks, omega, classes, equiv)
    text = "\n".join(lines)
    (run_dir / "table.txt").write_text(text + "\n", encoding="utf-8")
    plot(run_dir / "study.png", correct, draws, ks, OMEGAS, costs, title, omega)
    return text


def run_study(cfg) -> Path:
    """k_max = n_votes rollouts per question, sampled and verified once, saved, then the report
    (--agent: and k_max agent rollouts per question on the same seeds, for TTRL-Agent's vote). It
    samples and verifies with the loop's own functions (t3rl.py); each question has its own seed,
    so a resumed study samples what an uninterrupted one would."""
    run_dir = open_study(cfg)
    records = stratified(load_bench(cfg.bench), cfg.limit, cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    policy, tokenizer = model.load_model(cfg.model, dtype=getattr(torch, cfg.sample_dtype))
    policy.to(device)  # it never trains
    domain = t3rl.bench_domain(cfg.bench)
    weights = (policy, tokenizer) if cfg.verifier_model == "self" else None
    # --backend's generate, and a speed path's hold on the verifier's weights (not on the policy's)
    generate, speed = t3rl.speed_path(cfg.backend)
    hold = speed.hold_verifier if speed and not weights else None
    verify_call = t3rl.build_verifier(cfg, device, generate=generate, hold=hold, loaded=weights)
    sampling = Sampling(cfg.max_new_tokens, cfg.temperature, cfg.top_p, getattr(torch,
                                                                              cfg.sample_dtype))
    with SandboxPool(timeout=SANDBOX_TIMEOUT) as pool:
        verify = t3rl.verify_function(cfg, verify_call, pool, domain)  # every rollout
        tools = agent.Interpreter(tokenizer, pool) if cfg.agent else None

        def sample_and_verify(batch, first: int, n: int):
            # rollouts from `first` on (a grown study) get seeds of their own: new draws
            grown = f"+{first}" if first else ""
            seeds = [t3rl.question_seed(cfg.seed, -1, rec["id"], "study" + grown) for rec in batch]
            prompts = [t3rl.policy_prompt(tokenizer, rec["problem"], domain.instruction)
                       for rec in batch]
            groups = generate(policy, tokenizer, prompts, n, sampling, seed=seeds,
                              progress="study")
            answers = t3rl.read_answers(batch, groups, domain)
            verdicts = t3rl.verify_groups(verify, cfg.seed, batch, groups, answers, -1,
                                          "study" + grown)
            if not tools:
                return groups, answers, verdicts, None
            # --agent: the same questions and seeds, the policy with its own interpreter
            prompts = [t3rl.policy_prompt(tokenizer, rec["problem"],
                                          domain.instruction + agent.TOOL_INSTRUCTION)
                       for rec in batch]
            rollouts = agent.generate(policy, tokenizer, prompts, n, sampling, seeds, cfg.backend,
                                      tools)
            return groups, answers, verdicts, list(zip(rollouts, t3rl.read_answers(
                batch, rollouts, domain)))
        collect(records, run_dir, sample_and_verify, cfg.questions_per_step, cfg.n_votes)
    print(report(run_dir, domain.classes, domain.equiv))
    return run_dir


def replay(run_dir: Path, omegas: list[float] | None = None) -> str:
    """Re-vote every saved rollout group with each omega (None: OMEGAS): label accuracy, reward
    accuracy and flips, no model needed. A --study folder gets its study report (study.py), whose
    omegas are OMEGAS, instead."""
    cfg = run_config(run_dir)
    domain = t3rl.bench_domain(cfg["bench"])
    if (run_dir / "study.jsonl").is_file():
        if omegas is not None:
            raise t3rl.OptionError(f"--replay {run_dir} --omega: a study's report has omegas "
                                   f"{', '.join(f'{o:g}' for o in OMEGAS)}; drop --omega")
        return report(run_dir, domain.classes, domain.equiv)
    omegas = list(OMEGAS) if omegas is None else omegas
    if not (run_dir / "rollouts.jsonl").is_file():
        raise RunDirError(f"--replay {run_dir}: no rollouts.jsonl there; pass a run folder "
                          f"written by t3rl.py")
    gold = {r["id"]: r["answer"] for r in load_bench(cfg["bench"])}
    groups, seen = {}, {}
    for lineno, r in jsonl_objects(run_dir / "rollouts.jsonl", torn_tail_ok=True):
        where = f"{run_dir / 'rollouts.jsonl'}:{lineno}"
        if not (isinstance(r.get("id"), str) and r["id"] in gold and "status" in r
                and type(r.get("step")) is int and type(r.get("index")) is int
                and r.get("v") in (0, 1) and isinstance(r.get("answer"), (str, type(None)))):
            raise DataError(f"{where}: not a rollout of --bench {cfg['bench']} (its id, step, "
                            f"index, answer, v and status); replay the folder of a run on that "
                            f"benchmark, or fix or delete that line")
        first = seen.setdefault((r["step"], r["id"], r["index"]), lineno)
        if first != lineno:
            raise DataError(f"{where}: rollout {r['index']} of {r['id']} at step {r['step']} again "
                            f"(line {first}); delete one of them")
        groups.setdefault((r["step"], r["id"]), []).append(r)
    unsettled = [omega for omega in omegas if omega not in (1.0, cfg["omega"])]
    if unsettled and any(r["status"] == "skipped" for rows in groups.values() for r in rows):
        raise RunDirError(f"--replay {run_dir} --omega {' '.join(f'{o:g}' for o in unsettled)}: "
                          f"the run verified lazily (--lazy-verify), so its verdicts settle the "
                          f"vote at omega {cfg['omega']:g} (and 1) only; replay those, or train "
                          f"with --no-lazy-verify for the ablation")
    lines = [f"omega ablation replayed on {len(groups)} rollout groups of {run_dir}",
             f"{'omega':>7}{'label acc':>11}{'reward acc':>12}{'flips':>7}{'fixed':>7}"
             f"{'broke':>7}"]
    for omega in omegas:
        totals = {"label_accuracy": 0.0, "reward_accuracy": 0.0, "flipped": 0.0,
                  "flip_fixed": 0.0, "flip_broke": 0.0}
        for (_, qid), rows in groups.items():
            answers = [r["answer"] for r in rows]
            v = [r["v"] for r in rows]
            vote = weighted_vote(answers, v, omega=omega, **domain.classes)
            stats = group_metrics(vote, answers, v, omega, gold=gold[qid], **domain.classes)
            for key in totals:
                totals[key] += stats[key]
        n = max(len(groups), 1)
        lines.append(f"{omega:>7g}{totals['label_accuracy'] / n:>11.3f}"
                     f"{totals['reward_accuracy'] / n:>12.3f}"
                     f"{totals['flipped']:>7.0f}{totals['flip_fixed']:>7.0f}"
                     f"{totals['flip_broke']:>7.0f}")
    return "\n".join(lines)


def study_config(argv: list, gpu: bool):
    """t3rl.py's options for a study: every rollout verified (the preset's budget and laziness off
    unless typed); --n-train, which a study never uses, 2 unless typed; a resumed study may grow
    --n-votes and --limit (0: every question), never shrink."""
    grow = argparse.ArgumentParser(add_help=False)
    grow.add_argument("--resume")
    grow.add_argument("--n-votes", type=int)
    grow.add_argument("--limit", type=int)
    known, rest = grow.parse_known_args(argv)
    if known.resume:
        cfg = parse_config(["--resume", known.resume, *rest], gpu)
        for name, value in (("n_votes", known.n_votes), ("limit", known.limit)):
            if value is None:
                continue
            size = lambda n: float("inf") if name == "limit" and n == 0 else n  # noqa: E731
            if size(value) < size(getattr(cfg, name)):
                raise t3rl.OptionError(f"--{name.replace('_', '-')} {value} (the run has "
                                       f"{getattr(cfg, name)}): a study may grow, never shrink")
            setattr(cfg, name, value)
        return cfg
    typed = " ".join(argv)
    defaults = ([] if "verify-budget" in typed else ["--verify-budget", "0"]) + (
        [] if "lazy-verify" in typed else ["--no-lazy-verify"])
    if "--n-train" not in typed:  # the least GRPO allows: --n-votes 2 and up all start
        defaults += ["--n-train", "2"]
    votes = [] if known.n_votes is None else ["--n-votes", str(known.n_votes)]
    limit = [] if known.limit is None else ["--limit", str(known.limit)]
    return parse_config(rest + votes + limit + defaults, gpu)


def main(argv: list):
    """python -m extensions.study [t3rl.py options], or --replay RUN [--omega W ...]."""
    try:
        if "--replay" in argv or any(a.startswith("--replay=") for a in argv):
            parser = argparse.ArgumentParser(prog="python -m extensions.study")
            parser.add_argument("--replay", type=Path, required=True, help="a study folder to "
                                "report again, or a training run to re-vote at each --omega")
            parser.add_argument("--omega", type=float, nargs="+")
            args = parser.parse_args(argv)
            bad = [w for w in args.omega or () if not w >= 1]
            if bad:
                raise t3rl.OptionError(f"--omega {bad[0]}: must be in [1, inf]")
            print(replay(args.replay, args.omega))
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would sample it all
            raise t3rl.OptionError("the study runs in one process (it never trains, nothing is "
                                   "split over processes): start it with python -m "
                                   "extensions.study, not accelerate launch or torchrun")
        else:
            gpu = torch.cuda.is_available()
            cfg = study_config(argv, gpu)
            settle(cfg, gpu)  # the sampling dtype, fixed in its config.json as a run's
            t3rl.check_models(cfg)  # before its folder exists
            run_study(cfg)
    except (RunDirError, t3rl.OptionError, t3rl.runs.DataError, model.ModelLoadError) as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
