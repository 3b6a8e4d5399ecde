"""t3rl's tests, one property per test, on the CPU: a tiny random Qwen2 (conftest.py) where any transformer will
do, the embedded 0.5B model where the real one matters. Run: python -m pytest -q test_t3rl.py"""
import copy
import dataclasses
import doctest
import hashlib
import http.server
import itertools
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

import knk
import model as model_lib
import sampler
import study
import t3rl
import verifier
import voting
from conftest import make_tiny_model
from grpo import (
    cosine_schedule,
    group_advantages,
    grpo_step,
    make_optimizer,
    pad_batch,
    policy_loss,
    token_logprobs,
)
from sampler import cache_bytes_per_row, generate, nucleus, prefix_plan, sample_next
from sandbox import SandboxPool, run_snippet
from answers import answer_key, extract_answer, is_equiv, same_answer
from bench.answers_bench import EQUIV_CASES
from verifier import (
    MAX_ROLLOUT_CHARS,
    VERIFIER_SYSTEM,
    ToolRun,
    extract_code,
    hardcoded,
    model_verifier,
    python_tool,
    tool_agrees,
    verifier_prompt,
    verify_batch,
)
from voting import answer_classes, group_metrics, undecided_classes, weighted_vote

# =================================================================================================================
# foundation: model loading and benchmarks
# =================================================================================================================

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


def test_coder_1_5b_parts_assemble_into_the_paper_verifier_gguf():
    """The 22 installed parts concatenate into the GGUF the table claims: the 1.5B coder, Q4_K_M, with its chat
    template (a header read only; converting the 1.5B is left to `python model.py coder-1.5b`)."""
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
    with pytest.raises(t3rl.DataError, match=r"amc.jsonl:2: invalid JSON"):
        t3rl.load_bench("amc")


def test_record_without_answer_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "amc.jsonl").write_text('{"problem": "1+1", "answer": "2"}\n\n{"problem": "2+2"}\n')
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path))
    with pytest.raises(t3rl.DataError, match=r"amc.jsonl:3: record has no 'answer'"):
        t3rl.load_bench("amc")


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's HTTP API as huggingface_hub uses it (repo info, file tree, file downloads), on 127.0.0.1, serving
    `files` {repo: {path: bytes}} of `kind` "datasets" or "models"; `requests` records (path, Authorization header)
    for each request about a served repo."""

    def __init__(self, files, kind="datasets"):
        self.files, self.kind, self.requests = files, kind, []
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    commit = "0123456789abcdef0123456789abcdef01234567"

    def do_GET(self):
        path = urllib.parse.urlparse(self.path).path
        kind = self.server.kind
        for repo, files in self.server.files.items():
            if repo in path:
                self.server.requests.append((path, self.headers.get("authorization")))
            if path.startswith(f"/api/{kind}/{repo}/revision/"):
                return self.reply({"id": repo, "sha": self.commit, "siblings": [{"rfilename": f} for f in files]})
            if path.startswith(f"/api/{kind}/{repo}/tree/"):
                return self.reply([{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                                   for f, data in files.items()])
            name = path.removeprefix(f"{'/datasets' if kind == 'datasets' else ''}/{repo}/resolve/{self.commit}/")
            if name in files:
                etag = f'"{hashlib.sha1(files[name]).hexdigest()}"'
                return self.reply(files[name], {"X-Repo-Commit": self.commit, "ETag": etag})
        if path.startswith(f"/api/{kind}/"):  # what the Hub answers about a repository it does not have
            return self.reply(b"", {"X-Error-Code": "RepoNotFound"}, status=401)
        self.reply(b"", status=404)

    do_HEAD = do_GET

    def reply(self, body, headers=(), status=200):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for key, value in dict(headers).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def load_benches_in_a_new_process(env, *names) -> dict:
    """load_bench(name) for each name in a fresh process (huggingface_hub reads HF_* variables at import) with no
    local benchmark files."""
    script = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r})\nimport t3rl\nt3rl.ROOT = t3rl.Path(sys.argv[1])\n"
              "print(json.dumps({name: t3rl.load_bench(name) for name in sys.argv[2:]}))\n")
    env = {**{k: v for k, v in os.environ.items() if k not in ("T3RL_DATA_DIR", "HF_HUB_OFFLINE")}, **env}
    done = subprocess.run([sys.executable, "-c", script, env.pop("EMPTY_ROOT"), *names], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def load_models_in_a_new_process(env, *specs) -> list[dict]:
    """load_model(spec) for each spec in a fresh process (huggingface_hub reads HF_* variables at import):
    {"hidden_size", "vocab"} of the loaded model, or {"error": the ModelLoadError's message}."""
    script = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r})\nimport model\n"
              "for spec in sys.argv[1:]:\n"
              "    try:\n        m, tok = model.load_model(spec)\n"
              "        print(json.dumps({'hidden_size': m.config.hidden_size, 'vocab': len(tok)}))\n"
              "    except model.ModelLoadError as err:\n        print(json.dumps({'error': str(err)}))\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, **env}
    done = subprocess.run([sys.executable, "-c", script, *specs], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


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
        monkeypatch.setattr(t3rl, "ROOT", tmp_path)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
        assert t3rl.load_bench("amc") == online["amc"]
        with pytest.raises(t3rl.BenchError) as err:
            t3rl.load_bench("aime2024")
    finally:
        hub.shutdown()
    assert hub.requests == []
    assert str(err.value).startswith("--bench aime2024: not found locally and not available from the Hub (")
    assert "HF_HUB_OFFLINE" in str(err.value) and "put the file at" in str(err.value) and "\n" not in str(err.value)


def test_a_data_folder_without_the_benchmark_is_named_in_the_error(tmp_path, monkeypatch):
    """T3RL_DATA_DIR set to a folder that lacks the file (or does not exist) must be what the error names, not
    'not found locally' (the user did point somewhere); the Hub is offline here."""
    import huggingface_hub
    monkeypatch.setattr(t3rl, "ROOT", tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    for folder, said in ((tmp_path, f"not found in T3RL_DATA_DIR={tmp_path} nor in data/"),
                         (tmp_path / "missing", f"not found in T3RL_DATA_DIR={tmp_path / 'missing'} (no such folder)")):
        monkeypatch.setenv("T3RL_DATA_DIR", str(folder))
        with pytest.raises(t3rl.BenchError) as err:
            t3rl.load_bench("aime2024")
        assert str(err.value).startswith(f"--bench aime2024: {said}") and "\n" not in str(err.value)


# =================================================================================================================
# voting.py and answer checking
# =================================================================================================================

INF = float("inf")


# ---------------------------------------------------------------- voting.py

def test_doctests_pass():
    for module in (voting, verifier):
        failed, _ = doctest.testmod(module)
        assert failed == 0


def test_voting_imports_only_the_standard_library():
    source = open(voting.__file__).read()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports and imports <= set(sys.stdlib_module_names)


def vote_of(answers, verified, omega, **classes):
    vote = weighted_vote(answers, verified, omega, **classes)
    return vote.label, vote.scores


def test_voting_runs_as_a_lone_file(tmp_path):
    shutil.copy(voting.__file__, tmp_path / "voting.py")
    done = subprocess.run([sys.executable, "-m", "doctest", "-v", "voting.py"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0 and "passed and 0 failed" in done.stdout, done.stdout + done.stderr


def test_paper_example_flips_with_omega_5_and_not_with_omega_1():
    answers, verified = ["1260"] * 11 + ["1320"] * 5, [0] * 11 + [1] * 5
    assert vote_of(answers, verified, 5.0) == ("1320", {"1320": 25.0, "1260": 11.0})
    assert vote_of(answers, verified, 1.0) == ("1260", {"1260": 11.0, "1320": 5.0})


def test_hard_filter_counts_only_verified_answers():
    answers, verified = ["7"] * 10 + ["8", "9", "9"], [0] * 10 + [1, 0, 0]
    assert vote_of(answers, verified, INF) == ("8", {"8": 1.0, "7": 0.0, "9": 0.0})


def test_hard_filter_without_verified_answers_is_plain_majority():
    assert vote_of(["7", "8", "8"], [0, 0, 0], INF) == ("8", {"8": 2.0, "7": 1.0})


def test_tie_on_score_goes_to_more_rollouts():
    # "a": one verified rollout (5); "b": five unverified rollouts (5)
    label, scores = vote_of(["a", "b", "b", "b", "b", "b"], [1, 0, 0, 0, 0, 0], 5.0)
    assert label == "b" and scores == {"b": 5.0, "a": 5.0}


def test_full_tie_goes_to_first_appearance():
    assert weighted_vote(["x", "y", "y", "x"], [0, 0, 0, 0], 1.0).label == "x"
    assert weighted_vote(["y", "x", "y", "x"], [0, 0, 0, 0], 1.0).label == "y"


def test_hard_filter_tie_goes_to_first_appearance():
    assert weighted_vote(["p", "q", "q"], [0, 1, 1], INF).label == "q"
    assert weighted_vote(["p", "q", "r"], [1, 0, 1], INF).label == "p"


def test_none_never_wins_against_an_answer():
    vote = weighted_vote([None, None, None, "4"], [1, 1, 1, 0], 5.0)
    assert (vote.label, vote.scores, vote.assignment, vote.rewards()) == ("4", {"4": 1.0}, [None, None, None, 0],
                                                                          [0.0, 0.0, 0.0, 1.0])


def test_all_none_gives_no_label():
    for omega in (1.0, 5.0, INF):
        vote = weighted_vote([None, None], [0, 1], omega)
        assert (vote.label, vote.scores, vote.rewards()) == (None, {}, [0.0, 0.0])


def test_single_class_group():
    assert vote_of(["3", "3", "3"], [1, 0, 1], 5.0) == ("3", {"3": 11.0})


def test_whitespace_variants_vote_together_by_default():
    assert vote_of(["1 + i", "1+i", "2"], [0, 0, 0], 1.0) == ("1 + i", {"1 + i": 2.0, "2": 1.0})


def test_class_is_represented_by_its_most_frequent_spelling():
    answers = ["\\frac12", "0.5", "0.5", "1/2", "3", "3"]
    assert vote_of(answers, [0] * 6, 1.0, key=answer_key) == ("0.5", {"0.5": 4.0, "3": 2.0})


def test_same_merges_spellings_the_key_misses():
    answers = ["\\sqrt{2}/2", "\\frac{1}{\\sqrt2}", "1", "1"]
    assert vote_of(answers, [0] * 4, 1.0, key=answer_key)[1] == {"1": 2.0, "\\sqrt{2}/2": 1.0, "\\frac{1}{\\sqrt2}": 1.0}
    assert vote_of(answers, [0] * 4, 1.0, key=answer_key, same=same_answer) == ("\\sqrt{2}/2", {"\\sqrt{2}/2": 2.0, "1": 2.0})


def test_equivalent_spellings_collapse_into_one_class():
    answers = ["1,000", "1000", "1000.0", "10^3", "999", "\\boxed{1000}"]
    label, scores = vote_of(answers, [0, 0, 0, 0, 1, 0], 2.0, key=answer_key, same=same_answer)
    assert label == "1,000" and scores["1,000"] == 5.0 and scores["999"] == 2.0


def test_same_answers_in_any_order_elect_the_same_class_and_reward_only_it():
    # 9% is 9 percent, not 0.09: the winner is 0.09 whichever rollout comes first, and the 9 / 9% rollouts lose
    answers = ["9", "9\\%", "0.09", "0.09", "0.09"]
    for order in itertools.permutations(range(len(answers))):
        shuffled = [answers[i] for i in order]
        vote = weighted_vote(shuffled, [0] * len(shuffled), 5.0, key=answer_key, same=same_answer)
        assert vote.label == "0.09" and list(vote.scores.values()) == [3.0, 2.0]
        assert vote.rewards() == [1.0 if a == "0.09" else 0.0 for a in shuffled]


def test_classes_are_connected_components_whatever_the_order():
    # a `same` that is not transitive (neighbours): classes must still not depend on the rollouts' order
    def neighbours(a, b):
        return abs(int(a) - int(b)) == 1
    for answers in itertools.permutations(["1", "2", "3", "7"]):
        classes = answer_classes(list(answers), same=neighbours)
        assert sorted(sorted(answers[i] for i in c) for c in classes) == [["1", "2", "3"], ["7"]]


def test_assignment_matches_classes_and_rewards():
    answers = ["5", "6", None, "5", "6", "6"]
    vote = weighted_vote(answers, [1, 0, 0, 1, 0, 0], 5.0)
    assert [c.members for c in vote.classes] == [[0, 3], [1, 4, 5]]
    assert vote.assignment == [0, 1, None, 0, 1, 1] and vote.rewards() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


def every_outcome(verified):
    """Each way the unverified rollouts (None) could turn out: complete 0/1 lists."""
    unknown = [i for i, v in enumerate(verified) if v is None]
    for bits in itertools.product((0, 1), repeat=len(unknown)):
        filled = list(verified)
        for i, bit in zip(unknown, bits):
            filled[i] = bit
        yield filled


OMEGAS = (1.0, 2.0, 5.0, math.inf)


def test_the_vote_is_undecided_exactly_when_unverified_rollouts_can_change_its_label():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        answers = [None if rng.random() < 0.15 else rng.choice("abc") for _ in range(n)]
        verified = [rng.choice((0, 1, None)) for _ in range(n)]
        for omega in OMEGAS:
            labels = {weighted_vote(answers, v, omega).label for v in every_outcome(verified)}
            assert (undecided_classes(answers, verified, omega) == []) == (len(labels) == 1), (answers, verified, omega)


def test_verifying_the_undecided_classes_in_two_rounds_gives_the_label_and_rewards_of_verifying_all():
    rng = random.Random(1)
    asked = everyone = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        answers = [None if rng.random() < 0.15 else rng.choice("abcd") for _ in range(n)]
        truth = [rng.randint(0, 1) for _ in range(n)]
        for omega in OMEGAS:
            known = [None] * n
            for first_round in (True, False):  # the likeliest winner first, then every class that can beat it
                undecided = undecided_classes(answers, known, omega)
                for members in undecided[:1] if first_round else undecided:
                    for i in members:
                        known[i] = truth[i]
            assert undecided_classes(answers, known, omega) == []
            lazy = weighted_vote(answers, [0 if v is None else v for v in known], omega)
            full = weighted_vote(answers, truth, omega)
            assert (lazy.label, lazy.rewards()) == (full.label, full.rewards())
            asked += sum(v is not None for v in known)
            everyone += sum(a is not None for a in answers)
    assert asked < 0.8 * everyone


def test_plain_majority_needs_no_verdict():
    assert undecided_classes(["1", "2", "2"], [None] * 3, omega=1.0) == []


def test_bad_group_is_refused():
    with pytest.raises(ValueError, match="verified has 1"):
        weighted_vote(["1", "2"], [0], 5.0)
    with pytest.raises(ValueError, match="omega must be >= 1"):
        weighted_vote(["1"], [0], 0.5)
    with pytest.raises(ValueError, match="0/1"):
        weighted_vote(["1"], [0.5], 5.0)


def test_rewards_follow_the_class_assignment():
    assert weighted_vote(["5", "5.0", None, "6", " 5 ", "5"], [0] * 6, 1.0).rewards() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert weighted_vote(["5", "5.0", None, "6"], [0] * 4, 1.0, key=answer_key).rewards() == [1.0, 1.0, 0.0, 0.0]


def test_metrics_of_a_flip_that_fixes_the_label():
    answers = ["1260"] * 11 + ["1320"] * 4 + [None]
    verified = [0] * 11 + [1] * 4 + [0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), verified, gold="1320")
    assert m == {"majority_ratio": 11 / 16, "verified_ratio": 4 / 16, "flipped": 1.0,
                 "label_accuracy": 1.0, "reward_accuracy": 1.0, "ground_truth_ratio": 4 / 16,
                 "pass@N": 1.0, "flip_fixed": 1.0, "flip_broke": 0.0}


def test_metrics_of_a_flip_that_breaks_the_label():
    answers, verified = ["7", "7", "7", "9"], [0, 0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0)
    m = group_metrics(vote, verified, gold="7")
    # pseudo rewards 0,0,0,1 against true 1,1,1,0: none agree
    assert (vote.label, m["flipped"], m["flip_fixed"], m["flip_broke"]) == ("9", 1.0, 0.0, 1.0)
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.0, 0.75, 1.0)


def test_metrics_without_flip_or_gold():
    answers, verified = ["2", "3", "3", "4"], [0, 1, 0, 0]
    assert group_metrics(weighted_vote(answers, verified, 1.0), verified) == {"majority_ratio": 0.5,
                                                                               "verified_ratio": 0.25, "flipped": 0.0}


def test_metrics_when_nobody_finds_gold():
    answers, verified = ["2", "2", "3", None], [0, 0, 0, 0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), verified, gold="4")
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.5, 0.0, 0.0)


def test_metrics_find_gold_in_a_class_through_same():
    answers, verified = ["0.5", "0.5", "3"], [0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0, key=answer_key, same=same_answer)
    m = group_metrics(vote, verified, gold="\\frac{1}{2}", key=answer_key, same=same_answer)
    assert (vote.label, m["flipped"], m["flip_broke"], m["ground_truth_ratio"]) == ("3", 1.0, 1.0, 2 / 3)


# ---------------------------------------------------------------- extract_answer

