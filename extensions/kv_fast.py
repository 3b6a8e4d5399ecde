"""The kv sampler's fast path (--backend kv-fast): sampler.py's KV-cache sampler made fast and fit
in memory, a generate of sampler.generate's signature; t3rl.setup enters it at one call, serve. What
it adds to the plain loop:

    waves          rows in waves whose cache fits a memory budget (default: half the free memory)
    packing        on a CPU in bfloat16 each weight reordered once per call into oneDNN's blocked
                   layout (PackedLinear): decode's products 1.4-3x faster, the same numbers
    kept weights   a model only the sampler reads (the verifier: sampling_only) keeps its sampling
                   weights between calls, read from its checkpoint's files a tensor at a time, and
                   drops them while the policy updates (sleep)
    shared starts  each distinct prompt prefilled once, only its tokens after the longest start it
                   shares with another (prefix_plan), in batched chunks
    compaction     finished rows leave the batch once an eighth of it has finished
    tool rows      --agent: a row that closes a ```python block runs it, the output appended to its
                   own cache (the decode loop's hook, extensions/agent.py's ToolRows)

The tokens are those of the plain loop where the forward pass is batch-invariant (bfloat16 on CPUs);
docs/sampler.md has the design and the measurements.
"""
import functools
import os
import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from machinery.runs import release_freed_memory
from sampler import (Completion, KVCache, Linear, Sampling, checked_arguments, decode_texts,
                     forward, model_weights, rotary_tables, row_uniforms, runnable_backend,
                     sample_next)
from sampler import generate as plain_generate

COMPACT_WHEN_FINISHED = 1 / 8  # compact the batch once this fraction of its rows has finished
# padded tokens per prefill forward: bounds its activations (the float32 attention scores grow
# with tokens x keys) while keeping matrix products large enough to run at speed
PREFILL_TOKENS = 2048


@dataclass
class Settings:
    memory_budget: int | None = None  # bytes for one wave's cache and logits (None: half free)


SETTINGS = Settings()


def serve(learner):
    """t3rl.setup's one call for --backend kv-fast: the run samples with this generate, and the
    verifier's weights are read from its files, kept, and dropped while the policy updates."""
    learner.generate, learner.hold_verifier = generate, hold_verifier
    learner.before_update.append(sleep)


def hold_verifier(model, tokenizer, dtype, device):
    """The verifier's weights held by this sampler alone (sampling_only), its module on `device`."""
    sampling_only(model, getattr(model, "name_or_path", ""))
    model.to(device)


def generate(model, tokenizer, prompts, n: int, sampling: Sampling, *, seed=None, progress=None):
    """sampler.generate through the fast path: n Completions for each prompt, a list per prompt. A
    model the kv sampler does not run samples with hf (sampler.runnable_backend)."""
    if runnable_backend(model, "kv-fast") == "hf":
        return plain_generate(model, tokenizer, prompts, n, sampling, seed=seed, backend="hf")
    prompt_ids, eos, seeds = checked_arguments(model, tokenizer, prompts, n, sampling, seed)
    with torch.inference_mode():
        rows = generate_rows(model, prompt_ids, n, sampling, seeds, eos, progress)
    decode_texts(rows, tokenizer)
    return [rows[p * n:(p + 1) * n] for p in range(len(prompt_ids))]


