"""bench/training_study.py (issue 49): the selection, an arm, the report."""
import json

import pytest

from bench import training_study
from helpers import QUESTIONS, rows, tiny_argv, write_bench


def write_study(folder, questions):
    """A --study folder: config.json and one study.jsonl line per (id, answers, verdicts)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"bench": "demo", "n_votes": 5}))
    (folder / "study.jsonl").write_text("".join(
        json.dumps({"id": qid, "gold": "0", "level": None, "answers": answers, "v": v}) + "\n"
        for qid, answers, v in questions))


def test_select_picks_the_disagreeing_questions_and_a_seeded_control_of_as_many(tmp_path):
    """d1, d2: the verified minority outweighs the majority at omega 5 (labels 5 and 3 against 7 and
    4); trap: a verified rollout that cannot outweigh its majority; a0..a6 agree unverified."""
    questions = [("d1", ["7", "7", "7", "5", "5"], [0, 0, 0, 1, 1]),
                 ("trap", ["6", "6", "6", "6", "2"], [1, 0, 0, 0, 1]),
                 ("d2", ["3", "3", "4", "4", "4"], [1, 0, 0, 0, 0])]
    questions += [(f"a{i}", ["1", "1", "1", "2", "2"], [0] * 5) for i in range(7)]
    write_study(tmp_path / "study", questions)
    controls = []
    for seed in range(6):
        out = tmp_path / f"out{seed}"
        training_study.main(["--results", str(out), "select", str(tmp_path / "study"),
                             "--seed", str(seed)])
        chosen = json.loads((out / "questions.json").read_text())["questions"]
        disagree = {q["id"]: (q["majority_label"], q["weighted_label"]) for q in chosen
                    if q["group"] == "disagree"}
        assert disagree == {"d1": ("7", "5"), "d2": ("4", "3")}
        control = [q["id"] for q in chosen if q["group"] == "control"]
        assert len(control) == 2 and set(control) <= {"trap", *(f"a{i}" for i in range(7))}
        listed = [line.split("#")[0].strip() for line in (out / "questions.txt").read_text().splitlines()]
        assert listed == [q["id"] for q in chosen]
        controls.append(tuple(control))
    assert len(set(controls)) > 1  # a draw, not the first agreeing questions
    training_study.main(["--results", str(tmp_path / "again"), "select", str(tmp_path / "study"),
                         "--seed", "5"])
    again = json.loads((tmp_path / "again" / "questions.json").read_text())["questions"]
    assert tuple(q["id"] for q in again if q["group"] == "control") == controls[5]  # seeded


def selection_file(results, questions):
    results.mkdir(parents=True, exist_ok=True)
    (results / "questions.json").write_text(json.dumps(
        {"study": "s", "bench": "demo", "n_votes": 8, "omega": 5.0, "seed": 0, "levels": None,
         "questions": questions}))
    (results / "questions.txt").write_text("".join(q["id"] + "\n" for q in questions))


def test_an_arm_trains_on_the_selection_and_copies_its_small_outputs(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    results = tmp_path / "results"
    selection_file(results, [{"id": qid, "group": group, "majority_label": "1", "weighted_label": "2",
                              "gold": gold} for qid, group, gold in
                             (("q0", "disagree", "2"), ("q2", "disagree", "4"), ("q3", "control", "6"))])
    tiny = [arg for arg in tiny_argv(tiny_dir, tmp_path, episodes=2)
            if not arg.startswith(("--out-dir", "--run-name", "--max-steps", "--eval-every",
                                   "--save-every", "--questions-per-step", "--preset", "--eval-samples",
                                   "--bench"))]
    monkeypatch.chdir(tmp_path)  # the questions' file is named from the working directory (another checkout)
    training_study.main(["--results", str(results), "arm", "t3rl", "--out-dir", str(tmp_path / "runs"),
                         "--", "--eval-samples=2", *tiny])
    copied = results / "t3rl"
    assert sorted(p.name for p in copied.iterdir()) == [
        "config.json", "evaluations.jsonl", "metrics.jsonl", "shares.jsonl"]  # no checkpoint, no rollouts
    config = json.loads((copied / "config.json").read_text())
    assert config["omega"] == 5.0 and config["bench"] == "runs/training-study-questions.jsonl"
    # 3 questions at 3 a step: one step an episode, an evaluation after each
    assert {r["step"] for r in rows(copied, "evaluations.jsonl")} == {0, 1, 2}
    assert {r["id"] for r in rows(copied, "evaluations.jsonl")} == {"q0", "q2", "q3"}
    run = tmp_path / "runs" / "training-study-t3rl"
    rollouts = rows(run, "rollouts.jsonl")
    shares = rows(copied, "shares.jsonl")
    assert [(r["step"], r["episode"], r["id"]) for r in shares] == [
        (s, s, q) for s in (0, 1) for q in ("q0", "q2", "q3")]
    for r in shares:
        mine = [x for x in rollouts if (x["step"], x["id"]) == (r["step"], r["id"])]
        assert r["share_t3rl_answer"] == sum(x["answer"] == "2" for x in mine) / len(mine)
        assert r["label_is_t3rl_answer"] == (mine[0]["label"] == "2")


def eval_rows(step, runs_by_id):
    return [{"step": step, "id": qid, "runs": runs} for qid, runs in runs_by_id.items()]


def write_arm(folder, omega, before, after, shares):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"omega": omega, "run_name": str(omega), "lr": 2e-6}))
    (folder / "metrics.jsonl").write_text("")
    (folder / "evaluations.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in eval_rows(0, before) + eval_rows(8, after)))
    (folder / "shares.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shares))


def runs_of(rights):  # avg@4 of rights/4
    return [1.0] * rights + [0.0] * (4 - rights)


def test_the_report_pairs_the_arms_over_questions_from_the_committed_files(tmp_path):
    """On d0..d3 T3RL's change in avg@4 is TTRL's + 0.25 on every question, though the changes
    themselves spread (-0.25 .. +0.75): a paired interval is exactly [+0.25, +0.25]."""
    results = tmp_path / "results"
    questions = [{"id": f"d{i}", "group": "disagree", "majority_label": "1", "weighted_label": "2",
                  "gold": "2" if i < 3 else "1"} for i in range(4)]
    questions += [{"id": f"c{i}", "group": "control", "majority_label": "1", "weighted_label": "1",
                   "gold": "1"} for i in range(4)]
    selection_file(results, questions)
    before = {q["id"]: runs_of(1) for q in questions}
    t3_after = {"d0": runs_of(3), "d1": runs_of(2), "d2": runs_of(1), "d3": runs_of(4),
                **{f"c{i}": runs_of(2) for i in range(4)}}
    tt_after = {"d0": runs_of(2), "d1": runs_of(1), "d2": runs_of(0), "d3": runs_of(3),
                **{f"c{i}": runs_of(2) for i in range(4)}}
    share = lambda arm_share: [{"episode": e, "step": e, "id": f"d{i}", "group": "disagree",  # noqa: E731
                                "share_t3rl_answer": arm_share[e] if i < 3 else 0.0,
                                "label_right": i < 3, "label_is_t3rl_answer": True}
                               for e in range(2) for i in range(4)]
    write_arm(results / "t3rl", 5.0, before, t3_after, share([0.5, 0.75]))
    write_arm(results / "ttrl", 1.0, before, tt_after, share([0.5, 0.25]))
    training_study.main(["--results", str(results), "report"])
    text = (results / "report.txt").read_text()
    assert "T3RL right and TTRL wrong 3, TTRL right and T3RL wrong 1, both wrong 0" in text
    lines = [line.strip() for line in text.splitlines()]
    assert "disagree  t3rl - ttrl  +0.250 [+0.250, +0.250]" in lines
    assert "control   t3rl - ttrl  +0.000 [+0.000, +0.000]" in lines
    # T3RL - TTRL is +0.25 on 4 questions and 0 on 4: sd 0.1336, (1.96 * 0.1336 / 0.016)^2 = 267.97
    assert ("scale: T3RL - TTRL spreads over questions with sd 0.134; at that spread an interval "
            "excluding 0 for the paper's +0.016 needs 268 questions") in lines
    own = [line for line in lines if line.startswith("disagree  t3rl         +0.375 [")]
    assert len(own) == 1 and "[+0.375, +0.375]" not in own[0]  # each arm's own change spreads
    assert own[0].endswith("(n 4: 0.250 -> 0.625)")
    assert "t3rl episode 1: label accuracy 0.750 / nan, share 0.750" in lines
    assert "ttrl episode 1: label accuracy 0.750 / nan, share 0.250" in lines
    assert "t3rl: 0: 0.250 / 0.250, 8: 0.625 / 0.500" in lines
    assert (results / "share.png").stat().st_size > 0
    for name in ("config.json", "evaluations.jsonl", "metrics.jsonl", "shares.jsonl"):
        (results / "ttrl" / name).unlink()
    alone = training_study.report(results).splitlines()
    assert "ttrl: not run yet (python -m bench.training_study arm ttrl)" in alone
    assert any(line.strip().startswith("disagree  t3rl         +0.375") for line in alone)
    assert not any("t3rl - ttrl" in line for line in alone)