@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{\\frac{1}{2}} first, then \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt{3}}{2}"),
    ("$\\boxed{\\{1, \\{2\\}\\}}$", "\\{1, \\{2\\}\\}"),
    ("hence \\boxed 5 is it", "5"),
    ("\\fbox{12}", "12"),
    ("Thus, the answer is $\\dfrac{3}{4}$.", "\\dfrac{3}{4}"),
    ("The final answer is 3.5.", "3.5"),
    ("I am not sure.", None),
    ("\\boxed{}", None),
    ("\\boxed{unclosed", None),
    # Minerva's format: the sentence's math span, not the rest of the sentence
    ("so $x=5$.\nFinal Answer: The final answer is $100$. I hope it is correct.", "100"),
    ("Final Answer: The final answer is 7/2. I hope it is correct.", "7/2"),
    ("$= \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.", "24"),
    # a later "final answer is" overrides a mid-solution box; a box inside the sentence is the answer
    ("after six months \\boxed{200} dollars ... so the final answer is 10,455.", "10,455"),
    ("The final answer is $\\boxed{7}$.", "7"),
    ("\\boxed{6}. Let me check: the answer is right.", "6"),  # only a *final* answer sentence beats a box
    # boxes separated only by connectors are one answer; prose in between keeps only the last
    ("The roots are \\boxed{-2} and \\boxed{1}.", "-2, 1"),
    ("$\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}$", "(2, 2), (6, 2)"),
    ("first \\boxed{5}, wait, that is wrong: \\boxed{6}", "6"),
    # a short response: its last math span; a long unmarked solution: none
    ("Answer \\( (9+1) \\)", "(9+1)"),
    ("We find that $x \\lt 3$.", "x \\lt 3"),
    ("$1$ and $2$ and $3$", "1, 2, 3"),
    ("Answer $ \n 9 \n $", None),  # $...$ does not span lines
    ("Let $t$ be the time. " * 20 + "Then $t = 3$.", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


# ---------------------------------------------------------------- answer_key / is_equiv

def test_answer_key_gives_equal_spellings_one_key():
    assert answer_key("0.5") == answer_key("\\frac12") == answer_key("\\dfrac{1}{2}") == answer_key("1/2")
    assert answer_key("1,000") == answer_key("1000") == answer_key("1000.0") == answer_key("$1,\\!000$")
    assert answer_key("(1,2,3)") == answer_key("\\begin{pmatrix} 1 \\\\ 2 \\\\ 3 \\end{pmatrix}")
    assert answer_key("x > 2") == answer_key("(2, \\infty)")
    assert answer_key(None) is None


def test_answer_key_refuses_non_strings():
    with pytest.raises(TypeError, match="answer must be a string"):
        answer_key(["1"])


EQUIV = [  # (pred, gold) pairs that are equal, one or more per category of the issue
    ("0.\\overline{3}", "\\frac13"), ("0.1\\overline{6}", "\\frac{1}{6}"),             # repeating decimals
    ("x \\le 3", "(-\\infty, 3]"), ("-2 \\le x < 7", "[-2,7)"),                         # inequalities
    ("x<2 \\text{ or } x>3", "(-\\infty,2)\\cup(3,\\infty)"),
    ("10\u2009080", "10,\\!080"), ("10\\,080", "10080"),                                 # thousands
    ("90°", "90^\\circ"), ("90", "90^{\\circ}"),                                         # degrees
    ("(-2,-14,-7)", "\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}"),               # vectors
    ("6 - 5 i", "6-5i"), ("-5i + 6", "6 - 5i"),                                          # complex
    ("\\textbf{(C)} 12", "\\text{(C)}"), ("C", "(C)"),                                    # choices
    ("142", "142.0"), ("25", "025"),                                                      # AMC / AIME
    ("\\frac{\\sqrt3}{3}", "\\frac{1}{\\sqrt3}"), ("1 \\pm \\sqrt{19}", "1-\\sqrt{19}, 1+\\sqrt{19}"),
    ("(p,q)=(3,2)", "(3,2)"), ("AB=4, CD=5", "CD=5, AB=4"), ("a=4,\\,-8,\\,-10", "-10,-8,4"),       # labels
    ("f(x)=1", "1"), ("p=-1 \\text{ and } p=\\dfrac{15}{8}", "p=-1, p=\\frac{15}{8}"),
    ("-x > -1", "x < 1"), ("x \\neq 3", "x != 3"), ("x = 5+5+1 = 11", "11"),             # relations
    ("28 pct", "28\\%"), ("28 percent", "28\\%"), ("9\\%", "9"),                              # percent words
    ("0.0833333333333333", "\\frac{1}{12}"),                                               # a printed double
]
NOT_EQUIV = [  # near misses
    ("141", "142.0"), ("-3", "3"), ("\\frac{3}{14}", "\\frac{14}{3}"),                   # off by one, sign, reciprocal
    ("0.333", "\\frac13"), ("0.3333333", "\\frac13"), ("1.4142", "\\sqrt2"),             # rounded decimals
    ("(3,4)", "(3,4]"), ("x < 3", "(-\\infty, 3]"),                                       # open vs closed
    ("(-29,15)", "(15,-29)"), ("(-1/3, 5/3, 2/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
    ("1", "1,-2"), ("1,-2,3", "1,-2"), ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),              # missing / extra root
    ("6+5i", "6-5i"), ("(B)", "\\text{(C)}"), ("89^\\circ", "90^\\circ"), ("10,081", "10,\\!080"),
    ("0.\\overline{3}", "0.3"),
    ("32, 349", "32349"), ("", ""), ("\\boxed{}", ""),                                       # false positives
    ("(p,q)=(3,2)", "(2,3)"), ("AB=4, CD=5", "AB=5, CD=4"), ("f(x)=1", "2"),
    ("-x > -1", "x > 1"), ("28 pct", "2.8\\%"), ("9\\%", "0.09"),
]


@pytest.mark.parametrize("pred, gold", EQUIV)
def test_is_equiv_accepts_equal_spellings(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", NOT_EQUIV)
def test_is_equiv_rejects_near_misses(pred, gold):
    assert not is_equiv(pred, gold)


def test_is_equiv_none_is_never_equal():
    assert not is_equiv(None, "1") and not is_equiv("1", None) and not is_equiv(None, None)


def test_is_equiv_on_the_labelled_set_has_no_false_positive():
    with open(EQUIV_CASES) as f:
        cases = [json.loads(line) for line in f]
    assert len(cases) >= 300
    false_pos = [c for c in cases if not c["equal"] and is_equiv(c["pred"], c["gold"])]
    right = sum(is_equiv(c["pred"], c["gold"]) == c["equal"] for c in cases)
    assert false_pos == []
    assert right / len(cases) >= 0.985


def test_hanging_comparison_returns_within_its_limit():
    start = time.monotonic()
    assert not is_equiv("2^{2^{2^{2^{2^{2}}}}}", "7", timeout=1.0)  # a huge integer power, in C
    assert time.monotonic() - start < 1.0 + 0.5
    assert is_equiv("\\sqrt{8}", "2\\sqrt2")  # the helper process is replaced


def test_is_equiv_works_outside_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(is_equiv("\\cos^2 x + \\sin^2 x", "1")))
    thread.start()
    thread.join()
    assert results == [True]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_is_equiv_works_in_a_forked_child():
    is_equiv("\\sqrt{12}", "2\\sqrt{3}")  # make sure the parent has a helper process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = is_equiv("\\sqrt{27}", "3\\sqrt{3}") and not is_equiv("\\sqrt{27}", "3\\sqrt{2}")
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert is_equiv("\\sqrt{50}", "5\\sqrt{2}")  # the parent's helper still answers


def test_same_answer_is_symmetric():
    assert same_answer("2x+y=0", "y=-2x") == same_answer("y=-2x", "2x+y=0")
    assert same_answer("\\frac{1}{\\sqrt2}", "\\frac{\\sqrt2}{2}") and not same_answer("1", None)


# =================================================================================================================
# sandbox.py
# =================================================================================================================

HERE = os.path.dirname(os.path.abspath(__file__))


def _processes():
    """{pid: (ppid, cmdline)} of every process on the host."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    table[int(name)] = (ppid, f.read().replace(b"\0", b" ").decode(errors="replace"))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                pass
    return table


def _descendants(pid, depth=1, exact=False):
    """Processes at least (exact: exactly) `depth` generations below `pid`, from one look at the process table."""
    table = _processes()
    found, frontier, generation = set(), {pid}, 0
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier}
        generation += 1
        found |= frontier if generation == depth or (generation > depth and not exact) else set()
    return found


def _spawned_by_snippets(pool):
    """Below the helper: launcher, worker, snippet process, then whatever a snippet spawned."""
    return _descendants(pool._helper.pid, depth=4)


def _eventually(condition, patience=10.0):
    """Killed processes are reaped right after the reply; wait for that (not a speed test)."""
    deadline = time.monotonic() + patience
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def _with_marker(marker):
    return [pid for pid, (_, cmdline) in _processes().items() if marker in cmdline]


def _mounts():
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


def _cgroups(helper):
    found = []
    for _, dirs, _ in os.walk("/sys/fs/cgroup"):
        found += [d for d in dirs if d.startswith(f"t3rl-sandbox-{helper}-")]
    return found


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, timeout=5.0, memory_bytes=512 << 20) as p:
        yield p


@pytest.mark.parametrize("code, expected", [
    ("from sympy import symbols, solve\nx = symbols('x')\nprint(solve(x**2 - 5*x + 6, x))", "[2, 3]\n"),
    ("import numpy as np\nprint(int(np.linalg.det(np.array([[2, 1], [1, 3]])).round()))", "5\n"),
    ("from fractions import Fraction\nprint(sum(Fraction(1, n * (n + 1)) for n in range(1, 10)))", "9/10\n"),
])
def test_math_programs_print_the_right_value(pool, code, expected):
    result = pool.run(code)
    assert (result.status, result.stdout, result.returncode) == ("ok", expected, 0)


def test_syntax_error_is_an_error_with_traceback(pool):
    result = pool.run("print(1 +")
    assert result.status == "error" and "SyntaxError" in result.stderr and result.returncode == 1


def test_exception_is_an_error_with_traceback(pool):
    result = pool.run("def f():\n    return 1 / 0\nf()")
    assert result.status == "error"
    assert result.stderr.startswith("Traceback") and "in f" in result.stderr and "ZeroDivisionError" in result.stderr


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_endless_programs_time_out_within_the_limit(pool, code):
    result = pool.run(code, timeout=1.0)
    assert result.status == "timeout" and result.duration < 1.0 + 0.5


def test_memory_bomb_is_stopped_and_reported(pool):
    result = pool.run("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", timeout=30)
    assert result.status == "memory" and "MemoryError" in result.stderr


def test_fork_bomb_fails_and_leaves_nothing(pool):
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = pool.run(bomb, timeout=1.0)
    assert result.status == "timeout"
    assert pool.run("print(2)").stdout == "2\n"
    assert _eventually(lambda: _spawned_by_snippets(pool) == set())


def test_os_system_and_subprocess_leave_no_process(pool):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = (f"import os, subprocess\nos.system('sleep {marker} &')\n"
            f"subprocess.Popen(['sleep', '{marker}'], start_new_session=True)\nprint('spawned')")
    result = pool.run(code)
    assert result.stdout == "spawned\n"
    assert _with_marker(f"sleep {marker}") == []


def test_background_child_is_gone_afterwards(pool):
    marker = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"
    code = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\nprint('left running')")
    assert pool.run(code).stdout == "left running\n"
    assert _with_marker(f"sleep {marker}") == []
    assert _eventually(lambda: _spawned_by_snippets(pool) == set())


def test_files_written_outside_its_folder_do_not_appear(pool, tmp_path):
    name = f"t3rl-escape-{uuid.uuid4().hex}"
    targets = [os.path.join(d, name) for d in ("/tmp", os.path.expanduser("~"), os.getcwd(), str(tmp_path), "/")]
    code = (f"for path in {targets!r}:\n    try:\n        open(path, 'w').write('x')\n"
            "    except OSError as e:\n        print(type(e).__name__)")
    pool.run(code)
    assert [t for t in targets if os.path.exists(t)] == []


def test_callers_files_survive_a_snippet_deleting_them(pool, tmp_path):
    kept = tmp_path / "results.jsonl"
    kept.write_text("precious")
    code = (f"import os, shutil\nfor path in [{str(kept)!r}, {__file__!r}]:\n    try:\n        os.remove(path)\n"
            f"    except OSError:\n        pass\nshutil.rmtree({str(tmp_path)!r}, ignore_errors=True)\n"
            f"shutil.rmtree({HERE!r}, ignore_errors=True)")
    pool.run(code)
    assert kept.read_text() == "precious" and os.path.exists(__file__)


def test_secret_file_in_callers_working_folder_is_unreadable(pool):
    secret = uuid.uuid4().hex
    path = os.path.join(os.getcwd(), f".t3rl-secret-{secret[:8]}")
    with open(path, "w") as f:
        f.write(secret)
    try:
        code = (f"import glob\nfor p in [{path!r}] + glob.glob('/proc/*/cwd/{os.path.basename(path)}') + "
                f"glob.glob('/proc/*/root{path}'):\n    try:\n        print(open(p).read())\n"
                "    except OSError as e:\n        print(type(e).__name__)")
        result = pool.run(code)
    finally:
        os.remove(path)
    assert result.status == "ok" and secret not in result.stdout


def test_secret_in_parents_environment_is_unreadable(tmp_path):
    secret = uuid.uuid4().hex
    probe = ("import glob, os\nprint(dict(os.environ))\n"
             "for p in ['/proc/%d/environ' % PARENT] + glob.glob('/proc/*/environ'):\n    try:\n"
             "        print(p, open(p, 'rb').read())\n    except OSError as e:\n        print(p, type(e).__name__)")
    parent = ("import os, sys\nsys.path.insert(0, sys.argv[1])\nfrom sandbox import SandboxPool\n"
              "with SandboxPool(workers=1) as pool:\n"
              "    result = pool.run(sys.argv[2].replace('PARENT', str(os.getpid())))\n"
              "print(result.status)\nprint(result.stdout)")
    out = subprocess.run([sys.executable, "-c", parent, HERE, probe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "T3RL_PLANTED_SECRET": secret}, cwd=tmp_path)
    assert out.stdout.startswith("ok\n") and "environ" in out.stdout and secret not in out.stdout


def test_output_flood_is_truncated_and_memory_stays_bounded(pool):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = pool.run("import sys\nfor _ in range(1000):\n    sys.stdout.write('x' * 100_000)", timeout=30)
    assert result.status == "output_limit" and len(result.stdout) == 64 << 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 20 << 10  # KiB


def test_200_snippets_at_once_all_finish_correctly(pool):
    results = pool.run_many([f"print({i} * {i})" for i in range(200)])
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(200)]


def test_code_arriving_at_any_moment_of_the_idle_prefault_runs_correctly(pool):
    # one at a time, so each request lands somewhere in the waiting process's prefault solve
    results = [pool.run(f"import signal, time\ntime.sleep({i % 7} / 1e4)\n"
                        f"print({i}, signal.getsignal(signal.SIGALRM) == signal.SIG_DFL)") for i in range(150)]
    assert [(r.status, r.stdout) for r in results] == [("ok", f"{i} True\n") for i in range(150)]


@pytest.mark.parametrize("code, statuses", [
    ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(1, signal.SIGKILL)", {"ok", "error"}),
    ("import os\nos.close(1)\nos.close(2)\nprint('gone')", {"ok", "error"}),
    ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass", {"timeout"}),
    ("import ctypes\nctypes.string_at(0)", {"killed"}),
    ("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\xfd')", {"ok"}),
    ("def f(n):\n    return f(n + 1)\nf(0)", {"error"}),
    ("import sys\nsys.setrecursionlimit(10**9)\ndef f(n):\n    return f(n + 1)\nf(0)", {"timeout", "memory", "killed"}),
])
def test_the_pool_survives_anything_a_snippet_does(pool, code, statuses):
    assert pool.run(code, timeout=1.0).status in statuses
    assert [r.stdout for r in pool.run_many(["print(2)"] * 4)] == ["2\n"] * 4


def test_a_dead_worker_is_reported_and_replaced(pool):
    for worker in _descendants(pool._helper.pid, depth=2, exact=True):
        os.kill(worker, signal.SIGKILL)
    first = pool.run_many(["print(3)"] * 4)
    assert {r.status for r in first} <= {"ok", "killed"} and "killed" in {r.status for r in first}
    assert [r.stdout for r in pool.run_many(["print(3)"] * 4)] == ["3\n"] * 4


def test_invalid_utf8_output_is_replaced(pool):
    assert pool.run("import sys\nsys.stdout.buffer.write(b'\\xff ok')").stdout == "\ufffd ok"


def test_stdin_reads_eof_at_once(pool):
    assert pool.run("import sys\nprint(repr(sys.stdin.read()))", timeout=2).stdout == "''\n"


def test_environment_is_empty_and_home_is_its_own_folder(pool):
    result = pool.run("import os\nprint(sorted(os.environ))\nprint(os.environ['HOME'] == os.getcwd())")
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\nTrue\n"


def test_its_folder_is_writable_and_fresh_each_time(pool):
    code = "import os\nprint(os.listdir('.'))\nopen('scratch.txt', 'w').write('x')"
    assert [r.stdout for r in pool.run_many([code] * 4)] == ["[]\n"] * 4


def test_network_is_unreachable_even_on_loopback(pool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        result = pool.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
    assert result.status == "error" and "in" not in result.stdout


def test_report_names_every_protection(pool):
    assert set(pool.protections) == {"isolation", "files", "proc", "cleanup", "network", "user", "processes", "limits"}
    assert pool.report.count("\n") == len(pool.protections) - 1


def test_user_namespace_isolation_runs_programs_and_protects_tmp():
    with SandboxPool(workers=1, isolation="userns") as pool:
        name = f"/tmp/t3rl-escape-{uuid.uuid4().hex}"
        results = pool.run_many(["import sympy\nprint(sympy.factorial(5))", f"open({name!r}, 'w')"])
        assert pool.protections["isolation"] == "userns"
    assert [r.status for r in results] == ["ok", "error"] and results[0].stdout == "120\n"
    assert not os.path.exists(name)


def test_without_namespaces_sockets_are_blocked_and_the_report_says_so():
    with pytest.warns(UserWarning, match="incomplete"):
        pool = SandboxPool(workers=1, isolation="none")
    with pool:
        result = pool.run("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)")
    assert result.status == "error" and "PermissionError" in result.stderr
    assert "NOT protected" in pool.report and "seccomp" in pool.report


def test_a_pool_starts_from_a_process_running_torch_threads():
    torch = pytest.importorskip("torch")
    torch.set_num_threads(2)
    torch.ones(256, 256) @ torch.ones(256, 256)  # the intra-op thread pool is running now
    with SandboxPool(workers=1) as pool:
        assert pool.run("import numpy\nprint(numpy.ones(3).sum())").stdout == "3.0\n"


def test_two_pools_side_by_side_each_work():
    with SandboxPool(workers=1) as first, SandboxPool(workers=1) as second:
        assert (first.run("print(1)").stdout, second.run("print(2)").stdout) == ("1\n", "2\n")


def test_closing_leaves_no_process_mount_cgroup_or_folder():
    mounts, temp_before = _mounts(), set(os.listdir(tempfile.gettempdir()))
    pool = SandboxPool(workers=2, timeout=1.0)
    helper = pool._helper.pid
    pool.run_many(["import os\nos.system('sleep 100 &')\nwhile True:\n    pass",
                   "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"])
    pool.close()
    assert _descendants(helper) == set() and helper not in _processes()
    assert _cgroups(helper) == [] and _mounts() == mounts
    assert [n for n in set(os.listdir(tempfile.gettempdir())) - temp_before if "sandbox" in n] == []


def test_closed_pool_refuses_work():
    pool = SandboxPool(workers=1)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run("print(1)")


@pytest.mark.parametrize("make", [
    lambda: SandboxPool(workers=0), lambda: SandboxPool(timeout=0), lambda: SandboxPool(isolation="docker"),
    lambda: SandboxPool(memory_bytes=1024),
])
def test_bad_settings_are_refused(make):
    with pytest.raises(ValueError):
        make()


def test_code_must_be_text(pool):
    with pytest.raises(TypeError, match="str"):
        pool.run(b"print(1)")


def test_run_snippet_uses_a_shared_pool():
    assert run_snippet("print(6 * 7)").stdout == "42\n"


# =================================================================================================================
# sampler.py
# =================================================================================================================
# Tests for sampler.py: the kv backend against transformers, its sampling distribution, seeds, EOS, waves.

PROMPTS = [[9707, 11, 1879, 0, 358, 1079, 264, 1614, 13], [785, 4226], [10061, 594, 1744, 3019, 553, 3019, 13]]


def token_rows(result):
    return [[c.token_ids for c in group] for group in result]


def small_vocab_model(vocab_size=48, logit_scale=10.0):
    """A tiny Qwen2 over `vocab_size` tokens whose head is scaled so its next-token distribution is far from flat.

    (make_tiny_model's special-token ids need the real 152k vocabulary, hence its own config here.)
    """
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=vocab_size - 1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_kv_matches_hf_greedy_on_tiny_model(tokenizer, tied):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied)
    hf = generate(model, tokenizer, PROMPTS, n=2, max_new_tokens=16, temperature=0, backend="hf")
    kv = generate(model, tokenizer, PROMPTS, n=2, max_new_tokens=16, temperature=0, backend="kv")
    assert token_rows(kv) == token_rows(hf)


@pytest.mark.parametrize("bias", [False, True])
def test_kv_matches_hf_greedy_on_a_tiny_llama(bias):
    """Llama: no projection biases (or, with attention_bias, biases on q, k, v and o), unlike Qwen2's q, k, v."""
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=bias, bos_token_id=0,
                         eos_token_id=47, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights of unit-scale outputs and random biases (zeros at init): tokens that vary
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_()
    options = dict(n=1, max_new_tokens=12, temperature=0, ignore_eos=True)
    hf = generate(model, None, SMALL_PROMPTS, backend="hf", **options)
    assert token_rows(generate(model, None, SMALL_PROMPTS, backend="kv", **options)) == token_rows(hf)


def test_kv_matches_hf_greedy_on_embedded_model(embedded_model):
    model, tokenizer = embedded_model
    prompts = ["def fibonacci(n):", "What is 12 * 13? Answer:",
               "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"]
    hf = generate(model, tokenizer, prompts, n=1, max_new_tokens=24, temperature=0, backend="hf")
    kv = generate(model, tokenizer, prompts, n=1, max_new_tokens=24, temperature=0, backend="kv")
    assert token_rows(kv) == token_rows(hf)
    assert [[c.finish_reason for c in g] for g in kv] == [[c.finish_reason for c in g] for g in hf]


def chi_square_p_value(counts, expected):
    """p-value of Pearson's chi-square statistic, pooling cells expected below 5 into one."""
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic.double() / 2))


