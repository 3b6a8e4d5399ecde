"""machinery/evals.py: which questions a run evaluates, the step-0 evaluation's cache, the time line."""
import dataclasses
import json
import re
import time

import pytest

import t3rl
from helpers import rows, tiny_argv, write_bench
from config import Config
from machinery import evals, metrics
from machinery.options import parse_config

EIGHT = [(f"What is {i} + {i}?", str(2 * i)) for i in range(8)]
BUILD_VERIFIER = t3rl.build_verifier  # the real one: the `patched` fixture scripts the verifier


@pytest.fixture()
def eight(tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", EIGHT)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))


def sampler_calls(monkeypatch) -> list[str]:
    """The progress label of every sampler call from here on ('rollout', 'greedy', 'eval', ...)."""
    calls, real = [], t3rl.generate

    def recording(*args, **kwargs):
        calls.append(kwargs["progress"])
        return real(*args, **kwargs)
    monkeypatch.setattr(t3rl, "generate", recording)
    return calls


def test_evaluations_cover_the_questions_the_run_reached(tiny_dir, tmp_path, eight):
    """3 steps of 2 of 8 questions: every evaluation covers the 6 questions the steps visited, and says so."""
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", limit=0, episodes=1, max_steps=3)))
    trained = {r["id"] for r in rows(run, "rollouts.jsonl")}
    assert len(trained) == 6
    evals = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "eval"]
    assert [(m["eval_on"], m["questions"], m["trained_questions"]) for m in evals] == [("trained", 6, 6)] * 2
    per_question = rows(run, "evaluations.jsonl")
    for step in (0, 3):
        assert {r["id"] for r in per_question if r["step"] == step} == trained
    assert "evaluated on the 6 questions the run trains on (--eval-on trained; 6 of them trained)" in \
        metrics.summary(run)


def test_held_out_evaluates_only_the_questions_no_step_visits(tiny_dir, tmp_path, eight):
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", limit=0, episodes=1, max_steps=3,
                                            eval_on="held-out")))
    trained = {r["id"] for r in rows(run, "rollouts.jsonl")}
    evaluated = {r["id"] for r in rows(run, "evaluations.jsonl")}
    assert len(evaluated) == 2 and not evaluated & trained
    final = [m for m in rows(run, "metrics.jsonl") if m.get("final")][0]
    assert (final["questions"], final["trained_questions"]) == (2, 0)


def test_held_out_with_every_question_trained_is_refused_in_one_line(tiny_dir, tmp_path, eight):
    with pytest.raises(SystemExit, match=r"^error: --eval-on held-out: the run's steps visit all 8 questions"):
        t3rl.main(tiny_argv(tiny_dir, tmp_path / "out", limit=0, eval_on="held-out"))


def test_a_second_run_takes_the_evaluation_before_training_from_the_cache(tiny_dir, tmp_path, eight, monkeypatch,
                                                                          capsys):
    """T3RL, then TTRL (--omega 1) at another learning rate beside it: the second run samples no evaluation before
    training, logs the first's (its majority-vote numbers; at omega 1 the verified vote is the majority), and
    says where it came from. Changing an evaluation setting, or the verifier's weight, evaluates again."""
    cache = tmp_path / "cache"
    argv = lambda name, **o: tiny_argv(tiny_dir, tmp_path / "out", run_name=name, limit=0,  # noqa: E731
                                       eval_cache=str(cache), max_steps=1, **o)
    first = t3rl.train(parse_config(argv("t3rl")))
    calls = sampler_calls(monkeypatch)
    capsys.readouterr()
    second = t3rl.train(parse_config(argv("ttrl", omega=1, lr=5e-4)))
    assert calls.count("greedy") == 1 and calls.count("eval") == 1  # the final evaluation's only
    assert "evaluation at step 0 taken from" in capsys.readouterr().err
    before = [[m for m in rows(run, "metrics.jsonl") if m["step"] == 0 and m["kind"] == "eval"][0]
              for run in (first, second)]
    assert "verified_maj@2" in before[0] and "verified_maj@2" not in before[1]
    assert {k: v for k, v in before[0].items() if "verified_maj" not in k} == before[1]
    assert [r for r in rows(second, "evaluations.jsonl") if r["step"] == 0] == \
        [{k: v for k, v in r.items() if "verified_maj" not in k}
         for r in rows(first, "evaluations.jsonl") if r["step"] == 0]
    for changed in (dict(eval_temperature=0.9), dict(omega=10)):
        calls.clear()
        t3rl.train(parse_config(argv("again-" + next(iter(changed)), **changed)))
        assert calls.count("greedy") == 2, changed


