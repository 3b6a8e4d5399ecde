"""The update's batches: rollouts padded into forward passes, micro-batches that fit a token budget,
and each process's share of every mini-batch with its weight in the mini-batch's loss
(grpo.grpo_step)."""
from dataclasses import dataclass

import torch

from config import GRPOSettings


def pad_batch(prompts, completions, device=None, tool_masks=None):
    """Right-padded (input_ids long, attention_mask long, response_mask bool), each [B, T], from
    lists of prompt and completion token ids (T = longest prompt + completion; padding is masked
    out). tool_masks: per completion, True at the tokens a tool appended; the response mask leaves
    them out (they are read as context, and no loss, entropy or KL is taken on them)."""
    if len(prompts) != len(completions):
        raise ValueError(f"pad_batch: {len(prompts)} prompts but {len(completions)} completions; "
                         f"pass one of each per rollout")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{i}] is empty; every rollout needs at least one prompt "
                             f"token as context")
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    input_ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        input_ids[i, :lengths[i]] = torch.tensor(list(prompt) + list(completion), dtype=torch.long)
        attention_mask[i, :lengths[i]] = 1
        response_mask[i, len(prompt):lengths[i]] = True
        if tool_masks is not None and tool_masks[i] is not None:
            response_mask[i, len(prompt):lengths[i]] &= ~torch.tensor(tool_masks[i],
                                                                      dtype=torch.bool)
    return input_ids.to(device), attention_mask.to(device), response_mask.to(device)


def micro_batches(lengths, token_budget: int, rollouts: int = 0) -> list[list[int]]:
    """Indices split into micro-batches whose padded size (rows x longest) fits token_budget.
    Longest first, so neighbours have similar lengths and little padding; a sequence over the budget
    goes alone. rollouts > 0: runs of that many indices in order, whatever their lengths (verl's
    ppo_micro_batch_size_per_gpu)."""
    if rollouts:
        return [list(range(i, min(i + rollouts, len(lengths))))
                for i in range(0, len(lengths), rollouts)]
    batches = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


@dataclass
class MicroBatch:
    """Rollouts padded into one forward pass, with what the loss needs beside them."""
    input_ids: torch.Tensor                 # [b, T] long, right-padded prompt + completion
    attention_mask: torch.Tensor            # [b, T] long
    response_mask: torch.Tensor             # [b, T] bool, the completion's tokens the policy
                                            # sampled
    advantages: torch.Tensor                # [b] float32
    weight: float                           # its share of the mini-batch's loss normaliser
                                            # (x processes)
    old_logp: torch.Tensor | None = None    # [b, T] log pi_old, when the policy has moved since
                                            # sampling
    ref_logp: torch.Tensor | None = None    # [b, T] log pi_ref, when kl_coef > 0
    sampling_logp: torch.Tensor | None = None  # [b, T] log mu, the sampler's, when it reported them


def plan(batch: "grpo.Rollouts", advantages, s: GRPOSettings, accelerator, lockstep=False):
    """This process's micro-batches of each mini-batch: [[MicroBatch, ...] per optimizer step].
    lockstep: every process gets as many micro-batches in each mini-batch as the one with the most
    (the extra ones: a rollout at weight 0), since under FSDP every forward and backward is a
    collective; each process knows the others' counts, as it holds the whole batch."""
    rank, processes = ((accelerator.process_index, accelerator.num_processes)
                       if accelerator is not None else (0, 1))
    prompts, completions, group_size = batch.prompts, batch.completions, s.group_size
    sampler_logprobs = batch.sampling_logprobs
    groups = len(advantages) // group_size
    per_step = s.mini_batch_groups or groups

    def size(index):
        # a set of rollouts' part of L's normaliser: the policy's tokens (dapo) or sequences (every
        # other aggregation, verl's token-mean included: verl weights a micro-batch by its rollouts)
        return sum(batch.policy_tokens(i) for i in index) if s.agg == "dapo" else len(index)

    def cut(indices):  # indices split into micro-batches
        lengths = [len(prompts[i]) + len(completions[i]) for i in indices]
        return [[indices[j] for j in index]
                for index in micro_batches(lengths, s.token_budget, s.micro_batch_rollouts)]

    plan = []
    for first in range(0, groups, per_step):
        rollouts = range(first * group_size, min(first + per_step, groups) * group_size)
        # every process holds the whole batch, so each knows the mini-batch's normaliser without a
        # collective; x processes because DDP averages the processes' gradients
        share = processes / max(size(rollouts), 1)
        mine = list(rollouts[rank::processes])
        # nothing of this mini-batch here: one rollout at weight 0 keeps the all-reduce in step
        if not mine:
            mine, share = [rollouts[0]], 0.0
        cuts = [(index, share) for index in cut(mine)]
        if lockstep:
            most = max(max(1, len(cut(rollouts[r::processes]))) for r in range(processes))
            cuts += [([mine[0]], 0.0)] * (most - len(cuts))
        plan.append([])
        for index, weight in cuts:
            masks = None if batch.tool_masks is None else [batch.tool_masks[i] for i in index]
            padded = pad_batch([prompts[i] for i in index], [completions[i] for i in index],
                               advantages.device, masks)
            sampled = None
            # into the response positions, row-major as pad_batch laid them out
            if sampler_logprobs is not None:
                flat = torch.tensor([lp for i in index for lp in sampler_logprobs[i]],
                                    dtype=torch.float32)
                sampled = torch.zeros(padded[2].shape).masked_scatter(
                    padded[2].cpu(), flat).to(advantages.device)
            plan[-1].append(MicroBatch(*padded, advantages[index], weight=size(index) * weight,
                                       sampling_logp=sampled))
    return plan