def nucleus_distribution(logits, temperature, top_p):
    """Reference: softmax(logits / T), sorted in full, keeping tokens while the mass above them is below top_p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    kept = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return kept / kept.sum()


@pytest.mark.parametrize("temperature,top_p", [(0.6, 0.9), (1.3, 1.0)])
def test_first_token_frequencies_match_the_models_softmax(temperature, top_p):
    model = small_vocab_model()
    prompt = [3, 17, 29, 5]
    draws = 6000
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1]
    result = generate(model, None, [prompt], n=draws, max_new_tokens=1, temperature=temperature, top_p=top_p, seed=0)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in result[0]]), minlength=len(logits)).double()
    expected = nucleus_distribution(logits, temperature, top_p)
    assert counts[expected == 0].sum() == 0, "sampled a token outside the top-p nucleus"
    assert chi_square_p_value(counts, draws * expected) > 1e-3
    # the test has power: top-p cuts real mass here, and the same draws reject a temperature 25% off
    cut = 1 - torch.softmax(logits.double() / temperature, dim=-1)[expected > 0].sum()
    assert cut > 0.02 or top_p == 1.0
    assert chi_square_p_value(counts, draws * nucleus_distribution(logits, temperature * 1.25, top_p)) < 1e-6


def test_nucleus_keeps_the_same_tokens_as_transformers():
    torch.manual_seed(0)
    vocab = 5000
    logits = torch.cat([torch.randn(4, vocab) * scale for scale in (0.1, 1.0, 4.0, 12.0)])
    for top_p in (0.5, 0.9, 0.95, 0.999):
        top_probs, top_ids = nucleus(torch.softmax(logits, dim=-1), top_p)
        ours = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_ids, top_probs > 0)
        theirs = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
        assert torch.equal(ours, theirs), f"top_p={top_p}"


def test_a_frozen_model_is_packed_once_and_again_after_a_parameter_changes(monkeypatch):
    model = small_vocab_model().to(torch.bfloat16)
    made = []
    monkeypatch.setattr(sampler, "model_weights", lambda *args, real=sampler.model_weights, **kw: made.append(1) or real(*args, **kw))
    options = dict(n=2, max_new_tokens=8, seed=0, ignore_eos=True, dtype=torch.bfloat16)
    first, again = (generate(model, None, SMALL_PROMPTS, frozen=True, **options) for _ in range(2))
    assert len(made) == 1 and token_rows(first) == token_rows(again)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # in place, as an optimizer step writes
    changed = generate(model, None, SMALL_PROMPTS, frozen=True, **options)
    assert len(made) == 2 and token_rows(changed) == token_rows(generate(model, None, SMALL_PROMPTS, **options))
    assert token_rows(changed) != token_rows(first)


def test_packed_cpu_weights_sample_what_plain_products_sample(monkeypatch):
    """bfloat16 on a CPU: the weights are packed for oneDNN once per call; the tokens and their log-probs are
    those of F.linear on the plain weights."""
    model = small_vocab_model().to(torch.bfloat16)
    w = sampler.model_weights(model, torch.bfloat16)
    assert all(lin.packed is not None for lin in (w.layers[0].qkv, w.layers[0].o, w.layers[0].gate_up,
                                                  w.layers[0].down, w.head))
    options = dict(n=3, max_new_tokens=12, seed=0, ignore_eos=True)
    packed = generate(model, None, SMALL_PROMPTS, **options)
    monkeypatch.setattr(sampler, "cpu_packing_available", lambda dtype, device: False)
    assert sampler.model_weights(model, torch.bfloat16).head.packed is None
    plain = generate(model, None, SMALL_PROMPTS, **options)
    assert token_rows(packed) == token_rows(plain)
    assert [[c.logprob for c in g] for g in packed] == [[c.logprob for c in g] for g in plain]


def test_int8_products_are_close_and_each_token_is_scaled_alone():
    torch.manual_seed(0)
    weight, bias, x = torch.randn(96, 64), torch.randn(96), torch.randn(5, 64)
    x[2, 7] = 300.0  # one token with a large activation, as a model's first token has
    lin = sampler.Int8Linear.of(weight, bias)
    out, exact = lin(x), x @ weight.T + bias
    assert ((out - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.02  # one scale per call would round rows 0, 1, 3, 4 to 0
    assert all(torch.equal(out[i], lin(x[i:i + 1])[0]) for i in range(len(x)))  # a row's result ignores its neighbours


def last_logits(w, prompt):
    """The next-token logits after `prompt` from the kv sampler's forward pass on weights `w`, in bfloat16."""
    columns = torch.arange(len(prompt))
    cache = sampler.KVCache.zeros(w, 1, len(prompt), torch.bfloat16, "cpu")
    mask = (columns[None, :] <= columns[:, None])[None, None]
    with torch.inference_mode():
        return sampler.forward(w, torch.tensor([prompt]), columns[None], columns, cache, mask,
                               sampler.rotary_tables(w, len(prompt), torch.bfloat16))[0].float()


def test_an_int8_model_gives_nearly_the_logits_of_bfloat16():
    model = small_vocab_model().to(torch.bfloat16)
    plain, int8 = (sampler.model_weights(model, torch.bfloat16, int8=q) for q in (False, True))
    linears = [int8.head] + [getattr(layer, name) for layer in int8.layers for name in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(lin, sampler.Int8Linear) for lin in linears)
    for prompt in SMALL_PROMPTS:
        a, b = last_logits(plain, prompt), last_logits(int8, prompt)
        assert (a - b).norm() / a.norm() < 0.05 and a.argmax() == b.argmax()


def test_a_frozen_model_keeps_its_int8_and_bfloat16_copies_apart():
    model = small_vocab_model().to(torch.bfloat16)
    options = dict(n=2, max_new_tokens=8, seed=0, ignore_eos=True, dtype=torch.bfloat16)
    logprobs = lambda result: [[c.logprob for c in group] for group in result]  # noqa: E731
    int8 = generate(model, None, SMALL_PROMPTS, frozen=True, int8=True, **options)
    assert sampler._KEPT[model][0] == (torch.bfloat16, True)
    plain = generate(model, None, SMALL_PROMPTS, frozen=True, **options)
    assert sampler._KEPT[model][0] == (torch.bfloat16, False)
    assert logprobs(plain) == logprobs(generate(model, None, SMALL_PROMPTS, **options)) != logprobs(int8)


def test_int8_is_refused_off_the_kv_sampler_and_off_the_cpu():
    model = small_vocab_model()
    with pytest.raises(ValueError, match="int8 apply to backend 'kv'"):
        generate(model, None, SMALL_PROMPTS, n=1, max_new_tokens=2, backend="hf", int8=True)
    with pytest.raises(ValueError, match="int8=True: they run on a CPU .* on meta"):
        generate(model.to("meta"), None, SMALL_PROMPTS, n=1, max_new_tokens=2, int8=True)
    assert sampler.int8_unavailable_reason(torch.device("cpu")) is None


def test_greedy_sampling_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample_next(logits, 0, 0.95, None).tolist() == [1, 0]


SMALL_PROMPTS = [[3, 17, 29, 5, 8], [11], [40, 2, 2]]


def test_same_seed_repeats_a_call():
    model = small_vocab_model()
    first = generate(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=7)
    again = generate(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=7)
    other = generate(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=8)
    assert token_rows(first) == token_rows(again)
    assert token_rows(first) != token_rows(other)


@pytest.mark.parametrize("seed", [7, [7, 8, 9]])
def test_rows_of_one_prompt_differ(seed):
    result = generate(small_vocab_model(), None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=seed, ignore_eos=True)
    for group in result:
        assert len({tuple(c.token_ids) for c in group}) == 4


# Per-prompt seeds give a prompt the same tokens in any company only where the forward pass gives its rows the
# same logits in any batch: bfloat16 on CPU does; float32 on MKL does not (see sampler.py), hence dtype below.
@pytest.mark.parametrize("backend,options", [("kv", dict(dtype=torch.bfloat16)), ("hf", {})])
def test_a_prompts_samples_do_not_depend_on_the_prompts_sharing_its_call(tokenizer, backend, options):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    longer = PROMPTS[2] + PROMPTS[0]  # shifts the first prompt's left padding
    sample = dict(n=3, max_new_tokens=12, temperature=0.6, top_p=0.95, backend=backend, **options)
    alone = generate(model, None, [PROMPTS[0]], seed=[11], **sample)
    among = generate(model, None, [longer, PROMPTS[1], PROMPTS[0]], seed=[6, 5, 11], **sample)
    assert token_rows(among)[2] == token_rows(alone)[0]
    assert len({tuple(c.token_ids) for c in alone[0]}) == 3


def test_samples_do_not_depend_on_waves_or_on_finished_rows_leaving_the_batch():
    model = small_vocab_model()
    model.generation_config.eos_token_id = [14, 23]  # frequent tokens: rows finish at different steps
    sample = dict(n=4, max_new_tokens=10, seed=[3, 1, 2], dtype=torch.bfloat16)
    whole = generate(model, None, SMALL_PROMPTS, **sample)
    one_row = cache_bytes_per_row(model, max(map(len, SMALL_PROMPTS)) + 10, torch.bfloat16)
    waves = generate(model, None, SMALL_PROMPTS, memory_budget=one_row, **sample)
    assert token_rows(waves) == token_rows(whole)
    lengths = [c.num_tokens for g in whole for c in g]
    assert min(lengths) < max(lengths) == 10, "no row left the batch early: the test would not cover compaction"


# Shared-prefix prefill runs a prompt's tokens after the start it shares with another prompt, in one forward with
# the other prompts of its level: greedy tokens must be those of the prompt prefilled alone, in its own call.
SYSTEM = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872, 198]  # a chat system turn


def greedy_alone_and_together(model, prompts, dtype):
    options = dict(n=2, max_new_tokens=12, temperature=0, ignore_eos=True, dtype=dtype)
    alone = [token_rows(generate(model, None, [prompt], **options))[0] for prompt in prompts]
    return alone, token_rows(generate(model, None, prompts, **options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_sharing_nothing_prefilled_together_decode_as_alone(tokenizer, dtype):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    assert [(step.shared, step.level) for step in prefix_plan(PROMPTS)] == [(0, 0)] * 3  # one forward for all three
    alone, together = greedy_alone_and_together(model, PROMPTS, dtype)
    assert together == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_sharing_a_prefix_decode_as_alone(tokenizer, dtype):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    prompts = [SYSTEM + p for p in PROMPTS] + [SYSTEM + PROMPTS[0][:5] + [40, 2]]
    plan = prefix_plan(prompts)
    # the system turn is prefilled once; the last prompt also shares the first's next 5 tokens (a second level)
    assert sorted(step.shared for step in plan) == [0, len(SYSTEM), len(SYSTEM), len(SYSTEM) + 5]
    assert max(step.level for step in plan) == 2
    alone, together = greedy_alone_and_together(model, prompts, dtype)
    assert together == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_that_are_prefixes_of_each_other_decode_as_alone(tokenizer, dtype):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    prompts = [SYSTEM + PROMPTS[0], SYSTEM, SYSTEM + PROMPTS[0] + PROMPTS[1], SYSTEM[:3]]
    plan = prefix_plan(prompts)
    # each longer prompt copies the whole of the next shorter one and prefills only what it adds
    assert [step.shared for step in plan] == [len(SYSTEM), 3, len(SYSTEM + PROMPTS[0]), 0]
    alone, together = greedy_alone_and_together(model, prompts, dtype)
    assert together == alone


def test_eos_ends_a_row_with_the_eos_token_and_others_run_to_length(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    free = generate(model, None, PROMPTS, n=2, max_new_tokens=12, temperature=0, ignore_eos=True)
    stop_token = free[0][0].token_ids[3]  # the first prompt's 4th greedy token becomes the end-of-sequence token
    assert all(stop_token not in c.token_ids for g in free[1:] for c in g)
    model.generation_config.eos_token_id = stop_token
    for backend in ("kv", "hf"):
        result = generate(model, None, PROMPTS, n=2, max_new_tokens=12, temperature=0, backend=backend)
        first_stop = free[0][0].token_ids.index(stop_token) + 1
        for c in result[0]:
            assert (c.finish_reason, c.num_tokens) == ("eos", first_stop)
            assert c.token_ids == free[0][0].token_ids[:first_stop]
        # the rows still running after the others left the batch decode as before
        assert token_rows(result)[1:] == token_rows(free)[1:], backend
        assert all(c.finish_reason == "length" and c.num_tokens == 12 for g in result[1:] for c in g)


def test_waves_split_by_memory_budget_give_the_same_tokens(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    whole = generate(model, tokenizer, PROMPTS, n=3, max_new_tokens=10, temperature=0)
    one_row_budget = 4 * len(tokenizer) * 4 + 60_000  # logits buffers plus ~1 row of this tiny model's cache
    waves = generate(model, tokenizer, PROMPTS, n=3, max_new_tokens=10, temperature=0, memory_budget=one_row_budget)
    assert token_rows(waves) == token_rows(whole)


def test_too_small_memory_budget_names_the_option(tokenizer):
    model = make_tiny_model(len(tokenizer))
    with pytest.raises(ValueError, match="memory_budget"):
        generate(model, tokenizer, PROMPTS, n=2, max_new_tokens=10, memory_budget=1000)


def test_string_prompts_are_tokenised_without_special_tokens(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    prompt = "Solve 2 + 2."
    completion = generate(model, tokenizer, [prompt], n=1, max_new_tokens=6, seed=0)[0][0]
    assert completion.prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.num_tokens == len(completion.token_ids) == 6


def test_generate_leaves_a_training_model_in_train_mode(tokenizer):
    model = make_tiny_model(len(tokenizer))
    model.activation_checkpointing_enable()
    model.train()
    eos = model.generation_config.eos_token_id
    for backend in ("kv", "hf"):
        generate(model, tokenizer, PROMPTS, n=2, max_new_tokens=4, backend=backend, ignore_eos=True)
        assert model.training and model.generation_config.eos_token_id == eos


def test_other_architectures_fall_back_to_hf(tokenizer, capsys):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2, eos_token_id=63)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    kv = generate(model, None, [[1, 2, 3]], n=2, max_new_tokens=5, temperature=0, backend="kv")
    hf = generate(model, None, [[1, 2, 3]], n=2, max_new_tokens=5, temperature=0, backend="hf")
    assert "falling back to hf" in capsys.readouterr().err
    assert token_rows(kv) == token_rows(hf)


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="vllm"), "backend"),
    (dict(n=0), "n=0"),
    (dict(top_p=0), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(prompts="just a string"), "list"),
    (dict(prompts=[[]]), "empty"),
    (dict(seed=[1, 2]), "seed"),
])
def test_bad_arguments_raise_a_clear_error(tokenizer, kwargs, match):
    args = dict(prompts=PROMPTS, n=2, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        generate(make_tiny_model(len(tokenizer)), tokenizer, **args)


# =================================================================================================================
# grpo.py
# =================================================================================================================
# Tests for grpo.py: advantages, the clipped loss and its gradient, chunked log-probs, and the update step.

GRPO_PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
COMPLETIONS = [[11, 12], [13, 14, 15, 16], [17], [18, 19, 20]]


# ----------------------------------------------------------------------------- advantages

def test_group_advantages_standardise_within_each_group():
    advantages = group_advantages([1, 0, 0, 1, 1, 1, 1, 0], group_size=4)
    half = 0.5 / math.sqrt(1 / 3)  # group 1: mean 0.5, unbiased std sqrt(1/3)
    expected = [half, -half, -half, half, 0.5, 0.5, 0.5, -1.5]  # group 2: mean 0.75, std 0.5
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_group_advantages_unscaled_only_centre():
    advantages = group_advantages([1, 0, 0, 1, 1, 1, 1, 0], group_size=4, scale=False)
    torch.testing.assert_close(advantages, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))


