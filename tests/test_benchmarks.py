"""benchmarks.py: benchmark files, T3RL_DATA_DIR and the Hub client."""
import json
import os
import subprocess
import sys

import pytest

from machinery import benchmarks
from machinery import runs
from helpers import ROOT, FakeHub


@pytest.mark.parametrize("name,rows", [("math500", 500), ("aime2024", 30), ("amc", 83), ("demo", 40)])
def test_benchmarks_load(name, rows):
    records = benchmarks.load_bench(name)
    assert len(records) == rows
    assert all(r["problem"] and isinstance(r["answer"], str) and r["id"] for r in records)
    assert len({r["id"] for r in records}) == rows


def test_math500_keeps_level_and_subject():
    rec = benchmarks.load_bench("math500")[0]
    assert rec["level"] in range(1, 6) and rec["subject"]


def test_unknown_bench_is_rejected():
    with pytest.raises(benchmarks.BenchError, match="unknown benchmark; choose one of math500, aime2024, amc, demo"):
        benchmarks.load_bench("gsm8k")


def test_malformed_json_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "oops"\n')
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path))
    with pytest.raises(runs.DataError, match=r"amc.jsonl:2: invalid JSON"):
        benchmarks.load_bench("amc")


def test_record_without_answer_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path))
    with pytest.raises(runs.DataError, match=r"amc.jsonl:3: record has no 'answer'"):
        benchmarks.load_bench("amc")


def load_benches_in_a_new_process(env, *names) -> dict:
    """load_bench(name) for each name in a fresh process (huggingface_hub reads HF_* variables at import) with no
    local benchmark files."""
    script = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r})\nfrom machinery import benchmarks\nbenchmarks.ROOT = benchmarks.Path(sys.argv[1])\n"
              "print(json.dumps({name: benchmarks.load_bench(name) for name in sys.argv[2:]}))\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("T3RL_DATA_DIR", "HF_HUB_OFFLINE")}, **env}
    done = subprocess.run([sys.executable, "-c", script, env.pop("EMPTY_ROOT"), *names], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_benchmarks_come_through_the_hub_client_with_token_mirror_cache_and_offline_mode(tmp_path, monkeypatch):
    import huggingface_hub
    import pyarrow
    import pyarrow.parquet
    amc = tmp_path / "amc.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(
        [{"id": i, "problem": f"p{i}", "answer": 142.0 + i, "url": "u"} for i in range(3)]), amc)
    math500 = {"problem": "p", "answer": "\\frac12", "unique_id": "test/a.json", "level": 2, "subject": "Algebra"}
    hub = FakeHub({
        "AI-MO/aimo-validation-amc": {"data/train-00000-of-00001.parquet": amc.read_bytes(), "README.md": b"#"},
        "HuggingFaceH4/MATH-500": {"test.jsonl": (json.dumps(math500) + "\n").encode(), "README.md": b"#"}})
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_t3rl_test",
           "EMPTY_ROOT": str(tmp_path)}
    try:
        online = load_benches_in_a_new_process(env, "amc", "math500")
        assert online["amc"] == [{"id": str(i), "problem": f"p{i}", "answer": f"{142.0 + i}"} for i in range(3)]
        assert online["math500"] == [{"id": "test/a.json", "problem": "p", "answer": "\\frac12", "level": 2,
                                      "subject": "Algebra"}]
        # the mirror got every request, with the user's token, and served only the split's files
        assert hub.requests and {auth for _, auth in hub.requests} == {"Bearer hf_t3rl_test"}
        assert not any(path.endswith("README.md") for path, _ in hub.requests)
        # offline (what HF_HUB_OFFLINE=1 and that HF_HOME set at import): the cache answers without a request,
        # and what was never downloaded is one clear line
        hub.requests.clear()
        monkeypatch.delenv("T3RL_DATA_DIR")
        monkeypatch.setattr(benchmarks, "ROOT", tmp_path)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        assert benchmarks.load_bench("amc") == online["amc"]
        with pytest.raises(benchmarks.BenchError) as err:
            benchmarks.load_bench("aime2024")
    finally:
        hub.shutdown()
    assert hub.requests == []
    assert str(err.value).startswith("--bench aime2024: not found locally and not available from the Hub (")
    assert "HF_HUB_OFFLINE" in str(err.value) and "put the file at" in str(err.value) and "\n" not in str(err.value)


def test_a_data_folder_without_the_benchmark_is_named_in_the_error(tmp_path, monkeypatch):
    """T3RL_DATA_DIR set to a folder that lacks the file (or does not exist) must be what the error names, not
    'not found locally' (the user did point somewhere); the Hub is offline here."""
    import huggingface_hub
    monkeypatch.setattr(benchmarks, "ROOT", tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    for folder, said in ((tmp_path, f"not found in T3RL_DATA_DIR={tmp_path} nor in data/"),
                         (tmp_path / "missing", f"not found in T3RL_DATA_DIR={tmp_path / 'missing'} (no such folder)")):
        monkeypatch.setenv("T3RL_DATA_DIR", str(folder))
        with pytest.raises(benchmarks.BenchError) as err:
            benchmarks.load_bench("aime2024")
        assert str(err.value).startswith(f"--bench aime2024: {said}") and "\n" not in str(err.value)


def test_a_jsonl_file_is_a_benchmark(tmp_path):
    """--bench questions.jsonl: a file of {id, problem, answer} records, read as a named benchmark is."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"id": "a", "problem": "1+1", "answer": "2"}\n{"id": "b", "problem": "2+2", "answer": "4"}\n')
    assert [r["id"] for r in benchmarks.load_bench(str(path))] == ["a", "b"]
    path.write_text('{"id": "a", "problem": "1+1"}\n')
    with pytest.raises(runs.DataError, match=r"mine.jsonl:1: record has no 'answer'"):
        benchmarks.load_bench(str(path))


def test_a_file_saved_with_a_bom_loads_and_a_null_id_is_a_missing_one(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_bytes('\ufeff{"id": null, "problem": "1+1", "answer": 2}\n{"id": null, "problem": "2+2", "answer": 4.5}\n'
                     .encode("utf-8"))
    assert [(r["id"], r["answer"]) for r in benchmarks.load_bench(str(path))] == [("mine-1", "2"), ("mine-2", "4.5")]


@pytest.mark.parametrize("answer", ["[1, 2]", "true", '{"x": 1}', "NaN", "null"])
def test_an_answer_that_is_no_string_or_number_names_its_line(tmp_path, answer):
    """A list or true has no spelling to compare with (str([1, 2]) would read as an interval); null is missing."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "roots?", "answer": ' + answer + '}\n')
    with pytest.raises(runs.DataError, match=r"mine.jsonl:2: (record has no 'answer'|'answer' is .*; write it as a "
                                             r"JSON string)"):
        benchmarks.load_bench(str(path))


def test_a_missing_jsonl_file_is_named_as_missing():
    with pytest.raises(benchmarks.BenchError, match=r"--bench /no/such/mine.jsonl: no such file"):
        benchmarks.load_bench("/no/such/mine.jsonl")


def test_a_level_written_as_a_float_loads(tmp_path):
    """pandas writes integer columns with gaps as floats: 3.0 is a level."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2", "level": 3.0}\n')
    assert benchmarks.load_bench(str(path))[0]["level"] == 3.0


@pytest.mark.parametrize("level", ["[1]", "true", "NaN"])
def test_a_level_that_is_no_number_or_name_names_its_line(tmp_path, level):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2", "level": 1}\n{"problem": "2+2", "answer": "4", "level": '
                    + level + '}\n')
    with pytest.raises(runs.DataError, match=r"mine.jsonl:2: 'level' is .*; write it as a number or a string"):
        benchmarks.load_bench(str(path))



@pytest.mark.parametrize("line, said", [
    ('{"problem": "p", "answer": 1' + "0" * 5000 + "}", r"invalid JSON \(Exceeds the limit \(4300 digits\)"),
    ('{"problem": "p", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", r"invalid JSON \(maximum recursion"),
    ('{"problem": "p\\ud800", "answer": "1"}', r"holds a lone surrogate escape"),
], ids=["a number past 4,300 digits", "deep nesting", "a lone surrogate"])
def test_json_python_cannot_hold_as_text_names_its_line(tmp_path, line, said):
    """Valid JSON that Python refuses (a huge integer, deep nesting) or that is no text (a lone surrogate, which
    the tokenizer and the run's own JSON lines refuse later) is named at its line."""
    path = tmp_path / "mine.jsonl"
    path.write_text('{"problem": "1+1", "answer": "2"}\n' + line + "\n")
    with pytest.raises(runs.DataError, match=r"mine.jsonl:2: " + said):
        benchmarks.load_bench(str(path))


def test_a_benchmark_shipped_in_data_that_is_missing_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmarks, "ROOT", tmp_path)
    monkeypatch.delenv("T3RL_DATA_DIR", raising=False)
    with pytest.raises(benchmarks.BenchError, match=r"--bench knk: .*knk.jsonl is missing; restore it"):
        benchmarks.load_bench("knk")
