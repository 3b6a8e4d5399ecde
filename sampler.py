"""Sample n completions per prompt: the rollouts of test-time RL.

    generate(model, tokenizer, prompts, n, max_new_tokens, *, temperature=0.6, top_p=0.95,
             seed=None, backend="kv", ignore_eos=False, ...) -> [[Completion] * n for each prompt]

Three backends: "hf" (transformers `generate`, the reference), "vllm" (the vLLM engine, colocated,
the model's weights synced into it: machinery/engine.py) and "kv", a batched sampler in plain
PyTorch for the Llama / Qwen2 family that runs the model's own weights over a KV cache:

    x_0    = embed[tokens]
    h      = x + Attn(RMSNorm(x))                   RMSNorm(x) = w * x / sqrt(mean(x^2) + eps)
    x'     = h + W_down (silu(W_gate g) * W_up g),  g = RMSNorm(h)              (SwiGLU)
    logits = W_head RMSNorm(x_L)                    (W_head may be the embedding: tied)

with grouped-query attention and rotary positions (q, k at position t turned by t * theta^(-2i/d)).
Prompts are left-padded to end at one column, so every row writes the same column each step:
`prefill` puts the prompts into the cache, `decode_one_token` runs one token of every row and
`sample_next` draws the next (temperature, then exact top-p) at a uniform drawn per prompt from its
own seed. What makes it fast and fit (packed weights, shared-prefix prefill, waves, compaction) is
machinery/kv_fast.py, the tool calls of `tools` machinery/sampler_tools.py; docs/sampler.md has the
design. A string prompt is tokenised as tokenizer(prompt, add_special_tokens=False).input_ids (chat
templates are the caller's job). `token_ids` are exactly the sampled ids, the last one the
end-of-sequence token when finish_reason is "eos" (GRPO trains on it). Every backend runs under
torch.inference_mode and leaves the model's mode (train / eval) as it found it.
"""
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from tqdm import tqdm

from config import BACKENDS


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # decoded without special tokens; None when generate had no tokenizer
    finish_reason: str  # "eos" (token_ids ends with the end-of-sequence token) or "length"
    # at temperature > 0: log-probability of token_ids under softmax(logits / temperature), before
    # top-p ("kv"; "vllm": after it), and ("vllm") each drawn token's, which GRPO compares with its
    logprob: float | None = None
    token_logprobs: list[float] | None = None
    tool_mask: list[bool] | None = None  # tools: True at the tokens a tool appended (not trained)
    tool_calls: list | None = None       # tools: the calls made, in order
    policy_text: str | None = None       # the text without the tool's output: the answer's source

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float