def test_group_advantages_of_tied_group_are_exactly_zero():
    advantages = group_advantages([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], group_size=3)
    assert advantages.tolist() == [0.0] * 6


def test_group_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages([1, 0, 1], group_size=4)


# ----------------------------------------------------------------------------- policy loss

def _two_sequences():
    """Sequence 0 (A = 1): three tokens with ratios 1.1, 0.9, 1.0 (inside the clip range).
    Sequence 1 (A = -2): one valid token with ratio 0.5 (clipped to 0.8), then padding with a huge ratio."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old_logp = torch.full((2, 3), -2.0)
    logp = old_logp + torch.tensor([[1.1, 0.9, 1.0], [0.5, 1e6, 1e6]]).log()
    return logp, old_logp, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize("agg, expected", [
    ("token-mean", (-1.1 - 0.9 - 1.0 + 1.6) / 4),
    ("seq-mean-token-mean", ((-1.1 - 0.9 - 1.0) / 3 + 1.6) / 2),
    ("seq-mean-token-sum-norm", (-1.1 - 0.9 - 1.0 + 1.6) / (2 * 4)),
])
def test_policy_loss_matches_hand_computed_value(agg, expected):
    loss, _ = policy_loss(*_two_sequences(), agg=agg, norm_len=4)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_policy_loss_adds_k3_kl_to_the_reference():
    logp, old_logp, _, mask = _two_sequences()
    ref_logp = logp + torch.tensor([[math.log(2), 0.0, 0.0], [math.log(0.5), 0.0, 0.0]])
    loss, stats = policy_loss(logp, old_logp, torch.zeros(2), mask, ref_logp=ref_logp, kl_coef=0.1)
    k3 = (2 - math.log(2) - 1) + (0.5 - math.log(0.5) - 1)
    assert loss.item() == pytest.approx(0.1 * k3 / 4, abs=1e-6)
    assert stats["kl_ref"].item() == pytest.approx(k3 / 4, abs=1e-6)


def test_policy_loss_reports_clip_fractions_and_mean_ratio():
    _, stats = policy_loss(*_two_sequences())
    assert stats["clip_low"].item() == pytest.approx(0.25)  # the A < 0 token at ratio 0.5
    assert stats["clip_high"].item() == 0.0
    assert stats["ratio"].item() == pytest.approx((1.1 + 0.9 + 1.0 + 0.5) / 4)


def test_policy_loss_rejects_sum_norm_without_norm_len():
    with pytest.raises(ValueError, match="norm_len"):
        policy_loss(*_two_sequences(), agg="seq-mean-token-sum-norm")


def test_policy_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    logp = (-torch.rand(3, 5, dtype=torch.float64) * 3).requires_grad_()
    old_logp = logp.detach() + 0.3 * torch.randn(3, 5, dtype=torch.float64)
    ref_logp = logp.detach() + 0.3 * torch.randn(3, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    advantages = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)

    def loss(x):
        return policy_loss(x, old_logp, advantages, mask, agg="seq-mean-token-mean", ref_logp=ref_logp,
                           kl_coef=0.05)[0]
    assert torch.autograd.gradcheck(loss, (logp,))


def test_policy_loss_gradient_is_zero_when_all_advantages_are_zero():
    logp, old_logp, _, mask = _two_sequences()
    logp.requires_grad_()
    policy_loss(logp, old_logp, torch.zeros(2), mask)[0].backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_clipped_tokens_get_zero_gradient_exactly_where_the_formula_says():
    ratios = torch.tensor([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.5]).repeat(2, 1)  # [2, 7]
    logp = ratios.log().requires_grad_()
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 7)
    policy_loss(logp, torch.zeros(2, 7), advantages, mask)[0].backward()
    cut = torch.stack([ratios[0] > 1.2, ratios[1] < 0.8])  # A > 0 above 1 + eps, A < 0 below 1 - eps
    assert torch.equal(logp.grad == 0, cut)


# ----------------------------------------------------------------------------- log-probabilities

def _plain_logprobs(model, input_ids, attention_mask, response_mask):
    """The reference: full logits, float32 log_softmax, gather."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(logp, (1, 0)) * response_mask


def test_pad_batch_right_pads_and_marks_completions():
    input_ids, attention_mask, response_mask = pad_batch([[1, 2], [3]], [[4], [5, 6, 7]])
    assert input_ids.tolist() == [[1, 2, 4, 0], [3, 5, 6, 7]]
    assert attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert response_mask.tolist() == [[False, False, True, False], [False, True, True, True]]


@pytest.mark.parametrize("chunk_rows", [3, 10_000])
@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_equal_plain_log_softmax_gather(tokenizer, chunk_rows, tied):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied)
    batch = pad_batch(GRPO_PROMPTS, COMPLETIONS)
    with torch.no_grad():
        logp, _ = token_logprobs(model, *batch, chunk_rows=chunk_rows)
        expected = _plain_logprobs(model, *batch)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=0)


def test_token_logprobs_entropy_equals_softmax_entropy(tiny_model):
    batch = pad_batch(GRPO_PROMPTS, COMPLETIONS)
    with torch.no_grad():
        _, entropy = token_logprobs(tiny_model, *batch, chunk_rows=3)
        logits = tiny_model(input_ids=batch[0], attention_mask=batch[1]).logits.float()
    expected = torch.distributions.Categorical(logits=logits).entropy()
    expected = torch.nn.functional.pad(expected[:, :-1], (1, 0)) * batch[2]
    torch.testing.assert_close(entropy, expected, atol=1e-5, rtol=1e-4)  # float32 sums over 152k terms


def test_token_logprobs_at_the_sampling_temperature_are_the_samplers_own():
    """The sampler's log-probability of the tokens it drew at temperature T (no top-p) is what the update
    computes at T; at T = 1 it is not (the test can tell them apart)."""
    model = small_vocab_model()
    prompts = [[3, 5, 7], [11, 13]]
    groups = generate(model, None, prompts, n=3, max_new_tokens=8, temperature=0.6, top_p=1.0, seed=0)
    completions = [c for group in groups for c in group]
    batch = pad_batch([c.prompt_ids for c in completions], [c.token_ids for c in completions])
    sampled = torch.tensor([c.logprob for c in completions])
    with torch.no_grad():
        at_t = token_logprobs(model, *batch, temperature=0.6)[0].sum(-1)
        at_1 = token_logprobs(model, *batch)[0].sum(-1)
    torch.testing.assert_close(at_t, sampled, atol=1e-4, rtol=1e-5)
    assert (at_1 - sampled).abs().max() > 0.1


@pytest.mark.parametrize("tied", [True, False])
def test_token_logprobs_gradient_equals_plain_gradient(tokenizer, tied):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied)
    reference = copy.deepcopy(model)
    batch = pad_batch(GRPO_PROMPTS, COMPLETIONS)
    weights = torch.randn(batch[0].shape, generator=torch.Generator().manual_seed(0))
    (token_logprobs(model, *batch, chunk_rows=3)[0] * weights).sum().backward()
    (_plain_logprobs(reference, *batch) * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=name)


# ----------------------------------------------------------------------------- the update step

@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_full_batch_update(tiny_model, agg):
    rewards = [1.0, 0.0, 0.0, 1.0]
    deltas = []
    for token_budget in (4, 10_000):  # one sequence per micro-batch vs all in one
        model = copy.deepcopy(tiny_model)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        grpo_step(model, optimizer, cosine_schedule(optimizer, 1), GRPO_PROMPTS, COMPLETIONS, rewards, 2,
                  agg=agg, norm_len=4, token_budget=token_budget, max_grad_norm=math.inf, bf16=False)
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[0], deltas[1], atol=1e-5, rtol=1e-3)


def test_one_mini_batch_is_one_optimizer_step_whose_clip_never_binds(tiny_model):
    optimizer = make_optimizer(tiny_model, lr=1e-2, weight_decay=0.0)
    scheduler = cosine_schedule(optimizer, 10)
    metrics = grpo_step(tiny_model, optimizer, scheduler, GRPO_PROMPTS * 2, COMPLETIONS * 2,
                        [1.0, 0.0, 0.0, 1.0] * 2, 2, bf16=False)
    assert metrics["optimizer_steps"] == 1 and scheduler.last_epoch == 1
    assert metrics["clip_frac"] == 0.0 and metrics["ratio"] == 1.0  # pi_theta is pi_old throughout


def test_each_mini_batch_takes_an_optimizer_step_against_the_sampling_policy(tiny_model):
    """Four groups, one per mini-batch: four optimizer (and scheduler) steps, and from the second on the
    ratio is taken against the policy that sampled, fixed before the first step, so the clip binds."""
    optimizer = make_optimizer(tiny_model, lr=1e-2, weight_decay=0.0)
    scheduler = cosine_schedule(optimizer, 10)
    metrics = grpo_step(tiny_model, optimizer, scheduler, GRPO_PROMPTS * 2, COMPLETIONS * 2,
                        [1.0, 0.0, 0.0, 1.0] * 2, 2, mini_batch_groups=1, bf16=False)
    assert metrics["optimizer_steps"] == 4 and scheduler.last_epoch == 4
    assert metrics["clip_frac"] > 0 and abs(metrics["ratio"] - 1) > 1e-3


def test_float32_master_weights_keep_updates_below_bfloat16_resolution(tiny_model):
    norm = tiny_model.model.norm.weight  # initialised to exactly 1.0
    optimizer = make_optimizer(tiny_model, lr=5e-7)
    grpo_step(tiny_model, optimizer, cosine_schedule(optimizer, 10), GRPO_PROMPTS, COMPLETIONS,
              [1.0, 0.0, 0.0, 1.0], 2, bf16=True)
    moved = norm.detach() != 1.0
    assert moved.any()
    assert torch.equal(norm.detach()[moved].bfloat16(), torch.ones(int(moved.sum()), dtype=torch.bfloat16))


def test_grpo_step_rewarding_a_token_raises_its_probability(tiny_model):
    chosen, prompt = 1234, [100, 101, 102]
    generator = torch.Generator().manual_seed(0)
    optimizer = make_optimizer(tiny_model, lr=1e-2, weight_decay=0.0)
    scheduler = cosine_schedule(optimizer, total_steps=3)

    def chosen_probability():
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([prompt])).logits[0, -1]
        return torch.softmax(logits.float(), -1)[chosen].item()

    before = chosen_probability()
    for _ in range(3):
        completions = torch.randint(2000, 3000, (8, 4), generator=generator).tolist()
        rewards = [float(i % 2) for i in range(8)]  # half of each group contains the token and is rewarded
        for completion, reward in zip(completions, rewards):
            completion[0] = chosen if reward else completion[0]
        grpo_step(tiny_model, optimizer, scheduler, [prompt] * 8, completions, rewards, group_size=4)
    assert chosen_probability() > 2 * before


def test_grpo_step_runs_under_accelerate(tiny_model):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    optimizer = make_optimizer(tiny_model, lr=1e-3)
    model, optimizer = accelerator.prepare(tiny_model, optimizer)
    metrics = grpo_step(model, optimizer, cosine_schedule(optimizer, 10), GRPO_PROMPTS, COMPLETIONS,
                        [1.0, 0.0, 0.0, 1.0], 2, accelerator=accelerator)
    assert metrics["grad_norm"] > 0 and metrics["response_tokens"] == 10


def test_cosine_schedule_warms_up_then_decays_to_zero():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = cosine_schedule(optimizer, total_steps=6, warmup_steps=2)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lrs == pytest.approx([0.5, 1.0, *cosine])


# =================================================================================================================
# verifier.py: tool verification
# =================================================================================================================
# Tool verification (verifier.verify_batch): a scripted verifier writes the programs, the sandbox runs them.

PROBLEM = "What is the sum of the integers from 1 to 10?"
ROLLOUT = "Pairing 1+10, 2+9, ... gives 5 pairs of 11, so the sum is $\\boxed{55}$."


def block(code):
    return f"Here is the program.\n```python\n{code}\n```\nIt prints the result."


class ScriptedVerifier:
    """Answers each batch with the given completions, in order, and records what it was asked."""

    def __init__(self, *completions):
        self.completions = list(completions)
        self.batches = []

    def __call__(self, prompts):
        self.batches.append(list(prompts))
        out, self.completions = self.completions[:len(prompts)], self.completions[len(prompts):]
        return out


class CountingPool:
    """A real sandbox pool that counts run_many calls."""

    def __init__(self, pool):
        self.pool, self.calls = pool, 0

    def run_many(self, codes, timeout=None):
        self.calls += 1
        return self.pool.run_many(codes, timeout)


@pytest.fixture(scope="module")
def verify_pool():
    with SandboxPool(timeout=2.0) as p:
        yield p


def verify_one(completion, answer, pool):
    verifier = ScriptedVerifier(completion)
    return verify_batch([PROBLEM], [ROLLOUT], [answer], verifier, sandbox=pool)[0]


# -------------------------------------------------------------------------------------------- statuses

def test_computed_right_answer_is_verified(verify_pool):
    r = verify_one(block("print(sum(range(1, 11)))"), "55", verify_pool)
    assert (r.v, r.status, r.result) == (1, "verified", "55")


def test_printing_the_candidate_literally_is_hardcoded(verify_pool):
    r = verify_one(block("# the trace says 55\nprint(55)"), "55", verify_pool)
    assert (r.v, r.status) == (0, "hardcoded")


def test_computed_wrong_answer_is_a_mismatch(verify_pool):
    r = verify_one(block("print(sum(range(1, 10)))"), "55", verify_pool)
    assert (r.v, r.status, r.result) == (0, "mismatch", "45")


def test_result_is_the_last_nonempty_line(verify_pool):
    r = verify_one(block("print('checking', 10)\nprint(sum(range(1, 11)))\nprint()"), "55", verify_pool)
    assert (r.status, r.result) == ("verified", "55")


@pytest.mark.parametrize("code,answer,status", [
    ("from fractions import Fraction\nprint(Fraction(110, 4))", "\\frac{55}{2}", "verified"),
    ("print(1 / 3)", "\\frac{1}{3}", "verified"),  # a machine float matches a rational answer
    ("print(round(1 / 3, 2))", "\\frac{1}{3}", "mismatch"),  # a rounded decimal does not
    ("import sympy\nprint(sympy.sqrt(8) / 4)", "\\frac{\\sqrt{2}}{2}", "verified"),
    ("import sympy\nprint(sympy.expand((2 + 3 * sympy.I) * 3))", "6+9i", "verified"),  # I is read as i
    ("import sympy\nprint(sympy.sqrt(51))", "\\sqrt{51}", "verified"),
    ("import sympy\nprint(sympy.sqrt(52))", "\\sqrt{51}", "mismatch"),
    ("import sympy\nprint(2 * sympy.sqrt(3) / 3)", "\\frac{2\\sqrt{3}}{3}", "verified"),
    ("import sympy\nprint((3, sympy.pi / 2))", "\\left( 3, \\frac{\\pi}{2} \\right)", "verified"),
    ("import sympy\nprint((3, sympy.pi / 3))", "\\left( 3, \\frac{\\pi}{2} \\right)", "mismatch"),
    ("import sympy\nx = sympy.symbols('x')\nprint(sympy.expand((x + 1) ** 2))", "x^2+2x+1", "verified"),
    ("import sympy\nx = sympy.symbols('x')\nprint(sympy.expand((x + 1) ** 3))", "x^2+2x+1", "mismatch"),
    ("n = 4 + 5\nprint(f'The answer is {n}.')", "9", "verified"),
    ("n = 4 + 6\nprint(f'The answer is {n}.')", "9", "mismatch"),
])
def test_printed_results_are_compared_by_value(verify_pool, code, answer, status):
    """Equivalent spellings verify, near misses do not; sympy prints sqrt(51), (3, pi/2), x**2 + 2*x + 1,
    compared through sympy's own LaTeX of them; a labelled print is read as its value."""
    assert verify_one(block(code), answer, verify_pool).status == status


