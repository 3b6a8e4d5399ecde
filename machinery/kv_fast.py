"""The kv sampler's fast path: what makes sampler.py's plain decode loop fast and fit in memory.

sampler.py runs the model over its KV cache (forward, prefill, decode_one_token, sample_next) and
enters this module through visible calls:

    generate_kv         the "kv" backend: the rows in waves whose cache fits the memory budget,
                        the model's weights cast, stacked and packed once (sampling_weights: kept
                        between calls of a frozen model), the decode step compiled on request
    prefill_chunks      the prefill's forwards: each distinct prompt runs only its tokens after the
                        longest start it shares with another (prefix_plan), in batched chunks
    PrefillForward      one such forward's inputs, its shared starts copied into a scratch cache
    compact             finished rows leave the batch once an eighth of it has finished
    unsupported_reason  what a model has that forward does not run (sampler_args falls back to
                        "hf" then)

docs/sampler.md has the design and the measurements.
"""
import functools
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from machinery.sampler_cpu import (PackedLinear, forget_kept, kept_weights, packing_available,
                                   release_freed_memory)

KV_MODEL_TYPES = ("llama", "qwen2")
COMPACT_WHEN_FINISHED = 1 / 8  # compact the batch once this fraction of its rows has finished
# padded tokens per prefill forward: bounds its activations (the float32 attention scores grow with
# tokens x keys) while keeping matrix products large enough to run at speed
PREFILL_TOKENS = 2048


def unsupported_reason(model) -> str | None:
    """None when the kv backend can run `model`, else what it lacks (for the fallback notice)."""
    config = model.config
    if config.model_type not in KV_MODEL_TYPES:
        return f"model type {config.model_type!r} (only {', '.join(KV_MODEL_TYPES)})"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if config.hidden_act != "silu":
        return f"activation {config.hidden_act!r}"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        return f"rope type {rope_type!r} (its frequencies change with length)"
    return None


# --------------------------------------------------------------------------- weights

@dataclass
class Linear:
    """x W^T + b, W of shape (out_features, in_features)."""
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return len(self.weight)

    def __call__(self, x):
        return F.linear(x, self.weight, self.bias)


@dataclass
class Layer:
    """One block's tensors. q, k, v are one Linear stacked along the output and so are gate and up:
    one matrix product over the block's input instead of three (two), the same numbers at fewer,
    larger calls."""
    input_norm: torch.Tensor
    qkv: Linear | PackedLinear      # rows of q, then k, then v
    o: Linear | PackedLinear
    post_norm: torch.Tensor
    gate_up: Linear | PackedLinear  # rows of gate, then up
    down: Linear | PackedLinear


@dataclass
class Weights:
    """What sampler.forward reads."""
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    head: Linear | PackedLinear
    eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor  # float32 rotary frequencies theta^(-2i/d)
    rope_scale: float


def head_dim_of(config) -> int:
    """Width of one attention head: the config's head_dim, else hidden size / query heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sampling_weights(model, dtype: torch.dtype, frozen: bool) -> Weights:
    """model_weights, made once and kept between calls for a frozen model (the verifier: packing a
    1.5B takes 2-3 s) until a parameter changes, made anew on every call for a training one."""
    if frozen:
        return kept_weights(model, dtype, lambda: model_weights(model, dtype))
    return model_weights(model, dtype)


# models only the kv sampler reads, and the checkpoint folder their weights are read from
_FROM_FILES = weakref.WeakKeyDictionary()


def sampling_only(model, folder) -> bool:
    """Make a frozen model that only the kv sampler reads (the verifier) hold no weights of its own:
    its sampling weights are read from its checkpoint's safetensors files in `folder` (a tensor at a
    time), kept between calls, and dropped while the policy updates (sleep). False, and nothing
    changed, when the folder holds no safetensors file."""
    if not sorted(Path(folder).glob("*.safetensors")):
        return False
    for parameter in model.parameters():
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    _FROM_FILES[model] = Path(folder)
    return True


def sleep():
    """Drop the kept sampling weights of the models that read theirs from files (the update needs
    the memory; the next call reads them again, a few seconds for a 1.5B)."""
    for model in list(_FROM_FILES):
        forget_kept(model)


def file_tensors(folder: Path, device):
    """name -> the tensor stored under it in the folder's safetensors files, on `device`."""
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update(dict.fromkeys(f.keys(), path))

    def tensor(name):
        if name not in files and name == "lm_head.weight":  # a tied head is the embedding
            name = "model.embed_tokens.weight"
        with safe_open(files[name], "pt") as f:
            return f.get_tensor(name).to(device)
    return tensor


