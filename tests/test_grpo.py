"""grpo.py: advantages, the clipped loss and its gradient, chunked log-probs, and the update step."""
import copy
import math

import pytest
import torch

from config import Config
from grpo import (
    DUAL_CLIP,
    Rollouts,
    cosine_schedule,
    group_advantages,
    grpo_step,
    make_optimization,
    micro_batches,
    pad_batch,
    policy_loss,
)
from helpers import (
    make_tiny_model,
    small_vocab_model,
)
from machinery.logprobs import token_logprobs
from sampler import Sampling, generate

GRPO_PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]


COMPLETIONS = [[11, 12], [13, 14, 15, 16], [17], [18, 19, 20]]


def settings(n_train, **options):
    """The Config fields grpo_step reads: M = n_train, one AdamW step for the whole batch, dapo over
    micro-batches of up to 4096 padded tokens, log-probs at T = 1."""
    return Config(**{"n_train": n_train, "mini_batch_questions": 0, "loss_agg": "dapo", "temperature": 1.0,
                     "micro_batch_tokens": 4096, "micro_batch_rollouts": 0, "grad_checkpointing": False,
                     "max_new_tokens": 4, **options})


def optimizer_for(model, lr, total_steps=10):
    """AdamW and its schedule as a run makes them (no warmup below 34 steps)."""
    return make_optimization(model, Config(lr=lr), total_steps)


def test_group_advantages_standardise_within_each_group():
    advantages = group_advantages([1, 0, 0, 1, 1, 1, 1, 0], group_size=4)
    half = 0.5 / math.sqrt(1 / 3)  # group 1: mean 0.5, unbiased std sqrt(1/3)
    expected = [half, -half, -half, half, 0.5, 0.5, 0.5, -1.5]  # group 2: mean 0.75, std 0.5
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_group_advantages_of_tied_group_are_exactly_zero():
    advantages = group_advantages([0.1, 0.1, 0.1, 0.7, 0.7, 0.7], group_size=3)
    assert advantages.tolist() == [0.0] * 6


def test_group_advantages_reject_partial_groups():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages([1, 0, 1], group_size=4)


def _two_sequences():
    """Sequence 0 (A = 1): three tokens with ratios 1.1, 0.9, 1.0 (inside the clip range).
    Sequence 1 (A = -2): one valid token with ratio 0.5 (clipped to 0.8), then padding with a huge ratio."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old_logp = torch.full((2, 3), -2.0)
    logp = old_logp + torch.tensor([[1.1, 0.9, 1.0], [0.5, 1e6, 1e6]]).log()
    return logp, old_logp, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize("agg, expected", [
    ("token-mean", (-1.1 - 0.9 - 1.0 + 1.6) / 4),
    ("dapo", (-1.1 - 0.9 - 1.0 + 1.6) / 4),
    ("seq-mean-token-mean", ((-1.1 - 0.9 - 1.0) / 3 + 1.6) / 2),
    ("seq-mean-token-sum-norm", (-1.1 - 0.9 - 1.0 + 1.6) / 4),
    ("dr_grpo", (-1.1 - 0.9 - 1.0 + 1.6) / (2 * 4)),
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
    groups = generate(model, None, prompts, 3, Sampling(8, 0.6, 1.0), seed=0)
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


@pytest.mark.parametrize("agg", ["dapo", "seq-mean-token-mean", "dr_grpo"])
def test_micro_batches_give_the_full_batch_update(tiny_model, agg):
    rewards = [1.0, 0.0, 0.0, 1.0]
    deltas = []
    for token_budget in (4, 10_000):  # one sequence per micro-batch vs all in one
        model = copy.deepcopy(tiny_model)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        grpo_step(model, optimizer, cosine_schedule(optimizer, 1), Rollouts(GRPO_PROMPTS, COMPLETIONS, rewards),
                  settings(2, loss_agg=agg, max_new_tokens=4, micro_batch_tokens=token_budget), bf16=False)
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[0], deltas[1], atol=1e-5, rtol=1e-3)


def test_verl_token_mean_weights_each_micro_batch_by_its_rollouts(tiny_model):
    """verl's update_policy: a token-mean per micro-batch, scaled by the micro-batch's share of the
    mini-batch's rollouts. One rollout per micro-batch is then seq-mean-token-mean, one micro-batch for all
    is TRL's dapo, and the two differ here (the completions have different lengths)."""
    def delta(agg, token_budget):
        model = copy.deepcopy(tiny_model)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        grpo_step(model, optimizer, cosine_schedule(optimizer, 1), Rollouts(GRPO_PROMPTS, COMPLETIONS,
                  [1.0, 0.0, 0.0, 1.0]), settings(2, loss_agg=agg, micro_batch_tokens=token_budget),
                  bf16=False)
        return torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    alone, together = delta("token-mean", 4), delta("token-mean", 10_000)
    torch.testing.assert_close(alone, delta("seq-mean-token-mean", 10_000), atol=1e-5, rtol=1e-3)
    torch.testing.assert_close(together, delta("dapo", 10_000), atol=1e-5, rtol=1e-3)
    assert (alone - together).abs().max() > 1e-3 * together.abs().max()


