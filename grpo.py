"""GRPO: the policy update of test-time RL, as verl's core_algos compute it for TTRL.

For each question the sampling policy pi_old drew M responses o_1..o_M with rewards r_1..r_M; a
response's advantage is its reward standardised within the group, shared by every token of it:

    A_i    = (r_i - mean(r)) / (std(r) + eps)
    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)    pi = softmax(logits / T_sample)
    p_it   = -min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i),   at most -c A_i where A_i < 0
    l_it   = p_it + beta min(exp(d_it) - d_it - 1, 10)              d_it = log pi_ref - log pi_theta
    L      = AGG_{i,t} l_it       over the tokens the policy sampled (a tool's output is context)

eps = 0.2, c = 3 (verl's dual clip), beta = --kl-coef (verl's low_var_kl; the paper's 0). AGG is
--loss-agg (docs/grpo.md: verl's and TRL's, each with its source's file and line). A step's groups
are cut into mini-batches of Q questions (--mini-batch-questions), one AdamW step each; pi_old is
fixed before the first, so from the second on the clip can bind. Micro-batches accumulate the exact
gradient of L as AGG defines it (token-mean and seq-mean-token-sum-norm, as verl's, per micro-batch:
they depend on the cut). Weights stay float32 under bfloat16 autocast: 5e-7 is below bfloat16's
resolution near 1. `python -m bench.grpo` times one update.

    optimizer, scheduler = make_optimization(model, cfg, total_steps=len(batches))
    metrics = grpo_step(model, optimizer, scheduler, Rollouts(prompts, completions, rewards), cfg)
"""
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from config import AGGREGATIONS, Config
from machinery.logprobs import set_checkpointing, token_logprobs

CLIP = 0.2           # eps: the ratio's clip range [1 - eps, 1 + eps] (TTRL's scripts)
DUAL_CLIP = 3.0      # c: a token with A < 0 loses at most c |A| (verl's clip_ratio_c)
MAX_GRAD_NORM = 1.0  # the gradient's norm is clipped to this (verl's grad_clip)
WARMUP_RATIO = 0.03  # share of the schedule warming the learning rate up from 0 (TTRL's scripts)
WEIGHT_DECAY = 0.01  # AdamW's, on every parameter (verl's fsdp_workers.py:367-372)
CHUNK_ROWS = 256     # response rows per chunk of the output head (logprobs.token_logprobs)


@dataclass
class Rollouts:
    """What an update trains on, group after group (M per question): token ids and rewards, the
    sampler's log-prob of each sampled token when it reports them (the vLLM engine), and which
    completion tokens a tool appended (--agent): context, not actions, so no loss."""
    prompts: list
    completions: list
    rewards: list
    sampling_logprobs: list | None = None
    tool_masks: list | None = None   # True at a tool's tokens (None: all the policy's)

    def policy_tokens(self, i: int) -> int:
        """How many of completion i's tokens the policy sampled."""
        return len(self.completions[i]) - (sum(self.tool_masks[i]) if self.tool_masks else 0)


@dataclass
class MicroBatch:
    """Rollouts padded into one forward pass, with what the loss needs beside them."""
    input_ids: torch.Tensor          # [b, T] right-padded prompt + completion
    attention_mask: torch.Tensor     # [b, T]
    response_mask: torch.Tensor      # [b, T] bool: the completion tokens the policy sampled
    advantages: torch.Tensor         # [b]
    weight: float                    # its share of the mini-batch's loss (x processes: DDP
                                     # averages)
    sampling_logp: torch.Tensor | None = None  # [b, T] the sampler's log-probs, when it gave them
    old_logp: torch.Tensor | None = None  # [b, T] pi_old, once the policy has moved since sampling
    ref_logp: torch.Tensor | None = None  # [b, T] pi_ref, with --kl-coef


