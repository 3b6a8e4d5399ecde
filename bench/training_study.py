"""The training study (issue 49): does T3RL's better label train a better policy? Both votes train
alike where they agree, so the study trains on the questions where they disagree, and on as many
where they agree (the control), each arm from the same weights with the same seeds and settings.

  select   from a --study folder (the starting policy's N rollouts per question, all verified): the
           questions whose weighted vote (omega 5) differs from the plain majority, and a seeded
           draw of as many where they agree; no ground truth is read to choose them
  arm A    train arm A (ttrl: --omega 1, t3rl: the default omega) on exactly those questions
           (a --bench file of them), evaluating before, after every episode and at the end at
           avg@8, then copy its small outputs into results/training-study/A/
  report   from the committed files alone (report.txt, share.png): per arm and for T3RL - TTRL
           the change in avg@k on the disagreeing questions and on the control (paired bootstrap
           over questions), the label accuracy per episode, and the share of T3RL's starting
           answer in each arm's rollouts on the disagreeing questions where that answer is right

  python -m extensions.study --bench demo --limit 0 --n-votes 8 --verifier-model coder-1.5b \\
      --verify-budget 0 --no-lazy-verify --run-name training-study-selection   # ~35 min
  python -m bench.training_study select runs/training-study-selection
  python -m bench.training_study arm ttrl        # 70-80 min on 2 CPU cores; one sitting each
  python -m bench.training_study arm t3rl
  python -m bench.training_study report

Sizes, times and results: docs/results.md#the-training-study-where-the-two-votes-disagree (the
committed arms ran at commit efcf192 with 4 steps of at most 3 questions an episode; an arm now
runs whole steps of 5, every question once an episode).
"""
import argparse
import json
import math
import random
import shutil
import sys
from pathlib import Path

import numpy as np

import t3rl
from config import parse_config
from extensions.study import bootstrap_draws, interval, read_rows
from machinery.benchmarks import load_bench
from machinery.runs import read_jsonl_rows, write_jsonl
from voting import weighted_vote

RESULTS = Path(__file__).resolve().parent.parent / "results" / "training-study"
ARMS = {"ttrl": 1.0, "t3rl": 5.0}  # omega of each arm; 5 is Config's default
GROUPS = ("disagree", "control")
# one arm on 2 CPU cores with 10 questions: 2 steps of 5 an episode, 8 episodes, 9 evaluations at
# avg@8 (T3RL's verifying its samples too)
SETTINGS = dict(preset="cpu", verifier_model="coder-1.5b", n_votes=8, n_train=4,
                max_new_tokens=320, questions_per_step=5, episodes=8, lr=2e-6, eval_samples=8,
                limit=0, max_steps=0, seed=0)
COPIED = ("config.json", "metrics.jsonl", "evaluations.jsonl")
# the paper's T3RL - TTRL on MATH-500 (Qwen2.5-Math-1.5B, avg@4: 73.0 -> 74.6)
PAPER_EFFECT = 0.016
SHARES = "shares.jsonl"


# --------------------------------------------------------------------------------------------------
# select

def choose(rows: list[dict], classes: dict, omega: float, seed: int, max_disagree: int) -> list:
    """[(row, group)]: the rows whose vote at omega over all their rollouts differs from the plain
    majority's (at most max_disagree, a seeded draw when there are more), then a seeded draw of as
    many rows where the two agree. Reads answers and verdicts only."""
    disagree, agree = [], []
    for row in rows:
        majority = weighted_vote(row["answers"], row["v"], omega=1.0, **classes)
        weighted = weighted_vote(row["answers"], row["v"], omega=omega, **classes)
        tops = [vote.classes[0].members if vote.classes else None for vote in (majority, weighted)]
        (disagree if tops[0] != tops[1] else agree).append((row, majority.label, weighted.label))
    draw = random.Random(seed)
    if len(disagree) > max_disagree:
        disagree = draw.sample(disagree, max_disagree)
    if len(agree) < len(disagree):
        raise SystemExit(f"select: {len(disagree)} questions where the votes disagree but only "
                         f"{len(agree)} where they agree, too few for the control; study more "
                         f"questions (--limit) or lower --max-disagree")
    control = draw.sample(agree, len(disagree))
    return [(item, group) for group, items in (("disagree", disagree), ("control", control))
            for item in items]


