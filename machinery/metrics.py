"""What a run reports: per-question monitors, the step's metrics row and line, the summary table,
curves.png.

The monitors compare the vote with the hidden gold answers (label accuracy, the verifier's precision
and recall, flips fixed or broken): reporting only, never rewards. One row per step goes to
metrics.jsonl.
"""
import re
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from machinery.runs import read_jsonl_rows
from verifier import Domain
from voting import Vote, rank_classes, weighted_vote


class Stopwatch(dict):
    """Seconds per phase: `with clock("sample"): ...` adds the time the block took to
    clock["sample"]."""

    @contextmanager
    def __call__(self, phase: str):
        started = time.time()
        yield
        self[phase] = self.get(phase, 0.0) + time.time() - started


def is_correct(answer, gold, domain: Domain) -> bool:
    return answer is not None and domain.equiv(answer, gold)


def question_monitors(rec, group, answers, verdicts, vote, domain: Domain, omega: float) -> dict:
    """How one question's vote went, against the gold answer: monitors only, never rewards."""
    stats = group_metrics(vote.vote, answers, vote.v, omega, rec["answer"], **domain.classes)
    # TTRL's label is the plain majority: it differs from ours exactly where a flip fixed or broke
    # it
    stats["majority_label_accuracy"] = (stats["label_accuracy"] - stats["flip_fixed"]
                                        + stats["flip_broke"])
    correct = [is_correct(a, rec["answer"], domain) for a in answers]
    results = [res for res in verdicts if res is not None]
    stats["correct"] = sum(correct)
    stats["no_answer"] = sum(a is None for a in answers)
    # the verifier's precision and recall count the rollouts it judged: not a skipped one (never
    # asked), not one that inherited its class's verdict (--verify-budget), whose count is the
    # class's size
    judged = [res is not None and not res.inferred and res.status not in ("skipped", "no_answer")
              for res in verdicts]
    inherited = [res is not None and res.inferred for res in verdicts]
    stats["judged_verified"] = sum(vi and x for vi, x in zip(vote.v, judged))
    stats["verified_correct"] = sum(vi and ci and x for vi, ci, x in zip(vote.v, correct, judged))
    stats["correct_judged"] = sum(ci and x for ci, x in zip(correct, judged))
    stats["inherited_verified"] = sum(vi and x for vi, x in zip(vote.v, inherited))
    stats["inherited_verified_correct"] = sum(vi and ci and x
                                              for vi, ci, x in zip(vote.v, correct, inherited))
    # the programs' outcomes: a verdict a class passed on is counted once, where it was reached
    stats["statuses"] = [res.status for res in results if not res.inferred]
    stats["verifier_tokens"] = sum(res.tokens or 0 for res in results)
    stats["response_tokens"] = [c.num_tokens for c in group]
    return stats


def group_metrics(vote: Vote, answers, verified, omega, gold=None, same=None, key=None) -> dict:
    """One question's vote against its gold answer (monitors, never rewards): majority_ratio (share
    in the plain-majority class), verified_ratio, flipped (the vote's winner is not the majority
    class; never at omega 1); with gold: label_accuracy, reward_accuracy (rewards that agree with
    gold's), ground_truth_ratio (share in gold's class), pass@N, flip_fixed / flip_broke."""
    n = len(vote.assignment)
    by_count = rank_classes([c.members for c in vote.classes], [1.0] * n)
    majority = next((k for k, c in enumerate(vote.classes)
                     if by_count and c.members == by_count[0]), None)
    flipped = omega != 1 and majority not in (None, 0)
    metrics = {"majority_ratio": len(vote.classes[majority].members) / n if majority is not None
               else 0.0, "verified_ratio": sum(verified) / n, "flipped": float(flipped)}
    if gold is None:
        return metrics
    gold_class = class_of(vote, answers, gold, same, key)
    true = [1.0 if k is not None and k == gold_class else 0.0 for k in vote.assignment]
    label_right = gold_class is not None and gold_class == 0
    majority_right = gold_class is not None and gold_class == majority
    return metrics | {
        "label_accuracy": float(label_right),
        "reward_accuracy": sum(p == t for p, t in zip(vote.rewards(), true)) / n,
        "ground_truth_ratio": sum(true) / n, "pass@N": float(any(true)),
        "flip_fixed": float(flipped and label_right and not majority_right),
        "flip_broke": float(flipped and majority_right and not label_right)}


