"""Sample n completions per prompt, fast: the rollouts of test-time RL.

    generate(model, tokenizer, prompts, n, max_new_tokens, temperature=0.6, top_p=0.95, seed=None,
             backend="kv", ignore_eos=False) -> [[Completion] * n for each prompt]

Test-time RL samples N = 64 rollouts per question, so sampling is most of its cost. Three backends:

  "hf"    transformers `generate`, the reference.
  "vllm"  the vLLM inference engine, colocated, the model's weights synced into it (engine.py).
  "kv"  a batched sampler in plain PyTorch for the Llama / Qwen2 family, running the model's own weights:

            x_0    = embed[tokens]
            h      = x + Attn(RMSNorm(x))             RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
            x'     = h + W_down (silu(W_gate g) * W_up g),   g = RMSNorm(h)        (SwiGLU)
            logits = W_head RMSNorm(x_L)               (W_head may be the embedding: tied)

        Attention is grouped-query (several query heads share one key/value head) with rotary position
        embeddings: q, k at position t are rotated by angles t * theta^(-2i/d), i = 0 .. d/2-1.

Design of "kv":
  - KV cache: two tensors, keys and values, each (layers, rows, kv heads, max length, head dim), sized and
    allocated once per wave and never reallocated while decoding. Prompts of one wave are left-padded to end
    at a common column P (the longest prompt): prompt p sits in columns [P - len_p, P) and completion token j in
    column P + j, so every row writes the same column each step; an attention mask hides the columns
    before a row's prompt and the rotary position of a column is its offset from the row's own prompt start.
  - Prefill once what prompts share: a prompt runs through the model into one row, and its keys and values
    are copied into the other n - 1 rows that sample from it. Prompts that begin with the same tokens (the
    verifier's system prompt in all of its prompts, the problem in the N prompts of one question) prefill
    that start once: a token's keys and values depend only on the tokens up to it (causal attention), so a
    prompt copies the cache columns of the prompt sharing its longest start and runs only the rest, at the
    positions it has in the whole prompt. Sorted prompts give these sources (prefix_plan); the prompts whose
    sources are ready run together, their own tokens right-padded into one batched forward per
    PREFILL_TOKENS, so prefill runs at matrix speed rather than one prompt at a time.
  - Decode attends over the whole cache, masked, on a CPU (its batched product would copy a strided window
    whole, every layer and step); on CUDA over the window from the first live prompt column to the current.
  - Matrix products on the weights: q, k and v are one product on their stacked weights, and so are gate and
    up. On a CPU in bfloat16 each weight is packed once per call into oneDNN's blocked layout
    (sampler_cpu.py), which F.linear would redo at every product: the same numbers, decode 1.4-3x faster.
    A model that never trains (frozen=True: the verifier) keeps its packed weights between calls.
  - Finished rows leave the batch: when an eighth of the batch has produced its end-of-sequence token, the
    live rows are copied to the front of the cache and the batch shrinks, so they stop costing compute.
  - Tool calls (generate's `tools`, agent.py): a row whose tokens close a block pauses for one step while the
    step's blocks run together; the output's tokens then go through the model into that row's cache from its
    next column on (one forward of the output alone, nothing prefilled again), and from then on each row
    writes its own column (rows hold different numbers of tokens), with its rotary position and its mask.
  - The step's float32 logits and their probabilities live in two (rows, vocab) buffers allocated with the
    cache: fresh 152k-wide tensors every step cost more in page faults than the arithmetic on them.
  - Waves: the cache size (2 * layers * rows * kv heads * max length * head dim * bytes per element) is
    computed before allocating; rows are split into waves that fit `memory_budget` instead of failing.
  - Sampling: temperature, then exact top-p. transformers sorts all 152k logits every step; here tokens
    with probability below (1 - top_p) / V are dropped first: together they weigh less than 1 - top_p, so
    the nucleus (smallest set of top tokens with mass >= top_p) lies among the rest, and only those are
    sorted (top-k with k = the largest number of survivors in any row). The result is the same nucleus.
  - Seeds are per prompt: prompt p's n rows draw their uniforms u (n, max_new_tokens) up front from a
    generator seeded with seed[p], and row r takes token c_i at step j for the first candidate i with
        P_1 + ... + P_i >= u[r, j] * (P_1 + ... + P_k)       (inverse CDF; candidates ordered by probability,
    ties by token id), so a row's draws follow it through waves and compaction, and what a prompt gets is a
    function of (model, prompt, seed[p], options) alone, not of the prompts sharing its call. An int seed
    stands for the per-prompt seeds a generator seeded with it draws: prompt p's samples then depend on
    (seed, p). Tokens are identical only where the forward pass is too: bfloat16 on CPUs (oneDNN) gives a
    row the same logits whatever the batch; float32 on MKL does not (its GEMM rounds differently for 1, 2-3
    and >= 4 rows, and attention sums in an order that shifts with the left padding); GPUs promise neither.
  - compile=True: the decode step through torch.compile (CUDA graphs on a GPU; slower than eager on a CPU).
  - dtype=bfloat16 on a float32 model casts the weights once per call (the loop keeps float32 master weights).
  - Other architectures (or sliding-window / dynamic rotary variants) fall back to "hf" with a notice.

Token ids: a string prompt is tokenised as tokenizer(prompt, add_special_tokens=False).input_ids (chat
templates are the caller's job) and each Completion carries the prompt ids it was sampled from.
`token_ids` are exactly the sampled ids; when finish_reason is "eos" the last of them is the
end-of-sequence token (GRPO trains on it). `text` is the decoded completion without special tokens.
Both backends run under torch.inference_mode and leave the model's mode (train / eval) as they found it.
"""
import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from tqdm import tqdm

from sampler_cpu import PackedLinear, kept_weights, packing_available