def test_printed_text_is_turned_into_latex_inside_the_sandbox(verify_pool, tmp_path):
    """sympify evaluates text; a program can print code, so the LaTeX spelling runs in the sandbox, too."""
    target = tmp_path / "written-by-sympify"
    text = f"__import__('pathlib').Path('{target}').touch()"
    r = verify_one(block(f"print({text[:10]!r} + {text[10:]!r})"), "1", verify_pool)
    assert (r.status, r.result) == ("mismatch", text) and not target.exists()


def test_completion_without_code_is_no_code(verify_pool):
    r = verify_one("The candidate is right, the answer is 55.", "55", verify_pool)
    assert (r.v, r.status, r.code) == (0, "no_code", None)


def test_crashing_program_is_exec_error(verify_pool):
    r = verify_one(block("print(55 / 0)"), "55", verify_pool)
    assert (r.v, r.status) == (0, "exec_error")


def test_syntax_error_is_exec_error(verify_pool):
    r = verify_one(block("print(sum(range(1, 11))"), "55", verify_pool)
    assert (r.v, r.status) == (0, "exec_error")


def test_hanging_program_is_timeout(verify_pool):
    r = verify_one(block("while True:\n    pass"), "55", verify_pool)
    assert (r.v, r.status) == (0, "timeout")


def test_missing_answer_is_no_answer_without_a_verifier_call(verify_pool):
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"))
    results = verify_batch([PROBLEM, PROBLEM], ["no box here", ROLLOUT], [None, "55"], verifier, sandbox=verify_pool)
    assert [r.status for r in results] == ["no_answer", "verified"]
    assert len(verifier.batches[0]) == 1


# -------------------------------------------------------------------------------------------- batching

def test_one_verifier_call_and_one_sandbox_run_per_batch(verify_pool):
    verifier = ScriptedVerifier(*[block(f"print(len('{'x' * k}') * 11)") for k in range(4)])
    counting = CountingPool(verify_pool)
    results = verify_batch([PROBLEM] * 4, [ROLLOUT] * 4, ["0", "11", "22", "34"], verifier, sandbox=counting)
    assert (len(verifier.batches), counting.calls) == (1, 1)
    assert [r.v for r in results] == [1, 1, 1, 0]


def test_programs_run_in_the_sandbox_not_in_process(verify_pool):
    r = verify_one(block("import os\nprint(os.getpid())"), "55", verify_pool)
    assert r.result is not None and r.result != str(os.getpid())


def test_prompt_holds_problem_and_rollout():
    prompt = verifier_prompt(PROBLEM, ROLLOUT)
    assert PROBLEM in prompt and ROLLOUT in prompt


def test_long_rollout_keeps_its_end():
    rollout = "step\n" * 5000 + "so the answer is \\boxed{55}"
    prompt = verifier_prompt(PROBLEM, rollout)
    assert "\\boxed{55}" in prompt and len(prompt) < MAX_ROLLOUT_CHARS + len(PROBLEM) + 500


def test_custom_tool_decides_the_verdict():
    def always_seven(codes, sandbox):
        return [ToolRun("ok", "7", "7\n", 0.0) for _ in codes]
    verifier = ScriptedVerifier(block("solver code"), block("solver code"))
    results = verify_batch([PROBLEM] * 2, [ROLLOUT] * 2, ["7", "8"], verifier, tool=always_seven)
    assert [r.status for r in results] == ["verified", "mismatch"]


# -------------------------------------------------------------------------------------------- budget

def test_budget_verifies_only_k_per_answer_class(verify_pool):
    answers = ["\\frac12", "0.5", "1/2", "2", "2", "2"]  # two classes: 1/2 (three spellings) and 2
    verifier = ScriptedVerifier(*[block("print(1 / 2)")] * 2 + [block("print(1 + 1)")] * 2)
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, sandbox=verify_pool, budget=2)
    assert len(verifier.batches[0]) == 4
    assert [r.inferred for r in results] == [False, False, True, False, False, True]


def test_budget_shares_the_majority_outcome_of_the_class(verify_pool):
    answers = ["55"] * 5
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"), block("print(54 + len('x'))"),
                                block("print(1 / 0)"))
    results = verify_batch([PROBLEM] * 5, [ROLLOUT] * 5, answers, verifier, sandbox=verify_pool, budget=3)
    assert [r.v for r in results] == [1, 1, 0, 1, 1]
    assert [r.status for r in results[3:]] == ["verified", "verified"]


def test_budget_tie_inherits_unverified(verify_pool):
    verifier = ScriptedVerifier(block("print(54 + len('x'))"), block("print(54)"))
    results = verify_batch([PROBLEM] * 3, [ROLLOUT] * 3, ["55"] * 3, verifier, sandbox=verify_pool, budget=2)
    assert results[2].v == 0 and results[2].inferred


def test_budget_keeps_problems_apart(verify_pool):
    other = "What is 5 times 11?"
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"), block("print(5 * 11)"))
    results = verify_batch([PROBLEM, PROBLEM, other], [ROLLOUT] * 3, ["55"] * 3, verifier, sandbox=verify_pool, budget=1)
    assert [r.inferred for r in results] == [False, True, False]


def test_lazy_verification_stops_once_the_majority_is_verified(verify_pool, monkeypatch):
    monkeypatch.setattr("verifier.LAZY_SECOND_CALL", 0)
    answers = ["55", "55", "55", "55", "54", "56"]  # 55 verified scores 20, the others 5 at most
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"))
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, sandbox=verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [1]
    assert [r.status for r in results] == ["verified"] * 4 + ["skipped"] * 2 and [r.v for r in results] == [1] * 4 + [0, 0]


def test_lazy_verification_asks_the_classes_that_can_still_win_in_a_second_call(verify_pool, monkeypatch):
    monkeypatch.setattr("verifier.LAZY_SECOND_CALL", 0)  # a second call pays even for one prompt spared
    answers = ["55", "55", "55", "55", "54", "56"]  # 55 fails (4): 54 or 56 verified (5) would beat it
    verifier = ScriptedVerifier(*[block("print(6 * 9)")] * 3)
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, sandbox=verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [1, 2]
    assert [r.status for r in results] == ["mismatch"] * 4 + ["verified", "mismatch"]
    assert weighted_vote(answers, [r.v for r in results], 5.0).label == "54"


def test_lazy_verification_asks_every_class_that_can_win_at_once_when_a_second_call_spares_little(verify_pool):
    answers = ["55", "55", "55", "55", "54", "56", "57"]  # 55 and the three that could beat it: 3 prompts spared
    verifier = ScriptedVerifier(*[block("print(6 * 9)")] * 4)
    results = verify_batch([PROBLEM] * 7, [ROLLOUT] * 7, answers, verifier, sandbox=verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [4]
    assert [r.status for r in results] == ["mismatch"] * 4 + ["verified", "mismatch", "mismatch"]


def test_lazy_verification_of_several_problems_makes_two_verifier_calls(verify_pool, monkeypatch):
    monkeypatch.setattr("verifier.LAZY_SECOND_CALL", 0)
    other = "What is 5 times 11?"
    problems = [PROBLEM] * 4 + [other] * 4
    answers = ["55", "55", "54", "53"] * 2  # per problem: 55 fails, so 54 and 53 can still win
    verifier = ScriptedVerifier(*[block("print(0)")] * 8)
    results = verify_batch(problems, [ROLLOUT] * 8, answers, verifier, sandbox=verify_pool, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [4, 4]
    assert all(r.status == "mismatch" for r in results)


# -------------------------------------------------------------------------------------------- code and guard

def test_code_is_the_first_python_block():
    text = "```text\nnot code\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```"
    assert extract_code(text).strip() == "print(1)"


def test_code_falls_back_to_the_first_fenced_block():
    assert extract_code("```\nprint(3)\n```").strip() == "print(3)"


def test_unclosed_block_runs_to_the_end():
    assert extract_code("```python\nx = 2\nprint(x * 3)").strip() == "x = 2\nprint(x * 3)"


GUARD_PROBLEM = "A club of 12 members picks 3 officers; each of the 11 committees meets 120 times. Find the count."
HARDCODED = [  # the candidate 1320 copied into the program and printed, in the ways small verifiers do it
    "print(1320)", "print('1320')", "print(f'{1320}')", "print(f'The answer is {1320}')", "print(-(-1320))",
    "print(int(1320))", "from fractions import Fraction\nprint(Fraction(1320))", "import sympy\nprint(sympy.Integer(1320))",
    "print(1320 * 1)", "print(1320.0)", "x = [1320]\nprint(x[0])", "ans = 1320\nprint(ans)", "a = 1320\nb = a\nprint(b)",
    "p, q = 5, 1320\nprint(q)", "def solve():\n    # the trace says 1320\n    return 1320\nprint(solve())",
    "r = 0\nr += 1320\nprint(r)", "d = {'n': 1320}\nprint(d['n'])", "print(str(1320))", "import sympy\nprint(sympy.Rational(1320, 1))",
    "import math\nx = math.comb(12, 3)\nprint(x)\nresult = 1320\nprint(result)", "for v in [1320]:\n    pass\nprint(v)",
    "print(max(1320, 0))",
]
COMPUTED = [  # honest recomputations from the problem's numbers (and checks that do not feed the print)
    "import math\nprint(math.comb(12, 3))", "print(11 * 120)", "a, b = 11, 120\nprint(a * b)",
    "x = 1320\nprint(11 * 120)", "r = 11 * 120\nassert r == 1320\nprint(r)", "r = 11 * 120\nif r == 1320:\n    print(r)",
    "import math\nprint(math.perm(12, 3) // 1)", "x = 1\nfor i in range(5):\n    x = x * 2\nprint(x)",
    "n = 0\nn += 3\nprint(n)", "def f(k):\n    return k * 120\nprint(f(11))", "print(sum(120 for _ in range(11)))",
    "import sympy\nx = sympy.Symbol('x')\nprint(sympy.solve(x - 11 * 120, x)[0])", "p, q = 5, 1320\nprint(p * 264)",
    "print(2 * 660)", "from fractions import Fraction\nprint(Fraction(10 * 11, 2 * 1))", "print(", "",
]


@pytest.mark.parametrize("code", HARDCODED)
def test_copied_candidate_is_hardcoded(code):
    assert hardcoded(code, GUARD_PROBLEM, "1320")


@pytest.mark.parametrize("code", COMPUTED)
def test_recomputation_is_not_hardcoded(code):
    assert not hardcoded(code, GUARD_PROBLEM, "1320")


def test_a_small_answer_used_as_a_constant_is_no_copy():
    problem = "Sam has four socks and pairs them. How many pairs?"
    assert not hardcoded("s = 'abcd'\nprint(len(s) // 2)", problem, "2")
    assert not hardcoded("pairs = [('a', 'b'), ('c', 'd')]\nprint(len(pairs[1]))", problem, "2")
    assert hardcoded("print(2 + 0)", problem, "2")


def test_a_value_the_problem_supplies_or_another_answer_is_no_copy():
    assert not hardcoded("print(1320)", "What is 1320 divided by 1?", "1320")
    assert not hardcoded("print(1320)", GUARD_PROBLEM, "1321")
    assert hardcoded("from fractions import Fraction\nprint(Fraction(3, 4))", "Find the ratio p/q.", "\\frac34")
    assert not hardcoded("from fractions import Fraction\nprint(Fraction(3, 4))", "3 of every 4 cats ...", "\\frac34")


def test_a_word_the_problem_offers_is_no_copy():
    problem = "She spins 2250 degrees to her right. Which direction (north, south, east or west) is she facing?"
    chosen = "turns = 2250 // 90 % 4\nd = 'east' if turns == 1 else 'north'\nprint(d)"
    assert not hardcoded(chosen, problem, "\\text{east}")
    assert hardcoded(chosen, "She spins 2250 degrees to her right. Which way is she facing?", "\\text{east}")
    assert hardcoded("print('Evelyn')", "Which student ran fastest?", "\\text{Evelyn}")


def test_programs_find_the_allowed_modules_under_their_usual_names(verify_pool):
    run = python_tool(["x = sp.symbols('x')\nprint(sp.solve(x - 3, x)[0] + int(np.int64(1)) + math.floor(0.5))"],
                      verify_pool)[0]
    assert (run.status, run.result) == ("ok", "4")


def test_a_printed_double_verifies_an_irrational_answer_at_its_own_precision():
    assert tool_agrees("98.99494936611666", "70 \\sqrt{2}") and tool_agrees("6.283185307179586", "2\\pi")
    assert not tool_agrees("98.99494936611666", "70\\sqrt{3}")
    assert not tool_agrees("98.99", "70\\sqrt{2}")  # a rounded decimal is no computed double
    assert not is_equiv("98.99494936611666", "70\\sqrt{2}")  # between answers, decimals stay decimals


# -------------------------------------------------------------------------------------------- model verifier

def test_model_verifier_returns_one_completion_per_prompt_with_token_counts(tiny_model, tokenizer):
    verifier = model_verifier(tiny_model, tokenizer, max_new_tokens=4, seed=0)
    texts = verifier([verifier_prompt(PROBLEM, ROLLOUT), verifier_prompt(PROBLEM, "no idea")])
    assert len(texts) == 2 and all(isinstance(t, str) and 1 <= t.num_tokens <= 4 for t in texts)


def test_model_verifier_puts_the_system_prompt_in_the_chat(tiny_model, tokenizer, monkeypatch):
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, **kw))
    model_verifier(tiny_model, tokenizer, max_new_tokens=1, seed=0)(["hello"])
    assert VERIFIER_SYSTEM in seen[0] and "hello" in seen[0]


# =================================================================================================================
# t3rl.py: the loop
# =================================================================================================================

ROOT = Path(__file__).resolve().parent
QUESTIONS = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 + 3?", "6"), ("What is 4 + 4?", "8")]


def fake_answer(text):
    """The tiny random model never writes \\boxed{}; give each rollout a deterministic answer from its text
    so that votes, rewards and the GRPO update are not all trivial."""
    return str(len(text) % 3)


def scripted_verifier(prompts):
    """A verifier that always writes the same program: rollouts answering 2 get verified."""
    return ["```python\nprint(1 + 1)\n```" for _ in prompts]


@pytest.fixture()
def tiny_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_bench(folder: Path, questions):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "problem": p, "answer": a}) + "\n" for i, (p, a) in enumerate(questions)))


def tiny_argv(tiny_dir, out_dir, **extra):
    options = dict(preset="cpu", model=str(tiny_dir), verifier_model="self", bench="demo", n_votes=4, n_train=2, questions_per_step=2,
                   max_steps=4, max_new_tokens=12, verifier_max_new_tokens=8, lr=1e-3, save_every=2,
                   eval_samples=2, out_dir=str(out_dir), run_name="run", backend="kv", sample_dtype="bfloat16",
                   bf16=False, grad_checkpointing=False)
    options.update(extra)
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    return [(flag(k) if v else "--no-" + k.replace("_", "-")) if isinstance(v, bool) else f"{flag(k)}={v}"
            for k, v in options.items()]


@pytest.fixture()
def patched(monkeypatch):
    monkeypatch.setattr(t3rl, "extract_answer", fake_answer)
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: scripted_verifier if cfg.verify else None)


def rows(run_dir, name):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def without_timing(metrics):
    return [{k: v for k, v in r.items() if not k.startswith(("seconds/", "grpo/seconds"))} for r in metrics]