def generate_rows(model, prompt_ids, n: int, sampling: Sampling, seeds, eos, progress=None,
                  tool_rows=None) -> list:
    """Row r samples for prompt r // n, in waves of rows that fit SETTINGS.memory_budget. tool_rows:
    (n_rows, device) -> the decode loop's hook for a wave's tool calls (extensions/agent.py's
    ToolRows)."""
    device = next(model.parameters()).device
    dtype = sampling.dtype or next(model.parameters()).dtype
    longest, steps, n_rows = max(map(len, prompt_ids)), sampling.max_new_tokens, len(prompt_ids) * n
    planned = waves(model, n_rows, longest, steps, dtype)
    w = sampling_weights(model, dtype)
    run = Run(w, rotary_tables(w, longest + steps, dtype), device.type == "cuda",
              torch.tensor(eos, dtype=torch.long, device=device), dtype, device)
    rows = []
    for start, stop in planned:
        uniforms = (row_uniforms(seeds, n, steps, start, stop).to(device)
                    if sampling.temperature > 0 else None)
        label = progress and (progress if stop - start == n_rows
                              else f"{progress} (rows {start}-{stop - 1})")
        rows += decode_wave(run, [prompt_ids[r // n] for r in range(start, stop)], sampling,
                            uniforms, label, tool_rows)
    del run, w  # the sampling copy of a training model, the caches: back to the system
    release_freed_memory()
    return rows


# --------------------------------------------------------------------------- weights

@dataclass
class PackedLinear:
    """x W^T + b with W held only in oneDNN's blocked layout (out_features rows). On a CPU in
    bfloat16 F.linear reorders the weight on every call; decode calls it for every layer at every
    token with few rows, where the reorder costs more than the product. The ops are PyTorch
    internals (inductor's CPU linears use them) whose bfloat16 path needs AVX-512 or AVX-NE-CONVERT:
    packing_available tries them."""
    out_features: int
    packed: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, weight, bias):
        return cls(len(weight), torch.ops.mkldnn._reorder_linear_weight(weight), bias)

    def __call__(self, x):
        # 2-D in: oneDNN runs a (rows, 1, hidden) decode input several times slower than its view
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.packed, self.bias,
                                                 "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])


@functools.cache
def packing_runs() -> bool:
    """Whether this PyTorch has the packing ops and this CPU runs them (tried once on a small
    weight: torch has no public query for the CPU features they need)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        out = PackedLinear.of(torch.ones(16, 16, dtype=torch.bfloat16), None)(
            torch.ones(2, 16, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return torch.equal(out, torch.full((2, 16), 16.0, dtype=torch.bfloat16))


def packing_available(dtype, device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and packing_runs()


# models the sampler alone reads -> their checkpoint folder; their kept sampling weights
_FROM_FILES = weakref.WeakKeyDictionary()
_KEPT = weakref.WeakKeyDictionary()


def sampling_only(model, folder) -> bool:
    """Make a model that only this sampler reads (the verifier) hold no weights of its own: its
    sampling weights are read from the safetensors files in `folder` (a tensor at a time), kept
    between calls, and dropped while the policy updates (sleep). False, and nothing changed, when
    the folder holds no safetensors file."""
    if not sorted(Path(folder).glob("*.safetensors")):
        return False
    for parameter in model.parameters():
        parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
    _FROM_FILES[model] = Path(folder)
    return True


def sleep():
    """Drop the kept weights of the sampling_only models: the update needs the memory, and the next
    call reads them again (about 3 s for a 1.5B)."""
    _KEPT.clear()


def sampling_weights(model, dtype):
    """sampler.model_weights with each product's weight packed where it can be: made on every call
    for a training model (its weights change), once and kept for a sampling_only one."""
    pack = packing_available(dtype, next(model.parameters()).device)
    linear = PackedLinear.of if pack else Linear
    if model not in _FROM_FILES:
        return model_weights(model, dtype, linear=linear)
    if _KEPT.get(model, (None,))[0] != dtype:
        _KEPT[model] = (dtype, model_weights(model, dtype, file_tensors(_FROM_FILES[model]),
                                             linear))
    return _KEPT[model][1]


def file_tensors(folder: Path):
    """name -> the tensor stored under it in the folder's safetensors files."""
    files = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            files.update(dict.fromkeys(f.keys(), path))

    def tensor(name):
        if name not in files and name == "lm_head.weight":  # a tied head is the embedding
            name = "model.embed_tokens.weight"
        with safe_open(files[name], "pt") as f:
            return f.get_tensor(name)
    return tensor


# --------------------------------------------------------------------------- waves

@dataclass
class Run:
    """What every wave of one generate call shares."""
    w: object            # sampler.Weights
    rotary: tuple        # (cos, sin), each (length, head dim)
    windowed: bool       # decode attends over a window of the cache columns (CUDA)
    eos: torch.Tensor    # end-of-sequence ids (empty: EOS ignored)
    dtype: torch.dtype
    device: torch.device


def free_memory(device) -> int:
    """What a new allocation can get: on Linux MemAvailable (the page cache the kernel gives back
    included); on a GPU the free memory plus what PyTorch holds reserved but unused."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo
                        if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def waves(model, n_rows: int, longest: int, steps: int, dtype) -> list:
    """Rows [start, stop) of each wave: as many rows of `longest` prompt tokens + `steps` as one
    wave's cache, logits and sampling buffers fit in the memory budget."""
    config, length = model.config, longest + steps
    if length > config.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({steps}) exceeds the "
                         f"model's {config.max_position_embeddings} positions; shorten one of them")
    budget = SETTINGS.memory_budget or free_memory(next(model.parameters()).device) // 2
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_row = (2 * config.num_hidden_layers * config.num_key_value_heads * length * head_dim
               * torch.empty((), dtype=dtype).element_size() + 16 * config.vocab_size + 4 * length)
    if budget < per_row:
        raise ValueError(f"memory budget {budget} bytes holds no row of {length} tokens ({per_row} "
                         f"bytes); raise it or lower max_new_tokens")
    rows = budget // per_row
    return [(start, min(start + rows, n_rows)) for start in range(0, n_rows, rows)]