BACKENDS = ("kv", "hf", "vllm")
KV_MODEL_TYPES = ("llama", "qwen2")
COMPACT_WHEN_FINISHED = 1 / 8  # compact the batch once this fraction of its rows has finished


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when generate was given no tokenizer
    finish_reason: str  # "eos" (token_ids ends with the end-of-sequence token) or "length"
    # sum over the drawn tokens of log softmax(logits / temperature): the sampling policy's log-probability of
    # token_ids, before top-p truncation ("kv"; "vllm": after it) at temperature > 0
    logprob: float | None = None
    # each drawn token's log-probability as the engine sampled it ("vllm" at temperature > 0): what GRPO compares
    # with the trainer's (the rollout / training mismatch)
    token_logprobs: list[float] | None = None
    # with tools (agent.py): True at the tokens a tool appended (not sampled: the update masks them out), and the
    # calls made, in order
    tool_mask: list[bool] | None = None
    tool_calls: list | None = None
    # what the policy wrote, without the tool's output: the text its answer is read from (None: no tokenizer)
    policy_text: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def generate(model, tokenizer, prompts, n: int, max_new_tokens: int, *, temperature: float = 0.6,
             top_p: float = 0.95, seed: int | list[int] | None = None, backend: str = "kv", ignore_eos: bool = False,
             dtype: torch.dtype | None = None, memory_budget: int | None = None, compile: bool = False,
             progress: str | None = None, frozen: bool = False, tools=None):
    """n completions for each prompt: a list (one entry per prompt) of lists of n Completions.

    prompts: list of strings (needs `tokenizer`) or of token-id lists. temperature 0 is greedy decoding.
    seed: None, an int or a list with one int per prompt. A list makes each prompt's completions depend only
    on its own seed (not on the other prompts; "hf" then runs one transformers call per prompt). An int seeds
    the call: "kv" derives per-prompt seeds from it, "hf" seeds its one batched call. None draws an int from
    torch's global generator (so torch.manual_seed upstream makes a whole run repeatable).
    ignore_eos: keep sampling to max_new_tokens (benchmarks).
    dtype: the compute dtype of "kv" (weights cast once per call) and "vllm" (the engine's, fixed when it starts).
    "kv" only: memory_budget (bytes for the KV cache and
    logits of one wave; default half the available memory), compile (torch.compile the decode step), progress (a
    label: show a progress bar over decode steps, with the number of rows still sampling), frozen (the model
    does not train, e.g. a verifier: its weights' sampling copy, cast, stacked and packed, is made on the first
    call and kept for the next ones, until a parameter changes; "vllm" loads its weights into the engine once;
    "hf" has no copy to keep).
    tools: tool calls inside the completions (agent.Interpreter): a row whose tokens close a block stops, the
    blocks closed together run together, and each output is appended to its row, which samples on (max_calls
    calls, max_new_tokens tokens in all); "kv" appends to the row's cache, "hf" and "vllm" re-read the row.
    """
    _check_arguments(backend, n, max_new_tokens, temperature, top_p,
                     kv_only=memory_budget is not None or compile or (backend == "hf" and dtype is not None))
    prompt_ids = _prompt_ids(tokenizer, prompts)
    eos_ids = [] if ignore_eos else _eos_ids(model, tokenizer)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    prompt_seeds = _prompt_seeds(seed, len(prompt_ids))
    if backend == "kv" and (reason := kv_unsupported_reason(model)):
        print(f"[sampler] kv backend does not support {reason}; falling back to hf "
              f"(dtype, memory_budget and compile ignored)", file=sys.stderr)
        backend = "hf"
    sampling = Sampling(max_new_tokens, temperature, top_p)
    with torch.inference_mode():
        if backend == "vllm":
            from engine import engine_for
            engine = engine_for(model, tokenizer, dtype)
            if tools:
                rows = sample_with_tools(partial(engine.continue_rows, model, eos_ids=eos_ids, frozen=frozen),
                                         prompt_ids, n, sampling, prompt_seeds, tools)
            else:
                rows = engine.generate(model, prompt_ids, n, sampling, prompt_seeds, eos_ids, frozen)
        elif backend == "kv":
            rows = _generate_kv(model, prompt_ids, n, sampling, prompt_seeds=prompt_seeds, eos_ids=eos_ids,
                                dtype=dtype, memory_budget=memory_budget, compile=compile, progress=progress,
                                frozen=frozen, tools=tools)
        elif tools:
            rows = sample_with_tools(partial(_continue_rows_hf, model, tokenizer, eos_ids=eos_ids, tools=tools),
                                     prompt_ids, n, sampling, prompt_seeds, tools)
        else:
            rows = _generate_hf(model, tokenizer, prompt_ids, n, sampling,
                                seed if isinstance(seed, int) else prompt_seeds, eos_ids, ignore_eos)
    # a row: token ids, finish reason, then as the backend reports them logprob, token_logprobs, tool_mask, tool_calls
    return [[_completion(tokenizer, ids, *row) for row in rows[p * n:(p + 1) * n]]
            for p, ids in enumerate(prompt_ids)]


def _completion(tokenizer, prompt_ids, tokens, reason, *rest) -> Completion:
    c = Completion(prompt_ids, tokens, None, reason, *rest)
    if tokenizer is not None:
        c.text = tokenizer.decode(tokens, skip_special_tokens=True)
        own = [t for t, tool in zip(tokens, c.tool_mask) if not tool] if c.tool_mask else None
        c.policy_text = c.text if own is None else tokenizer.decode(own, skip_special_tokens=True)
    return c


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float


def _check_arguments(backend, n, max_new_tokens, temperature, top_p, kv_only: bool):
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: the number of completions per prompt must be a positive int")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a positive int")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if backend != "kv" and kv_only:
        raise ValueError(f"memory_budget and compile apply to backend 'kv' (and dtype to 'kv' and 'vllm'); for "
                         f"{backend!r} drop them (cast the model for 'hf')")