def final_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(run_dir / "checkpoint" / "model" / "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# configuration

def test_unknown_option_is_rejected(capsys):
    with pytest.raises(SystemExit):
        t3rl.parse_config(["--no-such-option", "1"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_cpu_preset_is_picked_without_gpu_and_explicit_options_win():
    cfg = t3rl.parse_config(["--n-votes", "16"])
    assert cfg.preset == "cpu" and cfg.model == "embedded" and cfg.bench == "demo"
    assert cfg.verifier_model == "coder-1.5b"
    assert cfg.n_votes == 16 and cfg.n_train == t3rl.PRESETS["cpu"]["n_train"]


@pytest.mark.parametrize("argv,loaded", [([], ["coder-1.5b"]), (["--verifier-model", "self"], ["embedded"])])
def test_cpu_preset_verifies_with_the_1_5b_and_self_verification_loads_the_policy(monkeypatch, argv, loaded):
    seen = []

    def load_model(spec, dtype=None):
        seen.append(spec)
        return torch.nn.Linear(2, 2), None
    monkeypatch.setattr(t3rl, "load_model", load_model)
    monkeypatch.setattr(t3rl, "model_verifier", lambda model, tok, **kw: ("verifier", model, kw["max_new_tokens"]))
    cfg = t3rl.parse_config(argv)
    verifier = t3rl.build_verifier(cfg, torch.device("cpu"))
    assert seen == loaded and verifier[0] == "verifier" and verifier[2] == cfg.verifier_max_new_tokens


def test_verifier_int8_builds_an_int8_verifier_on_a_cpu_with_the_kv_sampler_only(monkeypatch):
    monkeypatch.setattr(t3rl, "load_model", lambda spec, dtype=None: (torch.nn.Linear(2, 2), None))
    monkeypatch.setattr(t3rl, "model_verifier", lambda model, tok, **kw: kw)
    assert t3rl.build_verifier(t3rl.parse_config([]), torch.device("cpu"))["int8"] is False
    assert t3rl.build_verifier(t3rl.parse_config(["--verifier-int8"]), torch.device("cpu"))["int8"] is True
    with pytest.raises(t3rl.OptionError, match="--verifier-int8: the int8 products are the kv sampler's"):
        t3rl.parse_config(["--backend", "hf", "--verifier-int8"])
    with pytest.raises(t3rl.OptionError, match="--verifier-int8: they run on a CPU .* --no-verifier-int8"):
        t3rl.build_verifier(t3rl.parse_config(["--verifier-int8"]), torch.device("meta"))


def test_paper_preset_follows_the_paper():
    cfg = t3rl.parse_config(["--preset", "paper", "--bench", "aime2024"])
    assert (cfg.n_votes, cfg.n_train, cfg.temperature, cfg.top_p) == (64, 32, 0.6, 0.95)
    assert (cfg.max_new_tokens, cfg.verifier_max_new_tokens, cfg.lr, cfg.kl_coef, cfg.omega) == (2560, 1024, 5e-7, 0.0, 5.0)
    assert (cfg.episodes, cfg.eval_samples) == (80, 16)
    assert (cfg.mini_batch_questions, cfg.warmup_ratio, cfg.clip) == (1, 0.03, 0.2)  # TTRL's scripts
    assert t3rl.parse_config(["--preset", "paper", "--bench", "amc"]).episodes == 30


def test_every_option_is_read_by_the_run():
    """An option nothing reads does nothing (--sandbox-timeout once did): each Config field is read as cfg.<name>
    somewhere in t3rl.py, besides the preset that picks the others."""
    source = (ROOT / "t3rl.py").read_text()
    unread = [name for name in t3rl.Config.__dataclass_fields__
              if name != "preset" and not re.search(rf"\bcfg\.{name}\b(?!\s*=[^=])", source)]
    assert unread == []


def test_omega_inf_and_no_verify_parse():
    cfg = t3rl.parse_config(["--omega", "inf", "--no-verify"])
    assert cfg.omega == float("inf") and cfg.verify is False


def test_help_lists_every_option_with_its_default():
    out = subprocess.run([sys.executable, "t3rl.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for name in t3rl.Config.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out
    assert "(default: 5.0)" in out and "--replay" in out


def test_module_benchmark_commands_reach_their_bench_files():
    """`python X.py --bench ...` (as README documents them) still parses its options, now in bench/X_*.py: each
    module run as __main__ in one fresh interpreter prints the help of its benchmark."""
    commands = {"sampler.py": "--verifier-prompts", "grpo.py": "--configs", "verifier.py": "--rescore",
                "sandbox.py": "--selftest", "answers.py": "--bench-equiv"}
    script = ("import contextlib, io, runpy, sys\n"
              "for path in sys.argv[1:]:\n"
              "    sys.argv, out = [path, '--help'], io.StringIO()\n"
              "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
              "        runpy.run_path(path, run_name='__main__')\n"
              "    print(path, repr(out.getvalue()))\n")
    done = subprocess.run([sys.executable, "-c", script, *commands], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    helps = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert {path: option in helps[path] for path, option in commands.items()} == dict.fromkeys(commands, True)

def test_episodes_pass_over_every_question_in_a_seeded_order():
    cfg = t3rl.Config(episodes=3, questions_per_step=3, max_steps=0)
    records = [{"id": str(i)} for i in range(7)]
    batches = t3rl.question_batches(records, cfg)
    assert len(batches) == 9
    for episode in range(3):
        ids = sorted(r["id"] for b in batches[episode * 3:(episode + 1) * 3] for r in b)
        assert ids == sorted(r["id"] for r in records)
    assert batches == t3rl.question_batches(records, cfg)


# ---------------------------------------------------------------------------------------------------------------
# the loop

def test_self_verifier_answers_each_prompt_and_no_verify_builds_none(tiny_dir, tmp_path):
    cfg = t3rl.parse_config(tiny_argv(tiny_dir, tmp_path))
    verify = t3rl.build_verifier(cfg, torch.device("cpu"))
    [completion] = verify(["Is 2 + 2 = 4?"])
    assert isinstance(completion, str) and 0 < completion.num_tokens <= cfg.verifier_max_new_tokens
    assert t3rl.build_verifier(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path, verify=False)), "cpu") is None


def test_ground_truth_never_reaches_rewards_or_parameters(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "real", QUESTIONS)
    write_bench(tmp_path / "garbage", [(p, "GARBAGE-" + a) for p, a in QUESTIONS])
    runs = []
    for name in ("real", "garbage"):
        monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / name))
        runs.append(t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / f"out-{name}", max_steps=2))))
    real, garbage = (rows(r, "rollouts.jsonl") for r in runs)
    assert [r["reward"] for r in real] == [r["reward"] for r in garbage]
    assert 0 < sum(r["reward"] for r in real) < len(real)  # the rewards are not trivial
    weights = [final_weights(r) for r in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    start = make_tiny_model(weights[0]["model.embed_tokens.weight"].shape[0]).state_dict()
    assert not torch.equal(weights[0]["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    # ... while the monitors, which may see the gold answers, do notice the difference
    assert rows(runs[0], "metrics.jsonl")[1]["ground_truth_ratio"] != rows(runs[1], "metrics.jsonl")[1]["ground_truth_ratio"]


def test_lazy_verification_trains_exactly_as_verifying_every_rollout(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr("verifier.LAZY_SECOND_CALL", 0)  # the two-call path, the one that could go wrong
    asked = {}
    runs = {}
    for lazy in (False, True):
        def counting(prompts, lazy=lazy):
            asked[lazy] = asked.get(lazy, 0) + len(prompts)
            return scripted_verifier(prompts)
        monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: counting)
        argv = tiny_argv(tiny_dir, tmp_path / f"lazy-{lazy}", n_votes=6, max_steps=2, verify_budget=0, lazy_verify=lazy)
        runs[lazy] = t3rl.train(t3rl.parse_config(argv))
    full, lazy = (rows(runs[k], "rollouts.jsonl") for k in (False, True))
    assert [(r["label"], r["reward"], r["kept"]) for r in full] == [(r["label"], r["reward"], r["kept"]) for r in lazy]
    assert 0 < sum(r["reward"] for r in full) < len(full)
    assert "skipped" in {r["status"] for r in lazy} and asked[True] < asked[False]
    weights = [final_weights(runs[k]) for k in (False, True)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_run_folder_has_config_metrics_rollouts_checkpoint_and_plot(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    pools = []

    class RecordedPool(t3rl.SandboxPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)
    monkeypatch.setattr(t3rl, "SandboxPool", RecordedPool)
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, sandbox_timeout=2.5)))
    assert [pool.timeout for pool in pools] == [2.5]  # --sandbox-timeout reaches the pool
    assert json.loads((run / "config.json").read_text())["n_votes"] == 4
    metrics = rows(run, "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["eval", "train", "train", "eval"]
    assert {"label_accuracy", "majority_label_accuracy", "verified_ratio", "status", "grpo/loss"} <= set(metrics[1])
    rollouts = rows(run, "rollouts.jsonl")
    assert len(rollouts) == 2 * 2 * 4 and sum(r["kept"] for r in rollouts) == 2 * 2 * 2
    assert {r["status"] for r in rollouts} <= {"verified", "mismatch", "skipped"}  # the preset verifies lazily
    assert all((r["status"] == "verified") == (r["answer"] == "2") for r in rollouts if r["status"] != "skipped")
    assert (run / "checkpoint" / "state.pt").is_file() and (run / "curves.png").stat().st_size > 1000


def test_step_metrics_report_verifier_precision_and_recall_against_gold(tiny_dir, tmp_path, monkeypatch, patched):
    golds = ["0", "1", "2", "2"]  # fake answers are 0, 1 or 2, and the scripted verifier verifies only "2"
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, golds)])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2)))
    gold = {f"q{i}": g for i, g in enumerate(golds)}
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    pooled = {"verified": 0, "right": 0, "both": 0}
    for m in train_rows:
        step = [r for r in rows(run, "rollouts.jsonl") if r["step"] == m["step"]]
        verified = [r for r in step if r["v"]]
        right = [r for r in step if r["answer"] == gold[r["id"]]]
        both = [r for r in verified if r["answer"] == gold[r["id"]]]
        assert m["verifier_precision"] == (len(both) / len(verified) if verified else None)
        assert m["verifier_recall"] == (len(both) / len(right) if right else None)
        pooled = {"verified": pooled["verified"] + len(verified), "right": pooled["right"] + len(right),
                  "both": pooled["both"] + len(both)}
        recall = "-" if m["verifier_recall"] is None else f"{m['verifier_recall']:.2f}"
        assert f" rec {recall} |" in t3rl.format_step(m, 2)
    assert 0 < pooled["both"] < pooled["right"] and pooled["both"] < pooled["verified"]  # neither score is trivial
    table = t3rl.summary(run)
    assert f"verifier precision{pooled['both'] / pooled['verified']:>20.3f}" in table
    assert f"verifier recall{pooled['both'] / pooled['right']:>23.3f}" in table


def test_a_run_without_the_verifier_reports_no_verifier_precision_or_recall(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", [(p, g) for (p, _), g in zip(QUESTIONS, ["0", "1", "2", "2"])])
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, verify=False)))
    train_rows = [m for m in rows(run, "metrics.jsonl") if m["kind"] == "train"]
    assert sum(m["correct_rollouts"] for m in train_rows) > 0  # a recall of 0 / that would be defined, and wrong
    for m in train_rows:
        assert m["status"] == {} and m["verifier_precision"] is None and m["verifier_recall"] is None
        assert " prec - rec - |" in t3rl.format_step(m, 2)
    table = t3rl.summary(run)
    assert f"verifier precision{'-':>20}" in table and f"verifier recall{'-':>23}" in table


@contextmanager
def interrupted_at_update(monkeypatch, update: int):
    """Ctrl-C in the middle of the update-th GRPO update of whatever runs in the block."""
    real_step, calls = t3rl.grpo_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == update:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)
    monkeypatch.setattr(t3rl, "grpo_step", interrupted)
    try:
        yield
    finally:
        monkeypatch.setattr(t3rl, "grpo_step", real_step)


def train_until_interrupted(monkeypatch, argv, update: int):
    """Run t3rl.train on argv and press Ctrl-C in the middle of its update-th GRPO update."""
    with interrupted_at_update(monkeypatch, update), pytest.raises(KeyboardInterrupt):
        t3rl.train(t3rl.parse_config(argv))


def test_interrupted_run_resumes_to_the_same_metrics(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    straight = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "a")))

    with interrupted_at_update(monkeypatch, 3), pytest.raises(SystemExit) as stop:
        t3rl.main(tiny_argv(tiny_dir, tmp_path / "b"))  # Ctrl-C: one line with the command that continues the run
    run = tmp_path / "b" / "run"
    assert stop.value.code == (f"interrupted: {run} holds every step up to its last checkpoint; continue with: "
                               f"python t3rl.py --resume {run}")
    resumed = t3rl.train(t3rl.parse_config(["--resume", str(tmp_path / "b" / "run")]))

    assert without_timing(rows(resumed, "metrics.jsonl")) == without_timing(rows(straight, "metrics.jsonl"))
    assert rows(resumed, "rollouts.jsonl") == rows(straight, "rollouts.jsonl")
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_replay_recomputes_labels_per_omega(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", max_steps=2, lazy_verify=False)))
    capsys.readouterr()
    monkeypatch.setattr(t3rl, "load_model", lambda *a, **k: pytest.fail("replay loaded a model"))
    tables = []
    for spelling in (["--replay", str(run)], [f"--replay={run}"]):  # one parser: both spellings are the replay mode
        t3rl.main([*spelling, "--omega", "1", "5", "inf"])
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    table = tables[0].splitlines()
    assert "4 rollout groups" in table[0] and [line.split()[0] for line in table[2:]] == ["1", "5", "inf"]
    assert table[2].split()[3] == "0"  # omega = 1 is the majority vote itself: no flips
    assert not (run.parent / "runs").exists() and sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_replay_of_a_lazy_run_refuses_the_omegas_its_verdicts_do_not_settle(tiny_dir, tmp_path, monkeypatch, patched):
    monkeypatch.setattr("verifier.LAZY_SECOND_CALL", 0)  # as many skipped verdicts as laziness makes
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path / "out", n_votes=6, max_steps=2)))
    assert "skipped" in {r["status"] for r in rows(run, "rollouts.jsonl")}
    assert [line.split()[0] for line in t3rl.replay(run, [1.0, 5.0]).splitlines()[2:]] == ["1", "5"]
    with pytest.raises(t3rl.RunDirError, match=r"--omega 2 inf: the run verified lazily"):
        t3rl.replay(run, [1.0, 2.0, math.inf])


def tensorboard_scalars(folder: Path) -> dict:
    """{tag: [(step, value), ...]} from the TensorBoard event files in a folder, as TensorBoard itself reads them
    (events a resumed writer purged are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_report_to_tensorboard_logs_every_row_and_a_resumed_run_continues_it(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    # step 3 (index 2) is logged after the checkpoint at 2, then step 4 dies: the resumed run logs step 3 again
    train_until_interrupted(monkeypatch, tiny_argv(tiny_dir, tmp_path / "out", eval_samples=0, report_to="tensorboard"),
                            update=4)
    run = tmp_path / "out" / "run"
    assert max(step for step, _ in tensorboard_scalars(run / "t3rl")["label_accuracy"]) == 3
    t3rl.train(t3rl.parse_config(["--resume", str(run)]))

    scalars = tensorboard_scalars(run / "t3rl")
    expected = {}
    for row in rows(run, "metrics.jsonl"):
        for key, value in t3rl.tracker_row(row).items():
            expected.setdefault(key, []).append((row["step"] + (row["kind"] == "train"), value))
    assert "status/verified" in expected and "pass@1" in expected and "grpo/loss" in expected
    assert scalars.keys() == expected.keys()
    for key, points in expected.items():  # every row once, at its step, with its value (to float32 precision)
        assert [step for step, _ in scalars[key]] == [step for step, _ in points], key
        assert [value for _, value in scalars[key]] == pytest.approx([value for _, value in points], rel=1e-6), key
    hparams = [path.read_text() for path in (run / "t3rl").glob("*/hparams.yml")]  # one per start
    assert len(hparams) == 2 and all("n_votes: 4" in h and "report_to: tensorboard" in h for h in hparams)


def test_report_to_names_unknown_and_missing_trackers(monkeypatch):
    with pytest.raises(t3rl.OptionError, match="--report-to tensorbored: choose from"):
        t3rl.parse_config(["--report-to", "tensorbored"])
    monkeypatch.setattr(t3rl, "get_available_trackers", lambda: [])
    with pytest.raises(t3rl.OptionError, match="--report-to tensorboard: the tensorboard package is not installed; "
                                               "pip install tensorboard"):
        t3rl.parse_config(["--report-to", "tensorboard,wandb"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_slurm_script_launches_one_run_over_two_nodes(tiny_dir, tmp_path):
    """launch/slurm.sbatch as Slurm runs it on 2 nodes x 1 GPU, here on this CPU: a stand-in srun runs its launch
    line once per node with that node's SLURM_NODEID, scontrol names the main node; the two processes meet at
    that address and form one run of world size 2, which logs (metrics.jsonl, TensorBoard) from one process."""
    write_bench(tmp_path / "data", QUESTIONS[:2])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\n'
                                  'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" & done\n'
                                  'for job in $(jobs -p); do wait "$job" || exit 1; done\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "1", "MAIN_PORT": str(free_port()), "T3RL_DATA_DIR": str(tmp_path / "data"),
           "OMP_NUM_THREADS": "1"}
    argv = tiny_argv(tiny_dir, tmp_path / "out", max_steps=1, eval_samples=0, verify=False, report_to="tensorboard")
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 questions, 1 steps, 2 processes on cpu" in done.stderr
    run = tmp_path / "out" / "run"
    assert [m["kind"] for m in rows(run, "metrics.jsonl")] == ["eval", "train", "eval"]
    assert len(list((run / "t3rl").glob("events.out.tfevents.*"))) == 1
    assert [step for step, _ in tensorboard_scalars(run / "t3rl")["pass@1"]] == [0, 1]


LAUNCHED = """import sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import t3rl
t3rl.extract_answer = lambda text: str(len(text) % 3)  # test_t3rl.fake_answer
t3rl.build_verifier = lambda cfg, device: (lambda prompts: ["```python\\nprint(1 + 1)\\n```" for _ in prompts])
t3rl.main()
print(f"process {{dist.get_rank()}} of {{dist.get_world_size()}} done")
"""


@pytest.fixture()
def sharp_dir(tmp_path_factory, tokenizer):
    """The tiny model with an untied head scaled 20x. One and several processes' updates differ by float
    rounding (summation order); sampled in float32 from peaked next-token distributions, that cannot flip a
    drawn token, as it can on a near-flat distribution over 152k tokens or in bfloat16 (where a weight whose
    rounding flips moves logits by 2^-8)."""
    folder = tmp_path_factory.mktemp("sharp")
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_like_one(model_dir, tmp_path, monkeypatch, processes, questions, **options):
    """Train with `processes` real processes (torchrun, gloo) and in this one process; both run folders."""
    write_bench(tmp_path / "data", questions)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    options = dict(sample_dtype="float32", **options)
    one = t3rl.train(t3rl.parse_config(tiny_argv(model_dir, tmp_path / "one", **options)))
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
           str(script), *tiny_argv(model_dir, tmp_path / "many", **options)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the world size, as each process saw it inside the run
    seen = re.findall(r"process (\d+) of (\d+) done", done.stdout)  # the processes' lines may interleave
    assert sorted(seen) == [(str(rank), str(processes)) for rank in range(processes)]
    return one, tmp_path / "many" / "run"


def assert_trained_alike(one, many):
    """Same rollouts, same metrics (the update's statistics to float tolerance), weights to tolerance."""
    key = lambda r: (r["step"], r["id"], r["index"])  # noqa: E731
    assert sorted(rows(one, "rollouts.jsonl"), key=key) == sorted(rows(many, "rollouts.jsonl"), key=key)
    a, b = without_timing(rows(one, "metrics.jsonl")), without_timing(rows(many, "metrics.jsonl"))
    assert [{k: v for k, v in r.items() if not k.startswith("grpo/")} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith("grpo/")} for r in b]
    for ra, rb in zip(a, b):
        assert {k: pytest.approx(v, rel=1e-3, abs=1e-6) for k, v in ra.items() if k.startswith("grpo/")} == \
            {k: v for k, v in rb.items() if k.startswith("grpo/")}
    # AdamW moves a weight by about lr whatever its gradient's size, so where a gradient is at rounding level
    # the summation order shows as a small fraction of lr (1e-3 here)
    w1, w2 = final_weights(one), final_weights(many)
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-5) for k in w1)


