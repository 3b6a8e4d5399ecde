"""sampler.py: the hand-written KV-cache sampler against transformers' generate, seeds, EOS, arguments."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.generation.logits_process import TopPLogitsWarper

from helpers import SMALL_PROMPTS, make_tiny_model, sample, small_vocab_model, token_rows
from machinery.logprobs import set_checkpointing
from sampler import nucleus, sample_next

PROMPTS = [[9707, 11, 1879, 0, 358, 1079, 264, 1614, 13], [785, 4226],
           [10061, 594, 1744, 3019, 553, 3019, 13]]


@pytest.mark.parametrize("tied", [True, False])
def test_kv_matches_hf_greedy_on_tiny_model(tokenizer, tied):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=tied)
    hf = sample(model, tokenizer, PROMPTS, n=2, max_new_tokens=16, temperature=0, backend="hf")
    kv = sample(model, tokenizer, PROMPTS, n=2, max_new_tokens=16, temperature=0, backend="kv")
    assert token_rows(kv) == token_rows(hf)


@pytest.mark.parametrize("bias", [False, True])
def test_kv_matches_hf_greedy_on_a_tiny_llama(bias):
    """Llama: no projection biases (or, with attention_bias, biases on q, k, v and o), unlike
    Qwen2's q, k, v."""
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=bias,
                         bos_token_id=0, eos_token_id=47, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # weights of unit-scale outputs and random biases (zeros at init): tokens that vary
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            elif name.endswith("bias"):
                p.normal_()
    options = dict(n=1, max_new_tokens=12, temperature=0, ignore_eos=True)
    hf = sample(model, None, SMALL_PROMPTS, backend="hf", **options)
    kv = sample(model, None, SMALL_PROMPTS, backend="kv", **options)
    assert token_rows(kv) == token_rows(hf)


@pytest.mark.slow
def test_kv_matches_hf_greedy_on_embedded_model(embedded_model):
    model, tokenizer = embedded_model
    prompts = ["def fibonacci(n):", "What is 12 * 13? Answer:",
               "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"]
    hf = sample(model, tokenizer, prompts, n=1, max_new_tokens=16, temperature=0, backend="hf")
    kv = sample(model, tokenizer, prompts, n=1, max_new_tokens=16, temperature=0, backend="kv")
    assert token_rows(kv) == token_rows(hf)
    assert [[c.finish_reason for c in g] for g in kv] == [[c.finish_reason for c in g] for g in hf]


def chi_square_p_value(counts, expected):
    """p-value of Pearson's chi-square statistic, pooling cells expected below 5 into one."""
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp_min(1e-12)).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         statistic.double() / 2))


def nucleus_distribution(logits, temperature, top_p):
    """Reference: softmax(logits / T), sorted in full, keeping tokens while the mass above them is
    below top_p."""
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
    result = sample(model, None, [prompt], n=draws, max_new_tokens=1, temperature=temperature,
                      top_p=top_p, seed=0)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in result[0]]),
                            minlength=len(logits)).double()
    expected = nucleus_distribution(logits, temperature, top_p)
    assert counts[expected == 0].sum() == 0, "sampled a token outside the top-p nucleus"
    assert chi_square_p_value(counts, draws * expected) > 1e-3
    # the test has power: top-p cuts real mass here, and the same draws reject a temperature 25% off
    cut = 1 - torch.softmax(logits.double() / temperature, dim=-1)[expected > 0].sum()
    assert cut > 0.02 or top_p == 1.0
    off = nucleus_distribution(logits, temperature * 1.25, top_p)
    assert chi_square_p_value(counts, draws * off) < 1e-6


def test_nucleus_keeps_the_same_tokens_as_transformers():
    torch.manual_seed(0)
    vocab = 5000
    logits = torch.cat([torch.randn(4, vocab) * scale for scale in (0.1, 1.0, 4.0, 12.0)])
    for top_p in (0.5, 0.9, 0.95, 0.999):
        top_probs, top_ids = nucleus(torch.softmax(logits, dim=-1), top_p)
        ours = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_ids, top_probs > 0)
        theirs = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
        assert torch.equal(ours, theirs), f"top_p={top_p}"