def _prompt_ids(tokenizer, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: pass a non-empty list of strings or of token-id lists")
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but tokenizer is None; pass a tokenizer or token ids")
            prompt = tokenizer(prompt, add_special_tokens=False).input_ids
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        ids.append(prompt)
    return ids


def _prompt_seeds(seed, n_prompts: int) -> list[int]:
    """One seed per prompt: the list itself, or n_prompts draws of a generator seeded with the int."""
    if isinstance(seed, int):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, 2**62, (n_prompts,), generator=generator).tolist()
    if not isinstance(seed, (list, tuple)) or len(seed) != n_prompts or not all(isinstance(s, int) for s in seed):
        raise ValueError(f"seed={seed!r}: pass None, an int, or a list of {n_prompts} ints (one per prompt)")
    return list(seed)


def _eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config plus the tokenizer's (Qwen lists two)."""
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = [] if found is None else [found] if isinstance(found, int) else list(found)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    if not found:
        raise ValueError("no end-of-sequence token: set model.generation_config.eos_token_id or pass ignore_eos=True")
    return sorted(set(found))


# --------------------------------------------------------------------------- hf: the reference

def _generate_hf(model, tokenizer, prompt_ids, n, sampling: Sampling, seed, eos_ids, ignore_eos, *, stopping=()):
    """transformers generate on the left-padded batch; returns (token_ids, finish_reason, None) per row.

    seed: an int seeds the one batched call; a list (one per prompt) runs one call per prompt, each seeded.
    stopping: transformers StoppingCriteria for the call.
    """
    from transformers import GenerationConfig, StoppingCriteriaList
    if isinstance(seed, list):
        return [row for ids, prompt_seed in zip(prompt_ids, seed)
                for row in _generate_hf(model, tokenizer, [ids], n, sampling, prompt_seed, eos_ids, ignore_eos)]
    device = next(model.parameters()).device
    pad_id = eos_ids[0] if eos_ids else (tokenizer.pad_token_id if tokenizer is not None else 0)
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
    # greedy rows of one prompt are identical, and transformers refuses n > 1 for them: decode once, repeat n times
    greedy = sampling.temperature == 0
    repeats = n if greedy else 1
    # every sampling option set explicitly: transformers fills unset ones from the checkpoint (Qwen: top_k=20, ...)
    options = {} if greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, num_return_sequences=n // repeats,
                              do_sample=not greedy, repetition_penalty=1.0, pad_token_id=pad_id,
                              eos_token_id=eos_ids or None, **options)
    was_training, model_eos = model.training, model.generation_config.eos_token_id
    devices = [device] if device.type == "cuda" else []
    try:
        # eval mode: under gradient checkpointing transformers would turn the cache off in train mode.
        model.eval()
        if ignore_eos:  # transformers fills an unset eos from the model's own config, so unset it there
            model.generation_config.eos_token_id = None
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                                 stopping_criteria=StoppingCriteriaList(stopping))
    finally:
        model.train(was_training)
        model.generation_config.eos_token_id = model_eos
    rows = []
    for tokens in out[:, width:].tolist():
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        kept, reason = (tokens, "length") if stop is None else (tokens[:stop + 1], "eos")
        rows += [(list(kept), reason, None) for _ in range(repeats)]
    return rows


# --------------------------------------------------------------------------- tools, for backends that re-read a row

