"""Sample n completions per prompt: the rollouts of test-time RL.

    generate(model, tokenizer, prompts, n, Sampling(max_new_tokens, temperature, top_p), seed=...,
             backend="kv") -> [[Completion] * n for each prompt]

Backends: "hf" (transformers generate, the reference) and "kv" below. Two more have a generate of
the same signature, which t3rl.setup picks at one call: "kv-fast" (the same sampler in waves, its
weights packed, shared prefixes prefilled once, finished rows compacted: extensions/kv_fast.py) and
"vllm" (a colocated engine: extensions/engine.py).

"kv" runs the model's own weights (Llama / Qwen2) over a KV cache in plain PyTorch:

    x_0    = embed[tokens]
    h      = x + Attn(RMSNorm(x))                   RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
    x'     = h + W_down (silu(W_gate g) * W_up g),  g = RMSNorm(h)              (SwiGLU)
    logits = W_head RMSNorm(x_L)

with grouped-query attention and rotary positions. Prompts are left-padded to end at one column, so
every row writes the same column each step: `prefill` puts the prompts into the cache,
`decode_one_token` runs one token of every row and `sample_next` draws the next (temperature, then
exact top-p) at a uniform drawn per prompt from its own seed, so what a prompt gets depends on its
seed alone, not on the prompts beside it. `token_ids` are the sampled ids, ending with the
end-of-sequence token when finish_reason is "eos" (GRPO trains on it). docs/sampler.md: the design.
"""
import numbers
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, StoppingCriteriaList

KV_MODEL_TYPES = ("llama", "qwen2")


@dataclass
class Completion:
    prompt_ids: list
    token_ids: list
    text: str | None     # decoded without special tokens (None: no tokenizer)
    finish_reason: str   # "eos" (token_ids ends with it) or "length"
    # at temperature > 0: the log-probability of token_ids under softmax(logits / temperature)
    # ("vllm": after top-p, with each token's in token_logprobs)
    logprob: float | None = None
    token_logprobs: list | None = None
    tool_mask: list | None = None   # --agent: True at the tokens a tool appended (not trained)
    tool_calls: list | None = None  # --agent: the calls made, in order
    policy_text: str | None = None  # the text without a tool's output: where the answer is read

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 0.6   # 0: greedy
    top_p: float = 0.95
    dtype: torch.dtype | None = None  # the kv, kv-fast and vllm compute dtype (None: the model's)
    ignore_eos: bool = False   # sample to max_new_tokens


def generate(model, tokenizer, prompts, n: int, sampling: Sampling, *, seed=None, backend="kv",
             progress=None):
    """n completions for each prompt (strings, or token-id lists): a list per prompt. seed: None
    (drawn from torch's generator), an int (the prompts' seeds drawn from it) or one int per prompt.
    progress: a progress bar's label (kv-fast's). Runs under inference_mode, leaves the model's
    mode."""
    prompt_ids, eos_ids, seeds = checked_arguments(model, tokenizer, prompts, n, sampling, seed)
    backend = runnable_backend(model, backend)
    with torch.inference_mode():
        if backend == "kv":
            rows = generate_kv(model, prompt_ids, n, sampling, seeds, eos_ids)
        elif backend == "hf":
            rows = [row for ids, s in zip(prompt_ids, seeds)
                    for row in generate_hf(model, tokenizer, [ids], n, sampling, s, eos_ids)]
        else:
            raise ValueError(f"backend {backend!r}: use kv or hf (kv-fast and vllm: their own "
                             f"generate, extensions/)")
    decode_texts(rows, tokenizer)
    return [rows[p * n:(p + 1) * n] for p in range(len(prompt_ids))]


def decode_texts(rows, tokenizer):
    """Each completion's text, and its policy_text as the same (the agent's rows then get theirs:
    without the tools' output and the code, extensions/agent.py)."""
    for c in rows if tokenizer is not None else ():
        c.text = c.policy_text = tokenizer.decode(c.token_ids, skip_special_tokens=True)