def grpo_step(model, optimizer, scheduler, batch: Rollouts, cfg: Config, *, accelerator=None,
              ref_model=None, bf16=None) -> dict:
    """One GRPO step on a batch of rollouts (group after group, cfg.n_train each): an AdamW step per
    mini-batch of cfg.mini_batch_questions groups, then one step of the schedule (verl's: a training
    step's AdamW steps share one learning rate). Under DDP every process passes the whole batch and
    trains on its share of each mini-batch. bf16: autocast (None: where the hardware runs it).
    Returns float metrics of the whole step."""
    started = time.perf_counter()
    check_batch(batch, cfg, ref_model)
    device = accelerator.device if accelerator else next(model.parameters()).device
    bf16 = bf16_supported(device) if bf16 is None else bf16
    # no autocast weight cache: it would keep a bfloat16 copy of every weight for the whole pass
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16,
                       cache_enabled=False)
    logprobs = partial(token_logprobs, temperature=cfg.temperature, chunk_rows=CHUNK_ROWS)
    # 1. advantages: each reward standardised within its question's group
    advantages = group_advantages(batch.rewards, cfg.n_train).to(device)                # [B]
    # 2. mini-batches of Q questions, each this process's micro-batches
    plan = plan_batches(batch, advantages, cfg, accelerator, lockstep=not hasattr(model, "no_sync"))
    set_checkpointing(model, cfg.grad_checkpointing)
    model.train()
    # 3. pi_old and pi_ref, fixed before the first AdamW step (in the first mini-batch pi_old is
    # pi_theta itself: rho = 1)
    with torch.no_grad(), autocast():
        for k, mini_batch in enumerate(plan):
            for b in mini_batch:
                inputs = (b.input_ids, b.attention_mask, b.response_mask)
                b.old_logp = logprobs(model, *inputs)[0] if k > 0 else None
                b.ref_logp = logprobs(ref_model, *inputs)[0] if cfg.kl_coef > 0 else None
    # 4. per mini-batch: forward and backward over its micro-batches, clip, one AdamW step
    totals = {}
    for mini_batch in plan:
        update = mini_batch_update(model, optimizer, mini_batch, cfg, accelerator, autocast,
                                   logprobs)
        for name, value in update.items():
            totals[name] = totals.get(name, 0.0) + value
    scheduler.step()
    metrics = step_statistics(totals, len(plan), accelerator, device)
    metrics.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                   zero_adv_groups=float((advantages.view(-1, cfg.n_train) == 0).all(dim=1)
                                         .float().mean()),
                   tokens=float(sum(map(len, batch.prompts)) + sum(map(len, batch.completions))),
                   seconds=time.perf_counter() - started)
    return metrics


def mini_batch_update(model, optimizer, micro: list, cfg, accelerator, autocast, logprobs) -> dict:
    """Accumulate one mini-batch's gradient over its micro-batches, clip it, take an AdamW step
    (skipped, as verl skips it, when the norm is not finite). Returns the statistics' token-weighted
    sums over this process's rollouts, and the step's loss, norm, learning rate and skip."""
    sums = {}
    loss_total = torch.zeros((), device=micro[0].input_ids.device)
    for k, b in enumerate(micro):
        # the gradient is all-reduced once, with the last micro-batch
        last = k == len(micro) - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            with autocast():
                logp, entropy = logprobs(model, b.input_ids, b.attention_mask, b.response_mask)
                old = logp.detach() if b.old_logp is None else b.old_logp
                loss, stats = policy_loss(logp, old, b.advantages, b.response_mask,
                                          agg=cfg.loss_agg, norm_len=cfg.max_new_tokens,
                                          ref_logp=b.ref_logp, kl_coef=cfg.kl_coef)
                weighted = loss * b.weight
            (accelerator.backward if accelerator else torch.Tensor.backward)(weighted)
        loss_total += weighted.detach()
        stats["entropy"] = aggregate(entropy, b.response_mask)
        if b.sampling_logp is not None:  # the engine's log-probs against the trainer's
            stats["logprob_mismatch"] = aggregate((old - b.sampling_logp).abs(), b.response_mask)
        tokens = b.response_mask.sum() * (b.weight > 0)
        for name, value in stats.items():
            sums[name] = sums.get(name, 0.0) + value * tokens
        sums["response_tokens"] = sums.get("response_tokens", 0.0) + tokens
    grad_norm = clip_gradients(model)
    processes = accelerator.num_processes if accelerator else 1
    main = accelerator is None or accelerator.is_main_process
    # taken after the all-reduce: the same on every process
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums | dict(loss=loss_total / processes, grad_norm=grad_norm * main,
                       lr=optimizer.param_groups[0]["lr"] * main, skipped_steps=(not finite) * main)