def _source_loss(agg, lengths, advantages, micro, max_len):
    """The loss each aggregation's source computes on per-token losses l_it = -A_i (rho = 1, the first
    mini-batch), micro-batches of `micro` rollouts in order, responses padded to max_len as verl pads them.
    verl v0.4.1: core_algos.agg_loss (lines 539-549) per micro-batch, then dp_actor.update_policy divides
    by gradient_accumulation = mini-batch / micro-batch size (line 511). TRL's GRPOTrainer: loss_type dapo
    divides the whole batch's sum by its tokens, dr_grpo a micro-batch's sum by rows x max_completion_length
    and then by the accumulation steps."""
    cuts = [list(range(i, i + micro)) for i in range(0, len(lengths), micro)]
    accumulation = len(lengths) // micro
    token_sum = lambda index: sum(-advantages[i] * lengths[i] for i in index)  # noqa: E731
    if agg == "dapo":
        return token_sum(range(len(lengths))) / sum(lengths)
    per_micro = {"token-mean": lambda c: token_sum(c) / sum(lengths[i] for i in c),
                 "seq-mean-token-mean": lambda c: sum(-advantages[i] for i in c) / len(c),
                 "seq-mean-token-sum-norm": lambda c: token_sum(c) / max_len,
                 "dr_grpo": lambda c: token_sum(c) / (len(c) * max_len)}[agg]
    return sum(per_micro(c) / accumulation for c in cuts)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "dapo", "dr_grpo"])
def test_each_aggregation_computes_its_sources_value(tiny_model, agg):
    """verl's names give verl's values through its update loop, TRL's its loss types' (docs/grpo.md).
    seq-mean-token-mean is 0 at rho = 1 (a group's advantages sum to 0); its gradient is tested above."""
    rewards, max_len = [1.0, 1.0, 0.0, 1.0], 6  # one group of 4, two micro-batches of 2
    optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.0)
    metrics = grpo_step(tiny_model, optimizer, cosine_schedule(optimizer, 1),
                        Rollouts(GRPO_PROMPTS, COMPLETIONS, rewards),
                        settings(4, loss_agg=agg, max_new_tokens=max_len, micro_batch_rollouts=2), bf16=False)
    advantages = group_advantages(rewards, 4).tolist()
    expected = _source_loss(agg, [len(c) for c in COMPLETIONS], advantages, 2, max_len)
    assert abs(expected) > 0.01 and metrics["loss"] == pytest.approx(expected, rel=1e-5)