def select(study_dir: Path, levels, max_disagree: int, seed: int, out: Path) -> dict:
    """Write the chosen questions to out/questions.json (groups, both starting labels, and the gold
    answer for the report only) and out/questions.txt (the ids)."""
    cfg = json.loads((study_dir / "config.json").read_text())
    rows = [r for r in read_rows(study_dir) if not levels or r.get("level") in levels]
    omega = ARMS["t3rl"]
    chosen = choose(rows, t3rl.bench_domain(cfg["bench"]).classes, omega, seed, max_disagree)
    if not chosen:
        raise SystemExit(f"select: the votes agree on all {len(rows)} questions of {study_dir}; "
                         f"study more questions (--limit) or more rollouts (--n-votes)")
    selection = {"study": study_dir.name, "bench": cfg["bench"], "n_votes": cfg["n_votes"],
                 "omega": omega, "seed": seed, "levels": levels or None,
                 "questions": [{"id": row["id"], "group": group, "majority_label": majority,
                                "weighted_label": weighted, "gold": row["gold"],
                                "level": row.get("level")}
                               for (row, majority, weighted), group in chosen]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "questions.json").write_text(json.dumps(selection, indent=1) + "\n")
    (out / "questions.txt").write_text("".join(f"{q['id']}  # {q['group']}\n"
                                               for q in selection["questions"]))
    return selection


# --------------------------------------------------------------------------------------------------
# arm

def steps_per_episode(n_questions: int, questions_per_step: int) -> int:
    return n_questions // questions_per_step  # whole steps (verl's dataloader drops the rest)


def relative(path: Path) -> str:
    """path from the working directory when it is below it: config.json then names the same file
    in another checkout, and the arms of two sittings compare equal."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def arm_argv(arm: str, selection: dict, results: Path, out_dir: str, extra: list[str]) -> list:
    """t3rl's command line for an arm: SETTINGS on the selection's benchmark and questions, the
    arm's omega, an evaluation (and a checkpoint) after every episode; `extra` last (tests)."""
    per_step = min(SETTINGS["questions_per_step"], len(selection["questions"]))
    per_episode = steps_per_episode(len(selection["questions"]), per_step)
    options = {**SETTINGS, "questions_per_step": per_step,
               "bench": relative(selection_bench(selection, Path(out_dir))),
               "omega": ARMS[arm], "eval_every": per_episode, "save_every": per_episode,
               "out_dir": out_dir, "run_name": f"training-study-{arm}"}
    argv = [f"--{key.replace('_', '-')}={value}" for key, value in options.items()]
    return argv + extra


def selection_bench(selection: dict, out_dir: Path) -> Path:
    """The chosen questions as a --bench file (their records from the study's benchmark), in
    out_dir."""
    ids = {q["id"] for q in selection["questions"]}
    path = out_dir / "training-study-questions.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, [r for r in load_bench(selection["bench"]) if r["id"] in ids])
    return path


def run_arm(arm: str, results: Path, out_dir: str, extra: list[str]) -> Path:
    """Train the arm (resuming its run folder when a sitting was cut short), then collect."""
    selection = json.loads((results / "questions.json").read_text())
    run_dir = Path(out_dir) / f"training-study-{arm}"
    metrics = run_dir / "metrics.jsonl"
    finished = metrics.is_file() and any(r.get("final") for r in read_jsonl_rows(metrics))
    if not finished:
        resumed = (run_dir / "config.json").is_file()
        argv = ["--resume", str(run_dir)] if resumed else arm_argv(arm, selection, results,
                                                                   out_dir, extra)
        t3rl.train(parse_config(argv))
    return collect(arm, run_dir, selection, results / arm)


def collect(arm: str, run_dir: Path, selection: dict, dest: Path) -> Path:
    """Copy the run's small files to dest, and derive shares.jsonl from its rollouts: per step and
    chosen question, the share of rollouts giving T3RL's starting label, whether the step's
    pseudo-label is that answer, and whether it is right."""
    cfg = json.loads((run_dir / "config.json").read_text())
    dom = t3rl.bench_domain(cfg["bench"])
    chosen = {q["id"]: q for q in selection["questions"]}
    per_episode = steps_per_episode(len(chosen), cfg["questions_per_step"])
    groups = {}
    for r in read_jsonl_rows(run_dir / "rollouts.jsonl"):
        groups.setdefault((r["step"], r["id"]), []).append(r)
    same = lambda a, b: a is not None and b is not None and dom.same(a, b)  # noqa: E731
    shares = [{"step": step, "episode": step // per_episode, "id": qid,
               "group": chosen[qid]["group"],
               "share_t3rl_answer": sum(same(r["answer"], chosen[qid]["weighted_label"])
                                        for r in rows) / len(rows),
               "label_is_t3rl_answer": same(rows[0]["label"], chosen[qid]["weighted_label"]),
               "label_right": rows[0]["label"] is not None
               and bool(dom.equiv(rows[0]["label"], chosen[qid]["gold"]))}
              for (step, qid), rows in sorted(groups.items()) if qid in chosen]
    dest.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        shutil.copyfile(run_dir / name, dest / name)
    write_jsonl(dest / SHARES, shares)
    return dest