# --------------------------------------------------------------------------- decoding a wave

def prefill_shared(run, cache: KVCache, prompts, width: int, logits):
    """Put every row's prompt into its cache row, columns [width - len, width), and its last
    token's float32 logits into logits[row]; prompts[r] is row r's prompt (rows may share one).
    Each distinct prompt runs once, only its tokens after the longest start it shares with another,
    whose keys and values (a function of the tokens up to them: causal attention) it reads from that
    one's row; then its row is copied into the rows that sample from it."""
    chunks, rows_of = prefill_chunks(prompts, width)
    for jobs in chunks:
        prefill_forward(run, cache, jobs, width, logits)
    copy_shared_rows(cache, logits, prompts, rows_of, width)


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


def decode_wave(run, prompts, sampling: Sampling, uniforms, progress=None, tool_rows=None):
    """A Completion for every row of one wave (run: kv_fast.Run): prompts[r] is row r's prompt (rows
    may share one), and row r draws its token j with uniforms[r, j] (None when greedy)."""
    n_rows, steps, device = len(prompts), sampling.max_new_tokens, run.device
    width = max(map(len, prompts))  # prompts end at column `width`; completion token t at width + t
    last_column = width + steps - 1
    cache = KVCache.zeros(run.w, n_rows, width + steps, run.dtype, device)
    logits = torch.empty(n_rows, run.w.head.out_features, dtype=torch.float32, device=device)
    probs = torch.empty_like(logits)  # the step's logits and their probabilities, allocated once
    prefill_shared(run, cache, prompts, width, logits)
    start = width - torch.tensor([len(p) for p in prompts], device=device)
    alive = torch.ones(n_rows, dtype=torch.bool, device=device)
    batch = Batch(torch.arange(n_rows, device=device), start, alive, int(start.min()),
                  torch.full((n_rows,), width, device=device))
    out = torch.empty(n_rows, steps, dtype=torch.long, device=device)
    ends, reasons = [steps] * n_rows, ["length"] * n_rows  # tokens kept per row, why it ended
    logprobs = torch.zeros(n_rows, dtype=torch.float32, device=device)  # sum of log pi_T(drawn)
    calls = tool_rows(n_rows, device) if tool_rows else None  # agent.ToolRows
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
            if not finish_rows(batch, tokens, run.eos, full, step=j, ends=ends, reasons=reasons):
                break  # no row is left
            batch, tokens = compact(cache, batch, tokens)
        logits[:len(batch.rows)] = decode_step(run, cache, batch, tokens, width + j)
        batch.columns = (batch.columns + 1).clamp(max=last_column)  # a finished row's are not read
        for row, call in made:
            calls.append(run, cache, batch, row, call, logits, step=j, ends=ends)
    bar.close()
    out, logprobs = out.tolist(), logprobs.tolist() if uniforms is not None else [None] * n_rows
    rows = [Completion(prompts[r], out[r][:ends[r]], None, reasons[r], logprobs[r])
            for r in range(n_rows)]
    for r, c in enumerate(rows if calls else ()):
        c.token_ids, c.tool_mask, c.tool_calls = calls.interleave(r, c.token_ids)
    return rows