def test_micro_batches_of_a_fixed_size_take_the_rollouts_in_order_whatever_their_length():
    """verl's ppo_micro_batch_size_per_gpu (TTRL's scripts: 2): the micro-batches are runs of rollouts."""
    assert micro_batches([9, 2, 7, 1, 5], token_budget=4, rollouts=2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([9, 2, 7, 1, 5], token_budget=10) == [[0], [2], [4, 1], [3]]  # by budget, longest first


def test_one_mini_batch_is_one_optimizer_step_whose_clip_never_binds(tiny_model):
    optimizer, scheduler = optimizer_for(tiny_model, 1e-2, 10)
    metrics = grpo_step(tiny_model, optimizer, scheduler, Rollouts(GRPO_PROMPTS * 2, COMPLETIONS * 2,
                        [1.0, 0.0, 0.0, 1.0] * 2), settings(2), bf16=False)
    assert metrics["optimizer_steps"] == 1 and scheduler.last_epoch == 1
    assert metrics["clip_frac"] == 0.0 and metrics["ratio"] == 1.0  # pi_theta is pi_old throughout


def test_each_mini_batch_takes_an_optimizer_step_against_the_sampling_policy(tiny_model):
    """Four groups, one per mini-batch: four optimizer steps (one step of the schedule: verl's), and from the
    second on the ratio is taken against the policy that sampled, fixed before the first step, so the clip
    binds."""
    optimizer, scheduler = optimizer_for(tiny_model, 1e-2, 10)
    metrics = grpo_step(tiny_model, optimizer, scheduler, Rollouts(GRPO_PROMPTS * 2, COMPLETIONS * 2,
                        [1.0, 0.0, 0.0, 1.0] * 2), settings(2, mini_batch_questions=1), bf16=False)
    assert metrics["optimizer_steps"] == 4 and scheduler.last_epoch == 1
    assert metrics["clip_frac"] > 0 and abs(metrics["ratio"] - 1) > 1e-3


def test_float32_master_weights_keep_updates_below_bfloat16_resolution(tiny_model):
    norm = tiny_model.model.norm.weight  # initialised to exactly 1.0
    optimizer, scheduler = optimizer_for(tiny_model, 5e-7)
    grpo_step(tiny_model, optimizer, scheduler, Rollouts(GRPO_PROMPTS, COMPLETIONS,
              [1.0, 0.0, 0.0, 1.0]), settings(2), bf16=True)
    moved = norm.detach() != 1.0
    assert moved.any()
    assert torch.equal(norm.detach()[moved].bfloat16(), torch.ones(int(moved.sum()), dtype=torch.bfloat16))


def test_grpo_step_rewarding_a_token_raises_its_probability(tiny_model):
    chosen, prompt = 1234, [100, 101, 102]
    generator = torch.Generator().manual_seed(0)
    optimizer, scheduler = optimizer_for(tiny_model, 1e-2, 3)

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
        grpo_step(tiny_model, optimizer, scheduler, Rollouts([prompt] * 8, completions, rewards), settings(4))
    assert chosen_probability() > 2 * before


def test_grpo_step_runs_under_accelerate(tiny_model):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    optimizer, scheduler = optimizer_for(tiny_model, 1e-3)
    model, optimizer = accelerator.prepare(tiny_model, optimizer)
    metrics = grpo_step(model, optimizer, scheduler, Rollouts(GRPO_PROMPTS, COMPLETIONS,
                        [1.0, 0.0, 0.0, 1.0]), settings(2), accelerator=accelerator)
    assert metrics["grad_norm"] > 0 and metrics["response_tokens"] == 10


def test_adamw_decays_every_parameter_as_verl_does():
    """verl builds AdamW(module.parameters(), weight_decay=0.01): norms and biases decay too. One step with a zero
    gradient moves nothing but the decay."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    optimizer, scheduler = make_optimization(model, Config(lr=0.5), total_steps=1)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01]
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for old, new in zip(before, model.parameters()):
        assert torch.allclose(new, old * (1 - 0.5 * 0.01))


def test_cosine_schedule_warms_up_then_decays_to_zero():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = cosine_schedule(optimizer, total_steps=6, warmup_steps=2)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    cosine = [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lrs == pytest.approx([0.0, 0.5, *cosine])  # verl's warmup: current_step / warmup_steps


def test_dual_clip_caps_the_loss_of_a_negative_advantage_token():
    """verl's clip_ratio_c: with A < 0 a token whose ratio grew past c loses c |A|, not rho |A|, and gets no
    gradient."""
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]]).requires_grad_()
    mask, old, adv = torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([-1.0])
    loss, stats = policy_loss(logp, old, adv, mask)
    assert DUAL_CLIP == 3.0 and loss.item() == pytest.approx((3.0 + 2.0) / 2) and stats["clip_dual"].item() == 0.5
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_kl_term_is_verls_low_var_kl_capped_at_ten():
    logp = torch.zeros(1, 1)
    _, stats = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 1), ref_logp=logp + 5.0, kl_coef=0.001)
    assert stats["kl_ref"].item() == 10.0  # exp(5) - 5 - 1 = 142.4, capped as verl's kl_penalty("low_var_kl")


def test_a_step_whose_loss_is_not_finite_leaves_the_weights_and_is_counted(tiny_model, monkeypatch):
    """verl skips an optimizer step whose gradient norm is not finite; so does grpo_step, and it says so."""
    import grpo

    def nan_loss(*args, **kwargs):
        loss, stats = policy_loss(*args, **kwargs)
        return loss * float("nan"), stats
    optimizer, scheduler = optimizer_for(tiny_model, 1e-2, 10)
    batch = Rollouts(GRPO_PROMPTS, COMPLETIONS, [1.0, 0.0, 0.0, 1.0])
    before = copy.deepcopy(tiny_model.state_dict())
    monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    metrics = grpo_step(tiny_model, optimizer, scheduler, batch, settings(2), bf16=False)
    assert metrics["skipped_steps"] == 1 and not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(before[name], value) for name, value in tiny_model.state_dict().items())
    assert not optimizer.state and scheduler.last_epoch == 1  # no AdamW moment taken; the schedule keeps time
    monkeypatch.undo()
    metrics = grpo_step(tiny_model, optimizer, scheduler, batch, settings(2), bf16=False)
    assert metrics["skipped_steps"] == 0
    assert not all(torch.equal(before[name], value) for name, value in tiny_model.state_dict().items())


def test_the_schedule_steps_once_per_call_so_a_steps_adamw_steps_share_one_learning_rate(tiny_model):
    """verl steps the cosine once per training step, so that step's AdamW steps share one learning rate."""
    optimizer, scheduler = optimizer_for(tiny_model, 1e-2, 8)
    metrics = grpo_step(tiny_model, optimizer, scheduler, Rollouts(GRPO_PROMPTS * 2, COMPLETIONS * 2,
                        [1.0, 0.0, 0.0, 1.0] * 2), settings(2, mini_batch_questions=1), bf16=False)
    assert metrics["optimizer_steps"] == 4 and scheduler.last_epoch == 1
    assert metrics["lr"] == pytest.approx(1e-2, rel=1e-6)  # the mean lr of the 4 AdamW steps is the peak


def test_grpo_step_measures_the_samplers_logprobs_against_the_trainers(tiny_model):
    """The sampler's token log-probs equal to the trainer's give a zero mismatch; shifted by 0.1 each, a
    mismatch of 0.1."""
    prompts, completions = GRPO_PROMPTS, COMPLETIONS
    batch = pad_batch(prompts, completions)
    with torch.no_grad():
        trainer = token_logprobs(tiny_model, *batch)[0]
    own = [trainer[i][batch[2][i]].tolist() for i in range(len(prompts))]
    for shift, expected in ((0.0, 0.0), (0.1, 0.1)):
        model = copy.deepcopy(tiny_model)
        optimizer, scheduler = optimizer_for(model, 1e-3, 1)
        sampled = [[lp - shift for lp in row] for row in own]
        metrics = grpo_step(model, optimizer, scheduler,
                            Rollouts(prompts, completions, [1.0, 0.0, 0.0, 1.0], sampled), settings(2), bf16=False)
        assert metrics["logprob_mismatch"] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="one log-prob per completion token the policy sampled"):
        grpo_step(tiny_model, optimizer, scheduler,
                  Rollouts(prompts, completions, [1.0, 0.0, 0.0, 1.0], [row[:-1] for row in own]), settings(2))
