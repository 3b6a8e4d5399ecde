"""grpo.grpo_step's bookkeeping: its arguments checked at the boundary, the step's statistics summed
over processes, whether the hardware runs bfloat16 natively, and the gradient's accumulation and
clipping under DDP, FSDP (machinery/fsdp.py) or one process."""
from contextlib import nullcontext

import torch

from machinery.fsdp import clip_gradients as clip_sharded, is_sharded


def bf16_supported(device: torch.device) -> bool:
    """Whether bfloat16 autocast runs natively: GPUs with bf16, CPUs with AVX-512 BF16 or AMX."""
    if device.type == "cuda":  # not emulated: a V100 or T4 emulates bf16, and vLLM refuses it there
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":  # torch has no public query for these CPU features
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return False


def check_step_arguments(batch: "grpo.Rollouts", s, ref_model):
    if not len(batch.prompts) == len(batch.completions) == len(batch.rewards):
        raise ValueError(f"grpo_step: {len(batch.prompts)} prompts, {len(batch.completions)} "
                         f"completions and {len(batch.rewards)} rewards; pass one of each per "
                         f"rollout")
    lengths = [len(c) for c in batch.completions]
    if batch.tool_masks is not None and [len(m) for m in batch.tool_masks] != lengths:
        raise ValueError("grpo_step: tool_masks needs one flag per completion token of every "
                         "rollout")
    sampled = batch.sampling_logprobs
    policy_tokens = [batch.policy_tokens(i) for i in range(len(sampled or []))]
    if sampled is not None and [len(x) for x in sampled] != policy_tokens:
        raise ValueError("grpo_step: sampling_logprobs needs one log-prob per completion token the "
                         "policy sampled, for every rollout")
    if s.is_cap is not None and (sampled is None or s.is_cap < 1):
        raise ValueError(f"is_cap={s.is_cap}: truncated importance sampling needs the sampler's "
                         f"log-probs (sampling_logprobs) and a cap >= 1")
    if s.mini_batch_groups is not None and s.mini_batch_groups < 1:
        raise ValueError(f"mini_batch_groups={s.mini_batch_groups}: must be >= 1 (or None: one "
                         f"mini-batch)")
    if s.kl_coef > 0 and ref_model is None:
        raise ValueError("grpo_step: kl_coef > 0 needs ref_model (the frozen initial policy)")
    if s.temperature <= 0:
        raise ValueError(f"temperature={s.temperature}: pass the (positive) temperature the "
                         f"rollouts were sampled at")


def step_statistics(totals: dict, steps: int, accelerator) -> dict:
    """Sums over processes of the mini-batches' statistics -> the step's token means, and the loss,
    gradient norm and learning rate averaged over its optimizer steps."""
    names = sorted(totals)
    device = accelerator.device if accelerator is not None else "cpu"
    summed = torch.stack([torch.as_tensor(totals[name], dtype=torch.float32, device=device)
                          for name in names])
    if accelerator is not None and accelerator.num_processes > 1:
        summed = accelerator.reduce(summed, reduction="sum")
    totals = dict(zip(names, summed.tolist()))
    tokens = max(totals["response_tokens"], 1.0)
    per_step, counts = ("loss", "grad_norm", "lr"), ("response_tokens", "skipped_steps")
    metrics = {name: value / tokens for name, value in totals.items()
               if name not in (*per_step, *counts)}
    metrics.update({name: totals[name] / steps for name in per_step})
    metrics.update({name: totals[name] for name in counts})
    metrics.update(clip_frac=metrics["clip_low"] + metrics["clip_high"],
                   optimizer_steps=float(steps))
    return metrics


def no_sync(model, accelerator):
    """The context of a micro-batch before a mini-batch's last: DDP's no_sync (its all-reduce waits
    for the last). FSDP reduce-scatters every micro-batch's gradient into the shards instead, as
    holding them unsharded until the last would take the full gradients' memory."""
    if is_sharded(model):
        return nullcontext()
    if accelerator is not None:
        return accelerator.no_sync(model)
    return getattr(model, "no_sync", nullcontext)()


def clip_gradients(model, max_norm: float, accelerator) -> torch.Tensor:
    """Clip the gradient to a total norm of max_norm; returns the norm before clipping (the whole
    model's, the same under DDP, FSDP and one process)."""
    if is_sharded(model):
        return clip_sharded(model, max_norm)
    params = [p for p in model.parameters() if p.requires_grad]
    clip = (accelerator.clip_grad_norm_ if accelerator is not None
            else torch.nn.utils.clip_grad_norm_)
    return clip(params, max_norm)
