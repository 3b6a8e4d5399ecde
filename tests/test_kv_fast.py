"""extensions/kv_fast.py: the KV-cache sampler's fast path (waves, shared prefixes, packed weights) samples
what the plain sampler samples."""
import pytest
import torch

from extensions import kv_fast
from extensions.kv_fast import prefix_plan
from helpers import SMALL_PROMPTS, make_tiny_model, sample, small_vocab_model, token_rows

PROMPTS = [[9707, 11, 1879, 0, 358, 1079, 264, 1614, 13], [785, 4226],
           [10061, 594, 1744, 3019, 553, 3019, 13]]


def one_row_budget(model, longest, steps, dtype):
    """The smallest wave budget that holds one row: kv_fast.waves refuses one byte less."""
    low, high = 1, 1 << 40
    while low < high:
        middle = (low + high) // 2
        kv_fast.SETTINGS.memory_budget = middle
        try:
            kv_fast.waves(model, 1, longest, steps, dtype)
            high = middle
        except ValueError:
            low = middle + 1
        finally:
            kv_fast.SETTINGS.memory_budget = None
    return low


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fast_path_samples_the_plain_samplers_tokens(tokenizer, dtype):
    """Seeded sampling at T 0.6 / top-p 0.95: kv-fast gives the plain kv loop's tokens and log-probs."""
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    options = dict(n=3, max_new_tokens=12, seed=[4, 5, 6], dtype=dtype, ignore_eos=True)
    fast = sample(model, None, PROMPTS, backend="kv-fast", **options)
    plain = sample(model, None, PROMPTS, backend="kv", **options)
    assert token_rows(fast) == token_rows(plain)
    assert [c.logprob for g in fast for c in g] == pytest.approx([c.logprob for g in plain for c in g], abs=1e-4)


def test_samples_do_not_depend_on_waves_or_on_finished_rows_leaving_the_batch():
    model = small_vocab_model()
    # frequent tokens: rows finish at different steps
    model.generation_config.eos_token_id = [14, 23]
    options = dict(n=4, max_new_tokens=10, seed=[3, 1, 2], dtype=torch.bfloat16, backend="kv-fast")
    whole = sample(model, None, SMALL_PROMPTS, **options)
    one_row = one_row_budget(model, max(map(len, SMALL_PROMPTS)), 10, torch.bfloat16)
    waves = sample(model, None, SMALL_PROMPTS, memory_budget=one_row, **options)
    assert token_rows(waves) == token_rows(whole)
    lengths = [c.num_tokens for g in whole for c in g]
    assert min(lengths) < max(lengths) == 10, ("no row left the batch early: the test would not "
                                               "cover compaction")


# Shared-prefix prefill runs a prompt's tokens after the start it shares with another prompt, in one
# forward with the other prompts of its level: greedy tokens must be those of the prompt prefilled
# alone, in its own call.
SYSTEM = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198, 151644, 872,
          198]  # a chat system turn


def greedy_alone_and_together(model, prompts, dtype):
    options = dict(n=2, max_new_tokens=12, temperature=0, ignore_eos=True, dtype=dtype, backend="kv-fast")
    alone = [token_rows(sample(model, None, [prompt], **options))[0] for prompt in prompts]
    return alone, token_rows(sample(model, None, prompts, **options))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_sharing_nothing_prefilled_together_decode_as_alone(tokenizer, dtype):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    # one forward for all three
    assert [(step.shared, step.level) for step in prefix_plan(PROMPTS)] == [(0, 0)] * 3
    alone, together = greedy_alone_and_together(model, PROMPTS, dtype)
    assert together == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompts_sharing_a_prefix_decode_as_alone(tokenizer, dtype):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    prompts = [SYSTEM + p for p in PROMPTS] + [SYSTEM + PROMPTS[0][:5] + [40, 2]]
    plan = prefix_plan(prompts)
    # the system turn is prefilled once; the last prompt also shares the first's next 5 tokens (a
    # second level)
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


