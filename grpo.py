"""GRPO: the policy update of test-time RL, as verl's core_algos compute it for TTRL.

For each question the sampling policy pi_old drew M responses o_1..o_M with rewards r_1..r_M; a
response's advantage is its reward standardised within the group, shared by every token of it:

    A_i    = (r_i - mean(r)) / (std(r) + eps)       (no scale_advantages: r_i - mean(r), Dr. GRPO)
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)   pi = softmax(logits / T_sample)
    p_it   = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i), <= -c A_i if A_i < 0
    l_it   = w_it p_it + beta min(exp(d_it) - d_it - 1, 10)   d_it = log pi_ref - log pi_theta
    L      = AGG_{i,t} l_it    over the tokens the policy sampled (a tool's output is context)

The KL term is verl's low_var_kl; w_it = min(pi_old / mu, C) is truncated importance sampling
against the sampler's own distribution mu (off: 1). AGG is verl's token-mean, seq-mean-token-mean
or seq-mean-token-sum-norm as verl's update loop accumulates them (each micro-batch's value weighted
by its share of the mini-batch's rollouts), or TRL's dapo (one token-mean over the mini-batch) or
dr_grpo (docs/grpo.md: each with its source's file and line). A step's groups are cut into mini-batches
of Q groups, one AdamW step each; pi_old is fixed before the first, so from the second on the clip
can bind. Micro-batches accumulate the exact mini-batch gradient. Weights stay float32 under
bfloat16 autocast: 5e-7 is below bfloat16's resolution near 1. Design notes: docs/grpo.md; `python
-m bench.grpo` times one update.

    settings = GRPOSettings(group_size=8, mini_batch_groups=1, temperature=0.6)
    metrics = grpo_step(model, optimizer, scheduler, Rollouts(prompts, completions, rewards),
                        settings)
"""
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from config import AGGREGATIONS, GRPOSettings


# ----------------------------------------------------------------------------- the update

def grpo_step(model, optimizer, scheduler, batch: "Rollouts", settings: GRPOSettings, *,
              accelerator=None, ref_model=None) -> dict:
    """One GRPO step on a batch of rollouts: an optimizer (and scheduler) step per mini-batch.

    batch: prompts and completions (token ids; a completion that stopped at EOS ends with it) and
    rewards [B], group after group (B = G x group_size). Mini-batch k of mini_batch_groups groups
    takes optimizer step k on its own L, rho against pi_old = the policy before this call. Under DDP
    every process passes the whole batch and trains on its share of each mini-batch (rollouts
    rank::world); one with no share runs one rollout at weight 0, so that it still joins the
    all-reduce. model holds float32 weights. Returns float metrics of the whole batch."""
    started, s = time.perf_counter(), settings
    from machinery import batches, logprobs as kernel, update as books  # the update's machinery
    from machinery.sampler_cpu import release_freed_memory
    books.check_step_arguments(batch, s, ref_model)
    _check_aggregation(s.agg, s.norm_len)
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    bf16 = books.bf16_supported(device) if s.bf16 is None else s.bf16
    # no autocast weight cache: it would keep a bfloat16 copy of every weight alive for the whole
    # pass (1.2 GB here); recasting per use costs less time than it saves memory (bench.grpo)
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16,
                       cache_enabled=False)
    logprobs = partial(kernel.token_logprobs, temperature=s.temperature, chunk_rows=s.chunk_rows)
    loss_fn = partial(policy_loss, clip_low=s.clip_low, clip_high=s.clip_high,
                      clip_ratio_c=s.clip_ratio_c, agg=s.agg, kl_coef=s.kl_coef,
                      norm_len=s.norm_len, is_cap=s.is_cap)

    advantages = group_advantages(batch.rewards, s.group_size, scale=s.scale_advantages)  # [B]
    advantages = advantages.to(device)
    plan = batches.plan(batch, advantages, s, accelerator, lockstep=books.is_sharded(model))
    kernel.set_checkpointing(model, s.gradient_checkpointing)
    was_training = model.training
    model.train()
    with torch.no_grad(), autocast():
        _fix_logprobs(plan, logprobs, model, ref_model if s.kl_coef > 0 else None)
    totals = {}  # statistic -> token-weighted sum over this process's rollouts of every mini-batch
    for mini_batch in plan:
        update = _mini_batch_update(model, optimizer, mini_batch, accelerator=accelerator,
                                    autocast=autocast, logprobs=logprobs, loss_fn=loss_fn,
                                    max_grad_norm=s.max_grad_norm)
        if s.lr_schedule_unit == "optimizer-step":
            scheduler.step()
        for name, value in update.items():
            totals[name] = totals.get(name, 0.0) + value
    if s.lr_schedule_unit == "step":
        scheduler.step()
    model.train(was_training)
    metrics = books.step_statistics(totals, len(plan), accelerator)
    metrics.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                   zero_adv_groups=float((advantages.view(-1, s.group_size) == 0).all(dim=1)
                                         .float().mean()),
                   tokens=float(sum(map(len, batch.prompts)) + sum(map(len, batch.completions))),
                   seconds=time.perf_counter() - started)
    del plan  # its micro-batches and log-probs; then the freed memory back to the system
    release_freed_memory()
    return metrics