def checked_arguments(model, tokenizer, prompts, n, sampling: Sampling, seed):
    """(prompt ids, end-of-sequence ids, one seed per prompt); ValueError naming a bad argument."""
    if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 1
               for x in (n, sampling.max_new_tokens)):
        raise ValueError(f"n={n!r}, max_new_tokens={sampling.max_new_tokens!r}: ints >= 1")
    if not sampling.temperature >= 0 or not 0 < sampling.top_p <= 1:  # NaN fails both
        raise ValueError(f"temperature {sampling.temperature} (>= 0, 0 greedy) and top_p "
                         f"{sampling.top_p} (in (0, 1]) out of range")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts: pass a non-empty list of strings or of token-id lists")
    if any(isinstance(p, str) for p in prompts) and tokenizer is None:
        raise ValueError("prompts are strings but tokenizer is None; pass a tokenizer or token ids")
    ids = [tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else list(p)
           for p in prompts]
    if not all(ids):
        raise ValueError("prompts: every prompt needs at least one token")
    eos = [] if sampling.ignore_eos else eos_ids(model, tokenizer)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    one = isinstance(seed, numbers.Integral)
    seeds = [seed] if one else list(seed) if isinstance(seed, (list, tuple, range)) else []
    # an int a torch generator takes (numpy's too), not a bool
    if len(seeds) != (1 if one else len(ids)) or not all(
            isinstance(s, numbers.Integral) and not isinstance(s, bool) and -2**63 <= s < 2**64
            for s in seeds):
        raise ValueError(f"seed: pass None, an int, or {len(ids)} ints (one per prompt), each in "
                         f"[-2^63, 2^64)")
    if one:
        seeds = torch.randint(0, 2**62, (len(ids),),
                              generator=torch.Generator().manual_seed(int(seed))).tolist()
    return ids, eos, [int(s) for s in seeds]


def eos_ids(model, tokenizer) -> list:
    """End-of-sequence ids: the model's generation config's and the tokenizer's (Qwen has two)."""
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = [] if found is None else [found] if isinstance(found, int) else list(found)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    if not found:
        raise ValueError("no end-of-sequence token: set model.generation_config.eos_token_id or "
                         "sample with ignore_eos")
    return sorted(set(found))


def unsupported_reason(model) -> str | None:
    """None when the kv sampler runs `model`, else what it lacks (it then samples with hf)."""
    config = model.config
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return (f"model type {config.model_type!r}" if config.model_type not in KV_MODEL_TYPES
            else "sliding-window attention" if getattr(config, "use_sliding_window", False)
            else f"activation {config.hidden_act!r}" if config.hidden_act != "silu"
            else f"rope type {rope!r}" if rope in ("dynamic", "longrope") else None)


def runnable_backend(model, backend: str) -> str:
    """`backend`, or hf (said) when it is a kv loop (kv, kv-fast) and the model one it does not
    run."""
    reason = unsupported_reason(model)
    if backend in ("kv", "kv-fast") and reason:
        print(f"[sampler] {backend} does not run {reason}: sampling with hf", file=sys.stderr)
        return "hf"
    return backend