def generate(model, tokenizer, prompts, n: int, max_new_tokens: int, *, temperature: float = 0.6,
             top_p: float = 0.95, seed: int | list[int] | None = None, backend: str = "kv",
             ignore_eos: bool = False, dtype: torch.dtype | None = None,
             memory_budget: int | None = None, compile: bool = False, progress: str | None = None,
             frozen: bool = False, tools=None):
    """n completions for each prompt: a list (one entry per prompt) of lists of n Completions.

    prompts: strings (needs `tokenizer`) or token-id lists. temperature 0 is greedy decoding.
    seed: None (an int drawn from torch's global generator), an int (seeds the call: "kv" derives
    per-prompt seeds from it, "hf" seeds its one batched call) or one int per prompt (a prompt's
    completions then depend on its own seed alone). ignore_eos: sample to max_new_tokens.
    dtype: the compute dtype of "kv" (weights cast once per call) and "vllm" (fixed when the engine
    starts). "kv" only: memory_budget (bytes for one wave's cache and logits; default half the
    available memory), compile (torch.compile the decode step), progress (a progress bar's label).
    frozen: the model does not train (a verifier), so "kv" keeps its weights' sampling copy between
    calls until a parameter changes. tools: an agent.Interpreter; a row whose tokens close a block
    stops, the blocks closed together run, and each output is appended to its row, which samples on.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    from machinery.sampler_args import checked_arguments  # ValueError for a bad one
    backend, prompt_ids, eos_ids, seed, prompt_seeds = checked_arguments(
        model, tokenizer, prompts, n, max_new_tokens, temperature=temperature, top_p=top_p,
        seed=seed, backend=backend, ignore_eos=ignore_eos,
        kv_only=memory_budget is not None or compile or (backend == "hf" and dtype is not None))
    sampling = Sampling(max_new_tokens, temperature, top_p)
    with torch.inference_mode():  # every backend gives n Completions per prompt, in order
        if backend == "vllm":
            from machinery.engine import engine_for
            engine = engine_for(model, tokenizer, dtype)
        if tools and backend != "kv":  # the tool loop re-reads a row's context after each call
            from machinery.sampler_tools import continue_rows_hf, sample_with_tools
            if backend == "vllm":
                continue_rows = partial(engine.continue_rows, model, eos_ids=eos_ids, frozen=frozen)
            else:
                continue_rows = partial(continue_rows_hf, partial(_generate_hf, model, tokenizer),
                                        eos_ids=eos_ids, tools=tools)
            rows = sample_with_tools(continue_rows, prompt_ids, n, sampling, prompt_seeds, tools)
            rows = [Completion(prompt_ids[r // n], text=None, **row) for r, row in enumerate(rows)]
        elif backend == "vllm":
            rows = engine.generate(model, prompt_ids, n, sampling, prompt_seeds, eos_ids, frozen)
            rows = [Completion(prompt_ids[r // n], tokens, None, reason, logprob, token_logprobs)
                    for r, (tokens, reason, logprob, token_logprobs) in enumerate(rows)]
        elif backend == "kv":  # in waves of rows that fit memory_budget
            from machinery.kv_fast import generate_kv
            rows = generate_kv(model, prompt_ids, n, sampling, prompt_seeds, eos_ids, forward,
                               _decode_wave, dtype=dtype, memory_budget=memory_budget,
                               compile=compile, progress=progress, frozen=frozen, tools=tools)
        else:
            seeds = seed if isinstance(seed, int) else prompt_seeds  # one call, or one per prompt
            rows = _generate_hf(model, tokenizer, prompt_ids, n, sampling, seeds, eos_ids,
                                ignore_eos)
    for c in rows if tokenizer is not None else ():
        c.text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        own = [t for t, tool in zip(c.token_ids, c.tool_mask) if not tool] if c.tool_mask else None
        c.policy_text = c.text if own is None else tokenizer.decode(own, skip_special_tokens=True)
    return [rows[p * n:(p + 1) * n] for p in range(len(prompt_ids))]


def _generate_hf(model, tokenizer, prompt_ids, n, sampling: Sampling, seed, eos_ids, ignore_eos, *,
                 stopping=()) -> list[Completion]:
    """transformers generate on the left-padded batch, seeded: an int seeds the one batched call, a
    list (one per prompt) runs one call per prompt. stopping: StoppingCriteria for the call."""
    from transformers import GenerationConfig, StoppingCriteriaList
    if isinstance(seed, list):
        return [row for ids, prompt_seed in zip(prompt_ids, seed) for row in _generate_hf(
                model, tokenizer, [ids], n, sampling, prompt_seed, eos_ids, ignore_eos)]
    device = next(model.parameters()).device
    pad_id = eos_ids[0] if eos_ids else (tokenizer.pad_token_id if tokenizer is not None else 0)
    width = max(map(len, prompt_ids))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids],
                                  device=device)
    # greedy rows of one prompt are identical, and transformers refuses n > 1 for them: decode once
    greedy = sampling.temperature == 0
    repeats = n if greedy else 1
    # every sampling option set: transformers fills unset ones from the checkpoint (Qwen: top_k=20)
    options = {} if greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p,
                                     top_k=0)
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
                              num_return_sequences=n // repeats, repetition_penalty=1.0,
                              pad_token_id=pad_id, eos_token_id=eos_ids or None, **options)
    was_training, model_eos = model.training, model.generation_config.eos_token_id
    try:
        model.eval()  # under gradient checkpointing transformers turns the cache off in train mode
        if ignore_eos:  # transformers fills an unset eos from the model's config: unset it there
            model.generation_config.eos_token_id = None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config,
                                 stopping_criteria=StoppingCriteriaList(stopping))
    finally:
        model.train(was_training)
        model.generation_config.eos_token_id = model_eos
    rows = []
    for k, tokens in enumerate(out[:, width:].tolist()):  # n // repeats rows per prompt
        stop = next((i for i, t in enumerate(tokens) if t in eos_ids), None)
        kept, reason = (tokens, "length") if stop is None else (tokens[:stop + 1], "eos")
        rows += [Completion(prompt_ids[k // (n // repeats)], list(kept), None, reason)
                 for _ in range(repeats)]
    return rows


# ------------------------------------------------------------------ kv: the model and sampling

def rms_norm(x, weight, eps):
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 like the reference."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x, cos, sin):
    """Rotary position embedding: x turned by the angles whose cos and sin are given."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d), where mask) v, each key/value head shared by a group of query heads:
    q (rows, heads, T, d); k, v (rows, kv heads, S, d); mask (rows, 1, T, S). Written out: the CPU
    kernel of F.scaled_dot_product_attention is slow for one query token with a mask."""
    rows, heads, T, d = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group
    scores = (q.reshape(rows, kv_heads, group * T, d) @ k.transpose(2, 3)).float() * d**-0.5
    scores = scores.view(rows, kv_heads, group, T, S).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(rows, kv_heads, group * T, S)
    return (probs @ v).view(rows, heads, T, d)


@dataclass
class KVCache:
    """Keys and values of every row, each (layers, rows, kv heads, columns, head dim), allocated
    once. Zeros, not empty: a masked column gets probability 0, and 0 * a stale NaN is NaN."""
    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def zeros(cls, w, rows: int, columns: int, dtype, device):
        shape = (len(w.layers), rows, w.n_kv_heads, columns, w.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    def window(self, rows: int, start: int):
        """Rows [0, rows) from column `start` on: a view, so what forward writes lands here."""
        return KVCache(self.k[:, :rows, :, start:], self.v[:, :rows, :, start:])


def forward(w, tokens, positions, columns, cache: KVCache, mask, rotary, last=None):
    """Run `tokens` (rows, T) through the model w (kv_fast.Weights); return the logits (rows,
    vocab), in the weights' dtype, of each row's token `last` (rows,) (default: the last one).
    positions (rows, T) index the rotary tables rotary = (cos, sin), each (length, head dim). Keys
    and values of the T tokens go into cache columns `columns`, (T,) in every row or (rows, T);
    attention reads cache columns [0, mask.shape[-1]) where `mask` (rows, 1, T, that width) is True.
    """
    rows, T = tokens.shape
    cos, sin = rotary[0][positions][:, None], rotary[1][positions][:, None]  # (rows, 1, T, dim)
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


def sample_next(logits, temperature: float, top_p: float, uniforms, scratch=None):
    """One token per row from float32 logits (rows, vocab): greedy at temperature 0, else
    temperature + top-p by inverse CDF at each row's uniform u in [0, 1) (uniforms, (rows,)): the
    first candidate whose cumulative probability reaches u * total, never one of probability 0.
    `scratch`, shaped like logits, holds the probabilities: afterwards softmax(logits /
    temperature), before top-p, from which the caller reads the drawn tokens' log-probabilities."""
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
    """The top-p nucleus of each row of float32 `probs` (rows, vocab) as (probs, ids), (rows, k),
    zero outside it: a token is kept while the mass ranked strictly above it is below top_p
    (transformers' rule). Tokens under (1 - top_p) / vocab, together under 1 - top_p, are never
    kept, so only the rest are sorted: by probability, ties by token id (a row's nucleus and its
    order depend on that row alone)."""
    bound = (1 - top_p) / probs.shape[-1]
    # int32: a plain sum of bools widens all rows x vocab to int64 first, several times slower
    k = max(1, int((probs >= bound).sum(-1, dtype=torch.int32).max()))
    top_probs, top_ids = probs.topk(k, dim=-1, sorted=False)
    # one sort ranks both: the bits of a float32 >= 0, read as an int, order like the float itself
    ranked = ((top_probs.view(torch.int32).long() << 32) - top_ids).argsort(dim=-1, descending=True)
    top_probs, top_ids = top_probs.gather(-1, ranked), top_ids.gather(-1, ranked)
    return top_probs.masked_fill(top_probs.cumsum(-1) - top_probs >= top_p, 0), top_ids


