"""extensions/study.py: the evidence study (verified vote vs majority on the same samples) and --replay."""
import json
import math
import random
import re

import pytest
import torch

import config
import grpo
import t3rl
from config import parse_config
from extensions import budget, study
from helpers import QUESTIONS, copy_run, rows, tiny_argv, write_bench
from machinery import model as model_lib
from machinery import runs
from verifier import MATH


def test_replay_recomputes_labels_per_omega(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, lazy_verify=False)))
    capsys.readouterr()
    monkeypatch.setattr(model_lib, "load_model", lambda *a, **k: pytest.fail("replay loaded a model"))
    tables = []
    for spelling in (["--replay", str(run)], [f"--replay={run}"]):  # both spellings are the replay mode
        study.main([*spelling, "--omega", "1", "5", "inf"])
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    table = tables[0].splitlines()
    assert "4 rollout groups" in table[0] and [line.split()[0] for line in table[2:]] == ["1", "5", "inf"]
    assert table[2].split()[3] == "0"  # omega = 1 is the majority vote itself: no flips
    assert not (run.parent / "runs").exists() and sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_replay_re_votes_the_verdicts_the_run_voted_with(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    """--verifier-programs 2 logs each program's status and the rollout's v (1: one of them reproduced
    a_i); --replay re-votes with the logged v alone, so at the run's own omega it gives the run's labels."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    half = lambda prompts: ["```python\nprint(%s)\n```" % ("1 + 1" if k % 2 == 0 else "0")  # noqa: E731
                            for k in range(len(prompts))]
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: half)
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, lazy_verify=False,
                                            verify_budget=0, verifier_programs=2, verdict_memory=False)))
    logged = [r for r in rows(run, "rollouts.jsonl") if r["answer"] == "2"]
    assert logged and all(r["v"] == 1 and [p["status"] for p in r["programs"]] == ["verified", "mismatch"]
                          for r in logged)
    table = study.replay(run, [1.0, 5.0]).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["1", "5"]
    trained = [r for r in rows(run, "metrics.jsonl") if r["kind"] == "train"]
    run_accuracy = sum(r["label_accuracy"] * r["questions"] for r in trained) / sum(r["questions"] for r in trained)
    assert float(table[3].split()[1]) == pytest.approx(run_accuracy, abs=1e-3)


def test_replay_of_a_lazy_run_refuses_the_omegas_its_verdicts_do_not_settle(tiny_dir, tmp_path, monkeypatch, patched):
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)  # as many skipped verdicts as laziness makes
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", n_votes=6, max_steps=2, seed=2,
                                            top_p=0.95)))  # draws that leave verdicts to skip
    assert "skipped" in {r["status"] for r in rows(run, "rollouts.jsonl")}
    assert [line.split()[0] for line in study.replay(run, [1.0, 5.0]).splitlines()[2:]] == ["1", "5"]
    with pytest.raises(runs.RunDirError, match=r"--omega 2 inf: the run verified lazily"):
        study.replay(run, [1.0, 2.0, math.inf])




def append_line(path, line):
    with open(path, "a") as fh:
        fh.write(line + "\n")


@pytest.mark.parametrize("damage, line", [
    (lambda run: (run / "config.json").unlink(), r"/run: no config.json there; pass a folder written by t3rl.py"),
    (lambda run: (run / "config.json").write_text('{"bench": '), r"run/config.json: damaged .*restore it"),
    (lambda run: (run / "config.json").write_text("[]"), r"run/config.json: no bench or omega in it"),
    (lambda run: append_line(run / "rollouts.jsonl", '{"step": 9, "id": "nope", "answer": "1", "v": 0, "status": "x"}'),
     r"rollouts.jsonl:\d+: not a rollout of --bench demo \(its id, step, index, answer, v and status\)"),
    (lambda run: append_line(run / "rollouts.jsonl", '{"step": 9, "id": "q0"}'), r"rollouts.jsonl:\d+: not a rollout"),
    (lambda run: append_line(run / "rollouts.jsonl", '{"step": 9, "id": "q0", "index": 0, "answer": "1", "v": null, '
                                                     '"status": "x"}'), r"rollouts.jsonl:\d+: not a rollout"),
    (lambda run: append_line(run / "rollouts.jsonl", '{"step": [9], "id": "q0", "index": 0, "answer": "1", "v": 0, '
                                                     '"status": "x"}'), r"rollouts.jsonl:\d+: not a rollout"),
    (lambda run: append_line(run / "rollouts.jsonl", '{"step": 9, "id": "q0", "index": 0, "answer": ["1"], "v": 0, '
                                                     '"status": "x"}'), r"rollouts.jsonl:\d+: not a rollout"),
    (lambda run: append_line(run / "rollouts.jsonl", (run / "rollouts.jsonl").read_text().splitlines()[0]),
     r"rollouts.jsonl:\d+: rollout 0 of q\d at step 0 again \(line 1\); delete one of them"),
], ids=["no config", "damaged config", "config not an object", "unknown question", "row without its vote",
        "verdict null", "step a list", "answer a list", "a rollout twice"])
def test_a_replay_of_a_damaged_run_ends_in_one_line(damage, line, finished_run, tmp_path, monkeypatch):
    run = copy_run(finished_run, tmp_path / "run")
    damage(run)
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    with pytest.raises(SystemExit) as stop:
        study.main(["--replay", str(run)])
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message and re.search(line, message), message


def study_row(qid, gold, answers, v, level=None):
    n = len(answers)
    return {"id": qid, "gold": gold, "level": level, "subject": None, "answers": answers, "v": v,
            "status": ["verified" if x else "mismatch" for x in v], "result": [None] * n,
            "policy_tokens": [10 + i for i in range(n)], "verifier_tokens": [100 + i for i in range(n)],
            "text": [""] * n, "program": [None] * n}


def test_study_votes_on_nested_subsets_and_counts_their_tokens():
    # q0: at k = 4 a wrong majority (7 x3) beats the one verified gold rollout only with omega >= 5 (fixed);
    #     the next four rollouts say 5, so at k = 8 even the plain majority is right
    # q1: at k = 4 a verified wrong rollout outvotes a right majority (broke)
    rows = [study_row("q0", "5", ["7", "7", "7", "5", "5", "5", "5", "5"], [0, 0, 0, 1, 0, 0, 0, 0]),
            study_row("q1", "3", ["3", "3", "3", "9", "3", "3", "3", "3"], [0, 0, 0, 1, 0, 0, 0, 0])]
    c = study.score(rows, [4, 8], study.OMEGAS, MATH.classes, MATH.equiv)
    assert list(c[4, 1.0]) == [0, 1] and list(c[4, 2.0]) == [0, 1]
    assert list(c[4, 5.0]) == [1, 0] and list(c[4, math.inf]) == [1, 0]
    assert list(c[8, 1.0]) == [1, 1] and list(c[8, 5.0]) == [1, 1]
    assert study.token_costs(rows, [4, 8]) == {4: (46.0, 406.0, 46.0), 8: (108.0, 828.0, 108.0)}
    unread = [{**row, "verifier_tokens": [0] * 4 + row["verifier_tokens"][4:],  # rollouts 0-3 were not sent
               "status": ["no_answer"] * 4 + row["status"][4:]} for row in rows]
    assert study.token_costs(unread, [4, 8]) == {4: (46.0, 0.0, 0.0), 8: (108.0, 422.0, 62.0)}
    assert study.study_ks(64) == [4, 8, 16, 32, 64] and study.study_ks(12) == [4, 8, 12]
    draws = study.bootstrap_draws(2, seed=0)
    table = "\n".join(study.accuracy_table(c, draws, [4, 8], study.OMEGAS, study.token_costs(rows, [4, 8])))
    w5 = next(line for line in table.splitlines() if line.split()[:2] == ["4", "w=5"]).split()
    assert w5[2] == "0.500" and w5[5] == "+0.000" and w5[8:10] == ["1", "1"]  # one flip fixed, one broken


def test_study_omega_one_is_the_plain_majority():
    rng = random.Random(0)
    rows = [study_row(f"q{i}", str(rng.randint(0, 3)), [str(rng.randint(0, 3)) for _ in range(8)],
                      [rng.randint(0, 1) for _ in range(8)]) for i in range(40)]
    deaf = [{**row, "v": [0] * 8} for row in rows]  # verdicts removed: every omega is the plain majority
    with_verdicts = study.score(rows, [4, 8], study.OMEGAS, MATH.classes, MATH.equiv)
    without = study.score(deaf, [4, 8], [1.0], MATH.classes, MATH.equiv)
    for k in (4, 8):
        assert list(with_verdicts[k, 1.0]) == list(without[k, 1.0])
    assert any(list(with_verdicts[k, 5.0]) != list(without[k, 1.0]) for k in (4, 8))  # verdicts do matter at 5


def test_study_bootstrap_interval_holds_the_estimate_and_is_seeded():
    values = study.np.array([float(i % 3 == 0) for i in range(60)])
    draws = study.bootstrap_draws(60, seed=1)
    lo, hi = study.interval(values, draws)
    assert lo < values.mean() < hi and hi - lo < 0.5
    assert study.interval(values, study.bootstrap_draws(60, seed=1)) == (lo, hi)
    assert study.interval(values, study.bootstrap_draws(60, seed=2)) != (lo, hi)
    assert study.interval(values * 0 + 1, draws) == (1.0, 1.0)


def test_study_questions_of_numbered_and_named_levels_are_stratified():
    records = [{"id": str(i), "level": level} for i, level in enumerate([1, "olympiad", 2, 1, "olympiad", 2])]
    assert {r["level"] for r in study.stratified(records, 3, seed=0)} == {1, 2, "olympiad"}


def test_study_questions_are_level_stratified_and_seeded():
    records = [{"id": str(i), "level": 1 + i % 5 if i < 80 else 5} for i in range(100)]
    picked = study.stratified(records, 25, seed=0)
    assert [sum(r["level"] == lv for r in picked) for lv in range(1, 6)] == [5] * 5
    assert picked == study.stratified(records, 25, seed=0) != study.stratified(records, 25, seed=1)
    assert study.stratified([{"id": "a"}, {"id": "b"}], 1, seed=0) == [{"id": "a"}]


def study_argv(tiny_dir, out_dir, **extra):
    return tiny_argv(tiny_dir, out_dir, **{"n_votes": 8, "max_new_tokens": 6, **extra})


def study_cfg(argv):
    return study.study_config(argv, gpu=False)


def test_a_study_on_the_cpu_preset_verifies_every_rollout(tmp_path):
    """The cpu preset verifies one rollout per answer class, and only the classes that can change the vote, to
    save training time; a study on it verifies them all, and an explicit --verify-budget is refused."""
    cpu = parse_config(["--preset", "cpu", "--out-dir", str(tmp_path)])
    assert (cpu.verify_budget, cpu.lazy_verify) == (1, True)
    cfg = study_cfg(["--preset", "cpu", "--out-dir", str(tmp_path)])
    assert (cfg.verify_budget, cfg.lazy_verify) == (0, False)
    explicit = study_cfg(["--preset", "cpu", "--verify-budget", "1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--verify-budget"):
        study.run_study(explicit)


def test_a_study_samples_fewer_votes_than_training_keeps(tmp_path):
    """A study never trains: `--n-votes 3` starts although the preset keeps 4 rollouts for training, while a
    training run with 3 votes and 4 kept is refused, and so is an explicit --n-train above them."""
    cfg = study_cfg(["--n-votes", "3", "--out-dir", str(tmp_path)])
    assert cfg.n_votes == 3 and cfg.n_train <= 3
    with pytest.raises(config.OptionError, match="--n-train 4: must be at most --n-votes"):
        parse_config(["--n-votes", "3", "--out-dir", str(tmp_path)])
    with pytest.raises(config.OptionError, match="--n-train 5"):
        study_cfg(["--n-votes", "3", "--n-train", "5", "--out-dir", str(tmp_path)])


def test_study_replay_reproduces_the_table_without_a_model(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = study.run_study(study_cfg(study_argv(tiny_dir, tmp_path / "out")))
    printed = capsys.readouterr().out
    lines = rows(run, "study.jsonl")
    assert [r["id"] for r in lines] == ["q0", "q1", "q2", "q3"] and all(len(r["answers"]) == 8 for r in lines)
    assert {s for r in lines for s in r["status"]} == {"verified", "mismatch"}  # the scripted verifier ran
    assert "4 TTRL" in printed and "8 w=inf" in printed and (run / "study.png").stat().st_size > 1000
    table = (run / "table.txt").read_text()
    (run / "study.png").unlink()

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")
    monkeypatch.setattr(model_lib, "load_model", no_model)
    study.main(["--replay", str(run)])
    assert capsys.readouterr().out == printed == table
    assert (run / "study.png").stat().st_size > 1000


def test_a_study_from_the_command_line_samples_in_the_dtype_auto_picks(tiny_dir, tmp_path, monkeypatch, patched):
    """python -m extensions.study without --sample-dtype: auto is fixed as a run fixes it (bfloat16 where the
    CPU runs it, else float32) and written to the study's config.json, and the study runs to its table."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    study.main(study_argv(tiny_dir, tmp_path / "out", sample_dtype="auto", limit=2))
    saved = json.loads((tmp_path / "out" / "run" / "config.json").read_text())
    assert saved["sample_dtype"] == ("bfloat16" if grpo.bf16_supported(torch.device("cpu")) else "float32")
    assert len(rows(tmp_path / "out" / "run", "study.jsonl")) == 2


def test_a_study_of_a_model_that_cannot_load_ends_in_one_line_before_its_folder(tmp_path):
    with pytest.raises(SystemExit) as stop:
        study.main(["--model", str(tmp_path / "no-such-folder"), "--out-dir", str(tmp_path / "out")])
    assert str(stop.value.code).startswith("error: --model ") and "not a folder" in str(stop.value.code)
    assert not (tmp_path / "out").exists()


def test_killed_study_resumes_at_the_next_unfinished_question(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    straight = study.run_study(study_cfg(study_argv(tiny_dir, tmp_path / "a")))

    real_verify, sampled = t3rl.verify_groups, []

    def killed_in_batch_two(verify, seed, records, *args, **kwargs):
        sampled.extend(r["id"] for r in records)
        if len(sampled) > 2:
            raise KeyboardInterrupt
        return real_verify(verify, seed, records, *args, **kwargs)
    monkeypatch.setattr(t3rl, "verify_groups", killed_in_batch_two)
    with pytest.raises(KeyboardInterrupt):
        study.run_study(study_cfg(study_argv(tiny_dir, tmp_path / "b")))
    run = tmp_path / "b" / "run"
    assert [r["id"] for r in rows(run, "study.jsonl")] == ["q0", "q1"]
    with open(run / "study.jsonl", "a") as fh:
        fh.write('{"id": "q2", "gold": "6", "answ')  # a line cut short by the kill
    sampled.clear()
    with pytest.raises(SystemExit, match="other n_votes"):
        study.run_study(study_cfg(study_argv(tiny_dir, tmp_path / "b", n_votes=4)))
    resumed = study.run_study(study_cfg(["--resume", str(run)]))
    assert sampled == ["q2", "q3"]
    assert rows(resumed, "study.jsonl") == rows(straight, "study.jsonl")


def finished_study(tiny_dir, tmp_path, monkeypatch, **options):
    """A study of the four QUESTIONS run to its end: its folder and its study.jsonl rows."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = study.run_study(study_cfg(study_argv(tiny_dir, tmp_path, **options)))
    return run, rows(run, "study.jsonl")


def test_a_study_grows_to_more_votes_keeping_its_first_rollouts(tiny_dir, tmp_path, monkeypatch, patched):
    run, before = finished_study(tiny_dir, tmp_path, monkeypatch, n_votes=4)
    with pytest.raises(config.OptionError, match="--n-votes 2 .the run has 4"):
        study_cfg(["--resume", str(run), "--n-votes", "2"])  # a study may grow, never shrink
    real_verify, verified = t3rl.verify_groups, []

    def counting(verify, seed, records, groups, *args, **kwargs):
        verified.append([len(group) for group in groups])
        return real_verify(verify, seed, records, groups, *args, **kwargs)
    monkeypatch.setattr(t3rl, "verify_groups", counting)
    study.run_study(study_cfg(["--resume", str(run), "--n-votes", "8"]))
    after = rows(run, "study.jsonl")
    assert verified == [[4, 4], [4, 4]]  # only the 4 new rollouts of each question were sampled and verified
    assert [r["id"] for r in after] == [r["id"] for r in before]
    for old, new in zip(before, after):
        assert all(len(new[f]) == 8 and new[f][:4] == old[f] for f in study.ROLLOUT_FIELDS)
        assert new["text"][4:] != old["text"]  # new draws, not the first four again
    assert json.loads((run / "config.json").read_text())["n_votes"] == 8
    assert "8 w=inf" in (run / "table.txt").read_text()


def test_a_study_grows_to_more_questions_keeping_the_ones_it_has(tiny_dir, tmp_path, monkeypatch, patched):
    run, before = finished_study(tiny_dir, tmp_path, monkeypatch, limit=2)
    with pytest.raises(config.OptionError, match="--limit 1 .the run has 2"):
        study_cfg(["--resume", str(run), "--limit", "1"])
    study.run_study(study_cfg(["--resume", str(run), "--limit", "0"]))  # 0: every question
    after = rows(run, "study.jsonl")
    assert [r["id"] for r in after] == ["q0", "q1", "q2", "q3"] and after[:2] == before


def test_a_study_report_names_a_damaged_line_and_refuses_omegas_it_does_not_take(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"bench": "demo", "omega": 5.0, "seed": 0}))
    rows = [study_row("q0", "5", ["5"] * 4, [1, 0, 0, 0]), study_row("q1", "3", ["3"] * 4, [0] * 4)]
    del rows[1]["v"]
    (tmp_path / "study.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for argv, line in ((["--replay", str(tmp_path)], r"study.jsonl:2: no v in it; delete that line"),
                       (["--replay", str(tmp_path), "--omega", "2"], r"--omega: a study's report has omegas 1, ")):
        with pytest.raises(SystemExit) as stop:
            study.main(argv)
        assert re.search(line, str(stop.value.code)) and "\n" not in str(stop.value.code), stop.value.code


def test_a_study_line_without_a_field_is_named_before_anything_is_sampled(tmp_path):
    """collect reads what it has first: a damaged line stops the study at once, not after hours of sampling."""
    row = study_row("q0", "5", ["5"] * 4, [1, 0, 0, 0])
    del row["policy_tokens"]
    (tmp_path / "study.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(study.DataError, match=r"study.jsonl:1: no policy_tokens in it"):
        study.collect([{"id": "q0", "problem": "?", "answer": "5"}], tmp_path,
                      lambda *args: pytest.fail("sampled before reading the study"), 1, 4)