def model_weights(model, dtype: torch.dtype) -> Weights:
    """The model's tensors in `dtype`: the parameters themselves when the dtype matches, else one
    cast copy each (read from its files for a sampling_only model). Stacked weights are new tensors,
    made on every call: a training policy's weights change between calls. On a CPU in bfloat16
    each product's weight is packed for oneDNN (sampler_cpu.PackedLinear)."""
    cast, device = {}, next(model.parameters()).device
    pack = packing_available(dtype, device)
    named = dict(model.named_parameters(remove_duplicate=False))
    source = (file_tensors(_FROM_FILES[model], device) if model in _FROM_FILES
              else named.__getitem__)
    names = {id(p): name for name, p in reversed(named.items())}  # a tied head: the embedding's

    def get(t):
        if t is None:
            return None
        if id(t) not in cast:  # a tied head is cast once, together with the embedding
            cast[id(t)] = source(names[id(t)]).detach().to(dtype)
        return cast[id(t)]
    def linear(*modules):
        weight = (get(modules[0].weight) if len(modules) == 1
                  else torch.cat([get(m.weight) for m in modules]))
        biases = [get(getattr(m, "bias", None)) for m in modules]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(len(m.weight), dtype=dtype, device=weight.device) if b is None else b
             for m, b in zip(modules, biases)])
        # packed, the stacked weight is dropped at once: only the packed copy is read
        return PackedLinear.of(weight, bias) if pack else Linear(weight, bias)

    config, body = model.config, model.model
    layers = [Layer(get(b.input_layernorm.weight),
                    linear(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
                    linear(b.self_attn.o_proj), get(b.post_attention_layernorm.weight),
                    linear(b.mlp.gate_proj, b.mlp.up_proj), linear(b.mlp.down_proj))
              for b in body.layers]
    return Weights(get(body.embed_tokens.weight), layers, get(body.norm.weight),
                   linear(model.lm_head), config.rms_norm_eps, config.num_attention_heads,
                   config.num_key_value_heads, head_dim_of(config),
                   body.rotary_emb.inv_freq.float(), float(body.rotary_emb.attention_scaling))


def rotary_tables(w: Weights, length: int, dtype):
    """cos and sin of position * frequency for positions 0 .. length-1, each (length, head_dim)."""
    angles = torch.arange(length, device=w.inv_freq.device).float()[:, None] * w.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * w.rope_scale).to(dtype), (angles.sin() * w.rope_scale).to(dtype)


@functools.cache
def compiled(forward, device_type: str):
    # CUDA graphs ("reduce-overhead") remove the per-kernel launch cost that dominates small decode
    # steps on a GPU.
    mode = "reduce-overhead" if device_type == "cuda" else None
    return torch.compile(forward, dynamic=True, mode=mode)


# --------------------------------------------------------------------------- waves

@dataclass
class Run:
    """What every wave of one generate call shares."""
    w: Weights
    rotary: tuple        # (cos, sin), each (length, head dim)
    step: object         # sampler.forward, or its compiled twin: the decode step
    windowed: bool       # decode attends over a window of the cache columns, not all (eager CUDA)
    eos: torch.Tensor    # end-of-sequence ids (empty: EOS ignored)
    dtype: torch.dtype   # compute dtype
    device: torch.device