# --------------------------------------------------------------------------- kv: prefill and decode

def prefill(run, cache: KVCache, prompts, width: int, logits):
    """Put every row's prompt into its cache row, columns [width - len, width), and its last
    token's float32 logits into logits[row]; prompts[r] is row r's prompt (rows may share one).
    Each distinct prompt runs once, only its tokens after the longest start it shares with another,
    whose keys and values (a function of the tokens up to them: causal attention) it reads from that
    one's row; then its row is copied into the rows that sample from it."""
    from machinery import kv_fast  # which tokens run, after which shared start, in batched forwards
    chunks, rows_of = kv_fast.prefill_chunks(prompts, width)
    for jobs in chunks:
        c = kv_fast.PrefillForward.of(run.w, cache, jobs)  # a scratch cache holds the shared starts
        logits[c.rows] = forward(run.w, c.tokens, c.positions, c.columns, c.scratch, c.mask,
                                 run.rotary, last=c.last).float()
        c.store(cache, width)
    kv_fast.copy_shared_rows(cache, logits, prompts, rows_of, width)


@dataclass
class Batch:
    """The rows still sampling: batch row b is wave row rows[b], whose prompt starts at cache column
    start[b] and whose next token goes into columns[b] (aligned: the same in every row)."""
    rows: torch.Tensor     # (b,)
    start: torch.Tensor    # (b,)
    alive: torch.Tensor    # (b,) bool: has not finished yet
    first_column: int      # min(start): no row of the batch attends to a column before it
    columns: torch.Tensor  # (b,)
    aligned: bool = True


