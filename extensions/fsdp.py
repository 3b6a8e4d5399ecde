"""--parallel fsdp: the policy sharded over the processes with torch's FSDP2 (fully_shard), beside
DDP's replicas. Enters in t3rl.setup at one call, before the optimizer is made:

    shard(learner)   # trained: the shards; policy: a full copy the samplers read, refreshed before
                     # each sampling call; a checkpoint gathers the shards, a resume scatters them

grpo_step trains `trained` as it trains DDP's module (it clips a sharded gradient's DTensor norm,
and runs every process's micro-batches in lockstep since each backward is collective).

- Sharding: each decoder layer is a unit (its parameters all-gathered for its forward and its
  backward, its gradients reduce-scattered), then the root (embedding, final norm, head, so the tied
  embedding and head are one parameter in one unit), which stays gathered between its forward and
  backward: logprobs.token_logprobs applies the head's weight after the model's forward returns.
  Parameters stay float32 and are gathered in float32 (no MixedPrecisionPolicy): the update's
  bfloat16 autocast casts them per use, as under DDP. Gradients are averaged over processes, as
  DDP's all-reduce averages them, so grpo.plan_batches' weights are unchanged.
- Sampling: each process samples its own questions for its own number of tokens, so it cannot run
  through the sharded module (its per-layer all-gathers would wait on each other). A plain full copy
  of the policy is `policy` (Learner.policy), which the samplers read like a DDP replica;
  refreshing gathers it parameter by parameter before each sampling call, on every process.
- Checkpoints: full weights and optimizer state gathered to the main process (full_state), a
  --model folder as under DDP; a resume loads the weights, then scatters the optimizer state.
Design and memory figures: docs/distributed.md#fsdp.
"""
import copy

import torch
from torch.distributed.fsdp import fully_shard

from config import OptionError


def shard(learner):
    """t3rl.setup's one call for --parallel fsdp: the Learner's policy sharded (learner.trained),
    a full copy for the samplers (learner.policy) brought up to the shards before each sampling
    call, and the checkpoint's gather and the resume's scatter of the optimizer state."""
    learner.trained, learner.policy, learner.ref_model = shard_models(
        learner.policy, learner.ref_model, learner.cfg, learner.accelerator.device)
    learner.sample = refreshing(learner.sample, learner.trained, learner.policy)
    learner.full_state = full_state
    learner.load_optimizer = lambda state: restore_optimizer(learner.trained, learner.optimizer,
                                                             state)


def shard_models(policy, ref_model, cfg, device):
    """(sharded policy, its sampling copy, reference model) for --parallel fsdp; the policy is
    sharded in place. The copy holds the parameters in the dtype the samplers compute in (--backend
    hf: the policy's own, float32). The reference model (--kl-coef) has its decoder layers sharded
    and its embedding and head whole: it never takes a backward, in which a sharded root would
    reshard. Under --backend vllm the copy stays in CPU memory: the engine holds the weights it
    samples with, and loads them from the copy after each update."""
    # the config names a dtype (runs.settle fixes "auto" when the run starts)
    dtype = torch.float32 if cfg.backend == "hf" else getattr(torch, cfg.sample_dtype)
    home = torch.device("cpu") if cfg.backend == "vllm" else device
    full = copy.deepcopy(policy).requires_grad_(False)
    for p in full.parameters():  # not .to(dtype): that would cast the rotary buffers too
        p.data = p.data.to(device=home, dtype=dtype)
    full.to(home)
    mesh = _mesh(device)
    policy.to(device)
    _shard_layers(policy, mesh)
    # the root stays gathered from its forward to its backward: the head's weight is read after
    # the forward returns (logprobs.token_logprobs)
    fully_shard(policy, mesh=mesh, reshard_after_forward=False)
    if ref_model is not None:
        _shard_layers(ref_model.to(device), mesh)
    return policy, full, ref_model


def _mesh(device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device.type, (dist.get_world_size(),))


def _shard_layers(model, mesh):
    # resharded after each forward, also where a layer is its own root (the reference model's), for
    # which FSDP's default keeps it gathered
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' layout: model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise OptionError(f"--parallel fsdp: {type(model).__name__} has no model.layers to shard "
                         f"layer by layer; pass --parallel ddp")
    return list(layers)


def refreshing(sample, trained, policy):
    """The sampling function with the copy brought up to the shards' weights first: one all-gather
    per parameter, on every process (every process calls it, its share of questions empty or
    not)."""
    def sample_refreshed(*args, **kwargs):
        with torch.no_grad():
            for target, source in zip(policy.parameters(), trained.parameters(), strict=True):
                target.copy_(source.full_tensor())
        return sample(*args, **kwargs)
    return sample_refreshed


def full_state(model, optimizer) -> tuple[dict, dict]:
    """(weights, optimizer state) in full, on the main process (empty elsewhere), in CPU memory;
    every process takes part."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    # a tied head comes back as a copy of the embedding, which save_pretrained would write twice
    tied = ({name for name, _ in model.named_parameters(remove_duplicate=False)}
            - {name for name, _ in model.named_parameters()})
    return ({name: w for name, w in weights.items() if name not in tied},
            get_optimizer_state_dict(model, optimizer, options=options))


def restore_optimizer(model, optimizer, state: dict):
    """The full optimizer state of a checkpoint (full_state's) scattered onto the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True))