# ------------------------------------------------------------------------ pure tensor functions

def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [B] (float32) from rewards [B] laid out group after group."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values do not split into groups of "
                         f"group_size={group_size}; pass whole groups of at least 2 responses")
    groups = rewards.view(-1, group_size)                                        # [G, M]
    advantages = (groups - groups.mean(dim=1, keepdim=True)) / (groups.std(dim=1, keepdim=True)
                                                                 + eps)         # [G, M]
    # exactly zero, not rounding noise: an all-equal group must not move the policy
    tied = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # [G, 1]
    return torch.where(tied, 0.0, advantages).view(-1)


def aggregate(values, mask, agg: str = "token-mean", norm_len: int | None = None):
    """One micro-batch's per-token values [B, T] over the valid tokens (mask [B, T]) as a scalar, by
    name (plan_batches weights the micro-batches of a mini-batch)."""
    mask = mask.to(values.dtype)
    total = values * mask                                                        # [B, T]
    if agg in ("token-mean", "dapo"):  # dapo: a micro-batch weighs its tokens' share
        return total.sum() / mask.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return (total.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if agg == "seq-mean-token-sum-norm":  # verl divides by L_max alone
        return total.sum() / norm_len
    if agg == "dr_grpo":
        return total.sum() / (values.shape[0] * norm_len)
    raise ValueError(f"agg={agg!r}: use one of {', '.join(AGGREGATIONS)}")


def policy_loss(logp, old_logp, advantages, mask, *, agg="token-mean", norm_len=None,
                ref_logp=None, kl_coef=0.0):
    """The clipped GRPO loss L (see top) and its detached statistics (token-means): clip_low and
    clip_high (shares of tokens whose gradient the clip cuts), clip_dual (whose loss the dual clip
    caps), approx_kl (k3 of KL(pi_old || pi_theta)), ratio, and kl_ref with kl_coef > 0.
    logp, old_logp, ref_logp, mask: [B, T]; advantages: [B]."""
    if not logp.shape == old_logp.shape == mask.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(f"policy_loss: logp {tuple(logp.shape)}, old_logp "
                         f"{tuple(old_logp.shape)} and mask {tuple(mask.shape)} must be [B, T] and "
                         f"advantages {tuple(advantages.shape)} [B]")
    if agg in ("seq-mean-token-sum-norm", "dr_grpo") and not (norm_len and norm_len > 0):
        raise ValueError(f"agg={agg!r} needs norm_len > 0 (the max new tokens), got {norm_len!r}")
    valid = mask.bool()                                                          # [B, T]
    # padding may hold anything: its log-ratio is 0, so exp() stays finite and its gradient is 0
    log_ratio = torch.where(valid, logp - old_logp, 0.0).clamp(-20, 20)         # [B, T]
    ratio = torch.exp(log_ratio)                                                 # [B, T]
    adv = advantages[:, None].to(ratio.dtype)                                    # [B, 1]
    clipped = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)  # [B, T]
    # dual clip: however far rho has grown, a token with A < 0 loses at most c |A| (no gradient)
    dual = (adv < 0) & (clipped > -DUAL_CLIP * adv)                              # [B, T]
    per_token = torch.where(dual, -DUAL_CLIP * adv, clipped)                     # [B, T]
    if kl_coef > 0:
        ref_gap = torch.where(valid, ref_logp - logp, 0.0).clamp(-20, 20)       # [B, T]
        kl_ref = (torch.exp(ref_gap) - ref_gap - 1).clamp(max=10)               # low_var_kl
        per_token = per_token + kl_coef * kl_ref
    loss = aggregate(per_token, valid, agg, norm_len)
    with torch.no_grad():
        mean = lambda x: aggregate(x.float(), valid)  # noqa: E731
        stats = {"clip_low": mean((ratio < 1 - CLIP) & (adv < 0)),
                 "clip_high": mean((ratio > 1 + CLIP) & (adv > 0)), "clip_dual": mean(dual),
                 "approx_kl": mean(ratio - 1 - log_ratio), "ratio": mean(ratio)}
        if kl_coef > 0:
            stats["kl_ref"] = mean(kl_ref)
    return loss, stats


