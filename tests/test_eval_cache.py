"""extensions/eval_cache.py: the evaluation before training, kept for a later run (--eval-cache)."""
import dataclasses
import json

import pytest
from accelerate import Accelerator

import sampler
import t3rl
import verifier
from config import Config, parse_config
from extensions import eval_cache
from helpers import rows, tiny_argv, write_bench
from sandbox import SandboxPool

EIGHT = [(f"What is {i} + {i}?", str(2 * i)) for i in range(8)]
BUILD_VERIFIER = t3rl.build_verifier  # the real one: the `patched` fixture scripts the verifier


@pytest.fixture()
def eight(tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", EIGHT)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))


def sampler_calls(monkeypatch) -> list[str]:
    """The progress label of every sampler call from here on ('rollout', 'greedy', 'eval', ...)."""
    calls, real = [], sampler.generate

    def recorded(*args, **kwargs):
        calls.append(kwargs["progress"])
        return real(*args, **kwargs)
    monkeypatch.setattr(sampler, "generate", recorded)
    return calls


@pytest.mark.slow
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
    for changed in (dict(max_new_tokens=10), dict(omega=10)):
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
    said = [line for line in capsys.readouterr().err.splitlines() if "--eval-cache:" in line]
    assert said == [f"[t3rl] --eval-cache: {entry} is unreadable (JSONDecodeError: Expecting value: line 1 "
                    f"column 11 (char 10)); evaluating again and replacing it"]


def test_the_cache_key_holds_the_environment(monkeypatch):
    """Another device type, world size or version of a package that computes the numbers is another
    evaluation: a kept cache must not hand back its step-0 numbers."""
    cfg = Config(model="embedded", verifier_model="coder-1.5b")
    questions = [{"id": "q0", "problem": "1 + 1?", "answer": "2"}]
    keys = lambda device="cpu": [eval_cache.cache_key(cfg, questions, part, device)  # noqa: E731
                                 for part in (eval_cache.SAMPLES, eval_cache.VERDICTS)]
    base = keys()
    assert keys("cuda")[0] != base[0] and keys("cuda")[1] != base[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert keys()[0] != base[0] and keys()[1] != base[1]
    monkeypatch.delenv("WORLD_SIZE")
    real = eval_cache.importlib.metadata.version
    for package in eval_cache.PACKAGES:
        monkeypatch.setattr(eval_cache.importlib.metadata, "version",
                            lambda name, p=package: "0.0-other" if name == p else real(name))
        changed = keys()
        assert changed[0] != base[0] and changed[1] != base[1], package
    monkeypatch.setattr(eval_cache.importlib.metadata, "version", real)
    assert keys() == base


def test_a_run_without_a_verifier_keeps_and_reads_its_evaluation(tiny_dir, tmp_path):
    """--verifier-model none (the ttrl preset) has no verified vote: its evaluation is kept and read back
    without a verifier's key."""
    cfg = Config(model=str(tiny_dir), verifier_model="none", omega=1.0, eval_cache=str(tmp_path / "cache"))
    questions, made = [{"id": "q0", "problem": "1 + 1?", "answer": "2"}], []
    evaluate = eval_cache.cached(lambda records, step: made.append(step) or [{"id": "q0", "greedy@1": 1.0}],
                                 cfg, Accelerator(cpu=True))
    assert evaluate(questions, 0) == evaluate(questions, 0) == [{"id": "q0", "greedy@1": 1.0}]
    assert made == [0]


@pytest.mark.parametrize("entry", ['{"rows": 1, "votes": {}}', '{"rows": [{"id": "q0"}], "votes": null}',
                                   '{"rows": [], "votes": {}}', '{"rows": [{"id": "q0"}], "votes": {"k": []}}',
                                   '[1, 2]', '{"rows": [{}], "votes": {}}',  # a row without its numbers
                                   '{"rows": [{"id": "q9", "greedy@1": 1.0}], "votes": {}}',  # another question
                                   '[' * 100000])  # nested past the JSON parser's recursion
def test_a_cache_file_of_the_wrong_shape_is_evaluated_again(entry, tiny_dir, tmp_path, capsys):
    """A cache file that parses but is not an entry for these questions (edited, or another tool's) is
    named and replaced, never read as rows."""
    cfg = Config(model=str(tiny_dir), verifier_model="none", omega=1.0, eval_cache=str(tmp_path / "cache"))
    questions, made = [{"id": "q0", "problem": "1 + 1?", "answer": "2"}], []
    evaluate = eval_cache.cached(lambda records, step: made.append(step) or [{"id": "q0", "greedy@1": 1.0}],
                                 cfg, Accelerator(cpu=True))
    path = eval_cache.cache_path(cfg, questions, "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(entry)
    assert evaluate(questions, 0) == [{"id": "q0", "greedy@1": 1.0}] and made == [0]
    assert f"{path} is unreadable (" in capsys.readouterr().err
    assert json.loads(path.read_text())["rows"] == [{"id": "q0", "greedy@1": 1.0}]


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
    an option it reads and the key leaves out would let a kept cache hand back another setting's numbers.
    Its questions enter the key themselves, so the options that choose them may stay out."""
    cfg = parse_config(tiny_argv(tiny_dir, tmp_path / "out", eval_cache="none", max_steps=1))
    recorded, real_evaluate = ReadRecorder(cfg), t3rl.evaluate

    def evaluate_reading(learner, records):
        learner.cfg = recorded
        try:
            return real_evaluate(learner, records)
        finally:
            learner.cfg = cfg
    monkeypatch.setattr(t3rl, "evaluate", evaluate_reading)
    t3rl.train(cfg)
    BUILD_VERIFIER(recorded, "cpu")  # the verifier the evaluation's vote uses, and what wraps it
    with SandboxPool(workers=1) as pool:
        learner = t3rl.Learner(recorded, Accelerator(cpu=True), None, None, None, None, None, verifier.MATH,
                               tmp_path)
        t3rl.build_verify(learner, pool, 0)
    assert {"eval_samples", "seed", "omega", "verifier_max_new_tokens", "sample_dtype"} <= recorded.read
    # the memory teaches nothing at an evaluation, which verifies afresh (tests/test_memory.py)
    assert recorded.read - {"verdict_memory"} <= set(eval_cache.SAMPLES) | set(eval_cache.VERDICTS)


def test_rows_of_one_evaluation_with_runs_of_other_lengths_are_evaluated_again():
    rows = [{"id": "a", "greedy@1": 1.0, "runs": [1.0, 0.0]}, {"id": "b", "greedy@1": 0.0, "runs": [1.0]}]
    assert not eval_cache.well_formed({"rows": rows, "votes": {}}, ["a", "b"])
    rows[1]["runs"].append(0.0)
    assert eval_cache.well_formed({"rows": rows, "votes": {}}, ["a", "b"])
    assert eval_cache.well_formed({"rows": [], "votes": {}}, [])  # no question: no row to look at


def test_a_question_whose_level_changed_is_evaluated_again():
    """The rows carry each question's level (by_level): a level edited in the benchmark file is a new key."""
    cfg = Config(model="embedded", verifier_model="none", omega=1.0)
    question = {"id": "q0", "problem": "1 + 1?", "answer": "2", "level": 1}
    assert eval_cache.cache_key(cfg, [question], eval_cache.SAMPLES, "cpu") != \
        eval_cache.cache_key(cfg, [question | {"level": 2}], eval_cache.SAMPLES, "cpu")


def test_the_cache_key_names_only_real_options():
    """A misspelt name in the lists would key the evaluation on an option it does not depend on."""
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(eval_cache.SAMPLES) <= names and set(eval_cache.VERDICTS) <= names
    assert not set(eval_cache.SAMPLES) & set(eval_cache.VERDICTS)