def test_greedy_sampling_takes_the_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample_next(logits, 0, 0.95, None).tolist() == [1, 0]


def test_a_uniform_of_zero_never_draws_a_token_of_probability_zero():
    """torch.rand draws exactly 0 once in 2^24: the inverse CDF must then take the first token that has
    probability, not token 0 (-inf, or underflowed at a low temperature: a -inf log-prob for GRPO)."""
    logits = torch.tensor([[-float("inf"), 1.0, 2.0], [-200.0, 1.0, 2.0]])
    assert sample_next(logits, 1.0, 1.0, torch.zeros(2), torch.empty_like(logits)).tolist() == [1, 1]
    assert sample_next(logits, 0.01, 1.0, torch.zeros(2), torch.empty_like(logits)).tolist() == [2, 2]


def test_same_seed_repeats_a_call():
    model = small_vocab_model()
    first = sample(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=7)
    again = sample(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=7)
    other = sample(model, None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=8)
    assert token_rows(first) == token_rows(again)
    assert token_rows(first) != token_rows(other)


@pytest.mark.parametrize("seed", [7, [7, 8, 9]])
def test_rows_of_one_prompt_differ(seed):
    result = sample(small_vocab_model(), None, SMALL_PROMPTS, n=4, max_new_tokens=8, seed=seed,
                      ignore_eos=True)
    for group in result:
        assert len({tuple(c.token_ids) for c in group}) == 4


# Per-prompt seeds give a prompt the same tokens in any company only where the forward pass gives
# its rows the same logits in any batch: bfloat16 on CPU does; float32 on MKL does not (see
# docs/sampler.md), hence dtype below.
@pytest.mark.parametrize("backend,options", [("kv", dict(dtype=torch.bfloat16)), ("kv-fast", dict(dtype=torch.bfloat16)),
                                             ("hf", {})])
def test_a_prompts_samples_do_not_depend_on_the_prompts_sharing_its_call(tokenizer, backend,
                                                                         options):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    longer = PROMPTS[2] + PROMPTS[0]  # shifts the first prompt's left padding
    options = dict(n=3, max_new_tokens=12, temperature=0.6, top_p=0.95, backend=backend, **options)
    alone = sample(model, None, [PROMPTS[0]], seed=[11], **options)
    among = sample(model, None, [longer, PROMPTS[1], PROMPTS[0]], seed=[6, 5, 11], **options)
    assert token_rows(among)[2] == token_rows(alone)[0]
    assert len({tuple(c.token_ids) for c in alone[0]}) == 3