def class_of(vote: Vote, answers, answer, same, key) -> int | None:
    """The index of the vote class `answer` (the gold answer, say) belongs to, or None."""
    key = key or (lambda a: "".join(a.split()))
    for k, vote_class in enumerate(vote.classes) if answer is not None else ():
        if (any(key(answers[i]) == key(answer) for i in vote_class.members)
                or same is not None and same(vote_class.answer, answer)):
            return k
    return None


def step_metrics(step, per_question, update, seconds, extensions=()) -> dict:
    """One metrics row: per-question monitors (means), the update's statistics (whole step, all
    processes), each phase's time (the slowest process) and, under "extensions", the counts of each
    extension monitor named (t3rl.Learner.monitors), summed over the questions."""
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    row = {"kind": "train", "step": step, "questions": len(per_question)}
    for key in ("label_accuracy", "majority_label_accuracy", "reward_accuracy", "majority_ratio",
                "ground_truth_ratio", "verified_ratio", "flipped", "flip_fixed", "flip_broke",
                "pass@N"):
        row[key] = mean([q[key] for q in per_question])
    # empty when no rollout went to the verifier
    statuses = [s for q in per_question for s in q["statuses"]]
    row["status"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    # the verifier against the hidden gold answers (reporting only), over the rollouts it judged:
    # precision = right share of the verified, recall = verified share of the right; None where it
    # judged none (no verifier, or none asked); verdicts a class passed on (budget, memory) apart
    for key, monitor in (("correct_rollouts", "correct"), ("verified_rollouts", "judged_verified"),
                         ("verified_correct", "verified_correct"),
                         ("correct_judged_rollouts", "correct_judged"),
                         ("inherited_verified_rollouts", "inherited_verified"),
                         ("inherited_verified_correct", "inherited_verified_correct")):
        row[key] = sum(q[monitor] for q in per_question)
    row["verifier_precision"] = (row["verified_correct"] / row["verified_rollouts"]
                                 if row["verified_rollouts"] else None)
    row["verifier_recall"] = (row["verified_correct"] / row["correct_judged_rollouts"]
                              if row["correct_judged_rollouts"] else None)
    lengths = [n for q in per_question for n in q["response_tokens"]]
    # rollouts that state no answer: no vote, reward 0 (TTRL's answer rule: an implicit format
    # reward)
    row["no_answer_ratio"] = sum(q["no_answer"] for q in per_question) / max(len(lengths), 1)
    row["response_length"] = mean(lengths)
    row["policy_tokens"] = sum(lengths)
    row["verifier_tokens"] = sum(q["verifier_tokens"] for q in per_question)
    if extensions:
        row["extensions"] = {name: sum_counts([q[name] for q in per_question])
                             for name in extensions}
    row.update({f"grpo/{key}": value for key, value in update.items()})
    for phase in seconds[0]:
        row[f"seconds/{phase}"] = max(s[phase] for s in seconds)
    return row


def sum_counts(per_question: list[dict]) -> dict:
    """Key-wise sums of per-question counts: numbers, or {what: count} dicts (a count that sums to
    0 stays)."""
    total = {}
    for counts in per_question:
        for key, value in counts.items():
            if isinstance(value, dict):
                total.setdefault(key, Counter()).update(value)  # update keeps zeros; + drops them
            else:
                total[key] = total.get(key, 0) + value
    return {key: dict(value) if isinstance(value, Counter) else value
            for key, value in total.items()}


def format_step(row: dict, total: int) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    timing = " ".join(f"{key[len('seconds/'):]} {value:.0f}s" for key, value in row.items()
                      if key.startswith("seconds/"))
    skips = row.get("grpo/skipped_steps", 0)
    skipped = f" (skipped {skips:.0f}: gradient not finite)" if skips else ""
    # the engine's log-probs against the trainer's (--backend vllm): how far off-policy its rollouts
    # are
    mismatch = (f" lp-gap {row['grpo/logprob_mismatch']:.4f}" if "grpo/logprob_mismatch" in row
                else "")
    extensions = "".join(f" | {name} " + " ".join(f"{key} {value}" for key, value in counts.items())
                         for name, counts in row.get("extensions", {}).items())
    return (f"step {row['step'] + 1}/{total} | label {fmt(row['label_accuracy'])}"
            f" (maj {fmt(row['majority_label_accuracy'])})"
            f" reward {fmt(row['reward_accuracy'])} | maj-ratio {fmt(row['majority_ratio'])}"
            f" gt-ratio {fmt(row['ground_truth_ratio'])} | verified {fmt(row['verified_ratio'])}"
            f" prec {fmt(row['verifier_precision'])} rec {fmt(row['verifier_recall'])}"
            f" | flips {row['flipped'] * row['questions']:.0f}"
            f" (+{row['flip_fixed'] * row['questions']:.0f}"
            f"/-{row['flip_broke'] * row['questions']:.0f})"
            f" | len {row['response_length']:.0f} no-ans {fmt(row.get('no_answer_ratio'))}"
            f" ent {fmt(row.get('grpo/entropy'))}"
            f" loss {row.get('grpo/loss', 0):+.4f}"
            f" opt-steps {row.get('grpo/optimizer_steps', 0):.0f}"
            f"{skipped} clip {row.get('grpo/clip_frac', 0):.4f}{mismatch}{extensions} | {timing}")


def eval_row(rec, greedy_answer, answers, verified, domain: Domain, omega: float) -> dict:
    """One question's evaluation against its gold answer: greedy@1, the k runs' results, maj@k,
    verified_maj@k (the weighted vote on the k samples, when verified: [k] verdicts) and the shares
    with no answer."""
    gold, k = rec["answer"], len(answers)
    row = {"id": rec["id"], "level": rec.get("level"),
           "greedy@1": float(is_correct(greedy_answer, gold, domain)),
           "greedy_no_answer": float(greedy_answer is None)}
    if k:
        row["runs"] = [float(is_correct(a, gold, domain)) for a in answers]  # [k]
        row[f"maj@{k}"] = float(is_correct(weighted_vote(answers, [0] * k, 1.0,
                                                         **domain.classes).label, gold, domain))
        if verified is not None:
            label = weighted_vote(answers, verified, omega, **domain.classes).label
            row[f"verified_maj@{k}"] = float(is_correct(label, gold, domain))
        row[f"no_answer@{k}"] = sum(a is None for a in answers) / k
    return row


def levels_of(rows) -> list:
    """The rows' levels, each once, numbers first, then names: a file may give both (1, 2,
    "olympiad")."""
    return sorted({r.get("level") for r in rows} - {None}, key=lambda lv: (isinstance(lv, str), lv))


def eval_metrics(rows: list[dict], k: int) -> dict:
    """One evaluation from its per-question rows (all processes): means over the questions, and
    avg@k with its spread, from each question's k run results ("runs"): run j's accuracy is the mean
    over questions of its j-th result, avg@k the mean of the k runs' accuracies, avg@k_std their
    standard deviation (ddof 0); the same for each level when the benchmark has levels."""
    def reduce(rows):
        result = {"greedy@1": statistics.fmean(r["greedy@1"] for r in rows)}
        if k:
            per_run = [statistics.fmean(r["runs"][j] for r in rows) for j in range(k)]
            result[f"avg@{k}"], result[f"avg@{k}_std"] = (statistics.fmean(per_run),
                                                          statistics.pstdev(per_run))
        keys = [key for key in rows[0] if key not in ("id", "level", "runs", "greedy@1")]
        return result | {key: statistics.fmean(r[key] for r in rows) for key in keys}
    result = reduce(rows)
    levels = levels_of(rows)
    if levels:
        result["by_level"] = {lv: reduce([r for r in rows if r["level"] == lv]) for lv in levels}
    return result


# what an evaluation row says about its questions (t3rl.train's coverage)
COVERAGE = ("questions", "trained_questions")
ACCURACY = re.compile(r"(greedy@1|avg@\d+|maj@\d+|verified_maj@\d+)$")


def best_evals(rows: list[dict]) -> dict:
    """Each accuracy's peak over a run's evaluations and the step it came at: best/<key> and
    best/<key>/step (the first step that reached it)."""
    evals = [r for r in rows if r.get("kind") == "eval"]
    best = {}
    for key in [key for key in (evals[-1] if evals else {}) if ACCURACY.match(key)]:
        peak = max((r for r in evals if key in r), key=lambda r: r[key])
        best[f"best/{key}"], best[f"best/{key}/step"] = peak[key], peak["step"]
    return best


def format_eval(result: dict) -> str:
    line = "  ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "by_level")
    if "by_level" in result:
        line += "\n" + "\n".join(f"    level {lv}: "
                                 + "  ".join(f"{k} {v:.3f}" for k, v in m.items())
                                 for lv, m in result["by_level"].items())
    return line


def summary(run_dir: Path) -> str:
    """Pass@1 (avg@k, with its spread over the k runs) before, at the end and at its best; every
    evaluation metric likewise; TTRL (majority) vs T3RL (weighted) pseudo-label accuracy during
    training."""
    rows = read_jsonl_rows(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    # "before" is the step-0 evaluation only: if metrics.jsonl lost it, the table says so instead
    # of showing another; a run that only evaluates (--episodes 0) has one, at step 0 and final
    after = next((r for r in reversed(rows) if r.get("final")), {})
    before = next((r for r in rows if r["kind"] == "eval" and r["step"] == 0
                   and not r.get("final")), after if after.get("step") == 0 else {})
    best = best_evals(rows)
    lines = [f"summary of {run_dir}"]
    k = next((key[4:] for key in after or before if re.fullmatch(r"avg@\d+", key)), None)
    if k:
        spread = lambda row: (f"{row[f'avg@{k}']:.3f} +- {row[f'avg@{k}_std']:.3f}"  # noqa: E731
                              if row else "-")
        lines.append(f"Pass@1 = avg@{k} +- std over {k} runs: before {spread(before)}, "
                     f"final {spread(after)}, best "
                     f"{best[f'best/avg@{k}']:.3f} at step {best[f'best/avg@{k}/step']}")
    shown = after or before
    if "questions" in shown:  # which questions the numbers are on: those it trains on
        lines.append(f"evaluated on the {shown['questions']} questions the run trains on "
                     f"({shown['trained_questions']} of them trained)")
    lines.append(f"{'metric':<28}{'before':>10}{'final':>10}{'best':>10}  at step")
    if not before:
        lines.append(f"(no step-0 evaluation in {run_dir / 'metrics.jsonl'}: the file was cut or "
                     f"deleted; 'before' is unknown)")
    for key in before or after:
        if key not in ("kind", "step", "final", "by_level", *COVERAGE) and \
                not key.startswith("best/") and \
                isinstance((before or after)[key], (int, float)):
            fmt = lambda row: f"{row[key]:>10.3f}" if key in row else f"{'-':>10}"  # noqa: E731
            peak = (f"{best[f'best/{key}']:>10.3f}  {best[f'best/{key}/step']}"
                    if f"best/{key}" in best else "")
            lines.append(f"{key:<28}{fmt(before)}{fmt(after)}{peak}")
    if k or before:
        changes = question_changes(read_jsonl_rows(run_dir / "evaluations.jsonl"),
                                   int(k) if k else 0)
        lines += [changes] if changes else []
    if train_rows:
        lines += _training_lines(train_rows)
    return "\n".join(lines)


def _training_lines(train_rows: list[dict]) -> list[str]:
    """The summary's rows for the training steps: pseudo-label and reward accuracy, the
    verifier's precision and recall, flips, and each extension's counts."""
    lines = [f"{'training steps':<28}{len(train_rows):>10}"]
    for name, key in (("label acc. TTRL (majority)", "majority_label_accuracy"),
                      ("label acc. T3RL (weighted)", "label_accuracy"),
                      ("reward accuracy", "reward_accuracy"), ("verified ratio", "verified_ratio")):
        mean = sum(r[key] for r in train_rows) / len(train_rows)
        lines.append(f"{name:<28}{mean:>10.3f}")
    # steps whose rollouts went to the verifier
    verifying = [r for r in train_rows if r.get("status") or r.get("inherited_verified_rollouts")]
    hits, verified = (sum(r["verified_correct"] for r in verifying),
                      sum(r["verified_rollouts"] for r in verifying))
    # a run logged before --lazy-verify existed judged every right rollout
    judged = sum(r.get("correct_judged_rollouts", r["correct_rollouts"]) for r in verifying)
    for name, of in (("verifier precision", verified), ("verifier recall", judged)):
        lines.append(f"{name:<28}" + (f"{hits / of:>10.3f}" if of else f"{'-':>10}"))
    inherited = sum(r.get("inherited_verified_rollouts", 0) for r in verifying)
    if inherited:  # --verify-budget: the verdicts the rollouts took from their class, counted apart
        right = sum(r["inherited_verified_correct"] for r in verifying)
        lines.append(f"{'inherited: verified, right':<28}{inherited:>10}{right:>10}")
    lines.append(f"{'flips (fixed / broke)':<28}"
                 f"{sum(r['flipped'] * r['questions'] for r in train_rows):>10.0f}"
                 f"   ({sum(r['flip_fixed'] * r['questions'] for r in train_rows):.0f} / "
                 f"{sum(r['flip_broke'] * r['questions'] for r in train_rows):.0f})")
    # each extension's counts over the run (agent: the policy's own tool use)
    totals = sum_counts([{f"{name} {key}": value for name, counts in r.get("extensions", {}).items()
                        for key, value in counts.items()} for r in train_rows])
    lines += [f"{key:<28}{value:>10}" for key, value in totals.items()
              if not isinstance(value, dict)]
    return lines


def plot_run(run_dir: Path):
    """curves.png: pseudo-label accuracy (TTRL vs T3RL), reward accuracy, verified ratio and loss
    per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    if not rows:
        return
    steps = [r["step"] + 1 for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for key, name in [("label_accuracy", "label acc. (T3RL)"),
                      ("majority_label_accuracy", "label acc. (majority)"),
                      ("reward_accuracy", "reward acc."),
                      ("ground_truth_ratio", "ground-truth ratio")]:
        axes[0].plot(steps, [r[key] for r in rows], marker="o", label=name)
    axes[1].plot(steps, [r["verified_ratio"] for r in rows], marker="o", label="verified ratio")
    axes[1].plot(steps, [r["majority_ratio"] for r in rows], marker="o", label="majority ratio")
    axes[2].plot(steps, [r.get("grpo/loss", 0) for r in rows], marker="o", label="GRPO loss")
    axes[2].plot(steps,
                 [r["response_length"] / max(r["response_length"] for r in rows) for r in rows],
                 marker="o", label="response length (rel.)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)
    plt.close(fig)


def question_changes(rows: list[dict], k: int) -> str:
    """How many evaluated questions rose, fell or stayed between the first and the final evaluation
    (avg@k per question; greedy@1 when k is 0): evaluations.jsonl's rows."""
    steps = sorted({r["step"] for r in rows})
    if len(steps) < 2:
        return ""
    score = lambda r: sum(r["runs"]) / k if k else r["greedy@1"]  # noqa: E731
    first = {r["id"]: score(r) for r in rows if r["step"] == steps[0]}
    last = {r["id"]: score(r) for r in rows if r["step"] == steps[-1]}
    shared = first.keys() & last.keys()
    up = sum(last[q] > first[q] for q in shared)
    down = sum(last[q] < first[q] for q in shared)
    what = f"avg@{k}" if k else "greedy@1"
    return (f"per question ({what}, step {steps[0]} -> {steps[-1]}): {up} up, {down} down, "
            f"{len(shared) - up - down} same")


def time_line(seconds: dict) -> str:
    """Where the run's time went: each phase in minutes and its share of the wall time."""
    wall = seconds["wall"]
    parts = [(phase, value) for phase, value in seconds.items() if phase != "wall"]
    parts.append(("other", max(wall - sum(value for _, value in parts), 0.0)))
    shares = ", ".join(f"{phase} {value / 60:.1f} ({value / wall:.0%})" for phase, value in parts)
    return f"time {wall / 60:.1f} min: {shares}"