# ----------------------------------------------------------------- batches, optimizer, bookkeeping

def plan_batches(batch: Rollouts, advantages, cfg: Config, accelerator, lockstep: bool) -> list:
    """This process's micro-batches of each mini-batch: [[MicroBatch] per AdamW step]. Each weighs
    its part of the mini-batch's normaliser (its policy tokens for dapo, its rollouts otherwise:
    verl weights a micro-batch by its rollouts) x processes, so that DDP's average of the processes'
    gradients is the mini-batch's. A process without rollouts in a mini-batch runs one at weight 0
    (the all-reduce needs it); lockstep (FSDP, whose every backward is collective): every process as
    many micro-batches as the one with the most."""
    rank, processes = ((accelerator.process_index, accelerator.num_processes) if accelerator
                       else (0, 1))
    groups = len(advantages) // cfg.n_train
    per_step = cfg.mini_batch_questions or groups
    size = lambda index: (sum(batch.policy_tokens(i) for i in index)  # noqa: E731
                          if cfg.loss_agg == "dapo" else len(index))

    def cut(indices):
        lengths = [len(batch.prompts[i]) + len(batch.completions[i]) for i in indices]
        return [[indices[j] for j in part] for part in micro_batches(
            lengths, cfg.micro_batch_tokens, cfg.micro_batch_rollouts)]

    plan = []
    for first in range(0, groups, per_step):
        rollouts = range(first * cfg.n_train, min(first + per_step, groups) * cfg.n_train)
        share, mine = processes / max(size(rollouts), 1), list(rollouts[rank::processes])
        if not mine:
            mine, share = [rollouts[0]], 0.0
        cuts = [(index, share) for index in cut(mine)]
        if lockstep:
            most = max(max(1, len(cut(list(rollouts[r::processes])))) for r in range(processes))
            cuts += [([mine[0]], 0.0)] * (most - len(cuts))
        plan.append([micro_batch(batch, index, advantages, size(index) * weight)
                     for index, weight in cuts])
    return plan


def micro_batch(batch: Rollouts, index: list, advantages, weight: float) -> MicroBatch:
    """Rollouts `index` of the batch, padded into one forward pass."""
    masks = [batch.tool_masks[i] for i in index] if batch.tool_masks else None
    padded = pad_batch([batch.prompts[i] for i in index], [batch.completions[i] for i in index],
                       advantages.device, masks)
    sampled = None
    if batch.sampling_logprobs is not None:  # into the response positions, row-major as padded
        flat = torch.tensor([lp for i in index for lp in batch.sampling_logprobs[i]])
        sampled = torch.zeros(padded[2].shape).masked_scatter(padded[2].cpu(), flat)
        sampled = sampled.to(advantages.device)
    return MicroBatch(*padded, advantages[index], weight, sampled)


def pad_batch(prompts, completions, device=None, tool_masks=None):
    """Right-padded (input_ids, attention_mask, response_mask), each [B, T]: the response mask
    leaves out padding and a tool's tokens (context: no loss, entropy or KL on them)."""
    if len(prompts) != len(completions) or not all(prompts):
        raise ValueError("pad_batch: one prompt of at least one token per completion")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    input_ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        input_ids[i, :lengths[i]] = torch.tensor(list(prompt) + list(completion))
        attention_mask[i, :lengths[i]] = 1
        response_mask[i, len(prompt):lengths[i]] = True
        if tool_masks is not None and tool_masks[i] is not None:
            response_mask[i, len(prompt):lengths[i]] &= ~torch.tensor(tool_masks[i])
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


