"""model.py: loading models (Hub ids, folders, GGUF files, the offline models on PyPI)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from machinery import model as model_lib
from helpers import ROOT, FakeHub, make_tiny_model, write_tiny_qwen2_gguf


def test_embedded_model_loads_and_generates(embedded_model):
    model, tok = embedded_model
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.hidden_size == 896
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3? Answer with a number only."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "5" in tok.decode(out[0, ids["input_ids"].shape[1]:])


def _tiny_gguf(path, name="fake model"):
    """A valid GGUF file (header with general.name and one small tensor), written with the gguf package."""
    import gguf
    import numpy as np
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(name)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.arange(512, dtype=np.float32).reshape(8, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _fake_parts(tmp_path, monkeypatch, blob, cuts):
    """Install stand-in part packages on sys.path holding `blob` cut at `cuts`; return an OfflineModel for them."""
    bounds = [0, *cuts, len(blob)]
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]), start=1):
        pkg = tmp_path / "site" / f"fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob[lo:hi])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return model_lib.OfflineModel("fake model", "fake-part", "1.0", tuple(hi - lo for lo, hi in zip(bounds, bounds[1:])),
                                  torch.float32, "fake")


def test_two_gguf_files_of_one_name_and_size_convert_to_two_folders(tmp_path, monkeypatch):
    """Two fine-tunes exported alike (model.gguf, the same size) are two models: each gets its own
    converted folder, never the other's weights."""
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(model_lib, "_convert_gguf", lambda gguf, out_dir: out_dir)
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    blob = _tiny_gguf(tmp_path / "a" / "model.gguf")
    (tmp_path / "b" / "model.gguf").write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))  # a weight differs
    (tmp_path / "c.gguf").write_bytes(blob)  # the first one, copied
    folders = [model_lib._resolve(str(tmp_path / name)) for name in ("a/model.gguf", "b/model.gguf", "c.gguf")]
    assert folders[0] != folders[1] and folders[0].name.startswith("model-")
    assert folders[2].name.split("-")[1] == folders[0].name.split("-")[1]  # the same contents, the same key


def test_parts_assemble_in_order_into_one_gguf(tmp_path, monkeypatch):
    blob = _tiny_gguf(tmp_path / "whole.gguf")
    fake = _fake_parts(tmp_path, monkeypatch, blob, [300, 600])
    out = model_lib.assemble_gguf(fake, tmp_path / "cache" / "m.gguf")
    assert out.read_bytes() == blob and len(fake.sizes) == 3
    assert model_lib.gguf_header(out)["name"] == "fake model"


def test_missing_part_names_the_package_and_the_fix(tmp_path, monkeypatch):
    fake = _fake_parts(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "whole.gguf"), [300])
    fake = dataclasses.replace(fake, sizes=fake.sizes + (1,))  # a third part, never installed
    with pytest.raises(model_lib.ModelLoadError, match=r"fake-part3 of fake model is not installed; run: pip install "
                       r"-r requirements.txt \(or pip install fake-part\{1..3\}==1.0\)$"):
        model_lib.assemble_gguf(fake, tmp_path / "cache" / "m.gguf")


def test_truncated_part_is_reported_and_leaves_no_cache(tmp_path, monkeypatch):
    fake = _fake_parts(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "whole.gguf"), [300])
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"x" * 100)
    with pytest.raises(model_lib.ModelLoadError, match=r"part02.bin has 100 bytes, expected \d+.*force-reinstall fake-part2==1.0"):
        model_lib.assemble_gguf(fake, tmp_path / "cache" / "m.gguf")
    assert not (tmp_path / "cache" / "m.gguf").exists()


@pytest.mark.parametrize("damage", ["magic", "body", "name"])
def test_parts_that_are_not_the_expected_gguf_are_rejected_atomically(tmp_path, monkeypatch, damage):
    blob = _tiny_gguf(tmp_path / "whole.gguf", name="another model" if damage == "name" else "fake model")
    if damage == "magic":
        blob = b"NOPE" + blob[4:]
    if damage == "body":  # valid magic and version, then garbage where the tensor and field counts are
        blob = blob[:8] + bytes([0xFF]) * (len(blob) - 8)
    fake = _fake_parts(tmp_path, monkeypatch, blob, [300])
    dest = tmp_path / "cache" / "m.gguf"
    with pytest.raises(model_lib.ModelLoadError, match="not a valid GGUF of fake model.*force-reinstall fake-part1==1.0"):
        model_lib.assemble_gguf(fake, dest)
    assert list(dest.parent.iterdir()) == []


