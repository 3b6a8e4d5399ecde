"""Shared pytest fixtures: the real tokenizer, a tiny random Qwen2 built on it, and the embedded 0.5B model.

Most tests need *some* transformer, not a good one: the tiny model (2 layers, hidden 64) keeps them fast
while exercising the same code paths (real 152k vocabulary, grouped-query attention, rotary embeddings).
"""
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("T3RL_DATA_DIR", str(Path(__file__).resolve().parent.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def embedded_model():
    from model import load_model
    return load_model("embedded")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer
    from model import offline_model_dir
    return AutoTokenizer.from_pretrained(offline_model_dir("coder-0.5b"))


def make_tiny_model(vocab_size: int, seed: int = 0, tie_word_embeddings: bool = True):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=tie_word_embeddings, bos_token_id=151643, eos_token_id=151645,
                         pad_token_id=151643)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    return model


@pytest.fixture()
def tiny_model(tokenizer):
    """A fresh randomly initialised tiny Qwen2 (seed 0, float32, eval mode) per test, so tests can train it."""
    return make_tiny_model(len(tokenizer))