def _decode_wave(run, prompts, sampling: Sampling, uniforms, *, progress=None, tools=None):
    """A Completion for every row of one wave (run: kv_fast.Run): prompts[r] is row r's prompt (rows
    may share one), and row r draws its token j with uniforms[r, j] (None when greedy)."""
    from machinery.kv_fast import compact  # finished rows leave the batch
    n_rows, steps, device = len(prompts), sampling.max_new_tokens, run.device
    width = max(map(len, prompts))  # prompts end at column `width`; completion token t at width + t
    last_column = width + steps - 1
    cache = KVCache.zeros(run.w, n_rows, width + steps, run.dtype, device)
    logits = torch.empty(n_rows, run.w.head.out_features, dtype=torch.float32, device=device)
    probs = torch.empty_like(logits)  # the step's logits and their probabilities, allocated once
    prefill(run, cache, prompts, width, logits)
    start = width - torch.tensor([len(p) for p in prompts], device=device)
    alive = torch.ones(n_rows, dtype=torch.bool, device=device)
    batch = Batch(torch.arange(n_rows, device=device), start, alive, int(start.min()),
                  torch.full((n_rows,), width, device=device))
    out = torch.empty(n_rows, steps, dtype=torch.long, device=device)
    ends, reasons = [steps] * n_rows, ["length"] * n_rows  # tokens kept per row, why it ended
    logprobs = torch.zeros(n_rows, dtype=torch.float32, device=device)  # sum of log pi_T(drawn)
    calls = None
    if tools:
        from machinery.sampler_tools import ToolRows  # the decode hook for tool outputs
        calls = ToolRows(tools, n_rows, device, forward)
    bar = tqdm(total=steps, desc=progress, unit="tok", leave=False, disable=not progress)
    for j in range(steps):
        b = len(batch.rows)
        tokens = sample_next(logits[:b], sampling.temperature, sampling.top_p,
                             None if uniforms is None else uniforms[batch.rows, j], probs[:b])
        out[batch.rows, j] = tokens
        if uniforms is not None:  # sample_next left the tempered probabilities in probs
            drawn = probs[:b].gather(1, tokens[:, None]).squeeze(1).log()
            logprobs[batch.rows] += torch.where(batch.alive, drawn, 0.0)
        bar.update()
        bar.set_postfix(rows=b, refresh=False)
        if j == steps - 1:  # the budget's last token: it ends the row by "eos" if it is one
            for row in batch.rows[batch.alive & torch.isin(tokens, run.eos)].tolist():
                reasons[row] = "eos"
            break
        full = batch.columns >= last_column  # the row's budget is spent (tool output counts in it)
        made = calls.run(batch, tokens, out, j, room=~full) if calls else []  # [(row, ToolCall)]
        if len(run.eos) or calls:
            if not _finish_rows(batch, tokens, run.eos, full, step=j, ends=ends, reasons=reasons):
                break  # no row is left
            batch, tokens = compact(cache, batch, tokens)
        logits[:len(batch.rows)] = decode_one_token(run, cache, batch, tokens, width + j)
        batch.columns = (batch.columns + 1).clamp(max=last_column)  # a finished row's are not read
        for row, call in made:
            calls.append(run, cache, batch, row, call, logits, width + steps, step=j, ends=ends)
    bar.close()
    out, logprobs = out.tolist(), logprobs.tolist() if uniforms is not None else [None] * n_rows
    rows = [Completion(prompts[r], out[r][:ends[r]], None, reasons[r], logprobs[r])
            for r in range(n_rows)]
    for r, c in enumerate(rows if calls else ()):
        c.token_ids, c.tool_mask, c.tool_calls = calls.interleave(r, c.token_ids)
    return rows