def test_offline_models_are_known_by_name_and_alias():
    assert model_lib.offline_model("embedded") is model_lib.offline_model("coder-0.5b")
    assert model_lib.offline_model("coder-1.5b").dtype == torch.bfloat16
    assert model_lib.offline_model("Qwen/Qwen2.5-Coder-1.5B-Instruct") is None


@pytest.mark.slow
def test_coder_1_5b_parts_assemble_into_the_paper_verifier_gguf():
    """The 22 installed parts concatenate into the GGUF the table claims: the 1.5B coder, Q4_K_M, with its chat
    template (a header read only; converting the 1.5B is left to `python -m machinery.model coder-1.5b`)."""
    spec = model_lib.offline_model("coder-1.5b")
    with model_lib._locked(model_lib.cache_dir() / f"{spec.cache_name}.lock"):
        path = model_lib.assemble_gguf(spec, model_lib.cache_dir() / f"{spec.cache_name}.gguf")
    header = model_lib.gguf_header(path)
    assert path.stat().st_size == spec.size == 1_117_320_768
    assert header["name"] == "Qwen2.5 Coder 1.5B Instruct GGUF" and header["architecture"] == "qwen2"
    assert (header["blocks"], header["file_type"], header["tensors"]) == (28, 15, 339)
    assert "<|im_start|>" in header["chat_template"]


@pytest.mark.parametrize("spec", ["missing.gguf", "./no/such/folder", "not a model"])
def test_bad_model_spec_is_rejected(spec):
    with pytest.raises(model_lib.ModelLoadError, match="--model"):
        model_lib.load_model(spec)


def _truncate_weights(folder):
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])


def _drop_tokenizer(folder):
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (folder / name).unlink(missing_ok=True)


@pytest.mark.parametrize("damage, line", [
    (_truncate_weights, r"cannot read the checkpoint in .*; pass a folder that holds a whole checkpoint"),
    (lambda folder: (folder / "config.json").write_text('{"model_type": "no-such-model"}'),
     r"cannot read the checkpoint in .*; pass a folder that holds a whole checkpoint"),
    (lambda folder: (folder / "tokenizer.json").write_text("{"), r"cannot read the checkpoint in "),
    (_drop_tokenizer, r"holds no tokenizer; copy tokenizer.json and tokenizer_config.json from its base model"),
], ids=["truncated weights", "unknown model type", "damaged tokenizer", "no tokenizer"])
def test_a_damaged_checkpoint_folder_is_named_in_one_line(tiny_dir, damage, line):
    """transformers, safetensors and tokenizers raise their own errors, not OSError: each is the one line, and a
    user's folder is not to be deleted "to rebuild it"."""
    damage(tiny_dir)
    with pytest.raises(model_lib.ModelLoadError, match=line) as err:
        model_lib.load_model(str(tiny_dir), option="--model")
    assert "\n" not in str(err.value) and "delete" not in str(err.value)


def test_an_unwritable_model_cache_is_named_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path / "file" / "cache"))  # below a file: NotADirectoryError
    _tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(model_lib.ModelLoadError, match=r"--model .*m.gguf: cannot write the model cache .*; free space "
                                                       r"there, or set T3RL_CACHE to a writable folder"):
        model_lib.load_model(str(tmp_path / "m.gguf"))


