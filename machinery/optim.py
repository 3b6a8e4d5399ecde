"""The optimizer of test-time RL: AdamW with decoupled weight decay on the matrices, its
linear-warmup cosine schedule as verl steps it, and the update's settings from a run's config."""
import math

import torch

from config import GRPOSettings
from machinery.update import bf16_supported


def make_optimizer(model, lr: float, weight_decay: float = 0.01, betas=(0.9, 0.999)):
    """AdamW over the trainable parameters; matrices decay, vectors (norms, biases) do not. Fused
    where torch has a fused kernel for the parameters' device."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
    except RuntimeError:  # raised at construction for devices without fused kernels
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def cosine_schedule(optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0):
    """LambdaLR: linear warmup from 0 to the peak lr over warmup_steps (verl's: lr 0 at step 0),
    then cosine decay to min_lr_ratio x peak at total_steps; flat after."""
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"cosine_schedule: need total_steps >= 1 and 0 <= warmup_steps <= "
                         f"total_steps, got total_steps={total_steps}, warmup_steps={warmup_steps}")

    def multiplier(step):
        if step < warmup_steps:  # verl's warmup: lr 0 at step 0
            return step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


def make_optimization(policy, batches: list[list[dict]], cfg):
    """AdamW on the policy and its cosine schedule over the run's training steps (verl) or optimizer
    steps."""
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # an optimizer step per mini-batch of questions: ceil(questions / Q) per training step
    total = len(batches) if cfg.lr_schedule_unit == "step" else sum(
        -(-len(b) // (cfg.mini_batch_questions or len(b))) for b in batches)
    warmup = int(cfg.warmup_ratio * total)
    return optimizer, cosine_schedule(optimizer, total_steps=total, warmup_steps=warmup)


def grpo_settings(cfg, device) -> GRPOSettings:
    """The update's settings from the run's: M rollouts per question, Q questions per optimizer
    step, the loss."""
    return GRPOSettings(group_size=cfg.n_train, mini_batch_groups=cfg.mini_batch_questions or None,
                        clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                        clip_ratio_c=cfg.clip_ratio_c, kl_coef=cfg.kl_coef, agg=cfg.loss_agg,
                        lr_schedule_unit=cfg.lr_schedule_unit,
                        norm_len=cfg.max_new_tokens, scale_advantages=cfg.scale_advantages,
                        temperature=cfg.temperature, token_budget=cfg.micro_batch_tokens,
                        micro_batch_rollouts=cfg.micro_batch_rollouts,
                        bf16=cfg.bf16 and bf16_supported(device),
                        gradient_checkpointing=cfg.grad_checkpointing,
                        is_cap=cfg.vllm_is_cap if cfg.vllm_is_correction else None)