def test_three_processes_on_steps_of_two_questions_train_like_one(sharp_dir, tmp_path, monkeypatch, patched):
    """Every step leaves one process without a question; two optimizer steps per step, the second against the
    log-probs of the policy that sampled (ratio != 1)."""
    one, many = train_like_one(sharp_dir, tmp_path, monkeypatch, 3, QUESTIONS, max_steps=2, eval_samples=0,
                               mini_batch_questions=1)
    assert_trained_alike(one, many)
    train_rows = [r for r in rows(many, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["grpo/optimizer_steps"] for r in train_rows] == [2, 2]
    assert any(abs(r["grpo/ratio"] - 1) > 1e-4 for r in train_rows)


def test_four_processes_on_a_benchmark_not_a_multiple_of_the_step_train_like_one(sharp_dir, tmp_path, monkeypatch,
                                                                                  patched):
    """5 questions in steps of 2: the last step has one question for four processes, and is kept."""
    questions = QUESTIONS + [("What is 5 + 5?", "10")]
    one, many = train_like_one(sharp_dir, tmp_path, monkeypatch, 4, questions, episodes=1, max_steps=0,
                               eval_samples=0, verify=False, save_every=3)
    assert_trained_alike(one, many)
    train_rows = [r for r in rows(many, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["questions"] for r in train_rows] == [2, 2, 1]


# =================================================================================================================
# knk.py: Knights and Knaves, the logic domain (generator, answers, the z3 tool, a training step)
# =================================================================================================================

KNK = [json.loads(line) for line in (ROOT / "data" / "knk.jsonl").read_text().splitlines()]
KNK_4 = next(r for r in KNK if r["level"] == 4)  # Zoey, Ethan, Michael, Samuel: knight, knight, knave, knave


def flip_one(answer, who=0):
    """The same assignment with one person's role flipped: the closest wrong answer."""
    world = knk.parse_assignment(answer)
    name = list(world)[who]
    return knk.canonical(list(world), {**world, name: not world[name]})


def test_knk_set_regenerates_byte_for_byte(tmp_path):
    out = tmp_path / "knk.jsonl"
    done = subprocess.run([sys.executable, "knk.py", "--generate", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == (ROOT / "data" / "knk.jsonl").read_bytes()
    assert knk.generate(5, seed=1) != knk.generate(5, seed=0)  # the seed matters


def test_knk_puzzles_have_one_solution_which_is_the_answer():
    assert len(KNK) == 100 and sorted({r["level"] for r in KNK}) == list(range(2, 9))
    for r in KNK:
        names, statements = r["names"], r["statements"]
        [solution] = knk.solutions(names, names, statements)
        assert knk.canonical(names, dict(zip(names, solution))) == r["answer"]
        assert knk.puzzle_names(r["problem"]) == names and r["level"] == len(names)
        assert all(knk.text(st) in r["problem"] for st in statements)
        assert r["problem"].endswith("So who is a knight and who is a knave?")
        # the guard's premise: no statement fixes anybody on its own, and each names someone else
        assert not any(knk.fixes_someone(n, st) for n, st in zip(names, statements))
        assert all(set(knk.mentioned(st)) - {n} for n, st in zip(names, statements))


def test_knk_generator_enumerates_solutions_correctly():
    statements = [["is", "B", "knave"], ["is", "A", "knave"]]  # A: "B is a knave", B: "A is a knave"
    assert knk.solutions(["A", "B"], ["A", "B"], statements) == [(True, False), (False, True)]
    assert knk.fixes_someone("A", ["and", ["is", "A", "knave"], ["is", "B", "knight"]])  # A must be a knave
    assert not knk.fixes_someone("A", ["or", ["is", "A", "knight"], ["is", "B", "knight"]])


GOLD_4 = "Zoey: knight, Ethan: knight, Michael: knave, Samuel: knave"


@pytest.mark.parametrize("text", [
    "CONCLUSION:\n(1) Zoey is a knight\n(2) Ethan is a knight\n(3) Michael is a knave\n(4) Samuel is a knave",
    "(1) Zoey is a knight (2) Ethan is a knight (3) Michael is a knave (4) Samuel is a knave. The answer is above? "
    "Final answer: (1) Zoey is a knight (2) Ethan is a knight (3) Michael is a knave (4) Samuel is a knave",
    "So $\\boxed{Samuel: knave, Michael: knave, Zoey: knight, Ethan: knight}$",
    "\\boxed{\\text{Zoey is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave}}",
    "\\boxed{\\text{Zoey: Knight}, \\text{Ethan: Knight}, \\text{Michael: Knave}, \\text{Samuel: Knave}}",
    "The answer is: Knights: Zoey, Ethan; Knaves: Michael, Samuel.",
    "Final answer: Zoey and Ethan are knights, Michael and Samuel are knaves.",
    "\\boxed{Zoey is a knight, Ethan is not a knave, Michael is not a knight, Samuel is a knave}",
    "\\boxed{knight, knight, knave, knave}",
    "Suppose Zoey is a knave; then ... contradiction. \\boxed{Zoey - Knight, Ethan - Knight, Michael - Knave, "
    "Samuel - Knave}",
])
def test_knk_answer_spellings_read_as_the_canonical_assignment(text):
    assert knk.extract_answer(text, KNK_4["problem"]) == GOLD_4 == KNK_4["answer"]


@pytest.mark.parametrize("text", [
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave}",                          # Samuel is missing
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave, Samuel: knave, Bob: knight}",  # Bob is not there
    "\\boxed{Zoe is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave}",  # misspelt
    "Suppose Zoey is a knight, Ethan is a knight, Michael is a knave and Samuel is a knave.",  # no answer stated
    "\\boxed{knight, knave}",                                                          # two roles for four
])
def test_knk_unknown_name_or_missing_person_gives_no_answer(text):
    assert knk.extract_answer(text, KNK_4["problem"]) is None


def test_knk_equal_assignments_vote_together_and_grade_equal():
    other_order = "Samuel: knave, Michael: knave, Ethan: knight, Zoey: knight"
    assert knk.answer_key(other_order) == knk.answer_key(GOLD_4) and knk.same_answer(other_order, GOLD_4)
    assert knk.is_equiv(other_order, GOLD_4) and not knk.is_equiv(flip_one(GOLD_4, 2), GOLD_4)
    assert not knk.is_equiv(None, GOLD_4)
    label = weighted_vote([GOLD_4, other_order, flip_one(GOLD_4)], [0, 0, 0], omega=1.0,
                          key=knk.answer_key, same=knk.same_answer).label
    assert knk.same_answer(label, GOLD_4)


@pytest.fixture(scope="module")
def knk_pool():
    with SandboxPool(timeout=5.0) as p:
        yield p


def smt_block(script):
    return f"Encoding each statement:\n```smt2\n{script}\n```"


def reference_smt(record, drop=None):
    """The puzzle's encoding; drop=i leaves out the i-th statement (then the solution is not unique)."""
    lines = knk.smt_script(record["names"], record["statements"]).splitlines()
    dropped = None if drop is None else f"(assert (= {record['names'][drop]} "
    return "\n".join(line for line in lines if dropped is None or not line.startswith(dropped))


def asserted_smt(answer):
    world = knk.parse_assignment(answer)
    declared = "".join(f"(declare-const {n} Bool)\n" for n in world)
    return declared + "(assert (and " + " ".join(n if v else f"(not {n})" for n, v in world.items()) + "))\n(check-sat)"


def verify_knk(completions, answers, pool, record=KNK_4):
    scripted = ScriptedVerifier(*completions)
    results = verify_batch([record["problem"]] * len(answers), ["\\boxed{...}"] * len(answers), answers, scripted,
                           sandbox=pool, domain="knk")
    assert all(p.system == verifier.KNK_SYSTEM and record["problem"] in p for p in scripted.batches[0])
    return results


def test_knk_tool_verifies_a_right_script_and_mismatches_a_wrong_assignment(knk_pool):
    right, wrong = KNK_4["answer"], flip_one(KNK_4["answer"], 1)
    results = verify_knk([smt_block(reference_smt(KNK_4))] * 2, [right, wrong], knk_pool)
    assert [(r.v, r.status) for r in results] == [(1, "verified"), (0, "mismatch")], [r.output for r in results]
    assert knk.same_answer(results[1].result, right)  # the solver found the right one, not the rollout's


def test_knk_script_asserting_the_candidate_is_caught(knk_pool):
    answer = KNK_4["answer"]
    cheat = asserted_smt(answer)
    also_statements = reference_smt(KNK_4) + "\n(assert (not Michael))"  # one fact on top of the encoding
    results = verify_knk([smt_block(cheat), smt_block(also_statements)], [answer, answer], knk_pool)
    assert [(r.v, r.status) for r in results] == [(0, "hardcoded"), (0, "hardcoded")]
    assert results[1].result == "asserts Michael"


def test_knk_closing_parentheses_that_close_nothing_are_dropped_before_the_solver(knk_pool):
    """A small verifier's typical slip, `(assert (= Zoey (not Oliver))))`, made z3 refuse the whole script;
    the closers at depth 0 go (a comment's parentheses stay), and the encoding is solved as written."""
    right, wrong = KNK_4["answer"], flip_one(KNK_4["answer"], 1)
    sloppy = "; who says what (each line closes once too often)\n" + reference_smt(KNK_4).replace(")))\n", "))))\n")
    assert sloppy.count(")") > reference_smt(KNK_4).count(")") + 1
    results = verify_knk([smt_block(sloppy)] * 2, [right, wrong], knk_pool)
    assert [(r.v, r.status) for r in results] == [(1, "verified"), (0, "mismatch")], [r.output for r in results]
    assert verifier.extract_smt(smt_block(sloppy)).startswith("; who says what (each line closes once too often)")


def test_knk_non_unique_unsat_and_broken_scripts_do_not_verify(knk_pool):
    answer = KNK_4["answer"]
    broken = reference_smt(KNK_4).replace("(assert", "(assert (", 1)
    unsat = reference_smt(KNK_4) + "\n(assert (= Zoey (not Zoey)))"
    completions = [smt_block(reference_smt(KNK_4, drop=0)), smt_block(unsat), smt_block(broken), "no script here"]
    results = verify_knk(completions, [answer] * 4, knk_pool)
    assert [r.status for r in results] == ["mismatch", "mismatch", "exec_error", "no_code"]
    assert [r.result for r in results[:2]] == ["not unique", "unsat"] and sum(r.v for r in results) == 0


def test_knk_reference_encodings_of_the_set_verify_in_one_sandbox_batch(knk_pool):
    records = [r for size in range(2, 9) for r in [r for r in KNK if r["level"] == size][:3]]
    runs = verifier.smt_tool([reference_smt(r) for r in records], knk_pool)
    assert all(run.status == "ok" and verifier.smt_agrees(run.result, r["answer"]) for run, r in zip(runs, records))


def test_knk_verifier_chat_gets_the_knk_system_prompt(tiny_model, tokenizer, monkeypatch):
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, **kw))
    prompt = verifier_prompt(KNK_4["problem"], "\\boxed{Zoey: knight}", "knk")
    model_verifier(tiny_model, tokenizer, max_new_tokens=1, seed=0)([prompt])
    assert verifier.KNK_SYSTEM in seen[0] and VERIFIER_SYSTEM not in seen[0] and KNK_4["problem"] in seen[0]


def test_knk_training_step_votes_with_solver_verified_rollouts(tiny_dir, tmp_path, monkeypatch):
    """--bench knk end to end on the tiny model: the rollouts' answers are scripted (the tiny model writes none),
    the verifier writes each puzzle's encoding; z3 verifies exactly the rollouts that give the gold assignment."""
    by_problem = {r["problem"]: r for r in KNK}

    def scripted_answer(text, problem):
        gold = by_problem[problem]["answer"]
        return gold if len(text) % 2 else flip_one(gold)

    def encoding_verifier(prompts):
        return [smt_block(reference_smt(next(r for p, r in by_problem.items() if p in prompt))) for prompt in prompts]

    policy_prompts, real_generate = [], t3rl.generate
    monkeypatch.setattr(t3rl, "generate", lambda model, tok, prompts, **kw: policy_prompts.extend(prompts) or
                        real_generate(model, tok, prompts, **kw))
    monkeypatch.setitem(t3rl.DOMAINS, "knk", dataclasses.replace(t3rl.DOMAINS["knk"], extract=scripted_answer))
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device: encoding_verifier)
    monkeypatch.delenv("T3RL_DATA_DIR", raising=False)  # data/knk.jsonl, the committed set
    run = t3rl.train(t3rl.parse_config(tiny_argv(tiny_dir, tmp_path, bench="knk", limit=2, max_steps=1, eval_samples=0)))
    # the policy is asked for the assignment's form (else a small model boxes one word), in training and eval
    assert policy_prompts and all(t3rl.KNK_INSTRUCTION in p and t3rl.MATH_INSTRUCTION not in p for p in policy_prompts)
    rollouts = rows(run, "rollouts.jsonl")
    assert len(rollouts) == 2 * 4 and {r["id"] for r in rollouts} == {"knk-000", "knk-001"}
    golds = {r["id"]: r["answer"] for r in KNK}
    assert all((r["status"] == "verified") == (r["answer"] == golds[r["id"]]) for r in rollouts)
    assert {r["status"] for r in rollouts} == {"verified", "mismatch"}
    # omega 5: a verified gold answer wins the vote even where it is the minority
    assert all(r["label"] == golds[r["id"]] for r in rollouts if any(
        o["status"] == "verified" for o in rollouts if o["id"] == r["id"]))
    metrics = rows(run, "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["eval", "train", "eval"]
    assert set(metrics[0]["by_level"]) == {"2", "3"} and metrics[1]["verifier_precision"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# bad inputs and damaged run folders: one line naming the input and the fix, before any model loads where the
# input allows it, and no run or checkpoint lost

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tokenizer):
    """A finished 4-step tiny run (checkpoints at steps 2 and 4) and the model and benchmark it used."""
    root = tmp_path_factory.mktemp("finished")
    make_tiny_model(len(tokenizer)).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    write_bench(root / "data", QUESTIONS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("T3RL_DATA_DIR", str(root / "data"))
        mp.setattr(t3rl, "extract_answer", fake_answer)
        mp.setattr(t3rl, "build_verifier", lambda cfg, device: scripted_verifier if cfg.verify else None)
        run = t3rl.train(t3rl.parse_config(tiny_argv(root / "tiny", root / "out", max_steps=4, save_every=2)))
    assert torch.load(run / "checkpoint.old" / "state.pt", weights_only=False)["step"] == 2
    return run


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_run(run: Path, dest: Path, final=True, upto=None) -> Path:
    """A copy of the finished run; without its final evaluation, or cut back to its step-`upto` checkpoint
    (what a kill leaves behind)."""
    shutil.copytree(run, dest)
    if upto is not None:
        shutil.rmtree(dest / "checkpoint")
        os.replace(dest / "checkpoint.old", dest / "checkpoint")
    keep = lambda r: (final or not r.get("final")) and (upto is None or r["step"] < upto or r.get("kind") == "eval" and r["step"] == 0)  # noqa: E731,E501
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (dest / name).write_text("".join(json.dumps(r) + "\n" for r in rows(dest, name) if keep(r)))
    return dest


def argv_for(ctx, *args, out_dir=None, **extra):
    return tiny_argv(ctx["tiny"], out_dir or ctx["tmp"] / "out", **extra) + list(args)


def bench_file(ctx, text: bytes):
    (ctx["tmp"] / "data").mkdir()
    (ctx["tmp"] / "data" / "demo.jsonl").write_bytes(text)
    ctx["env"]["T3RL_DATA_DIR"] = str(ctx["tmp"] / "data")
    return argv_for(ctx)


def run_copy(ctx, **kwargs) -> Path:
    ctx["run"] = copy_run(ctx["finished"], ctx["tmp"] / "run", **kwargs)
    return ctx["run"]


def edit_config(run: Path, **changes) -> Path:
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, **changes}))
    return run