def test_eos_ends_a_row_with_the_eos_token_and_others_run_to_length(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    free = sample(model, None, PROMPTS, n=2, max_new_tokens=12, temperature=0, ignore_eos=True)
    # the first prompt's 4th greedy token becomes the end-of-sequence token
    stop_token = free[0][0].token_ids[3]
    assert all(stop_token not in c.token_ids for g in free[1:] for c in g)
    model.generation_config.eos_token_id = stop_token
    for backend in ("kv", "kv-fast", "hf"):
        result = sample(model, None, PROMPTS, n=2, max_new_tokens=12, temperature=0,
                          backend=backend)
        first_stop = free[0][0].token_ids.index(stop_token) + 1
        for c in result[0]:
            assert (c.finish_reason, c.num_tokens) == ("eos", first_stop)
            assert c.token_ids == free[0][0].token_ids[:first_stop]
        # the rows still running after the others left the batch decode as before
        assert token_rows(result)[1:] == token_rows(free)[1:], backend
        assert all(c.finish_reason == "length" and c.num_tokens == 12
                   for g in result[1:] for c in g)


def test_an_eos_drawn_as_the_last_allowed_token_finishes_by_eos(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    free = sample(model, None, PROMPTS[:1], n=1, max_new_tokens=12, temperature=0,
                    ignore_eos=True)
    stop_token = free[0][0].token_ids[3]
    # the budget ends on the end-of-sequence token itself
    last = free[0][0].token_ids.index(stop_token) + 1
    model.generation_config.eos_token_id = stop_token
    for backend in ("kv", "kv-fast", "hf"):
        c = sample(model, None, PROMPTS[:1], n=1, max_new_tokens=last, temperature=0,
                     backend=backend)[0][0]
        assert (c.finish_reason, c.token_ids) == ("eos", free[0][0].token_ids[:last]), backend


def test_string_prompts_are_tokenised_without_special_tokens(tokenizer):
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    prompt = "Solve 2 + 2."
    completion = sample(model, tokenizer, [prompt], n=1, max_new_tokens=6, seed=0)[0][0]
    assert completion.prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.num_tokens == len(completion.token_ids) == 6


def test_generate_leaves_a_training_model_in_train_mode(tokenizer):
    model = make_tiny_model(len(tokenizer))
    set_checkpointing(model, True)
    model.train()
    eos = model.generation_config.eos_token_id
    for backend in ("kv", "kv-fast", "hf"):
        sample(model, tokenizer, PROMPTS, n=2, max_new_tokens=4, backend=backend, ignore_eos=True)
        assert model.training and model.generation_config.eos_token_id == eos


@pytest.mark.parametrize("backend", ["kv", "kv-fast"])
def test_other_architectures_fall_back_to_hf(tokenizer, capsys, backend):
    config = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                        eos_token_id=63)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    kv = sample(model, None, [[1, 2, 3]], n=2, max_new_tokens=5, temperature=0, backend=backend)
    hf = sample(model, None, [[1, 2, 3]], n=2, max_new_tokens=5, temperature=0, backend="hf")
    assert "sampling with hf" in capsys.readouterr().err
    assert token_rows(kv) == token_rows(hf)


@pytest.mark.parametrize("backend", ["kv", "kv-fast"])
@pytest.mark.parametrize("change", [dict(use_sliding_window=True, sliding_window=4, max_window_layers=0),
                                    dict(hidden_act="gelu")])
def test_a_qwen2_variant_the_kv_sampler_lacks_samples_as_hf_does(capsys, backend, change):
    """A sliding window or another activation: the kv loops would compute another model's tokens."""
    model = small_vocab_model()
    for key, value in change.items():
        setattr(model.config, key, value)
    model = type(model)(model.config).eval()  # built with the variant
    prompt = [list(range(1, 12))]
    kv = sample(model, None, prompt, max_new_tokens=8, temperature=0, backend=backend, ignore_eos=True)
    hf = sample(model, None, prompt, max_new_tokens=8, temperature=0, backend="hf", ignore_eos=True)
    assert "sampling with hf" in capsys.readouterr().err and token_rows(kv) == token_rows(hf)


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="sglang"), "backend"),
    (dict(n=0), "n=0"),
    (dict(top_p=0), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(prompts="just a string"), "list"),
    (dict(prompts=[[]]), "at least one token"),
    (dict(seed=[1, 2]), "seed"),
    (dict(temperature=float("nan")), "temperature"),  # NaN passed `< 0` and crashed in the loop
    (dict(seed=2 ** 64), "seed"), (dict(seed=True), "seed"), (dict(n=True), "n=True"),
    (dict(max_new_tokens=1.5), "max_new_tokens"),
])
def test_bad_arguments_raise_a_clear_error(tokenizer, kwargs, match):
    args = dict(prompts=PROMPTS, n=2, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        sample(make_tiny_model(len(tokenizer)), tokenizer, **args)


def test_a_numpy_seed_or_length_and_a_range_of_seeds_are_what_ints_are(tokenizer):
    import numpy
    model = make_tiny_model(len(tokenizer))
    assert token_rows(sample(model, tokenizer, PROMPTS, seed=numpy.int64(3), max_new_tokens=numpy.int64(4))) == \
        token_rows(sample(model, tokenizer, PROMPTS, seed=3, max_new_tokens=4))
    seeds = range(len(PROMPTS))
    assert token_rows(sample(model, tokenizer, PROMPTS, seed=seeds, max_new_tokens=4)) == \
        token_rows(sample(model, tokenizer, PROMPTS, seed=list(seeds), max_new_tokens=4))


def test_greedy_hf_rows_are_lists_of_their_own():
    rows = sample(small_vocab_model(), None, [[1, 2, 3]], n=2, max_new_tokens=3, temperature=0, backend="hf")[0]
    assert rows[0].token_ids == rows[1].token_ids and rows[0].token_ids is not rows[1].token_ids