# --------------------------------------------------------------------------------------------------
# report

def read_arm(folder: Path) -> dict | None:
    """An arm's committed files, or None when it has not run."""
    if not all((folder / name).is_file() for name in (*COPIED, SHARES)):
        return None
    return {"config": json.loads((folder / "config.json").read_text()),
            "evaluations": read_jsonl_rows(folder / "evaluations.jsonl"),
            "shares": read_jsonl_rows(folder / SHARES)}


def avg_at_ends(arm: dict, ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """[questions] avg@k before training and at the last evaluation, in the order of ids."""
    last = max(r["step"] for r in arm["evaluations"])
    at = {(r["step"], r["id"]): float(np.mean(r["runs"])) for r in arm["evaluations"]}
    return np.array([at[0, qid] for qid in ids]), np.array([at[last, qid] for qid in ids])


def by_episode(rows: list[dict], key: str, ids) -> dict:
    """episode -> the mean of key over the rows of those questions."""
    out = {}
    for r in rows:
        if r["id"] in ids:
            out.setdefault(r["episode"], []).append(float(r[key]))
    return {episode: float(np.mean(values)) for episode, values in sorted(out.items())}


def report(results: Path, seed: int = 0) -> str:
    selection = json.loads((results / "questions.json").read_text())
    dom = t3rl.bench_domain(selection["bench"])
    qs = selection["questions"]
    ids = {g: [q["id"] for q in qs if q["group"] == g] for g in GROUPS}
    right = lambda label, q: label is not None and bool(dom.equiv(label, q["gold"]))  # noqa: E731
    dis = [q for q in qs if q["group"] == "disagree"]
    t3_right = [q["id"] for q in dis if right(q["weighted_label"], q)]
    # (T3RL's label right, TTRL's right) of each disagreeing question
    outcomes = [(right(q["weighted_label"], q), right(q["majority_label"], q)) for q in dis]
    lines = [f"training study on {selection['bench']} ({selection['study']}, "
             f"{selection['n_votes']} votes each): {len(dis)} questions where the votes disagree, "
             f"{len(ids['control'])} where they agree (control)",
             f"starting labels where they disagree: T3RL right and TTRL wrong "
             f"{outcomes.count((True, False))}, TTRL right and T3RL wrong "
             f"{outcomes.count((False, True))}, both wrong {outcomes.count((False, False))}"]
    arms = {arm: read_arm(results / arm) for arm in ARMS}
    for arm, data in arms.items():
        if data is None:
            lines.append(f"{arm}: not run yet (python -m bench.training_study arm {arm})")
    present = {arm: data for arm, data in arms.items() if data}
    if len(present) == 2:
        a, b = (present[arm]["config"] for arm in ARMS)
        differ = sorted(k for k in a
                        if k not in ("omega", "run_name", "resume") and a[k] != b.get(k))
        if differ:
            lines.append(f"warning: the arms differ in {', '.join(differ)}, not only in omega")
    lines += change_lines(present, ids, seed)
    lines += episode_lines(present, ids, t3_right)
    lines += evaluation_lines(present, ids)
    if present:
        plot_share(results / "share.png", present, t3_right)
    return "\n".join(lines)


def change_lines(present: dict, ids: dict, seed: int) -> list[str]:
    """avg@k after minus before, per group, per arm and for T3RL - TTRL, paired over questions."""
    lines = ["", "change in avg@k (last evaluation - before training), 95% paired bootstrap "
                 "intervals over questions"]
    diffs = []
    for group, qids in ids.items():
        if not qids:
            continue
        draws = bootstrap_draws(len(qids), seed)
        ends = {arm: avg_at_ends(data, qids) for arm, data in present.items()}
        changes = {arm: after - before for arm, (before, after) in ends.items()}
        for arm, change in changes.items():
            lo, hi = interval(change, draws)
            before, after = ends[arm]
            lines.append(f"  {group:<9} {arm:<12} {change.mean():+.3f} [{lo:+.3f}, {hi:+.3f}] "
                         f"(n {len(qids)}: {before.mean():.3f} -> {after.mean():.3f})")
        if len(changes) == 2:
            diff = changes["t3rl"] - changes["ttrl"]
            diffs.append(diff)
            lo, hi = interval(diff, draws)
            lines.append(f"  {group:<9} {'t3rl - ttrl':<12} {diff.mean():+.3f} "
                         f"[{lo:+.3f}, {hi:+.3f}]")
    if diffs:
        lines.append(scale_line(np.concatenate(diffs)))
    return lines


def scale_line(diff: np.ndarray) -> str:
    """How many questions a 95 % interval that excludes 0 for the paper's effect needs, at the
    spread of T3RL - TTRL over this study's questions (diff: [questions]): n >= (1.96 sd /
    effect)^2."""
    spread = float(np.std(diff, ddof=1))
    needed = math.ceil((1.96 * spread / PAPER_EFFECT) ** 2)
    return (f"  scale: T3RL - TTRL spreads over questions with sd {spread:.3f}; at that spread an "
            f"interval excluding 0 for the paper's +{PAPER_EFFECT:.3f} needs {needed} questions")


def episode_lines(present: dict, ids: dict, t3_right: list[str]) -> list[str]:
    lines = ["", "per episode: label accuracy (disagree / control) and the share of rollouts "
                 f"giving T3RL's starting answer on the {len(t3_right)} disagreeing questions "
                 f"where it is right"]
    for arm, data in present.items():
        labels = {g: by_episode(data["shares"], "label_right", set(qids))
                  for g, qids in ids.items()}
        share = by_episode(data["shares"], "share_t3rl_answer", set(t3_right))
        for episode in sorted(labels["disagree"]):
            lines.append(f"  {arm} episode {episode}: label accuracy "
                         f"{labels['disagree'][episode]:.3f} / "
                         f"{labels['control'].get(episode, float('nan')):.3f}, share "
                         f"{share.get(episode, float('nan')):.3f}")
    return lines


def evaluation_lines(present: dict, ids: dict) -> list[str]:
    """avg@k of each group at every evaluation of each arm."""
    lines = ["", "avg@k at each evaluation (step: disagree / control)"]
    for arm, data in present.items():
        at = {}
        for r in data["evaluations"]:
            group = next((g for g, qids in ids.items() if r["id"] in qids), None)
            at.setdefault(r["step"], {}).setdefault(group, []).append(float(np.mean(r["runs"])))
        lines.append(f"  {arm}: " + ", ".join(
            f"{step}: " + " / ".join(f"{np.mean(groups.get(g, [np.nan])):.3f}" for g in GROUPS)
            for step, groups in sorted(at.items())))
    return lines


def plot_share(path: Path, present: dict, t3_right: list[str]):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, data in present.items():
        share = by_episode(data["shares"], "share_t3rl_answer", set(t3_right))
        ax.plot(list(share), list(share.values()), marker="o",
                label=f"{arm} (omega {data['config']['omega']:g})")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("episode (the rollouts of its steps)")
    ax.set_ylabel("share of rollouts giving T3RL's answer")
    ax.set_title(f"{len(t3_right)} questions where the votes disagree and T3RL's label is right",
                 fontsize=9)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--results", type=Path, default=RESULTS, help="the study's results folder")
    sub = parser.add_subparsers(dest="command", required=True)
    pick = sub.add_parser("select", help="choose the questions from a --study folder")
    pick.add_argument("study_dir", type=Path)
    pick.add_argument("--levels", type=int, nargs="*", default=[], help="MATH levels to keep")
    pick.add_argument("--max-disagree", type=int, default=6)
    pick.add_argument("--seed", type=int, default=0)
    arm = sub.add_parser("arm", help="train one arm and copy its small outputs to --results")
    arm.add_argument("arm", choices=list(ARMS))
    arm.add_argument("--out-dir", default="runs", help="where the arm's run folder goes")
    sub.add_parser("report", help="the report from the committed files")
    # arm: t3rl options after --, overriding the study's (give both arms the same)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1:]
    if args.command == "select":
        if not (args.study_dir / "study.jsonl").is_file():
            raise SystemExit(f"select {args.study_dir}: no study.jsonl there; pass a folder "
                             f"written by python -m extensions.study")
        chosen = select(args.study_dir, args.levels, args.max_disagree, args.seed, args.results)
        print(f"{len(chosen['questions'])} questions written to {args.results}/questions.json")
    elif args.command == "arm":
        if not (args.results / "questions.json").is_file():
            raise SystemExit(f"arm: no {args.results}/questions.json; run select first")
        print(f"{args.arm}: results in {run_arm(args.arm, args.results, args.out_dir, extra)}",
              file=sys.stderr)
    else:
        if not (args.results / "questions.json").is_file():
            raise SystemExit(f"report: no {args.results}/questions.json; run select first")
        text = report(args.results)
        (args.results / "report.txt").write_text(text + "\n")
        print(text)


if __name__ == "__main__":
    main()