Q = lambda i, problem="What is 1 + 1?", **extra: json.dumps({"id": f"q{i}", "problem": problem, "answer": "2", **extra})  # noqa: E731,E501
# (name, the bad input: ctx -> argv, the line it must get)
BAD_INPUTS = [
    ("limit", lambda c: argv_for(c, limit=-5), r"--limit -5: must be in \[0, inf\)"),
    ("max-steps", lambda c: argv_for(c, max_steps=-1), r"--max-steps -1: must be in \[0, inf\)"),
    ("omega nan", lambda c: argv_for(c, omega="nan"), r"--omega nan: must be in \[1, inf\]"),
    ("omega below 1", lambda c: argv_for(c, omega=0.5), r"--omega 0.5: must be in \[1, inf\]"),
    ("omega list", lambda c: argv_for(c, "--omega", "1", "5"), r"--omega 1 5: one value for a run \(several only with --replay"),
    ("max-new-tokens", lambda c: argv_for(c, max_new_tokens=0), r"--max-new-tokens 0: must be in \[1, inf\)"),
    ("lr negative", lambda c: argv_for(c, lr=-1), r"--lr -1.0: must be in \[0, inf\)"),
    ("lr inf", lambda c: argv_for(c, lr="inf"), r"--lr inf: must be in \[0, inf\)"),
    ("questions-per-step", lambda c: argv_for(c, questions_per_step=0), r"--questions-per-step 0: must be in \[1, inf\)"),
    ("top-p", lambda c: argv_for(c, top_p=2), r"--top-p 2.0: must be in \(0, 1\]"),
    ("temperature", lambda c: argv_for(c, temperature=-1), r"--temperature -1.0: must be in \[0, inf\)"),
    ("verify-budget", lambda c: argv_for(c, verify_budget=-1), r"--verify-budget -1: must be in \[0, inf\)"),
    ("eval-samples", lambda c: argv_for(c, eval_samples=-1), r"--eval-samples -1: must be in \[0, inf\)"),
    ("episodes", lambda c: argv_for(c, episodes=0), r"--episodes 0: must be in \[1, inf\)"),
    ("save-every", lambda c: argv_for(c, save_every=0), r"--save-every 0: must be in \[1, inf\)"),
    ("n-votes", lambda c: argv_for(c, n_votes=0), r"--n-votes 0: must be in \[1, inf\)"),
    ("n-train one", lambda c: argv_for(c, n_train=1), r"--n-train 1: must be in \[2, inf\)"),
    ("n-train above n-votes", lambda c: argv_for(c, n_train=5), r"--n-train 5: must be at most --n-votes \(4\)"),
    ("warmup-ratio", lambda c: argv_for(c, warmup_ratio=1.5), r"--warmup-ratio 1.5: must be in \[0, 1\]"),
    ("sandbox-timeout", lambda c: argv_for(c, sandbox_timeout=0), r"--sandbox-timeout 0.0: must be in \(0, inf\)"),
    ("seed", lambda c: argv_for(c, seed=-1), r"--seed -1: must be in \[0, 4294967295\]"),
    ("bench", lambda c: argv_for(c, bench="gsm8k"), r"--bench gsm8k: choose one of math500, aime2024, amc, demo, knk"),
    ("backend", lambda c: argv_for(c, backend="tpu"), r"--backend tpu: choose one of kv, hf"),
    ("verifier-model", lambda c: argv_for(c, verifier_model="nonexistent"), r"--verifier-model nonexistent: not a folder"),
    ("model folder", lambda c: argv_for(c, model="./no/such/folder"), r"--model ./no/such/folder: not a folder"),
    ("model not gguf", lambda c: (c["tmp"] / "m.gguf").write_bytes(b"PK\x03\x04") and argv_for(c, model=c["tmp"] / "m.gguf"),
     r"--model .*m.gguf: not a GGUF file \(bad magic\)"),
    ("out-dir is a file", lambda c: (c["tmp"] / "f").write_text("x") and argv_for(c, out_dir=c["tmp"] / "f"),
     r"--out-dir .*/f: cannot write the run folder .*; pass a writable --out-dir"),
    ("out-dir under /proc", lambda c: argv_for(c, out_dir="/proc/t3rl-runs"), r"--out-dir /proc/t3rl-runs: cannot write"),
    ("reused run name", lambda c: argv_for(c, out_dir=run_copy(c).parent),
     r"run folder .*/run already holds a run; continue it with --resume .*/run, or pick another --run-name"),
    ("resume a finished run", lambda c: ["--resume", str(run_copy(c))], r"the run is finished .*read it with --replay"),
    ("resume with other options", lambda c: ["--resume", str(run_copy(c, final=False)), "--lr", "0.5", "--n-votes=8"],
     r"--lr 0.5 \(the run has 0.001\); --n-votes 8 \(the run has 4\); a resumed run keeps its config.json"),
    ("resume without config.json", lambda c: (run_copy(c, final=False) / "config.json").unlink() or ["--resume", str(c["run"])],
     r"--resume .*/run: no config.json in it; pass a run folder written by t3rl.py"),
    ("resume a damaged config.json", lambda c: (run_copy(c, final=False) / "config.json").write_text('{"lr": ') and
     ["--resume", str(c["run"])], r"run/config.json: damaged .*restore it"),
    ("resume a config.json edited wrong", lambda c: ["--resume", str(edit_config(run_copy(c, final=False), lr=-1))],
     r"run/config.json: --lr -1: must be in \[0, inf\)"),
    ("resume no folder", lambda c: ["--resume", str(c["tmp"] / "nothing")], r"--resume .*/nothing: no such folder"),
    ("replay with training options", lambda c: ["--replay", str(run_copy(c)), "--lr", "1"], r"--replay takes only --omega; drop --lr"),
    ("replay an empty folder", lambda c: ["--replay=" + str(c["tmp"])], r"--replay .*: no config.json there"),
    ("replay bad omega", lambda c: ["--replay", str(run_copy(c)), "--omega", "5", "0"], r"--omega 0.0: must be in \[1, inf\]"),
    ("replay damaged rollouts", lambda c: (run_copy(c) / "rollouts.jsonl").write_text('{"step": 0}\n{"ste\n{"step": 1}\n') and
     ["--replay", str(c["run"])], r"rollouts.jsonl:2: invalid JSON .*fix or delete that line"),
    ("bench not UTF-8", lambda c: bench_file(c, (Q(0) + '\n{"id": "q1", "problem": "caf\xe9", "answer": "2"}\n').encode("latin-1")),
     r"demo.jsonl:2: not UTF-8 \(byte 0xe9 at column 29\); save the file as UTF-8"),
    ("bench problem not a string", lambda c: bench_file(c, (Q(0, [1, 2]) + "\n").encode()),
     r"demo.jsonl:1: 'problem' is a list, not a string"),
    ("bench duplicate ids", lambda c: bench_file(c, (Q(0) + "\n" + Q(1) + "\n" + Q(0, "What is 2 + 2?") + "\n").encode()),
     r"demo.jsonl:3: id 'q0' is already used on line 1; give every question its own id"),
    ("bench invalid JSON", lambda c: bench_file(c, (Q(0) + '\n{"problem": \n' + Q(2) + "\n").encode()), r"demo.jsonl:2: invalid JSON"),
    ("bench without answers", lambda c: bench_file(c, b'{"problem": "1 + 1"}\n'), r"demo.jsonl:1: record has no 'answer'"),
    ("bench empty", lambda c: bench_file(c, b"\n"), r"demo.jsonl: no records; the file is empty"),
]
# inputs that can only be judged with the model at hand (they still fail before any sampling)
NEEDS_A_MODEL = [
    ("GGUF with a garbage body", lambda c: (c["tmp"] / "g.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
     and argv_for(c, model=c["tmp"] / "g.gguf"), r"g.gguf: GGUF header but unreadable contents .*re-download"),
    ("prompt longer than the context", lambda c: bench_file(c, (Q(0) + "\n" + Q(1, "What is 1 + 1? " * 400) + "\n").encode()),
     r"question q1 of --bench demo: its prompt \(\d+ tokens\) \+ --max-new-tokens 12 exceeds the policy's context of "
     r"2048 tokens; the run stops here: remove that question"),
]


@pytest.mark.parametrize("name,make_argv,line", BAD_INPUTS + NEEDS_A_MODEL, ids=[c[0] for c in BAD_INPUTS + NEEDS_A_MODEL])
def test_bad_input_is_answered_in_one_line_naming_it(name, make_argv, line, finished_run, tmp_path, monkeypatch):
    ctx = {"tiny": finished_run.parent.parent / "tiny", "finished": finished_run, "tmp": tmp_path, "env": {}, "run": None}
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    argv = [str(a) for a in make_argv(ctx)]
    for key, value in ctx["env"].items():
        monkeypatch.setenv(key, value)
    loaded = []
    if name not in {n for n, *_ in NEEDS_A_MODEL}:
        monkeypatch.setattr(t3rl, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("a model was loaded"))
    monkeypatch.setattr(t3rl, "build_verifier", lambda *a: pytest.fail("the verifier was loaded"))
    before = snapshot(ctx["run"]) if ctx["run"] else None
    with pytest.raises(SystemExit) as stop:
        t3rl.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert re.search(line, message), message
    assert not loaded
    if before is not None:
        assert snapshot(ctx["run"]) == before  # nothing of the run was touched


def test_the_table_covers_thirty_bad_inputs_and_every_option_has_a_range():
    assert len(BAD_INPUTS + NEEDS_A_MODEL) >= 30
    for f in t3rl.fields(t3rl.Config):
        # free text, checked elsewhere: model names by check_spec, tracker names by check_config
        free_text = f.name in ("model", "verifier_model", "out_dir", "run_name", "resume", "report_to")
        assert f.type in (bool, "bool") or free_text or f.metadata["allowed"] is not None, f"--{f.name} has no range"


def resume(run: Path, finished_run: Path, monkeypatch) -> Path:
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    return t3rl.train(t3rl.parse_config(["--resume", str(run)]))


def assert_same_run(run: Path, reference: Path):
    assert without_timing(rows(run, "metrics.jsonl")) == without_timing(rows(reference, "metrics.jsonl"))
    assert rows(run, "rollouts.jsonl") == rows(reference, "rollouts.jsonl")
    a, b = final_weights(run), final_weights(reference)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_checkpoint_falls_back_to_the_previous_one(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", final=False)
    state = (run / "checkpoint" / "state.pt").read_bytes()
    (run / "checkpoint" / "state.pt").write_bytes(state[:len(state) // 2])  # a disk that filled up
    resume(run, finished_run, monkeypatch)
    err = capsys.readouterr().err
    assert "checkpoint/state.pt is damaged" in err and "moved it to checkpoint.damaged/" in err
    assert "resuming after step 2" in err
    assert_same_run(run, finished_run)  # steps 3 and 4 computed again, to the same numbers and weights
    assert (run / "checkpoint.damaged" / "model").is_dir()
    assert torch.load(run / "checkpoint.old" / "state.pt", weights_only=False)["step"] == 2


def test_truncated_weights_are_a_damaged_checkpoint(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    assert t3rl.checkpoint_damage(run / "checkpoint") is None
    weights = run / "checkpoint" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    assert t3rl.checkpoint_damage(run / "checkpoint") == "checkpoint/model/model.safetensors is truncated"


def test_resume_drops_torn_last_lines_and_a_stale_checkpoint_old(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", upto=2)
    for name, torn in (("metrics.jsonl", '{"kind": "train", "st'), ("rollouts.jsonl", '{"step": 2, "id": "q')):
        with open(run / name, "a") as fh:
            fh.write(torn)  # a kill in the middle of an append
    for leftover in ("checkpoint.old", "checkpoint.tmp"):
        (run / leftover / "model").mkdir(parents=True)
        (run / leftover / "model" / "junk.bin").write_bytes(b"0" * 100)
    resume(run, finished_run, monkeypatch)
    err = capsys.readouterr().err
    assert "metrics.jsonl:" in err and "rollouts.jsonl:" in err and err.count("dropped a half-written last line") == 2
    assert_same_run(run, finished_run)
    assert not (run / "checkpoint.tmp").exists()
    assert torch.load(run / "checkpoint.old" / "state.pt", weights_only=False)["step"] == 2


def test_deleted_metrics_do_not_make_the_final_eval_the_before(finished_run, tmp_path, monkeypatch, patched, capsys):
    run = copy_run(finished_run, tmp_path / "out" / "run", final=False)
    (run / "metrics.jsonl").unlink()
    resume(run, finished_run, monkeypatch)
    table = capsys.readouterr().out
    assert "no step-0 evaluation" in table and "'before' is unknown" in table
    pass_at_1 = [line.split() for line in table.splitlines() if line.startswith("pass@1")]
    assert pass_at_1 and pass_at_1[0][1] == "-"
    assert [r.get("final") for r in rows(run, "metrics.jsonl")] == [True]


def test_resume_lists_the_bookkeeping_options_it_may_change(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run", final=False)
    cfg = t3rl.parse_config(["--resume", str(run), "--save-every", "1", "--lr", "0.001"])  # lr as saved: no change
    assert (cfg.save_every, cfg.lr, cfg.n_votes) == (1, 1e-3, 4)
    assert "[t3rl] --resume: --save-every 2 -> 1" in capsys.readouterr().err


# ==========================================================================================================


# =================================================================================================================
# study.py: the evidence study (verified vote vs majority on the same samples)
# =================================================================================================================

MATH = t3rl.DOMAINS["math"]


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


def test_study_questions_are_level_stratified_and_seeded():
    records = [{"id": str(i), "level": 1 + i % 5 if i < 80 else 5} for i in range(100)]
    picked = study.stratified(records, 25, seed=0)
    assert [sum(r["level"] == lv for r in picked) for lv in range(1, 6)] == [5] * 5
    assert picked == study.stratified(records, 25, seed=0) != study.stratified(records, 25, seed=1)
    assert study.stratified([{"id": "a"}, {"id": "b"}], 1, seed=0) == [{"id": "a"}]


def study_argv(tiny_dir, out_dir, **extra):
    return tiny_argv(tiny_dir, out_dir, **{"study": True, "n_votes": 8, "max_new_tokens": 6, **extra})


def test_a_study_on_the_cpu_preset_verifies_every_rollout(tmp_path):
    """The cpu preset verifies one rollout per answer class, and only the classes that can change the vote, to
    save training time; `python t3rl.py --study` on it must still verify all (it refused to start), and an
    explicit --verify-budget is still refused."""
    cpu = t3rl.parse_config(["--preset", "cpu", "--out-dir", str(tmp_path)])
    assert (cpu.verify_budget, cpu.lazy_verify) == (1, True)
    cfg = t3rl.parse_config(["--preset", "cpu", "--study", "--out-dir", str(tmp_path)])
    assert cfg.study and (cfg.verify_budget, cfg.lazy_verify) == (0, False)
    explicit = t3rl.parse_config(["--preset", "cpu", "--study", "--verify-budget", "1", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--verify-budget"):
        t3rl.study(explicit)


def test_a_study_samples_fewer_votes_than_training_keeps(tmp_path):
    """A study never trains: `--study --n-votes 3` must start although the preset keeps 4 rollouts for training,
    while a training run with 3 votes and 4 kept is still refused, and so is an explicit --n-train above them."""
    cfg = t3rl.parse_config(["--study", "--n-votes", "3", "--out-dir", str(tmp_path)])
    assert cfg.study and cfg.n_votes == 3 and cfg.n_train <= 3
    with pytest.raises(t3rl.OptionError, match="--n-train 4: must be at most --n-votes"):
        t3rl.parse_config(["--n-votes", "3", "--out-dir", str(tmp_path)])
    with pytest.raises(t3rl.OptionError, match="--n-train 5"):
        t3rl.parse_config(["--study", "--n-votes", "3", "--n-train", "5", "--out-dir", str(tmp_path)])


def test_study_replay_reproduces_the_table_without_a_model(tiny_dir, tmp_path, monkeypatch, patched, capsys):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.study(t3rl.parse_config(study_argv(tiny_dir, tmp_path / "out")))
    printed = capsys.readouterr().out
    lines = rows(run, "study.jsonl")
    assert [r["id"] for r in lines] == ["q0", "q1", "q2", "q3"] and all(len(r["answers"]) == 8 for r in lines)
    assert {s for r in lines for s in r["status"]} == {"verified", "mismatch"}  # the scripted verifier ran
    assert "4 TTRL" in printed and "8 w=inf" in printed and (run / "study.png").stat().st_size > 1000
    table = (run / "table.txt").read_text()
    (run / "study.png").unlink()

    def no_model(*args, **kwargs):
        raise AssertionError("replay loaded a model")
    monkeypatch.setattr(t3rl, "load_model", no_model)
    monkeypatch.setattr(model_lib, "load_model", no_model)
    t3rl.main(["--replay", str(run)])
    assert capsys.readouterr().out == printed == table
    assert (run / "study.png").stat().st_size > 1000


def test_killed_study_resumes_at_the_next_unfinished_question(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    straight = t3rl.study(t3rl.parse_config(study_argv(tiny_dir, tmp_path / "a")))

    real_verify, sampled = t3rl.verify_groups, []

    def killed_in_batch_two(records, *args):
        sampled.extend(r["id"] for r in records)
        if len(sampled) > 2:
            raise KeyboardInterrupt
        return real_verify(records, *args)
    monkeypatch.setattr(t3rl, "verify_groups", killed_in_batch_two)
    with pytest.raises(KeyboardInterrupt):
        t3rl.study(t3rl.parse_config(study_argv(tiny_dir, tmp_path / "b")))
    run = tmp_path / "b" / "run"
    assert [r["id"] for r in rows(run, "study.jsonl")] == ["q0", "q1"]
    with open(run / "study.jsonl", "a") as fh:
        fh.write('{"id": "q2", "gold": "6", "answ')  # a line cut short by the kill
    sampled.clear()
    with pytest.raises(SystemExit, match="other n_votes"):
        t3rl.study(t3rl.parse_config(study_argv(tiny_dir, tmp_path / "b", n_votes=4)))
    resumed = t3rl.study(t3rl.parse_config(["--resume", str(run)]))
    assert sampled == ["q2", "q3"]
    assert rows(resumed, "study.jsonl") == rows(straight, "study.jsonl")


def finished_study(tiny_dir, tmp_path, monkeypatch, **options):
    """A study of the four QUESTIONS run to its end: its folder and its study.jsonl rows."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    run = t3rl.study(t3rl.parse_config(study_argv(tiny_dir, tmp_path, **options)))
    return run, rows(run, "study.jsonl")


def test_a_study_grows_to_more_votes_keeping_its_first_rollouts(tiny_dir, tmp_path, monkeypatch, patched):
    run, before = finished_study(tiny_dir, tmp_path, monkeypatch, n_votes=4)
    with pytest.raises(t3rl.OptionError, match="--n-votes 2 .the run has 4"):
        t3rl.parse_config(["--resume", str(run), "--n-votes", "2"])  # a study may grow, never shrink
    real_verify, verified = t3rl.verify_groups, []

    def counting(records, groups, *args):
        verified.append([len(group) for group in groups])
        return real_verify(records, groups, *args)
    monkeypatch.setattr(t3rl, "verify_groups", counting)
    t3rl.study(t3rl.parse_config(["--resume", str(run), "--n-votes", "8"]))
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
    with pytest.raises(t3rl.OptionError, match="--limit 1 .the run has 2"):
        t3rl.parse_config(["--resume", str(run), "--limit", "1"])
    t3rl.study(t3rl.parse_config(["--resume", str(run), "--limit", "0"]))  # 0: every question
    after = rows(run, "study.jsonl")
    assert [r["id"] for r in after] == ["q0", "q1", "q2", "q3"] and after[:2] == before