def generate_hf(model, tokenizer, prompt_ids, n, sampling: Sampling, seed: int, eos, stopping=()):
    """transformers generate on the left-padded prompts, seeded with `seed`. stopping: its
    StoppingCriteria (the agent's tool calls)."""
    device = next(model.parameters()).device
    pad = eos[0] if eos else (tokenizer.pad_token_id if tokenizer is not None else 0)
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids],
                             device=device)
    greedy = sampling.temperature == 0  # n greedy rows of a prompt are one, decoded once
    # every option set: transformers fills unset ones from the checkpoint (Qwen: top_k=20)
    options = {} if greedy else dict(temperature=float(sampling.temperature), top_p=sampling.top_p,
                                     top_k=0)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
                              num_return_sequences=1 if greedy else n, repetition_penalty=1.0,
                              pad_token_id=pad, eos_token_id=eos or None, **options)
    was_training, model_eos = model.training, model.generation_config.eos_token_id
    try:
        model.eval()  # under gradient checkpointing transformers turns its cache off in training
        if not eos:  # transformers fills an unset eos from the model's config: unset it there
            model.generation_config.eos_token_id = None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids, attention_mask=attention,
                                 generation_config=config,
                                 stopping_criteria=StoppingCriteriaList(stopping))
    finally:
        model.train(was_training)
        model.generation_config.eos_token_id = model_eos
    rows = []
    for k, tokens in enumerate(out[:, width:].tolist()):
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        kept, reason = (tokens, "length") if stop is None else (tokens[:stop + 1], "eos")
        rows += [Completion(prompt_ids[k // (1 if greedy else n)], list(kept), None, reason)
                 for _ in range(n if greedy else 1)]
    return rows


# ------------------------------------------------------------------ kv: the model, its cache

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
    """One block: q, k, v stacked into one product over the block's input, gate and up too."""
    input_norm: torch.Tensor
    qkv: Linear        # rows of q, then k, then v
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear    # rows of gate, then up
    down: Linear


@dataclass
class Weights:
    """What `forward` reads."""
    embed: torch.Tensor
    layers: list
    norm: torch.Tensor
    head: Linear
    eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inv_freq: torch.Tensor  # float32 rotary frequencies theta^(-2i/d)
    rope_scale: float


def model_weights(model, dtype, tensor=None, linear=Linear) -> Weights:
    """The model's tensors in `dtype` (the parameters themselves where the dtype matches, else one
    cast copy each), q/k/v and gate/up stacked. tensor: parameter name -> tensor (default: the
    model's own); linear: what a stacked weight and bias become (kv-fast packs them)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    tensor, cast = tensor or named.__getitem__, {}
    names = {id(p): name for name, p in reversed(named.items())}  # a tied head: the embedding's

    def get(t):
        if t is not None and id(t) not in cast:  # a tied head is cast once, with the embedding
            cast[id(t)] = tensor(names[id(t)]).detach().to(dtype)
        return None if t is None else cast[id(t)]

    def stacked(*modules):
        weights, biases = [get(m.weight) for m in modules], [get(m.bias) for m in modules]
        if len(modules) == 1:
            return linear(weights[0], biases[0])
        return linear(torch.cat(weights), None if biases[0] is None else torch.cat(biases))

    config, body = model.config, model.model
    layers = [Layer(get(b.input_layernorm.weight),
                    stacked(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
                    stacked(b.self_attn.o_proj), get(b.post_attention_layernorm.weight),
                    stacked(b.mlp.gate_proj, b.mlp.up_proj), stacked(b.mlp.down_proj))
              for b in body.layers]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return Weights(get(body.embed_tokens.weight), layers, get(body.norm.weight),
                   stacked(model.lm_head), config.rms_norm_eps, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, body.rotary_emb.inv_freq.float(),
                   float(body.rotary_emb.attention_scaling))


def rotary_tables(w: Weights, length: int, dtype):
    """cos and sin of position * frequency for positions 0 .. length-1, each (length, head_dim)."""
    angles = torch.arange(length, device=w.inv_freq.device).float()[:, None] * w.inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * w.rope_scale).to(dtype), (angles.sin() * w.rope_scale).to(dtype)


@dataclass
class KVCache:
    """Keys and values of every row, each (layers, rows, kv heads, columns, head dim), allocated
    once. Zeros, not empty: a masked column gets probability 0, and 0 * a stale NaN is NaN."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, w: Weights, rows: int, columns: int, dtype, device):
        shape = (len(w.layers), rows, w.n_kv_heads, columns, w.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    def window(self, rows: int, start: int):
        """Rows [0, rows) from column `start` on: a view, so what forward writes lands here."""
        return KVCache(self.k[:, :rows, :, start:], self.v[:, :rows, :, start:])


def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 like the reference."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    """Rotary position embedding: x turned by the angles whose cos and sin are given."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), where mask) v, each key/value head shared by a group of query
    heads: q (rows, heads, T, d); k, v (rows, kv heads, S, d); mask (rows, 1, T, S). Written out:
    the CPU kernel of F.scaled_dot_product_attention is slow for one query token with a mask."""
    rows, heads, T, d = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group
    scores = (q.reshape(rows, kv_heads, group * T, d) @ k.transpose(2, 3)).float() * d**-0.5
    scores = scores.view(rows, kv_heads, group, T, S).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(rows, kv_heads, group * T, S)
    return (probs @ v).view(rows, heads, T, d)


def forward(w: Weights, tokens, positions, columns, cache: KVCache, mask, rotary, last=None):
    """The logits (rows, vocab) of each row's token `last` (default: its last) after running
    `tokens` (rows, T) at rotary `positions` (rows, T); their keys and values go into cache columns
    `columns` ((T,) in every row, or (rows, T)), and attention reads the cache's first
    mask.shape[-1] columns where `mask` (rows, 1, T, that width) is True."""
    rows, T = tokens.shape
    cos, sin = rotary[0][positions][:, None], rotary[1][positions][:, None]  # (rows, 1, T, dim)
    width = mask.shape[-1]
    x = F.embedding(tokens, w.embed)
    for i, layer in enumerate(w.layers):
        h = rms_norm(x, layer.input_norm, w.eps)
        heads = layer.qkv(h).reshape(rows, T, -1, w.head_dim).transpose(1, 2)  # q, k, v heads
        q, k, v = heads.split([w.n_heads, w.n_kv_heads, w.n_kv_heads], dim=1)
        write_columns(cache.k[i], columns, rotate(k, cos, sin))
        write_columns(cache.v[i], columns, v)
        attn = attention(rotate(q, cos, sin), cache.k[i, :, :, :width], cache.v[i, :, :, :width],
                         mask)
        x = x + layer.o(attn.transpose(1, 2).reshape(rows, T, -1))
        h = rms_norm(x, layer.post_norm, w.eps)
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
        x = x + layer.down(F.silu(gate) * up)
    x = x[:, -1] if last is None else x[torch.arange(rows, device=x.device), last]
    return w.head(rms_norm(x, w.norm, w.eps))


def write_columns(cache_layer, columns, x):
    """x (rows, kv heads, T, head dim) into cache_layer (rows, kv heads, columns, head dim) at
    `columns`: the same T columns in every row, or (rows, T) columns of each row's own."""
    if columns.dim() == 1:
        cache_layer.index_copy_(2, columns, x)
    else:
        cache_layer[torch.arange(len(x), device=x.device)[:, None], :, columns] = x.transpose(1, 2)


# ------------------------------------------------------------------ kv: sampling

def sample_next(logits, temperature: float, top_p: float, uniforms, scratch=None):
    """One token per row from float32 logits (rows, vocab): greedy at temperature 0, else
    temperature + top-p by inverse CDF at each row's uniform u (rows,): the first candidate whose
    cumulative probability reaches u * total. `scratch`, shaped like logits, then holds
    softmax(logits / temperature), from which the caller reads the drawn tokens' log-probs."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = torch.div(logits, temperature, out=scratch)                     # softmax, in place:
    probs = probs.sub_(probs.amax(-1, keepdim=True)).exp_()
    probs = probs.div_(probs.sum(-1, keepdim=True))
    ids = None
    if top_p < 1:
        probs, ids = nucleus(probs, top_p)
    cdf = probs.cumsum(-1)
    # u = 0 (torch.rand draws it, 2^-24 of the time) must not pick a leading token of probability 0
    drawn = (uniforms[:, None] * cdf[:, -1:]).clamp_(min=torch.finfo(torch.float32).tiny)
    choice = torch.searchsorted(cdf, drawn)
    return choice.squeeze(-1) if ids is None else ids.gather(-1, choice).squeeze(-1)


def nucleus(probs, top_p: float):
    """The top-p nucleus of each row of `probs` (rows, vocab) as (probs, ids), (rows, k), zero
    outside it: a token is kept while the mass ranked strictly above it is below top_p
    (transformers' rule). Tokens under (1 - top_p) / vocab, together under 1 - top_p, are never
    kept, so only the rest are sorted: by probability, ties by token id."""
    bound = (1 - top_p) / probs.shape[-1]
    k = max(1, int((probs >= bound).sum(-1, dtype=torch.int32).max()))
    top_probs, top_ids = probs.topk(k, dim=-1, sorted=False)
    # one sort ranks both: the bits of a float32 >= 0, read as an int, order like the float itself
    ranked = ((top_probs.view(torch.int32).long() << 32) - top_ids).argsort(dim=-1, descending=True)
    top_probs, top_ids = top_probs.gather(-1, ranked), top_ids.gather(-1, ranked)
    return top_probs.masked_fill(top_probs.cumsum(-1) - top_probs >= top_p, 0), top_ids


def row_uniforms(prompt_seeds, n: int, steps: int, start: int = 0, stop: int | None = None):
    """Uniforms in [0, 1), (rows, steps), of rows start .. stop-1 (row r samples for prompt r // n):
    prompt p's n rows are torch.rand(n, steps) of a CPU generator seeded with prompt_seeds[p], so a
    row's draws depend on its prompt's seed and its index among that prompt's rows alone."""
    stop = len(prompt_seeds) * n if stop is None else stop
    first = start // n
    draws = [torch.rand(n, steps, generator=torch.Generator().manual_seed(prompt_seeds[p]))
             for p in range(first, (stop - 1) // n + 1)]
    return torch.cat(draws)[start - first * n:stop - first * n]


def generate_kv(model, prompt_ids, n, sampling: Sampling, seeds, eos) -> list:
    """The "kv" backend: every row in one batch, row r sampling for prompt r // n."""
    device = next(model.parameters()).device
    dtype = sampling.dtype or next(model.parameters()).dtype
    w, steps = model_weights(model, dtype), sampling.max_new_tokens
    width = max(map(len, prompt_ids))  # prompts end at column `width`, token t goes to width + t
    rotary = rotary_tables(w, width + steps, dtype)
    cache, logits, start = prefill(w, prompt_ids, n, width + steps, rotary)
    uniforms = (row_uniforms(seeds, n, steps).to(device) if sampling.temperature > 0 else None)
    rows, eos = len(logits), torch.tensor(eos, dtype=torch.long, device=device)
    out = torch.zeros(rows, steps, dtype=torch.long, device=device)
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    logprobs = torch.zeros(rows, device=device)  # sum of log pi_T(drawn), softmax before top-p
    ends, reasons = [steps] * rows, ["length"] * rows
    for j in range(steps):
        probs = torch.empty_like(logits)
        tokens = sample_next(logits, sampling.temperature, sampling.top_p,
                             None if uniforms is None else uniforms[:, j], probs)
        out[:, j] = tokens
        if uniforms is not None:
            logprobs += torch.where(alive, probs.gather(1, tokens[:, None]).squeeze(1).log(), 0.0)
        ended = alive & torch.isin(tokens, eos)
        for r in ended.nonzero().flatten().tolist():
            ends[r], reasons[r] = j + 1, "eos"
        alive &= ~ended
        if not alive.any() or j == steps - 1:
            break
        logits = decode_one_token(w, cache, tokens, width + j, start, rotary)
    out, logprobs = out.tolist(), logprobs.tolist()
    return [Completion(prompt_ids[r // n], out[r][:ends[r]], None, reasons[r],
                       logprobs[r] if uniforms is not None else None) for r in range(rows)]


def prefill(w: Weights, prompt_ids, n: int, columns: int, rotary):
    """Each prompt once, left-padded to end at one column, into the cache of its n rows: (the cache
    of every row, `columns` wide; the float32 logits of each row's next token; each row's first
    column). A padding position attends to itself alone, so its keys stay finite."""
    device, dtype = w.embed.device, rotary[0].dtype
    width = max(map(len, prompt_ids))
    first = width - torch.tensor([len(p) for p in prompt_ids], device=device)        # (P,)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids], device=device)
    seen = torch.arange(width, device=device)
    positions = (seen[None, :] - first[:, None]).clamp(min=0)                        # (P, width)
    causal = seen[None, :] <= seen[:, None]                                          # (T, S)
    mask = causal & ((seen[None, None, :] >= first[:, None, None]) | torch.eye(
        width, dtype=torch.bool, device=device))                                     # (P, T, S)
    prompts = KVCache.zeros(w, len(prompt_ids), width, dtype, device)
    logits = forward(w, tokens, positions, seen, prompts, mask[:, None], rotary).float()
    cache = KVCache.zeros(w, len(prompt_ids) * n, columns, dtype, device)
    cache.k[:, :, :, :width] = prompts.k.repeat_interleave(n, dim=1)
    cache.v[:, :, :, :width] = prompts.v.repeat_interleave(n, dim=1)
    return cache, logits.repeat_interleave(n, dim=0), first.repeat_interleave(n)


def decode_one_token(w: Weights, cache: KVCache, tokens, column: int, start, rotary):
    """The logits (rows, vocab) of the token after `tokens` (rows,), whose keys and values go into
    cache column `column` of every row; row r attends to its columns start[r] .. column."""
    seen = torch.arange(cache.k.shape[3], device=tokens.device)
    mask = ((seen >= start[:, None]) & (seen <= column))[:, None, None, :]
    columns = torch.tensor([column], device=tokens.device)
    return forward(w, tokens[:, None], (column - start)[:, None], columns, cache, mask,
                   rotary).float()
