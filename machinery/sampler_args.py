"""sampler.generate's arguments, checked and made explicit before any backend runs.

    checked_arguments(model, tokenizer, prompts, n, max_new_tokens, ...)
        -> (backend, prompt_ids, eos_ids, seed, prompt_seeds)

A bad argument raises ValueError, naming it and what it takes. The prompts become token-id lists
(a string through tokenizer(prompt, add_special_tokens=False)), the end-of-sequence ids are the
model's generation config's plus the tokenizer's (none with ignore_eos), a seed of None becomes an
int drawn from torch's global generator, and an int seed becomes one seed per prompt, drawn from a
generator seeded with it. A model the kv backend cannot run (kv_fast.unsupported_reason) falls back
to "hf", with a notice.
"""
import sys

import torch

from machinery.kv_fast import unsupported_reason


def checked_arguments(model, tokenizer, prompts, n, max_new_tokens, *, temperature, top_p, seed,
                      backend, ignore_eos, kv_only: bool):
    """(backend, prompt_ids, eos_ids, seed, prompt_seeds) for sampler.generate; kv_only: an option
    that only "kv" (and for dtype "vllm") takes was given."""
    _check_arguments(backend, n, max_new_tokens, temperature, top_p, kv_only)
    prompt_ids = _prompt_ids(tokenizer, prompts)
    eos_ids = [] if ignore_eos else _eos_ids(model, tokenizer)
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    prompt_seeds = _prompt_seeds(seed, len(prompt_ids))
    if backend == "kv" and (reason := unsupported_reason(model)):
        print(f"[sampler] kv backend does not support {reason}; falling back to hf "
              f"(dtype, memory_budget and compile ignored)", file=sys.stderr)
        backend = "hf"
    return backend, prompt_ids, eos_ids, seed, prompt_seeds


def _check_arguments(backend, n, max_new_tokens, temperature, top_p, kv_only: bool):
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: the number of completions per prompt must be a positive int")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: must be a positive int")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p}: must be in (0, 1]")
    if backend != "kv" and kv_only:
        raise ValueError(f"memory_budget and compile apply to backend 'kv' (and dtype to 'kv' and "
                         f"'vllm'); for {backend!r} drop them (cast the model for 'hf')")


def _prompt_ids(tokenizer, prompts) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: pass a non-empty list of strings or of token-id lists")
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string but tokenizer is None; pass a "
                                 f"tokenizer or token ids")
            prompt = tokenizer(prompt, add_special_tokens=False).input_ids
        ids.append([int(t) for t in prompt])
        if not ids[-1]:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    return ids


def _prompt_seeds(seed, n_prompts: int) -> list[int]:
    """One seed per prompt: the list itself, or n_prompts draws of a generator seeded with the
    int."""
    if isinstance(seed, int):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(0, 2**62, (n_prompts,), generator=generator).tolist()
    if (not isinstance(seed, (list, tuple)) or len(seed) != n_prompts
            or not all(isinstance(s, int) for s in seed)):
        raise ValueError(f"seed={seed!r}: pass None, an int, or a list of {n_prompts} ints (one "
                         f"per prompt)")
    return list(seed)


def _eos_ids(model, tokenizer) -> list[int]:
    """End-of-sequence ids: the model's generation config plus the tokenizer's (Qwen lists two)."""
    found = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    found = [] if found is None else [found] if isinstance(found, int) else list(found)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.append(tokenizer.eos_token_id)
    if not found:
        raise ValueError("no end-of-sequence token: set model.generation_config.eos_token_id or "
                         "pass ignore_eos=True")
    return sorted(set(found))