def test_a_damaged_cache_file_is_evaluated_again_and_rewritten(tiny_dir, tmp_path, eight, monkeypatch, capsys):
    cache = tmp_path / "cache"
    argv = lambda name: tiny_argv(tiny_dir, tmp_path / "out", run_name=name, eval_cache=str(cache),  # noqa: E731
                                  max_steps=1)
    t3rl.train(parse_config(argv("a")))
    [entry] = cache.glob("*.json")
    kept = json.loads(entry.read_text())
    entry.write_text('{"rows": [')  # cut short
    calls = sampler_calls(monkeypatch)
    capsys.readouterr()
    t3rl.train(parse_config(argv("b")))
    assert calls.count("greedy") == 2
    assert json.loads(entry.read_text()) == kept
    said = [line for line in capsys.readouterr().err.splitlines() if "--eval-cache" in line]
    assert said == [f"[t3rl] --eval-cache: {entry} is unreadable (JSONDecodeError: Expecting value: line 1 "
                    f"column 11 (char 10)); evaluating again and replacing it"]


def test_the_time_line_gives_each_phase_in_minutes_and_shares_of_the_wall():
    line = metrics.time_line({"load": 60.0, "evaluation": 120.0, "sample": 30.0, "verify": 30.0,
                              "update": 150.0, "wall": 420.0})
    assert line == ("time 7.0 min: load 1.0 (14%), evaluation 2.0 (29%), sample 0.5 (7%), verify 0.5 (7%), "
                    "update 2.5 (36%), other 0.5 (7%)")


def test_a_run_ends_with_where_its_time_went(tiny_dir, tmp_path, eight, monkeypatch, capsys):
    """Each evaluation made 2 s slower: the printed evaluation time holds those seconds."""
    real = t3rl.evaluate
    monkeypatch.setattr(t3rl, "evaluate", lambda *a, **k: (time.sleep(2), real(*a, **k))[1])
    started = time.time()
    t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, eval_cache="none")))
    wall = time.time() - started
    line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("time ")][-1]
    shares = dict((phase, int(share)) for phase, share in re.findall(r"(\w+) [\d.]+ \((\d+)%\)", line))
    assert list(shares) == ["load", "evaluation", "sample", "verify", "update", "other"]
    assert shares["evaluation"] >= 100 * 4 / wall - 1 and abs(sum(shares.values()) - 100) <= 3


def test_the_cache_key_holds_the_environment(monkeypatch):
    """Another device type, world size or version of a package that computes the numbers is another
    evaluation: a kept cache must not hand back its step-0 numbers."""
    cfg, questions = Config(model="embedded"), [{"id": "q0", "problem": "1 + 1?", "answer": "2"}]
    keys = lambda: [evals.cache_key(cfg, questions, part, "cpu") for part in ("samples", "verdicts")]  # noqa: E731
    base = keys()
    assert [evals.cache_key(cfg, questions, part, "cuda") for part in ("samples", "verdicts")] != base
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert keys()[0] != base[0] and keys()[1] != base[1]
    monkeypatch.delenv("WORLD_SIZE")
    real = evals.importlib.metadata.version
    for package in evals.PACKAGES:
        monkeypatch.setattr(evals.importlib.metadata, "version",
                            lambda name, p=package: "0.0-other" if name == p else real(name))
        changed = keys()
        assert changed[0] != base[0] and changed[1] != base[1], package
    monkeypatch.setattr(evals.importlib.metadata, "version", real)
    assert keys() == base


class ReadRecorder:
    """A Config that records which of its fields are read."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, name):
        if name in Config.__dataclass_fields__:
            self.read.add(name)
        return getattr(self._cfg, name)


def test_every_option_the_evaluation_before_training_reads_is_in_its_cache_key(tiny_dir, tmp_path, eight,
                                                                              monkeypatch):
    """The evaluation (its samples, its verifier, its verified vote) reads only options in the cache key:
    an option it reads that is listed as training-only would let a kept cache hand back another setting's
    numbers. Its questions enter the key themselves, so the options that choose them may stay out."""
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path / "out", eval_cache="none", max_steps=1))
    recorded = ReadRecorder(cfg)
    real_evaluate = t3rl.evaluate
    monkeypatch.setattr(t3rl, "evaluate", lambda policy, tokenizer, records, cfg, *a, **k: real_evaluate(
        policy, tokenizer, records, recorded, *a, **k))
    t3rl.train(cfg)
    BUILD_VERIFIER(recorded, "cpu")  # the verifier the evaluation's vote uses
    assert {"eval_samples", "eval_temperature", "seed", "omega", "verifier_max_new_tokens"} <= recorded.read
    assert recorded.read & evals.TRAINING_ONLY == set()


def test_the_cache_key_names_only_real_options():
    """A misspelt name in the lists would key the evaluation on an option it does not depend on, or miss one."""
    names = {f.name for f in dataclasses.fields(Config)}
    assert evals.TRAINING_ONLY <= names and evals.VERIFIER_ONLY <= names
    assert not evals.TRAINING_ONLY & evals.VERIFIER_ONLY