def _finish_rows(batch: Batch, tokens, eos, full, *, step: int, ends, reasons) -> int:
    """Rows that drew an end-of-sequence token at `step`, or whose budget is `full`, finish (ends,
    reasons record it); how many rows still sample."""
    eos_drawn = batch.alive & torch.isin(tokens, eos)
    for row in batch.rows[eos_drawn].tolist():
        ends[row], reasons[row] = step + 1, "eos"
    for row in batch.rows[batch.alive & full & ~eos_drawn].tolist():
        ends[row] = step + 1
    batch.alive = batch.alive & ~eos_drawn & ~full
    return int(batch.alive.sum())


def decode_one_token(run, cache: KVCache, batch: Batch, tokens, column: int):
    """Logits (rows, vocab) of the token after `tokens` (rows,), its keys and values in cache column
    `column` of every row (not batch.aligned: each row's batch.columns). Attention reads the whole
    cache, masked, or with run.windowed the columns from the batch's first prompt column on."""
    last = column if batch.aligned else int(batch.columns.max())
    lo, hi = (batch.first_column, last + 1) if run.windowed else (0, cache.k.shape[3])
    seen = torch.arange(lo, hi, device=run.device)
    mask = ((seen >= batch.start[:, None]) & (seen <= batch.columns[:, None]))[:, None, None, :]
    at = (torch.tensor([column - lo], device=run.device) if batch.aligned
          else (batch.columns - lo)[:, None])
    return run.step(run.w, tokens[:, None], (batch.columns - batch.start)[:, None], at,
                    cache.window(len(batch.rows), lo), mask, run.rotary)