def generate_kv(model, prompt_ids, n, sampling, prompt_seeds, eos_ids, forward, decode, *, dtype,
                memory_budget, compile, progress, frozen, tools):
    """sampler.generate's "kv" backend: row r samples for prompt r // n, in waves of rows that fit
    memory_budget, each sampled by decode (sampler._decode_wave) with forward (sampler.forward)."""
    device = next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    longest, steps, n_rows = max(map(len, prompt_ids)), sampling.max_new_tokens, len(prompt_ids) * n
    planned = waves(model, n_rows, longest, steps, dtype, memory_budget)
    w = sampling_weights(model, dtype, frozen)
    run = Run(w, rotary_tables(w, longest + steps, dtype),
              compiled(forward, device.type) if compile else forward,
              device.type == "cuda" and not compile,
              torch.tensor(eos_ids, dtype=torch.long, device=device), dtype, device)
    rows = []
    for start, stop in planned:
        uniforms = None
        if sampling.temperature > 0:
            uniforms = row_uniforms(prompt_seeds, n, steps, start, stop).to(device)
        label = progress and (progress if stop - start == n_rows
                              else f"{progress} (rows {start}-{stop - 1})")
        rows += decode(run, [prompt_ids[r // n] for r in range(start, stop)], sampling, uniforms,
                       progress=label, tools=tools)
    del run, w  # the sampling copy of a training model, the caches: back to the system
    release_freed_memory()
    return rows


def _default_budget(device) -> int:
    """Half the memory a new allocation can get: on Linux MemAvailable, which counts the page cache
    the kernel gives back (free pages alone, after a run has read its model files, can be a few
    hundred MB of 24 GB and split a call into needless waves); on a GPU the free memory plus what
    PyTorch holds reserved but unused (the update's freed gradients and activations), which the
    driver counts as used."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return (torch.cuda.mem_get_info(device)[0] + cached) // 2
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo
                             if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2


def cache_bytes_per_row(model, length: int, dtype) -> int:
    """Bytes of one row's keys and values at `length` columns, plus its float32 logits, sampling
    buffers and uniforms."""
    config = model.config
    element = torch.empty((), dtype=dtype).element_size()
    cache = (2 * config.num_hidden_layers * config.num_key_value_heads * length
             * head_dim_of(config) * element)
    return cache + 4 * config.vocab_size * 4 + 4 * length


def waves(model, n_rows: int, longest: int, steps: int, dtype, memory_budget) -> list[tuple]:
    """Rows [start, stop) of each wave: as many rows of `longest` prompt tokens + `steps` as the
    cache of one wave fits in memory_budget (default: half the available memory)."""
    length = longest + steps
    if length > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({steps}) exceeds the "
                         f"model's {model.config.max_position_embeddings} positions; shorten one "
                         f"of them")
    budget = memory_budget or _default_budget(next(model.parameters()).device)
    per_row = cache_bytes_per_row(model, length, dtype)
    wave_rows = budget // per_row
    if wave_rows < 1:
        raise ValueError(f"memory_budget={budget} bytes holds no row of {length} tokens ({per_row} "
                         f"bytes); raise memory_budget or lower max_new_tokens")
    return [(start, min(start + wave_rows, n_rows)) for start in range(0, n_rows, wave_rows)]


def row_uniforms(prompt_seeds, n, steps, start, stop):
    """Uniforms in [0, 1), (stop - start, steps), for rows start .. stop-1 (row r samples for
    prompt r // n).

    Prompt p's n rows are torch.rand(n, steps) of a CPU generator seeded with prompt_seeds[p], so a
    row's draws depend on its prompt's seed and its index among that prompt's rows only (not on the
    device, the wave or the rows beside it).
    """
    first_prompt = start // n
    draws = [torch.rand(n, steps, generator=torch.Generator().manual_seed(prompt_seeds[p]))
             for p in range(first_prompt, (stop - 1) // n + 1)]
    return torch.cat(draws)[start - first_prompt * n:stop - first_prompt * n]


def compact(cache, batch, tokens):
    """Once COMPACT_WHEN_FINISHED of the batch has finished, its live rows move to the front of the
    cache and the batch shrinks to them, so they stop costing compute. Returns the batch and its
    rows' tokens."""
    live = int(batch.alive.sum())
    if len(batch.alive) - live < max(1, COMPACT_WHEN_FINISHED * len(batch.alive)):
        return batch, tokens
    keep = batch.alive.nonzero().squeeze(1)
    for i in range(len(cache.k)):  # layer by layer: the gather's temporary stays one layer large
        cache.k[i, :live] = cache.k[i, keep]
        cache.v[i, :live] = cache.v[i, keep]
    start = batch.start[keep]
    return replace(batch, rows=batch.rows[keep], start=start, alive=batch.alive[keep],
                   first_column=int(start.min()), columns=batch.columns[keep]), tokens[keep]


# --------------------------------------------------------------------------- prefill, shared starts

def common_prefix(a, b) -> int:
    """How many tokens lists a and b share at their start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class PrefixStep:
    source: int | None   # the distinct prompt whose row holds this one's first `shared` tokens
    shared: int          # tokens copied from it; this prompt prefills only tokens [shared, len)
    level: int           # prefilled in forward number `level`, after its source (level - 1)


def prefix_plan(prompts) -> list[PrefixStep]:
    """How distinct `prompts` (token-id lists) share their prefill: one PrefixStep each.

    In sorted order the earlier prompt sharing the longest start with prompt k is its neighbour
    k - 1, since lcp(a, c) = min(lcp(a, b), lcp(b, c)) for a <= b <= c. Its source is the first
    prompt of the run that shares those tokens; that one shares fewer with its own predecessor,
    so sources lead down to a prompt that shares nothing (level 0), and there are at most as many
    levels as distinct shared lengths. A distinct prompt never shares all of its tokens (a prompt
    that starts another sorts before it), so each prefills at least its last token, whose logits
    start the sampling.
    """
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    lcp = [0] + [common_prefix(prompts[a], prompts[b]) for a, b in zip(order, order[1:])]
    plan = [None] * len(prompts)
    for k, i in enumerate(order):
        if lcp[k] == 0:
            plan[i] = PrefixStep(None, 0, 0)
            continue
        j = k - 1
        while j > 0 and lcp[j] >= lcp[k]:
            j -= 1
        plan[i] = PrefixStep(order[j], lcp[k], plan[order[j]].level + 1)
    return plan


def prefill_chunks(prompts, width: int):
    """How sampler.prefill runs `prompts` (prompts[r]: row r's; rows may share one), ending at
    column `width`: (chunks, rows_of). rows_of[i] are the rows that sample from distinct prompt i;
    chunks are the forwards, in order, each a list of jobs (row, prompt, shared, (source row, its
    first column) or None).

    Each distinct prompt runs once, in its first row, and only its tokens after the longest start
    it shares with another prompt (prefix_plan), whose source row an earlier chunk prefills. The
    prompts of one level go together, in chunks of PREFILL_TOKENS padded tokens, shortest suffix
    first.
    """
    distinct, rows_of = {}, []  # token tuple -> its index; the rows sampling from each prompt
    for row, prompt in enumerate(prompts):
        index = distinct.setdefault(tuple(prompt), len(distinct))
        if index == len(rows_of):
            rows_of.append([])
        rows_of[index].append(row)
    unique = [list(p) for p in distinct]
    plan = prefix_plan(unique)
    chunks = []
    for level in range(max(step.level for step in plan) + 1):
        jobs = []  # (row, prompt, shared, (source row, its first column))
        for i, step in enumerate(plan):
            if step.level == level:
                source = (None if step.source is None
                          else (rows_of[step.source][0], width - len(unique[step.source])))
                jobs.append((rows_of[i][0], unique[i], step.shared, source))
        jobs.sort(key=lambda job: len(job[1]) - job[2])
        chunk = []
        for job in jobs:
            if chunk and (len(chunk) + 1) * (len(job[1]) - job[2]) > PREFILL_TOKENS:
                chunks.append(chunk)
                chunk = []
            chunk.append(job)
        chunks.append(chunk)
    return chunks, rows_of


@dataclass
class PrefillForward:
    """The inputs of one prefill forward over jobs [(row, prompt, shared, (source row, its first
    column) or None)]. A scratch cache holds one row per job: its `shared` tokens, copied from the
    source row, end at column A (the most any job shares), its own tokens follow, right-padded to
    the longest; a token attends to its row's columns from its prompt's first to itself, so padding
    (after every real token) is never read."""
    jobs: list
    shared_end: int          # A
    rows: torch.Tensor       # (jobs,) the wave rows whose logits this forward gives
    tokens: torch.Tensor     # (jobs, S) each job's own tokens, right-padded
    positions: torch.Tensor  # (jobs, S) their rotary positions; padding at 0
    columns: torch.Tensor    # (S,) their scratch columns
    scratch: object          # sampler.KVCache, (jobs, A + S columns)
    mask: torch.Tensor       # (jobs, 1, S, A + S)
    last: torch.Tensor       # (jobs,) each job's last own token

    @classmethod
    def of(cls, w, cache, jobs):
        device = cache.k.device
        shared = torch.tensor([job[2] for job in jobs], device=device)
        own = torch.tensor([len(job[1]) - job[2] for job in jobs], device=device)  # tokens it runs
        A, S = int(shared.max()), int(own.max())
        scratch = type(cache).zeros(w, len(jobs), A + S, cache.k.dtype, device)
        tokens = torch.zeros(len(jobs), S, dtype=torch.long, device=device)
        for j, (_, prompt, n_shared, source) in enumerate(jobs):
            tokens[j, :len(prompt) - n_shared] = torch.tensor(prompt[n_shared:], device=device)
            if source is not None:
                copy_columns(scratch, j, A - n_shared, cache, *source, n_shared)
        t = torch.arange(S, device=device)
        positions = torch.where(t < own[:, None], shared[:, None] + t, 0)
        keys = torch.arange(A + S, device=device)
        mask = (keys >= A - shared[:, None, None]) & (keys <= A + t[None, :, None])  # jobs, S, A+S
        rows = torch.tensor([job[0] for job in jobs], device=device)
        return cls(jobs, A, rows, tokens, positions, A + t, scratch, mask[:, None], own - 1)

    def store(self, cache, width: int):
        """Each job's prompt, from the scratch cache into its row's columns [width - len, width)."""
        for j, (row, prompt, n_shared, _) in enumerate(self.jobs):
            copy_columns(cache, row, width - len(prompt), self.scratch, j,
                         self.shared_end - n_shared, len(prompt))


def copy_shared_rows(cache, logits, prompts, rows_of, width: int):
    """Each distinct prompt's prefilled row (rows_of[i][0]), its cache columns and logits, into the
    other rows that sample from it."""
    for rows in rows_of:
        if len(rows) > 1:
            start = width - len(prompts[rows[0]])
            copies = torch.tensor(rows[1:], device=logits.device)
            copy_columns(cache, copies, start, cache, rows[0], start, width - start)
            logits[copies] = logits[rows[0]].clone()


def copy_columns(cache, rows, start: int, source, source_row: int, source_start: int, count: int):
    """Columns [start, start + count) of the cache's `rows` (an int or an index tensor) := `count`
    columns of source's row source_row from source_start."""
    rows = slice(rows, rows + 1) if isinstance(rows, int) else rows
    for mine, theirs in ((cache.k, source.k), (cache.v, source.v)):
        mine[:, rows, :, start:start + count] = theirs[:, source_row:source_row + 1, :,
                                                       source_start:source_start + count]