@dataclass
class Rollouts:
    """The rollouts an update trains on, group after group (M per question): token ids and rewards,
    the sampler's log-prob of each sampled completion token when it reports them (the inference
    engine), and which completion tokens a tool appended (agent rollouts): those are context, not
    actions, and get no loss."""
    prompts: list[list[int]]
    completions: list[list[int]]
    rewards: list[float]
    sampling_logprobs: list[list[float]] | None = None
    tool_masks: list[list[bool]] | None = None   # True at a tool's tokens (None: all the policy's)

    def policy_tokens(self, i: int) -> int:
        """How many of completion i's tokens the policy sampled."""
        return len(self.completions[i]) - (sum(self.tool_masks[i]) if self.tool_masks else 0)


# ------------------------------------------------------------------------ pure tensor functions

def group_advantages(rewards, group_size: int, scale: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages [B] (float32) from rewards [B] laid out group after group (B = groups x
    group_size)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a flat list of B values, got shape "
                         f"{tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values do not split into groups of "
                         f"group_size={group_size}; "
                         f"pass whole groups of at least 2 responses")
    groups = rewards.view(-1, group_size)                                        # [G, M]
    advantages = groups - groups.mean(dim=1, keepdim=True)                       # [G, M]
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    # exactly zero, not mean-rounding noise: an all-equal group must not move the policy
    tied = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # [G, 1]
    return torch.where(tied, 0.0, advantages).view(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              norm_len: int | None = None):
    """Reduce one micro-batch's per-token values [B, T] over the valid tokens (mask [B, T]) to a
    scalar, by name (see top); batches.plan weights the micro-batches of a mini-batch."""
    mask = mask.to(values.dtype)
    total = values * mask                                                        # [B, T]
    if agg in ("token-mean", "dapo"):  # dapo: plan weights a micro-batch by its tokens
        return total.sum() / mask.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return (total.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if agg == "seq-mean-token-sum-norm":  # verl divides by L_max alone
        return total.sum() / norm_len
    if agg == "dr_grpo":
        return total.sum() / (values.shape[0] * norm_len)
    raise ValueError(f"agg={agg!r}: use one of {', '.join(AGGREGATIONS)}")


def _check_aggregation(agg: str, norm_len: int | None):
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r}: use one of {', '.join(AGGREGATIONS)}")
    if agg in ("seq-mean-token-sum-norm", "dr_grpo") and not (norm_len and norm_len > 0):
        raise ValueError(f"agg={agg!r} needs norm_len > 0 (the max new tokens of the rollouts), "
                         f"got {norm_len!r}")


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                agg="token-mean", ref_logp=None, kl_coef=0.0, norm_len=None, sampling_logp=None,
                is_cap=None):
    """The clipped GRPO loss L (see top) and its statistics.

    logp, old_logp, ref_logp, sampling_logp (log mu), mask: [B, T] over response tokens; advantages:
    [B]. is_cap: C of the truncated importance weight w (None: w = 1). Returns (loss, stats); stats
    are detached token-means over valid tokens: clip_low and clip_high (share of tokens whose
    gradient the clip cuts: rho < 1 - eps_low with A < 0, rho > 1 + eps_high with A > 0), clip_dual
    (share whose loss the dual clip caps: A < 0 and rho > c), approx_kl (k3 estimate of KL(pi_old ||
    pi_theta)), ratio (mean rho), kl_ref when kl_coef > 0, and with sampling_logp logprob_mismatch
    (mean |log pi_old - log mu|) and is_weight (mean w, 1 when off).
    """
    if not (logp.shape == old_logp.shape == mask.shape) or advantages.shape != logp.shape[:1]:
        raise ValueError(f"policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} "
                         f"and mask {tuple(mask.shape)} must be [B, T] and advantages "
                         f"{tuple(advantages.shape)} must be [B]")
    _check_aggregation(agg, norm_len)
    if kl_coef > 0 and (ref_logp is None or ref_logp.shape != logp.shape):
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logp of the same shape [B, T] as logp")
    if is_cap is not None and (sampling_logp is None or sampling_logp.shape != logp.shape):
        raise ValueError("policy_loss: is_cap needs sampling_logp (the sampler's log-probs) of the "
                         "same shape [B, T] as logp")
    valid = mask.bool()                                                          # [B, T]
    # padding may hold anything; zero its log-ratio so exp() stays finite and its gradient is 0
    log_ratio = torch.where(valid, logp - old_logp, 0.0).clamp(-20, 20)         # [B, T]
    ratio = torch.exp(log_ratio)                                                 # [B, T]
    adv = advantages[:, None].to(ratio.dtype)                                    # [B, 1]
    clipped = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # [B, T]
    # dual clip: however far rho has grown, a token with A < 0 loses at most c |A| (no gradient)
    dual = (adv < 0) & (clipped > -clip_ratio_c * adv)                           # [B, T]
    per_token = torch.where(dual, -clip_ratio_c * adv, clipped)                  # [B, T]
    if sampling_logp is not None:
        # [B, T] log pi_old / mu
        sampler_gap = torch.where(valid, old_logp - sampling_logp, 0.0).clamp(-20, 20)
        is_weight = (torch.exp(sampler_gap).clamp(max=is_cap) if is_cap is not None
                     else torch.ones_like(ratio))
        per_token = per_token * is_weight.detach()                               # [B, T]
    if kl_coef > 0:
        ref_gap = torch.where(valid, ref_logp - logp, 0.0).clamp(-20, 20)       # [B, T]
        kl_ref = (torch.exp(ref_gap) - ref_gap - 1).clamp(max=10)               # [B, T], low_var_kl
        per_token = per_token + kl_coef * kl_ref
    loss = aggregate(per_token, valid, agg, norm_len)

    with torch.no_grad():
        def token_mean(x):
            return aggregate(x.float(), valid, "token-mean")
        stats = {"clip_low": token_mean((ratio < 1 - clip_low) & (adv < 0)),
                 "clip_high": token_mean((ratio > 1 + clip_high) & (adv > 0)),
                 "clip_dual": token_mean(dual),
                 "approx_kl": token_mean(ratio - 1 - log_ratio),
                 "ratio": token_mean(ratio)}
        if kl_coef > 0:
            stats["kl_ref"] = token_mean(kl_ref)
        if sampling_logp is not None:
            stats.update(logprob_mismatch=token_mean(sampler_gap.abs()),
                         is_weight=token_mean(is_weight))
    return loss, stats