def test_waves_split_by_memory_budget_give_the_same_tokens(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    whole = sample(model, tokenizer, PROMPTS, n=3, max_new_tokens=10, temperature=0, backend="kv-fast")
    budget = one_row_budget(model, max(map(len, PROMPTS)), 10, torch.float32)
    assert len(kv_fast.waves(model, 9, max(map(len, PROMPTS)), 10, torch.float32)) == 1
    waves = sample(model, tokenizer, PROMPTS, n=3, max_new_tokens=10, temperature=0, backend="kv-fast",
                   memory_budget=budget)
    assert token_rows(waves) == token_rows(whole)


def test_too_small_memory_budget_names_the_option(tokenizer):
    model = make_tiny_model(len(tokenizer))
    with pytest.raises(ValueError, match="memory budget 1000 bytes holds no row"):
        sample(model, tokenizer, PROMPTS, n=2, max_new_tokens=10, memory_budget=1000, backend="kv-fast")


@pytest.mark.skipif(not kv_fast.packing_available(torch.bfloat16, torch.device("cpu")),
                    reason="this CPU has neither AVX-512 (BW, VL, DQ) nor AVX-NE-CONVERT: oneDNN's "
                           "bfloat16 packing does not run on it")
def test_packed_cpu_weights_sample_what_plain_products_sample(monkeypatch):
    """bfloat16 on a CPU: the weights are packed for oneDNN once per call; the tokens and their
    log-probs are those of F.linear on the plain weights."""
    model = small_vocab_model().to(torch.bfloat16)
    w = kv_fast.sampling_weights(model, torch.bfloat16)
    layer = w.layers[0]
    assert all(isinstance(lin, kv_fast.PackedLinear)
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down, w.head))
    options = dict(n=3, max_new_tokens=12, seed=0, ignore_eos=True, backend="kv-fast")
    packed = sample(model, None, SMALL_PROMPTS, **options)
    monkeypatch.setattr(kv_fast, "packing_available", lambda dtype, device: False)
    assert isinstance(kv_fast.sampling_weights(model, torch.bfloat16).head, kv_fast.Linear)
    plain = sample(model, None, SMALL_PROMPTS, **options)
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
    draw = lambda: [c.token_ids for c in sample(  # noqa: E731
        model, None, [[1, 2, 3, 4]], 2, 8, temperature=0.6, top_p=1.0, seed=[3], backend="kv-fast",
        dtype=torch.bfloat16)[0]]
    tokens = draw()
    assert kv_fast.sampling_only(model, tmp_path) and not kv_fast.sampling_only(model, tmp_path / "none")
    assert sum(p.numel() for p in model.parameters()) == 0
    made, real = [], kv_fast.model_weights
    monkeypatch.setattr(kv_fast, "model_weights", lambda *a, **k: made.append(1) or real(*a, **k))
    assert draw() == tokens and draw() == tokens and len(made) == 1
    kv_fast.sleep()
    assert draw() == tokens and len(made) == 2
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_benchmarks_matmul_floor_runs_every_product_of_a_decode_step(tiny_model, dtype,
                                                                         monkeypatch):
    """bench.sampler's `matmuls ms` column: each of a step's products (qkv, o, gate_up, down per
    layer, then the head) runs on `rows` inputs of its own width, whichever Linear the sampler
    builds for this dtype."""
    import bench.sampler
    steps = []
    monkeypatch.setattr(bench.sampler, "_rate",
                        lambda step, device, seconds: steps.append(step()) or 1.0)
    assert bench.sampler.matmul_seconds(tiny_model, 3, dtype, torch.device("cpu")) == 1.0
    c = tiny_model.config
    head = c.hidden_size // c.num_attention_heads
    layer = [(c.num_attention_heads + 2 * c.num_key_value_heads) * head, c.hidden_size,
             2 * c.intermediate_size, c.hidden_size]
    assert [tuple(out.shape) for out in steps[0]] == [
        (3, width) for width in layer * c.num_hidden_layers + [c.vocab_size]]
