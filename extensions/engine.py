"""Sample on vLLM, colocated: one inference engine per model per process, its weights synced from
the trainer.

    serve(learner)   # t3rl.setup's one call: this generate, the engines started, stop() at the end
    generate(model, tokenizer, prompts, n, Sampling(...))   # sampler.generate's signature

What an RL library does with an engine, and how it is done here (TRL's colocate mode, verl's hybrid
engine):

  - One engine per process and model (tensor-parallel 1), built once and kept, from the model's
    config and tokenizer alone (load_format "dummy"): its weights come from the trainer's model.
  - Weight sync before every sampling call that follows a change (a parameter written in place or
    an optimizer step), through vLLM's in-place reload, with its prefix cache reset.
  - Seeds: what a prompt gets depends on (weights, prompt, seed), not on its batch.
  - Log-probabilities: each sampled token's, as the engine sampled it (after temperature, top-p).
  - Started up front, on every process. GPUs: GPU_MEMORY_UTILIZATION (0.3) per engine, the
    policy's asleep during the update. CPUs: a fixed KV-cache budget, eager mode.
  - Shut down when the run ends, so that a process can run again.

Not done here: vLLM's server mode (a separate GPU for the engine, weights over NCCL), tensor
parallelism, and prompt log-probs. `python -m bench.engine` measures this backend beside "hf" and
"kv". The design in full: docs/distributed.md#the-vllm-engine.
"""
import contextlib
import gc
import importlib
import os
import random
import sys
import tempfile
import threading
import time
import weakref

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from config import OptionError, builds_verifier
from machinery.runs import first_line
from sampler import Completion, checked_arguments, decode_texts

# CPU: KV-cache memory per engine (vLLM's default would take 90 % of the machine's memory)
ENGINE_KV_CACHE_GIB = 1
# GPU: the share of its memory each engine takes (TRL's colocate default)
GPU_MEMORY_UTILIZATION = 0.3

# The engine runs in this process (not in a child): weights go in from memory (a generator of
# tensors, which a child's RPC cannot carry), so that one is set whatever the user's; the others are
# defaults (a CPU process keeps the cores torch already uses). Set before vllm is imported.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                      "VLLM_LOGGING_LEVEL": "WARNING"}


class EngineUnavailable(OptionError):
    """An engine cannot be started as asked; the message says why and which option to change."""


_ENGINES = weakref.WeakKeyDictionary()  # model -> Engine
# optimizer steps taken in this process, by any torch optimizer
_OPTIMIZER_STEPS = [0]
# agent rollouts stop after one (extensions/agent.py)
FENCE = "```"


def _count_step(optimizer, args, kwargs):
    _OPTIMIZER_STEPS[0] += 1


register_optimizer_step_post_hook(_count_step)


def start(model, tokenizer, dtype: torch.dtype | None = None, *, sleeps: bool = False,
          frozen: bool = False) -> "Engine":
    """The engine serving `model` in this process, built on first use (its start-up time printed).
    sleeps: on a GPU in vLLM's sleep mode, so that sleep frees its memory for the update (the
    policy's engine; one per process). frozen: the model never trains, its weights load once."""
    engine = _ENGINES.get(model)
    if engine is None:
        dtype = dtype or next(model.parameters()).dtype
        engine = _ENGINES[model] = Engine(model, tokenizer, dtype, sleeps, frozen)
    return engine


def serve(learner):
    """t3rl.setup's one call for --backend vllm: the run samples with this generate; once the GPU's
    memory is seen to fit both, the policy's engine starts now on every process, asleep during
    each update, and the verifier's when it is built (its model's own copy stays in CPU memory);
    both shut down when the run ends."""
    cfg, accelerator = learner.cfg, learner.accelerator
    check_gpu_memory(learner.policy, builds_verifier(cfg), cfg.parallel, accelerator,
                     learner.ref_model)
    start(accelerator.unwrap_model(learner.policy), learner.tokenizer,
          getattr(torch, cfg.sample_dtype), sleeps=True)
    learner.generate, learner.hold_verifier = generate, hold_verifier
    learner.before_update.append(sleep)
    learner.releases.callback(stop)


def hold_verifier(model, tokenizer, dtype, device):
    """The verifier's engine, started now on every process from the model in CPU memory (whatever
    the trainer's device)."""
    start(model, tokenizer, dtype, frozen=True)