# ----------------------------------------------------------------------------- the update's parts

def _fix_logprobs(plan, logprobs, model, ref_model):
    """Before the first optimizer step: pi_old's log-probs for every mini-batch after the first (in
    the first, pi_theta is pi_old), and pi_ref's for all when there is a reference model."""
    for k, mini_batch in enumerate(plan):
        for b in mini_batch:
            inputs = (b.input_ids, b.attention_mask, b.response_mask)
            if k > 0:
                b.old_logp = logprobs(model, *inputs)[0]
            if ref_model is not None:
                b.ref_logp = logprobs(ref_model, *inputs)[0]


def _mini_batch_update(model, optimizer, micro: list, *, accelerator, autocast, logprobs, loss_fn,
                       max_grad_norm) -> dict:
    """Accumulate one mini-batch's gradient over its micro-batches, then one optimizer step, skipped
    when the gradient norm is not finite. Returns token-weighted sums of the loss statistics over
    this process's rollouts (weight-0 ones excluded), and this step's loss, gradient norm, learning
    rate and whether it was skipped (counted once, by the main process)."""
    from machinery import update as books
    sums = {}
    loss_total = torch.zeros((), device=micro[0].input_ids.device)
    for k, b in enumerate(micro):
        # gradients are all-reduced once, on the last micro-batch
        last = k == len(micro) - 1
        with nullcontext() if last else books.no_sync(model, accelerator):
            with autocast():
                # [b, T] each
                logp, entropy = logprobs(model, b.input_ids, b.attention_mask, b.response_mask)
                old_logp = logp.detach() if b.old_logp is None else b.old_logp
                loss, stats = loss_fn(logp, old_logp, b.advantages, b.response_mask,
                                      ref_logp=b.ref_logp, sampling_logp=b.sampling_logp)
                weighted = loss * b.weight
            if accelerator is not None:
                accelerator.backward(weighted)
            else:
                weighted.backward()
        loss_total += weighted.detach()
        stats["entropy"] = aggregate(entropy, b.response_mask, "token-mean")
        tokens = b.response_mask.sum() * (b.weight > 0)
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + value * tokens
        sums["response_tokens"] = sums.get("response_tokens", 0.0) + tokens
    grad_norm = books.clip_gradients(model, max_grad_norm, accelerator)
    processes = accelerator.num_processes if accelerator is not None else 1
    main = accelerator is None or accelerator.is_main_process
    # loss_total is this process's share of L_k, scaled by processes (the weights above):
    # / processes sums to L_k
    # the norm is taken after the all-reduce, so every process skips the same steps
    finite = bool(torch.isfinite(grad_norm))
    sums.update(loss=loss_total / processes, grad_norm=grad_norm * main,
                lr=optimizer.param_groups[0]["lr"] * main, skipped_steps=float(not finite) * main)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums

