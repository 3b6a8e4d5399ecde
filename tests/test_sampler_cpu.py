"""sampler_cpu.py: oneDNN-packed weights and the kept weights of a frozen model."""
import pytest
import torch

from helpers import SMALL_PROMPTS, make_tiny_model, small_vocab_model, token_rows
from machinery import kv_fast
from machinery.sampler_cpu import PackedLinear
from sampler import generate


def test_a_frozen_model_is_packed_once_and_again_after_a_parameter_changes(monkeypatch):
    model = small_vocab_model().to(torch.bfloat16)
    made = []
    real = kv_fast.model_weights
    monkeypatch.setattr(kv_fast, "model_weights",
                        lambda *args, **kw: made.append(1) or real(*args, **kw))
    options = dict(n=2, max_new_tokens=8, seed=0, ignore_eos=True, dtype=torch.bfloat16)
    first, again = (generate(model, None, SMALL_PROMPTS, frozen=True, **options) for _ in range(2))
    assert len(made) == 1 and token_rows(first) == token_rows(again)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1)  # in place, as an optimizer step writes
    changed = generate(model, None, SMALL_PROMPTS, frozen=True, **options)
    assert len(made) == 2
    assert token_rows(changed) == token_rows(generate(model, None, SMALL_PROMPTS, **options))
    assert token_rows(changed) != token_rows(first)


@pytest.mark.skipif(not kv_fast.packing_available(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU has neither AVX-512 (BW, VL, DQ) nor AVX-NE-CONVERT: oneDNN's "
                           "bfloat16 packing does not run on it")
def test_packed_cpu_weights_sample_what_plain_products_sample(monkeypatch):
    """bfloat16 on a CPU: the weights are packed for oneDNN once per call; the tokens and their
    log-probs are those of F.linear on the plain weights."""
    model = small_vocab_model().to(torch.bfloat16)
    w = kv_fast.model_weights(model, torch.bfloat16)
    layer = w.layers[0]
    assert all(isinstance(lin, PackedLinear)
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, w.head))
    options = dict(n=3, max_new_tokens=12, seed=0, ignore_eos=True)
    packed = generate(model, None, SMALL_PROMPTS, **options)
    monkeypatch.setattr(kv_fast, "packing_available", lambda dtype, device: False)
    assert isinstance(kv_fast.model_weights(model, torch.bfloat16).head, kv_fast.Linear)
    plain = generate(model, None, SMALL_PROMPTS, **options)
    assert token_rows(packed) == token_rows(plain)
    assert [[c.logprob for c in g] for g in packed] == [[c.logprob for c in g] for g in plain]


@pytest.mark.parametrize("tied", [True, False])
def test_a_model_only_the_kv_sampler_reads_holds_no_weights_and_samples_the_same(tokenizer, tmp_path, tied,
                                                                                 monkeypatch):
    """kv_fast.sampling_only (the verifier's): the module's parameters are freed, the sampling weights are
    read from its checkpoint's files, kept between calls and dropped by sleep (the update's memory), and
    what it samples does not change."""
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    sample = lambda: [c.token_ids for c in generate(  # noqa: E731
        model, None, [[1, 2, 3, 4]], 2, 8, temperature=0.6, top_p=1.0, seed=[3], backend="kv",
        dtype=torch.bfloat16, frozen=True)[0]]
    tokens = sample()
    assert kv_fast.sampling_only(model, tmp_path) and not kv_fast.sampling_only(model, tmp_path / "none")
    assert sum(p.numel() for p in model.parameters()) == 0
    made, real = [], kv_fast.model_weights
    monkeypatch.setattr(kv_fast, "model_weights", lambda *a, **k: made.append(1) or real(*a, **k))
    assert sample() == tokens and sample() == tokens and len(made) == 1
    kv_fast.sleep()
    assert sample() == tokens and len(made) == 2