def finish_rows(batch: Batch, tokens, eos, full, *, step: int, ends, reasons) -> int:
    """Rows that drew an end-of-sequence token at `step`, or whose budget is `full`, finish (ends,
    reasons record it); how many rows still sample."""
    eos_drawn = batch.alive & torch.isin(tokens, eos)
    for row in batch.rows[eos_drawn].tolist():
        ends[row], reasons[row] = step + 1, "eos"
    for row in batch.rows[batch.alive & full & ~eos_drawn].tolist():
        ends[row] = step + 1
    batch.alive = batch.alive & ~eos_drawn & ~full
    return int(batch.alive.sum())


def decode_step(run, cache: KVCache, batch: Batch, tokens, column: int):
    """Logits (rows, vocab) of the token after `tokens` (rows,), its keys and values in cache column
    `column` of every row (not batch.aligned: each row's batch.columns). Attention reads the whole
    cache, masked, or with run.windowed the columns from the batch's first prompt column on."""
    last = column if batch.aligned else int(batch.columns.max())
    lo, hi = (batch.first_column, last + 1) if run.windowed else (0, cache.k.shape[3])
    seen = torch.arange(lo, hi, device=run.device)
    mask = ((seen >= batch.start[:, None]) & (seen <= batch.columns[:, None]))[:, None, None, :]
    at = (torch.tensor([column - lo], device=run.device) if batch.aligned
          else (batch.columns - lo)[:, None])
    return forward(run.w, tokens[:, None], (batch.columns - batch.start)[:, None], at,
                   cache.window(len(batch.rows), lo), mask, run.rotary)


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
    by_prompt = {}  # token tuple -> the rows sampling from it, in the order prompts first appear
    for row, prompt in enumerate(prompts):
        by_prompt.setdefault(tuple(prompt), []).append(row)
    unique, rows_of = [list(p) for p in by_prompt], list(by_prompt.values())
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


def prefill_forward(run, cache: KVCache, jobs, width: int, logits):
    """One prefill forward over jobs [(row, prompt, shared, (source row, its first column) or
    None)]: each job's last token's float32 logits into logits[row], its prompt into its row's
    cache columns [width - len, width). A scratch cache holds one row per job: its `shared` tokens,
    copied from the source row, end at column A (the most any job shares), its own tokens follow,
    right-padded to the longest; a token attends to its row's columns from its prompt's first to
    itself, so padding (after every real token) is never read."""
    device = cache.k.device
    shared = torch.tensor([job[2] for job in jobs], device=device)
    own = torch.tensor([len(job[1]) - job[2] for job in jobs], device=device)  # tokens it runs
    A, S = int(shared.max()), int(own.max())
    scratch = KVCache.zeros(run.w, len(jobs), A + S, cache.k.dtype, device)
    tokens = torch.zeros(len(jobs), S, dtype=torch.long, device=device)
    for j, (_, prompt, n_shared, source) in enumerate(jobs):
        tokens[j, :len(prompt) - n_shared] = torch.tensor(prompt[n_shared:], device=device)
        if source is not None:
            copy_columns(scratch, j, A - n_shared, cache, *source, n_shared)
    t = torch.arange(S, device=device)
    positions = torch.where(t < own[:, None], shared[:, None] + t, 0)  # padding at 0
    keys = torch.arange(A + S, device=device)
    mask = (keys >= A - shared[:, None, None]) & (keys <= A + t[None, :, None])  # jobs, S, A+S
    rows = torch.tensor([job[0] for job in jobs], device=device)
    logits[rows] = forward(run.w, tokens, positions, A + t, scratch, mask[:, None], run.rotary,
                           last=own - 1).float()
    for j, (row, prompt, n_shared, _) in enumerate(jobs):
        copy_columns(cache, row, width - len(prompt), scratch, j, A - n_shared, len(prompt))


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