def sample_with_tools(continue_rows, prompt_ids, n, sampling: Sampling, prompt_seeds, tools):
    """Rows with tool calls, in rounds, for backends that cannot append to a row's cache ("hf", "vllm"): a round
    samples every open row on from its whole context (prompt, its tokens, the outputs appended) until it ends
    or may have closed a block (continue_rows: contexts, token budgets, seeds, may-stop flags, sampling ->
    (new tokens, "eos" | "length" | "stop", their log-probs or None) per row); then the blocks closed run
    together, their outputs are appended and those rows stay open. Returns generate's rows with tool fields."""
    rows = [dict(context=list(prompt_ids[r // n]), tokens=[], mask=[], calls=[], logprobs=[], segment=0,
                 reason="length") for r in range(len(prompt_ids) * n)]
    open_rows, round_ = list(range(len(rows))), 0
    while open_rows:
        budgets = [sampling.max_new_tokens - len(rows[r]["tokens"]) for r in open_rows]
        seeds = [row_seed(prompt_seeds[r // n], r % n, round_) for r in open_rows]
        may_stop = [len(rows[r]["calls"]) < tools.max_calls for r in open_rows]
        blocks = []  # (row, code, segment)
        for r, (new, reason, logprobs) in zip(open_rows, continue_rows([rows[r]["context"] for r in open_rows],
                                                                       budgets, seeds, may_stop, sampling)):
            row = rows[r]
            row["context"] += new
            row["tokens"] += new
            row["mask"] += [False] * len(new)
            row["logprobs"] = None if logprobs is None or row["logprobs"] is None else row["logprobs"] + logprobs
            row["reason"] = reason
            segment = row["tokens"][row["segment"]:]
            if reason == "stop" and (code := tools.block_ends(segment)) is not None:
                blocks.append((r, code, segment))
        for (r, _, _), call in zip(blocks, tools.run([b[1] for b in blocks], [b[2] for b in blocks]) if blocks else []):
            row = rows[r]
            ids = call.token_ids[:sampling.max_new_tokens - len(row["tokens"])]
            row["context"] += ids
            row["tokens"] += ids
            row["mask"] += [True] * len(ids)
            row["calls"].append(call)
            row["segment"] = len(row["tokens"])
        open_rows = [r for r in open_rows if rows[r]["reason"] == "stop"
                     and len(rows[r]["tokens"]) < sampling.max_new_tokens]
        round_ += 1
    return [(row["tokens"], "length" if row["reason"] == "stop" else row["reason"],
             None if row["logprobs"] is None else sum(row["logprobs"]), row["logprobs"], row["mask"], row["calls"])
            for row in rows]


def row_seed(prompt_seed: int, index: int, round_: int) -> int:
    """The seed of round `round_` of a prompt's row `index`: a function of the three alone."""
    digest = hashlib.blake2b(f"{prompt_seed}|{index}|{round_}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def _continue_rows_hf(model, tokenizer, contexts, budgets, seeds, may_stop, sampling: Sampling, *, eos_ids, tools):
    """sample_with_tools' continue_rows on transformers generate: one call per row, stopped by a criterion once
    the tokens of this call close a block."""
    from transformers import StoppingCriteria

    class BlockClosed(StoppingCriteria):
        def __init__(self, prompt_length):
            self.prompt_length, self.fired = prompt_length, False

        def __call__(self, input_ids, scores, **kwargs):
            self.fired = (int(input_ids[0, -1]) in tools.triggers
                          and tools.block_ends(input_ids[0, self.prompt_length:].tolist()) is not None)
            return torch.full((len(input_ids),), self.fired, dtype=torch.bool, device=input_ids.device)

    results = []
    for context, budget, seed, stop in zip(contexts, budgets, seeds, may_stop):
        criterion = BlockClosed(len(context))
        budgeted = Sampling(budget, sampling.temperature, sampling.top_p)
        (tokens, reason, _), = _generate_hf(model, tokenizer, [context], 1, budgeted, seed, eos_ids, not eos_ids,
                                            stopping=[criterion] if stop else [])
        results.append((tokens, "stop" if criterion.fired else reason, None))
    return results


# --------------------------------------------------------------------------- kv: the hand-written sampler

def kv_unsupported_reason(model) -> str | None:
    """None when the kv backend can run `model`, else what it lacks (printed in the fallback notice)."""
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
    """One block's tensors. q, k, v are one Linear stacked along the output and so are gate and up: one
    matrix product over the block's input instead of three (two), the same numbers at fewer, larger calls."""
    input_norm: torch.Tensor
    qkv: Linear | PackedLinear      # rows of q, then k, then v
    o: Linear | PackedLinear
    post_norm: torch.Tensor
    gate_up: Linear | PackedLinear  # rows of gate, then up
    down: Linear | PackedLinear


@dataclass
class Weights:
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
    """Width of one attention head: the config's head_dim, else hidden size / query heads (older configs)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def model_weights(model, dtype: torch.dtype, pack: bool = True) -> Weights:
    """The model's tensors in `dtype`: the parameters themselves when the dtype matches, else one cast copy each.
    Stacked weights are new tensors, made on every call: a training policy's weights change between calls. On
    a CPU in bfloat16 each product's weight is packed for oneDNN (sampler_cpu.PackedLinear; pack=False: the
    plain F.linear path, for comparison)."""
    cast = {}
    pack = pack and packing_available(dtype, next(model.parameters()).device)

    def get(t):
        if t is None:
            return None
        if id(t) not in cast:  # a tied head is cast once, together with the embedding
            cast[id(t)] = t.detach().to(dtype)
        return cast[id(t)]

    def linear(*modules):
        weight = get(modules[0].weight) if len(modules) == 1 else torch.cat([get(m.weight) for m in modules])
        biases = [get(getattr(m, "bias", None)) for m in modules]
        bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(len(m.weight), dtype=dtype, device=weight.device) if b is None else b
             for m, b in zip(modules, biases)])
        # packed, the stacked weight is dropped at once: only the packed copy is read
        return PackedLinear.of(weight, bias) if pack else Linear(weight, bias)

    config, body = model.config, model.model
    layers = [Layer(get(b.input_layernorm.weight), linear(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
                    linear(b.self_attn.o_proj), get(b.post_attention_layernorm.weight),
                    linear(b.mlp.gate_proj, b.mlp.up_proj), linear(b.mlp.down_proj)) for b in body.layers]
    return Weights(get(body.embed_tokens.weight), layers, get(body.norm.weight), linear(model.lm_head),
                   config.rms_norm_eps, config.num_attention_heads, config.num_key_value_heads, head_dim_of(config),
                   body.rotary_emb.inv_freq.float(), float(body.rotary_emb.attention_scaling))


def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 like the reference."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotary_tables(w: Weights, length: int, dtype):
    """cos and sin of position * frequency for positions 0 .. length-1, each (length, head_dim)."""
    angles = torch.arange(length, device=w.inv_freq.device).float()[:, None] * w.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * w.rope_scale).to(dtype), (angles.sin() * w.rope_scale).to(dtype)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), where mask) v, each key/value head shared by a group of query heads.

    q (rows, heads, T, d); k, v (rows, kv heads, S, d); mask (rows, 1, T, S). Written out rather than
    F.scaled_dot_product_attention, whose CPU kernel is slow for one query token with a mask.
    """
    rows, heads, T, d = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group
    scores = (q.reshape(rows, kv_heads, group * T, d) @ k.transpose(2, 3)).float() * d**-0.5
    scores = scores.view(rows, kv_heads, group, T, S).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(rows, kv_heads, group * T, S)
    return (probs @ v).view(rows, heads, T, d)


@dataclass
class KVCache:
    """Keys and values of every row, each (layers, rows, kv heads, columns, head dim), allocated once.

    Zeros, not empty: a masked column gets probability 0, and 0 * a stale NaN would still be NaN."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, w: Weights, rows: int, columns: int, dtype, device):
        shape = (len(w.layers), rows, w.n_kv_heads, columns, w.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def window(self, rows: int, start: int):
        """Rows [0, rows) from column `start` on: a view, so what forward writes there lands in this cache."""
        return KVCache(self.k[:, :rows, :, start:], self.v[:, :rows, :, start:])

    def copy_columns(self, rows, start: int, source, source_row: int, source_start: int, count: int):
        """Columns [start, start + count) of `rows` (an int or an index tensor) := `count` columns of
        source's row source_row from source_start."""
        rows = slice(rows, rows + 1) if isinstance(rows, int) else rows
        for mine, theirs in ((self.k, source.k), (self.v, source.v)):
            mine[:, rows, :, start:start + count] = theirs[:, source_row:source_row + 1, :,
                                                           source_start:source_start + count]


def forward(w: Weights, tokens, positions, columns, cache: KVCache, mask, rotary, last=None):
    """Run `tokens` (rows, T) through the model; return the logits (rows, vocab), in the weights' dtype, of
    each row's token `last` (rows,) (default: the last one).

    positions (rows, T) index the rotary tables rotary = (cos, sin), each (length, head dim). Keys and values of
    the T tokens are written into cache columns `columns`, (T,) in every row or (rows, T); attention reads cache columns
    [0, mask.shape[-1]) where `mask` (rows, 1, T, that width) is True.
    """
    rows, T = tokens.shape
    cos, sin = rotary[0][positions][:, None], rotary[1][positions][:, None]  # (rows, 1, T, head_dim)
    width, kv_width = mask.shape[-1], w.n_kv_heads * w.head_dim
    x = F.embedding(tokens, w.embed)
    for i, layer in enumerate(w.layers):
        h = rms_norm(x, layer.input_norm, w.eps)
        q, k, v = layer.qkv(h).split([w.n_heads * w.head_dim, kv_width, kv_width], dim=-1)
        q = q.reshape(rows, T, w.n_heads, w.head_dim).transpose(1, 2)
        k = k.reshape(rows, T, w.n_kv_heads, w.head_dim).transpose(1, 2)
        v = v.reshape(rows, T, w.n_kv_heads, w.head_dim).transpose(1, 2)
        write_columns(cache.k[i], columns, rotate(k, cos, sin))
        write_columns(cache.v[i], columns, v)
        attn = attention(rotate(q, cos, sin), cache.k[i, :, :, :width], cache.v[i, :, :, :width], mask)
        x = x + layer.o(attn.transpose(1, 2).reshape(rows, T, -1))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        x = x + layer.down(F.silu(gate) * up)
    x = x[:, -1] if last is None else x[torch.arange(rows, device=x.device), last]
    return w.head(rms_norm(x, w.norm, w.eps))


def write_columns(cache_layer, columns, x):
    """x (rows, kv heads, T, head dim) into cache_layer (rows, kv heads, columns, head dim) at `columns`: the same
    T columns in every row, or (rows, T) columns of each row's own."""
    if columns.dim() == 1:
        cache_layer.index_copy_(2, columns, x)
    else:
        cache_layer[torch.arange(len(x), device=x.device)[:, None], :, columns] = x.transpose(1, 2)


@functools.cache
def compiled_forward(device_type: str):
    # CUDA graphs ("reduce-overhead") remove the per-kernel launch cost that dominates small decode steps on GPU.
    return torch.compile(forward, dynamic=True, mode="reduce-overhead" if device_type == "cuda" else None)


def sample_next(logits, temperature: float, top_p: float, uniforms, scratch=None):
    """One token per row from float32 logits (rows, vocab): greedy at temperature 0, else temperature + top-p,
    by inverse CDF at each row's uniform in [0, 1) (uniforms, (rows,)). `scratch`, a float32 tensor shaped
    like logits, holds the probabilities (a fresh [rows, vocab] tensor per step costs more in page faults
    than the arithmetic on it).

    The first candidate whose cumulative probability reaches u * total is never one of probability 0 (the
    cumulative sum is flat there), so no renormalisation is needed. Afterwards `scratch` (when given) holds
    softmax(logits / temperature), before top-p: the caller reads the drawn tokens' log-probabilities there.
    """
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.div(logits, temperature, out=scratch)                     # softmax, in place:
    probs = probs.sub_(probs.amax(-1, keepdim=True)).exp_()
    probs = probs.div_(probs.sum(-1, keepdim=True))
    ids = None
    if top_p < 1:
        probs, ids = nucleus(probs, top_p)
    cdf = probs.cumsum(-1)
    choice = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:])
    return choice.squeeze(-1) if ids is None else ids.gather(-1, choice).squeeze(-1)


def nucleus(probs, top_p: float):
    """The top-p nucleus of each row of float32 `probs` (rows, vocab) as (probs, ids), (rows, k), zero outside it.

    A token is kept while the mass ranked strictly above it is below top_p (transformers' rule). Tokens
    under (1 - top_p) / vocab weigh less than 1 - top_p all together, so none of them is ever kept: only
    the rest are sorted, k being the largest number of them in any row. They are ranked by probability,
    ties by token id (topk's order of equal probabilities can change with k, which depends on the other
    rows), so a row's nucleus and its order are a function of that row alone.
    """
    bound = (1 - top_p) / probs.shape[-1]
    # int32: a plain sum of bools widens all rows x vocab to int64 first, several times slower
    k = max(1, int((probs >= bound).sum(-1, dtype=torch.int32).max()))
    top_probs, top_ids = probs.topk(k, dim=-1, sorted=False)
    # one sort ranks both: the bits of a float32 >= 0, read as an int, order like the float itself
    ranked = ((top_probs.view(torch.int32).long() << 32) - top_ids).argsort(dim=-1, descending=True)
    top_probs, top_ids = top_probs.gather(-1, ranked), top_ids.gather(-1, ranked)
    return top_probs.masked_fill(top_probs.cumsum(-1) - top_probs >= top_p, 0), top_ids


def _default_budget(device) -> int:
    """Half the memory a new allocation can get: on Linux MemAvailable, which counts the page cache the kernel
    gives back (free pages alone, after a run has read its model files, can be a few hundred MB of 24 GB and
    split a call into needless waves); on a GPU the free memory plus what PyTorch holds reserved
    but unused (the update's freed gradients and activations), which the driver counts as used."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return (torch.cuda.mem_get_info(device)[0] + cached) // 2
    try:
        with open("/proc/meminfo") as meminfo:
            available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 2


def cache_bytes_per_row(model, length: int, dtype) -> int:
    """Bytes of one row's keys and values at `length` columns, plus its float32 logits, sampling buffers and
    uniforms."""
    config = model.config
    element = torch.empty((), dtype=dtype).element_size()
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * length * head_dim_of(config) * element
    return cache + 4 * config.vocab_size * 4 + 4 * length


def _generate_kv(model, prompt_ids, n, sampling: Sampling, *, prompt_seeds, eos_ids, dtype, memory_budget,
                 compile, progress, frozen, tools=None):
    device = next(model.parameters()).device
    dtype = dtype or next(model.parameters()).dtype
    longest = max(map(len, prompt_ids))
    length = longest + sampling.max_new_tokens
    if length > model.config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds the "
                         f"model's {model.config.max_position_embeddings} positions; shorten one of them")
    budget = memory_budget or _default_budget(device)
    per_row = cache_bytes_per_row(model, length, dtype)
    wave_rows = budget // per_row
    if wave_rows < 1:
        raise ValueError(f"memory_budget={budget} bytes holds no row of {length} tokens ({per_row} bytes); "
                         f"raise memory_budget or lower max_new_tokens")
    # a frozen model (the verifier) keeps its sampling weights between calls: packing a 1.5B takes 2-3 s
    w = kept_weights(model, dtype, lambda: model_weights(model, dtype)) if frozen else model_weights(model, dtype)
    run = Run(w, rotary_tables(w, length, dtype), compiled_forward(device.type) if compile else forward,
              device.type == "cuda" and not compile,
              torch.tensor(eos_ids, dtype=torch.long, device=device), dtype, device)
    n_rows = len(prompt_ids) * n  # row r samples for prompt r // n
    rows = []
    for start in range(0, n_rows, wave_rows):
        stop = min(start + wave_rows, n_rows)
        wave = [prompt_ids[r // n] for r in range(start, stop)]
        uniforms = None
        if sampling.temperature > 0:
            uniforms = row_uniforms(prompt_seeds, n, sampling.max_new_tokens, start, stop).to(device)
        label = progress and (progress if stop - start == n_rows else f"{progress} (rows {start}-{stop - 1})")
        rows += _decode_wave(run, wave, sampling, uniforms, progress=label, tools=tools)
    return rows


def row_uniforms(prompt_seeds, n, steps, start, stop):
    """Uniforms in [0, 1), (stop - start, steps), for rows start .. stop-1 (row r samples for prompt r // n).

    Prompt p's n rows are torch.rand(n, steps) of a CPU generator seeded with prompt_seeds[p], so a row's
    draws depend on its prompt's seed and its index among that prompt's rows only (and not on the device).
    """
    first_prompt = start // n
    draws = [torch.rand(n, steps, generator=torch.Generator().manual_seed(prompt_seeds[p]))
             for p in range(first_prompt, (stop - 1) // n + 1)]
    return torch.cat(draws)[start - first_prompt * n:stop - first_prompt * n]


@dataclass
class Run:
    """What every wave of one generate call shares: the weights, the rotary tables, the decode step."""
    w: Weights
    rotary: tuple        # (cos, sin), each (length, head dim)
    step: object         # forward, or its compiled twin
    windowed: bool       # decode attends over a window of the cache columns, not all of them (eager CUDA)
    eos: torch.Tensor    # end-of-sequence ids (empty: EOS ignored)
    dtype: torch.dtype   # compute dtype
    device: torch.device


# --------------------------------------------------------------------------- kv: prefill, shared prefixes first

def common_prefix(a, b) -> int:
    """How many tokens lists a and b share at their start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


@dataclass
class PrefixStep:
    source: int | None   # the distinct prompt whose cache row holds this prompt's first `shared` tokens
    shared: int          # tokens copied from it; this prompt prefills only tokens [shared, len)
    level: int           # prefilled in forward number `level`, after its source (level - 1)


def prefix_plan(prompts) -> list[PrefixStep]:
    """How distinct `prompts` (token-id lists) share their prefill: one PrefixStep each.

    In sorted order the earlier prompt sharing the longest start with prompt k is its neighbour k - 1,
    since lcp(a, c) = min(lcp(a, b), lcp(b, c)) for a <= b <= c. Its source is the first prompt of the run that
    shares those tokens; that one shares fewer with its own predecessor, so sources lead down to a prompt
    that shares nothing (level 0), and there are at most as many levels as distinct shared lengths. A
    distinct prompt never shares all of its tokens (a prompt that starts another sorts before it), so each
    prefills at least its last token, whose logits start the sampling.
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


PREFILL_TOKENS = 2048  # padded tokens per prefill forward: bounds its activations (the float32 attention
                       # scores grow with tokens x keys) while keeping matrix products large enough to run at speed


def prefill(run: Run, cache: KVCache, prompts, width: int, logits):
    """Put every row's prompt into its cache row (prompt in columns [width - len, width)) and its last token's
    float32 logits into logits[row]. prompts[r] is row r's prompt (rows may share one).

    Each distinct prompt runs through the model once, and only its tokens after the longest start it shares
    with another prompt (prefix_plan), whose keys and values are copied from that prompt's row: causal
    attention makes a token's keys and values a function of the tokens up to it, so this is prefilling it
    whole. The prompts of one level go through the model together, in chunks of PREFILL_TOKENS padded
    tokens, shortest suffix first; then each prompt's row is copied into the other rows that sample from it.
    """
    distinct, rows_of = {}, []  # token tuple -> its index; the rows sampling from each distinct prompt
    for row, prompt in enumerate(prompts):
        index = distinct.setdefault(tuple(prompt), len(distinct))
        if index == len(rows_of):
            rows_of.append([])
        rows_of[index].append(row)
    unique = [list(p) for p in distinct]
    plan = prefix_plan(unique)
    for level in range(max(step.level for step in plan) + 1):
        jobs = []  # (row, prompt, shared, (source row, its first column))
        for i, step in enumerate(plan):
            if step.level == level:
                source = None if step.source is None else (rows_of[step.source][0], width - len(unique[step.source]))
                jobs.append((rows_of[i][0], unique[i], step.shared, source))
        jobs.sort(key=lambda job: len(job[1]) - job[2])
        chunk = []
        for job in jobs:
            if chunk and (len(chunk) + 1) * (len(job[1]) - job[2]) > PREFILL_TOKENS:
                _prefill_chunk(run, cache, chunk, width, logits)
                chunk = []
            chunk.append(job)
        _prefill_chunk(run, cache, chunk, width, logits)
    for rows in rows_of:
        if len(rows) > 1:
            start = width - len(prompts[rows[0]])
            copies = torch.tensor(rows[1:], device=logits.device)
            cache.copy_columns(copies, start, cache, rows[0], start, width - start)
            logits[copies] = logits[rows[0]].clone()


def _prefill_chunk(run: Run, cache: KVCache, jobs, width: int, logits):
    """One forward over the jobs' own tokens, [(row, prompt, shared, (source row, its first column) or None)].

    A scratch cache holds one row per job: its `shared` tokens, copied from the source row, end at column A (the
    most any job shares), its own tokens follow, right-padded to the longest; a token attends to its row's
    columns from its prompt's first to itself, so padding (after every real token) is never read.
    """
    device = logits.device
    shared = torch.tensor([job[2] for job in jobs], device=device)
    own = torch.tensor([len(job[1]) - job[2] for job in jobs], device=device)  # tokens each job runs
    A, S = int(shared.max()), int(own.max())
    scratch = KVCache.zeros(run.w, len(jobs), A + S, cache.k.dtype, device)
    tokens = torch.zeros(len(jobs), S, dtype=torch.long, device=device)
    for j, (_, prompt, n_shared, source) in enumerate(jobs):
        tokens[j, :len(prompt) - n_shared] = torch.tensor(prompt[n_shared:], device=device)
        if source is not None:
            scratch.copy_columns(j, A - n_shared, cache, *source, n_shared)
    t = torch.arange(S, device=device)
    positions = torch.where(t < own[:, None], shared[:, None] + t, 0)                # (jobs, S); padding at 0
    keys = torch.arange(A + S, device=device)
    mask = (keys >= A - shared[:, None, None]) & (keys <= A + t[None, :, None])      # (jobs, S, A + S)
    rows = torch.tensor([job[0] for job in jobs], device=device)
    logits[rows] = forward(run.w, tokens, positions, A + t, scratch, mask[:, None], run.rotary, last=own - 1).float()
    for j, (row, prompt, n_shared, _) in enumerate(jobs):
        cache.copy_columns(row, width - len(prompt), scratch, j, A - n_shared, len(prompt))


# --------------------------------------------------------------------------- kv: decode one wave

@dataclass
class Batch:
    """The rows still sampling: batch row b is wave row rows[b], whose prompt starts at cache column start[b] and
    whose next token goes into column columns[b] (the same column in every row until a tool's output is
    appended to one: aligned)."""
    rows: torch.Tensor     # (b,)
    start: torch.Tensor    # (b,)
    alive: torch.Tensor    # (b,) bool: has not finished yet
    first_column: int      # min(start): no row of the batch attends to a column before it
    columns: torch.Tensor  # (b,)
    aligned: bool = True

    def select(self, keep):
        start = self.start[keep]
        return Batch(self.rows[keep], start, self.alive[keep], int(start.min()), self.columns[keep], self.aligned)


def _decode_wave(run: Run, prompts, sampling: Sampling, uniforms, *, progress=None, tools=None):
    """Sample every row of one wave: prompts[r] is row r's prompt (rows may share one), and row r draws its
    token j with uniforms[r, j] (None when greedy). Returns (token_ids, finish_reason, logprob) per row, and
    with `tools` (generate's) also (None, tool_mask, tool_calls)."""
    n_rows, steps = len(prompts), sampling.max_new_tokens
    width = max(map(len, prompts))  # prompts end at column `width`; a row's completion token t sits in column width + t
    last_column = width + steps - 1
    cache = KVCache.zeros(run.w, n_rows, width + steps, run.dtype, run.device)
    logits = torch.empty(n_rows, run.w.head.out_features, dtype=torch.float32, device=run.device)  # the step's logits
    probs = torch.empty_like(logits)                                                      # their probabilities
    prefill(run, cache, prompts, width, logits)
    start = width - torch.tensor([len(p) for p in prompts], device=run.device)
    alive = torch.ones(n_rows, dtype=torch.bool, device=run.device)
    batch = Batch(torch.arange(n_rows, device=run.device), start, alive, int(start.min()),
                  torch.full((n_rows,), width, device=run.device))
    out = torch.empty(n_rows, steps, dtype=torch.long, device=run.device)
    ends, reasons = [steps] * n_rows, ["length"] * n_rows  # sampled tokens kept per row, why it stopped
    logprobs = torch.zeros(n_rows, dtype=torch.float32, device=run.device)  # sum of log pi_T(drawn token) per row
    calls = tools and ToolRows(tools, n_rows, run.device)
    bar = tqdm(total=steps, desc=progress, unit="tok", leave=False, disable=not progress)
    for j in range(steps):
        b = len(batch.rows)
        tokens = sample_next(logits[:b], sampling.temperature, sampling.top_p,
                             None if uniforms is None else uniforms[batch.rows, j], probs[:b])
        out[batch.rows, j] = tokens
        if uniforms is not None:  # sample_next left the tempered probabilities, before top-p, in probs
            drawn = probs[:b].gather(1, tokens[:, None]).squeeze(1).log()
            logprobs[batch.rows] += torch.where(batch.alive, drawn, 0.0)
        bar.update()
        bar.set_postfix(rows=b, refresh=False)
        if j == steps - 1:  # the budget's last token: it ends the row by "eos" if it is one
            for row in batch.rows[batch.alive & torch.isin(tokens, run.eos)].tolist():
                reasons[row] = "eos"
            break
        full = batch.columns >= last_column  # the row's token budget is spent (tool output counts in it)
        made = calls.run(batch, tokens, out, j, room=~full) if calls else []  # [(wave row, ToolCall)]
        if len(run.eos) or calls:
            batch, tokens = _finish_rows(cache, batch, tokens, run.eos, full, step=j, ends=ends, reasons=reasons)
            if batch is None:
                break
        logits[:len(batch.rows)] = decode_one_token(run, cache, batch, tokens, width + j)
        batch.columns = (batch.columns + 1).clamp(max=last_column)  # a finished row's writes are never read
        for row, call in made:
            calls.append(run, cache, batch, row, call, logits, width + steps, step=j, ends=ends)
    bar.close()
    out = out.tolist()
    logprobs = logprobs.tolist() if uniforms is not None else [None] * n_rows
    if calls:
        return [calls.completion(row, out[row][:ends[row]], reasons[row], logprobs[row]) for row in range(n_rows)]
    return [(out[row][:ends[row]], reasons[row], logprobs[row]) for row in range(n_rows)]


def _finish_rows(cache: KVCache, batch: Batch, tokens, eos, full, *, step: int, ends, reasons):
    """Rows that drew an end-of-sequence token at `step`, or whose budget is `full`, finish (ends, reasons record
    it); once COMPACT_WHEN_FINISHED of the batch has, the live rows move to the front of the cache and the batch
    shrinks. Returns the batch (None when no row is left) and its rows' tokens."""
    eos_drawn = batch.alive & torch.isin(tokens, eos)
    for row in batch.rows[eos_drawn].tolist():
        ends[row], reasons[row] = step + 1, "eos"
    for row in batch.rows[batch.alive & full & ~eos_drawn].tolist():
        ends[row] = step + 1
    batch.alive = batch.alive & ~eos_drawn & ~full
    live = int(batch.alive.sum())
    if live == 0:
        return None, tokens
    if len(batch.alive) - live < max(1, COMPACT_WHEN_FINISHED * len(batch.alive)):
        return batch, tokens
    keep = batch.alive.nonzero().squeeze(1)
    for i in range(len(cache.k)):  # layer by layer: the gather's temporary stays one layer large
        cache.k[i, :live] = cache.k[i, keep]
        cache.v[i, :live] = cache.v[i, keep]
    return batch.select(keep), tokens[keep]


class ToolRows:
    """A wave's tool calls (generate's `tools`): the rows that closed a block, their outputs appended to their
    cache rows (one forward over the output's tokens: the row keeps its cache, nothing is prefilled again), and
    each row's completion with its tool tokens marked."""

    def __init__(self, tools, n_rows: int, device):
        self.tools = tools
        self.triggers = torch.tensor(sorted(tools.triggers), dtype=torch.long, device=device)
        self.made = [[] for _ in range(n_rows)]   # per wave row: (step, appended ids, ToolCall), in order
        self.segment = [0] * n_rows               # per wave row: its first step after its last output

    def run(self, batch: Batch, tokens, out, step: int, room) -> list:
        """The blocks that the tokens of `step` close, in live rows with calls and budget left, run together."""
        maybe = batch.alive & room & torch.isin(tokens, self.triggers)
        codes, segments, rows = [], [], []
        for row in batch.rows[maybe].tolist():
            if len(self.made[row]) < self.tools.max_calls:
                segment = out[row, self.segment[row]:step + 1].tolist()
                code = self.tools.block_ends(segment)
                if code is not None:
                    codes.append(code), segments.append(segment), rows.append(row)
        return list(zip(rows, self.tools.run(codes, segments))) if codes else []

    def append(self, run: Run, cache: KVCache, batch: Batch, row: int, call, logits, limit: int, *, step: int, ends):
        """Wave row `row`'s tool output into its cache row from its next column on, cut to fit the cache (limit:
        its width); the row's logits become those after the output. A row the output fills finishes."""
        b = batch.rows.tolist().index(row)
        column, first = int(batch.columns[b]), int(batch.start[b])
        ids = call.token_ids[:limit - column]
        self.made[row].append((step, ids, call))
        self.segment[row] = step + 1
        t = torch.arange(len(ids), device=logits.device)
        keys = torch.arange(column + len(ids), device=logits.device)
        mask = ((keys >= first) & (keys <= column + t[:, None]))[None, None]        # (1, 1, L, columns)
        one_row = KVCache(cache.k[:, b:b + 1], cache.v[:, b:b + 1])
        logits[b] = forward(run.w, torch.tensor([ids], device=logits.device), (column - first + t)[None],
                            column + t, one_row, mask, run.rotary)[0].float()
        batch.aligned = False
        batch.columns[b] = min(column + len(ids), limit - 1)  # a row the output fills writes no more that is read
        if column + len(ids) >= limit:
            batch.alive[b] = False
            ends[row] = step + 1

    def completion(self, row: int, sampled: list[int], reason: str, logprob):
        """(token_ids, finish_reason, logprob, None, tool_mask, tool_calls): the outputs between the sampled tokens."""
        tokens, mask, last = [], [], 0
        for step, ids, _ in self.made[row]:
            tokens += sampled[last:step + 1] + ids
            mask += [False] * (step + 1 - last) + [True] * len(ids)
            last = step + 1
        tokens += sampled[last:]
        mask += [False] * (len(sampled) - last)
        return tokens, reason, logprob, None, mask, [call for _, _, call in self.made[row]]


def decode_one_token(run: Run, cache: KVCache, batch: Batch, tokens, column: int):
    """Logits (rows, vocab) of the token after `tokens` (rows,), whose keys and values go into cache column
    `column` of every row, or, once a tool's output has been appended to a row (not batch.aligned), into each
    row's batch.columns. Attention reads the whole cache, masked, or with run.windowed only the columns from
    the batch's first prompt column to the last written (the padding before it, which no row attends to, is
    skipped)."""
    last = column if batch.aligned else int(batch.columns.max())
    lo, hi = (batch.first_column, last + 1) if run.windowed else (0, cache.k.shape[3])
    seen = torch.arange(lo, hi, device=run.device)
    mask = ((seen >= batch.start[:, None]) & (seen <= batch.columns[:, None]))[:, None, None, :]  # (rows, 1, 1, seen)
    at = torch.tensor([column - lo], device=run.device) if batch.aligned else (batch.columns - lo)[:, None]
    return run.step(run.w, tokens[:, None], (batch.columns - batch.start)[:, None], at,
                    cache.window(len(batch.rows), lo), mask, run.rotary)
