"""Shared pytest fixtures: the real tokenizer, a tiny random Qwen2 built on it, and the embedded 0.5B model.

Most tests need *some* transformer, not a good one: the tiny model (2 layers, hidden 64) keeps them fast
while exercising the same code paths (real 152k vocabulary, grouped-query attention, rotary embeddings).
"""
import dataclasses
import os
from pathlib import Path

import pytest
import torch

import t3rl
import verifier
from config import parse_config
from helpers import QUESTIONS, fake_answer, make_tiny_model, scripted_verifier, tiny_argv, write_bench
from machinery import runs
from sandbox import SandboxPool

os.environ.setdefault("T3RL_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(scope="session")
def embedded_model():
    from machinery.model import load_model
    return load_model("embedded")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from machinery.model import offline_model_dir
    return AutoTokenizer.from_pretrained(offline_model_dir("coder-0.5b"))




@pytest.fixture()
def tiny_model(tokenizer):
    """A fresh randomly initialised tiny Qwen2 (seed 0, float32, eval mode) per test, so tests can train it."""
    return make_tiny_model(len(tokenizer))


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(workers=2, timeout=5.0, memory_bytes=512 << 20) as p:
        yield p


@pytest.fixture(scope="module")
def verify_pool():
    """The verifier tests' pool: the default workers and limits, a 2 s timeout."""
    with SandboxPool(timeout=2.0) as p:
        yield p


@pytest.fixture()
def tiny_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


FAKE_MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: fake_answer(text))


@pytest.fixture()
def patched(monkeypatch):
    """The tiny model's rollouts get fake answers, and the verifier is scripted_verifier."""
    monkeypatch.setattr(verifier, "MATH", FAKE_MATH)
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: scripted_verifier)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tokenizer):
    """A finished 4-step tiny run (checkpoints at steps 2 and 4, the step-2 one kept as checkpoint.old/
    so that tests can cut the run back to it) and the model and benchmark it used."""
    root = tmp_path_factory.mktemp("finished")
    make_tiny_model(len(tokenizer)).save_pretrained(root / "tiny")
    tokenizer.save_pretrained(root / "tiny")
    write_bench(root / "data", QUESTIONS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("T3RL_DATA_DIR", str(root / "data"))
        mp.setattr(verifier, "MATH", FAKE_MATH)
        mp.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: scripted_verifier)
        mp.setattr(runs, "finish_run", lambda run_dir: None)
        run = t3rl.train(parse_config(tiny_argv(root / "tiny", root / "out", max_steps=4, save_every=2)))
    assert torch.load(run / "checkpoint.old" / "state.pt", weights_only=False)["step"] == 2
    return run