def micro_batches(lengths, token_budget: int, rollouts: int = 0) -> list:
    """Indices cut into micro-batches: runs of `rollouts` in order (verl's fixed size), or (0)
    longest first, as many as fit token_budget padded tokens (a longer one goes alone)."""
    if rollouts:
        return [list(range(i, min(i + rollouts, len(lengths))))
                for i in range(0, len(lengths), rollouts)]
    cuts = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if cuts and (len(cuts[-1]) + 1) * lengths[cuts[-1][0]] <= token_budget:
            cuts[-1].append(i)
        else:
            cuts.append([i])
    return cuts


def clip_gradients(model) -> torch.Tensor:
    """Clip the gradient to a total norm of MAX_GRAD_NORM; returns the norm before clipping, over
    the whole model (FSDP's shards give a DTensor: summed over the processes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], 2.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    torch.nn.utils.clip_grads_with_norm_(params, MAX_GRAD_NORM, norm)
    return norm


def step_statistics(totals: dict, steps: int, accelerator, device) -> dict:
    """The sums over processes -> the step's token means, and the loss, norm and learning rate
    averaged over its AdamW steps."""
    names = sorted(totals)
    summed = torch.stack([torch.as_tensor(totals[n], dtype=torch.float32, device=device)
                          for n in names])
    if accelerator is not None and accelerator.num_processes > 1:
        summed = accelerator.reduce(summed, reduction="sum")
    totals = dict(zip(names, summed.tolist()))
    per_step, counts = ("loss", "grad_norm", "lr"), ("response_tokens", "skipped_steps")
    metrics = {n: v / max(totals["response_tokens"], 1.0) for n, v in totals.items()
               if n not in per_step + counts}
    metrics |= {n: totals[n] / steps for n in per_step} | {n: totals[n] for n in counts}
    return metrics | dict(clip_frac=metrics["clip_low"] + metrics["clip_high"],
                          optimizer_steps=float(steps))


def check_batch(batch: Rollouts, cfg: Config, ref_model):
    if not len(batch.prompts) == len(batch.completions) == len(batch.rewards):
        raise ValueError(f"grpo_step: {len(batch.prompts)} prompts, {len(batch.completions)} "
                         f"completions and {len(batch.rewards)} rewards; pass one of each per "
                         f"rollout")
    sampled = batch.sampling_logprobs
    if sampled is not None and [len(x) for x in sampled] != [batch.policy_tokens(i)
                                                              for i in range(len(sampled))]:
        raise ValueError("grpo_step: sampling_logprobs needs one log-prob per completion token the "
                         "policy sampled, for every rollout")
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("grpo_step: kl_coef > 0 needs ref_model (the frozen starting policy)")


def make_optimization(model, cfg: Config, total_steps: int):
    """AdamW over the trainable parameters, every one decayed (verl's; fused where torch has the
    kernel), and its cosine schedule over the run's steps: linear warmup from 0 over the first 3 %,
    then decay to 0 (verl's)."""
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=WEIGHT_DECAY, fused=True)
    except RuntimeError:  # raised at construction on devices without a fused kernel
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=WEIGHT_DECAY)
    return optimizer, cosine_schedule(optimizer, total_steps, int(WARMUP_RATIO * total_steps))


def cosine_schedule(optimizer, total_steps: int, warmup_steps: int = 0):
    """LambdaLR: from 0 to the peak over warmup_steps (verl's: 0 at step 0), then a cosine to 0 at
    total_steps; flat after."""
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"cosine_schedule: need total_steps >= 1 and 0 <= warmup_steps <= "
                         f"total_steps, got {total_steps} and {warmup_steps}")

    def multiplier(step):
        if step < warmup_steps:
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def bf16_supported(device: torch.device) -> bool:
    """Whether bfloat16 runs natively: GPUs with it (not emulated: a V100 or T4 emulates it, and
    vLLM refuses it there), CPUs with AVX-512 BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":  # torch has no public query for these CPU features
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False