def test_a_gguf_converts_with_its_own_tokenizer_whatever_lies_beside_it(tmp_path, monkeypatch, tiny_dir):
    """transformers reads tokenizer files from the folder of a .gguf: another model's lying there must not
    become this one's tokenizer (the converted folder is shared by every copy of the file)."""
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path / "cache"))
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a 151k-token Qwen tokenizer
        (tmp_path / name).write_bytes((tiny_dir / name).read_bytes())
    model, tokenizer = model_lib.load_model(str(write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")))
    assert (model.config.hidden_size, len(tokenizer)) == (32, 260)


def test_a_killed_conversions_folder_is_removed_by_the_next(tmp_path, monkeypatch):
    """Both builds of an offline model (the assembled .gguf, the converted folder) leave GBs when killed."""
    stale = tmp_path / "out.tmp-99999"
    (stale / "sub").mkdir(parents=True)
    monkeypatch.setattr(model_lib.AutoTokenizer, "from_pretrained", lambda *a, **k: 1 / 0)
    with pytest.raises(model_lib.ModelLoadError):
        model_lib._convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not stale.exists()
    fake = _fake_parts(tmp_path, monkeypatch, _tiny_gguf(tmp_path / "whole.gguf"), [300])
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "m.gguf.tmp-99999").write_bytes(b"half a model")
    model_lib.assemble_gguf(fake, tmp_path / "cache" / "m.gguf")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m.gguf"]


def test_an_offline_model_whose_parts_are_missing_is_refused_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path))  # nothing converted yet
    fake = model_lib.OfflineModel("fake model", "no-such-part", "1.0", (1,), torch.float32, "fake")
    monkeypatch.setitem(model_lib.OFFLINE_MODELS, "fake", fake)
    with pytest.raises(model_lib.ModelLoadError, match="no-such-part1 of fake model is not installed"):
        model_lib.check_spec("fake")


@pytest.mark.parametrize("snapshot, line", [
    (lambda tmp_path: tmp_path, r"the Hub repository has no config.json \(only GGUF files\?\); download a .gguf"),
    (None, r"the download stopped \(peer closed connection\); run again"),
], ids=["no config.json", "connection dropped"])
def test_a_hub_download_that_gives_no_checkpoint_is_named_in_one_line(tmp_path, monkeypatch, snapshot, line):
    def download(spec, allow_patterns):
        if snapshot is None:  # what the Hub client's HTTP library raises: not an OSError
            raise type("RemoteProtocolError", (Exception,), {})("peer closed connection")
        return str(snapshot(tmp_path))
    monkeypatch.setattr(model_lib, "snapshot_download", download)
    with pytest.raises(model_lib.ModelLoadError, match=line):
        model_lib.check_hub("owner/gguf-only", "--model")


def load_models_in_a_new_process(env, *specs) -> list[dict]:
    """load_model(spec) for each spec in a fresh process (huggingface_hub reads HF_* variables at import):
    {"hidden_size", "vocab"} of the loaded model, or {"error": the ModelLoadError's message}."""
    script = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r})\nfrom machinery import model\n"
              "for spec in sys.argv[1:]:\n"
              "    try:\n        m, tok = model.load_model(spec)\n"
              "        print(json.dumps({'hidden_size': m.config.hidden_size, 'vocab': len(tok)}))\n"
              "    except model.ModelLoadError as err:\n        print(json.dumps({'error': str(err)}))\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, **env}
    done = subprocess.run([sys.executable, "-c", script, *specs], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_hub_models_come_through_the_hub_client_with_token_mirror_cache_and_offline_mode(tmp_path, tokenizer):
    folder = tmp_path / "tiny"
    make_tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "tiny-q4.gguf").write_bytes(b"GGUF" + bytes(64))  # a repository's GGUF copy: not a checkpoint file
    hub = FakeHub({"t3rl-test/tiny-qwen2": {p.name: p.read_bytes() for p in folder.iterdir()}}, kind="models")
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_t3rl_test"}
    try:
        online = load_models_in_a_new_process(env, "t3rl-test/tiny-qwen2", "t3rl-test/no-such-model")
        fetched = {path.rsplit("/", 1)[-1] for path, _ in hub.requests if "/resolve/" in path}
        tokens = {auth for _, auth in hub.requests}
        hub.requests.clear()
        offline = load_models_in_a_new_process({**env, "HF_HUB_OFFLINE": "1"}, "t3rl-test/tiny-qwen2",
                                               "t3rl-test/never-downloaded")
    finally:
        hub.shutdown()
    assert online[0] == {"hidden_size": 64, "vocab": len(tokenizer)}
    # through the mirror, with the user's token, only the checkpoint's files
    assert tokens == {"Bearer hf_t3rl_test"} and "model.safetensors" in fetched and "tiny-q4.gguf" not in fetched
    assert online[1]["error"].startswith("--model t3rl-test/no-such-model: the Hub has no such model")
    # offline: the cache answers without a request; what was never downloaded is one clear line
    assert offline[0] == online[0] and hub.requests == []
    assert offline[1]["error"].startswith("--model t3rl-test/never-downloaded: not in the local Hugging Face cache")
    assert "HF_HUB_OFFLINE" in offline[1]["error"] and "\n" not in offline[1]["error"]