def generate(model, tokenizer, prompts, n: int, sampling, *, seed=None, progress=None) -> list:
    """sampler.generate on the model's engine: n Completions for each prompt, a list per prompt."""
    prompt_ids, eos, seeds = checked_arguments(model, tokenizer, prompts, n, sampling, seed)
    with torch.inference_mode():
        engine = start(model, tokenizer, sampling.dtype)
        rows = [Completion(prompt_ids[r // n], tokens, None, reason, logprob, token_logprobs)
                for r, (tokens, reason, logprob, token_logprobs)
                in enumerate(engine.generate(model, prompt_ids, n, sampling, seeds, eos))]
    decode_texts(rows, tokenizer)
    return [rows[p * n:(p + 1) * n] for p in range(len(prompt_ids))]


def stop():
    """Shut down this process's engines and give their memory back: the run that started them has
    ended, and the process may start another. Not in a launched process: there vLLM's shutdown would
    tear down the process group its engines share with the launcher's, which the process still
    uses; its engines end with it."""
    if executor(os.environ):
        return
    for engine in list(_ENGINES.values()):
        engine.llm.llm_engine.engine_core.shutdown()
        del engine.llm
    _ENGINES.clear()
    gc.collect()


def sleep():
    """Free the engines' GPU memory for the update; a no-op where sleep mode is off (CPUs)."""
    for engine in list(_ENGINES.values()):
        engine.sleep()


def import_vllm():
    """The vllm package, its LLM imported the first time in a thread of its own: vLLM keeps the
    ImportError of an optional package (torchcodec) with its traceback, whose frames would keep the
    importing call's callers alive, and with them a finished run's models."""
    def import_llm():
        with contextlib.suppress(ImportError):  # raised again below, in the caller's thread
            importlib.import_module("vllm.entrypoints.llm")

    if "vllm.entrypoints.llm" not in sys.modules:
        thread = threading.Thread(target=import_llm)
        thread.start()
        thread.join()
    import vllm as package
    return package


def check_memory(total: int, trainer: int, engines: list) -> tuple:
    """The GPU's memory shares as a line, and whether they fit in its `total` bytes: each engine
    of `engines` (their roles) takes GPU_MEMORY_UTILIZATION of it, beside the trainer's `trainer`
    bytes; activations use what is left (and the policy's share while it sleeps)."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    share = GPU_MEMORY_UTILIZATION * total
    parts = [f"{role}'s engine {gib(share)}" + " (asleep during the update)" * (role == "policy")
             for role in engines] + [f"trainer {gib(trainer)}"]
    left = total - len(engines) * share - trainer
    line = f"GPU memory {gib(total)}: {', '.join(parts)}, {gib(left)} left"
    if left >= 0:
        return line, True
    return f"{line}: does not fit; pass --backend kv-fast (it fits itself into what is left)", False


def check_gpu_memory(policy, verifies: bool, parallel: str, accelerator, ref_model=None):
    """On a GPU, both engines' shares and the trainer's against its memory before anything starts:
    a line saying them, or EngineUnavailable naming what to do."""
    if not torch.cuda.is_available():
        return
    # float32 weights, gradients and AdamW's two moments: 16 bytes (sharded under FSDP), and the
    # frozen reference model's weights (--kl-coef: --preset ttrl's)
    trainer = 16 * sum(p.numel() for p in policy.parameters())
    if ref_model is not None:
        trainer += sum(p.numel() * p.element_size() for p in ref_model.parameters())
    trainer //= accelerator.num_processes if parallel == "fsdp" else 1
    total = torch.cuda.get_device_properties(accelerator.device).total_memory
    line, fits = check_memory(total, trainer, ["policy"] + ["verifier"] * verifies)
    if not fits:
        raise EngineUnavailable(line)
    accelerator.print(f"[t3rl] {line}")


def executor(environment) -> dict:
    """vLLM's executor for an engine of this process: external_launcher whenever a launcher
    (torchrun, accelerate launch) started it (LOCAL_RANK set), so that each process's engine sits on
    its own device and joins the launcher's process group, as TRL's colocate mode starts it;
    vLLM's in-process default otherwise (one process, python t3rl.py)."""
    return ({"distributed_executor_backend": "external_launcher"}
            if "LOCAL_RANK" in environment else {})


def parameter_versions(model) -> tuple | None:
    """The storage and version counter of every parameter: an in-place write bumps a version and a
    move gives new storage, so a change of either shows here (None: an inference tensor, which
    keeps no version counter)."""
    parameters = list(model.parameters())
    if any(p.is_inference() for p in parameters):
        return None
    return tuple((p.data_ptr(), p._version) for p in parameters)


@contextlib.contextmanager
def kept_random_state():
    """Python's, numpy's and torch's (CUDA's too) generators as they were, whatever the block
    seeds."""
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class Engine:
    def __init__(self, model, tokenizer, dtype: torch.dtype, sleeps: bool, frozen: bool):
        gpu = torch.cuda.is_available()
        self.sleeps = sleeps and gpu  # sleep mode is a CUDA feature of vLLM
        if self.sleeps and any(engine.sleeps for engine in _ENGINES.values()):
            # vLLM's sleep-mode allocator is one per process: a second engine fails as it loads
            raise EngineUnavailable("vLLM runs one sleep-mode engine per process (the policy's); "
                                    "start the others with sleeps=False")
        for name, value in ENGINE_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        os.environ.update(IN_PROCESS)
        LLM = import_vllm().LLM
        started = time.perf_counter()
        self.dtype, self.synced, self.asleep, self.syncs = dtype, None, False, 0
        self.frozen = frozen
        with tempfile.TemporaryDirectory(prefix="t3rl-engine-") as folder:
            # config and tokenizer only: the engine starts with placeholder weights, then
            # sync() loads the model's
            model.config.save_pretrained(folder)
            model.generation_config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            if gpu:
                memory = dict(gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                              enable_sleep_mode=self.sleeps)
            else:  # VLLM_CPU_KVCACHE_SPACE, vLLM's own setting, wins over ours
                memory = (dict(enforce_eager=True) if os.environ.get("VLLM_CPU_KVCACHE_SPACE")
                          else dict(enforce_eager=True,
                                    kv_cache_memory_bytes=ENGINE_KV_CACHE_GIB << 30))
            memory.update(executor(os.environ))
            try:
                with kept_random_state():  # vLLM's worker seeds every global generator
                    self.llm = LLM(model=folder, load_format="dummy",
                                   dtype=str(dtype).removeprefix("torch."), seed=0,
                                   logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                                   **memory)
            except ValueError as err:
                if "KV cache" not in str(err):  # vLLM's: no room for one request of the context
                    raise
                raise EngineUnavailable(f"vLLM cannot start for {type(model).__name__}: "
                                        f"{first_line(err, 300)}; give its KV cache more memory "
                                        f"(on a CPU VLLM_CPU_KVCACHE_SPACE, GiB) or pass "
                                        f"--backend kv-fast") from None
        print(f"[engine] vLLM engine for {type(model).__name__} ({dtype}) started in "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr)

    def sync(self, model):
        """Load the model's weights into the engine if they may have changed since the last load: a
        parameter written in place or, unless the model is frozen, an optimizer step."""
        versions = parameter_versions(model)
        if versions is not None and not self.frozen:
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

    def generate(self, model, prompt_ids, n: int, sampling, prompt_seeds, eos_ids):
        """(token_ids, finish_reason, sum of log-probs, per-token log-probs) per row, n rows per
        prompt in order. sampling: sampler.Sampling; eos_ids: the ids that end a row (empty: sample
        to max_new_tokens)."""
        greedy = sampling.temperature == 0
        repeats = n if greedy else 1  # vLLM refuses n > 1 when greedy: decode once, repeat
        params = [_params(sampling, sampling.max_new_tokens, seed, eos_ids, n=n // repeats)
                  for seed in prompt_seeds]
        rows = []
        for request in self._run(model, prompt_ids, params):
            for sample in sorted(request.outputs, key=lambda s: s.index):
                tokens, logprobs = list(sample.token_ids), _token_logprobs(sample, greedy)
                reason = "eos" if tokens and tokens[-1] in eos_ids else "length"
                rows += [(tokens, reason, None if greedy else sum(logprobs), logprobs)] * repeats
        return rows

    def continue_rows(self, model, contexts, budgets, seeds, may_stop, sampling, *, eos_ids):
        """agent.sample_with_tools' continue_rows: each context (prompt, tokens,
        tool outputs) sampled on by one request of up to its budget, stopped after a fence (```)
        where may_stop (the caller reads whether it closed a block); (new tokens, "eos" | "length" |
        "stop", their log-probs) per row."""
        params = [_params(sampling, budget, seed, eos_ids, stop=FENCE if stop else None)
                  for budget, seed, stop in zip(budgets, seeds, may_stop)]
        rows = []
        for request in self._run(model, contexts, params):
            sample = request.outputs[0]
            tokens = list(sample.token_ids)
            reason = ("eos" if tokens and tokens[-1] in eos_ids
                      else "stop" if sample.stop_reason == FENCE else "length")
            rows.append((tokens, reason, _token_logprobs(sample, sampling.temperature == 0)))
        return rows

    def _run(self, model, contexts, params):
        """vLLM's outputs for token-id contexts, one SamplingParams each, on the model's current
        weights."""
        self.wake()
        self.sync(model)
        return self.llm.generate([{"prompt_token_ids": ids} for ids in contexts], params,
                                 use_tqdm=False)


def _params(sampling, max_tokens: int, seed: int, eos_ids, n: int = 1, stop: str | None = None):
    """One request's SamplingParams: sampler.Sampling's temperature and top-p (greedy when 0: no
    seed, no nucleus), ending at eos_ids (none: sample to max_tokens) or after stop, kept in the
    output."""
    SamplingParams = import_vllm().SamplingParams
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
