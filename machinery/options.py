"""The command line: one parser built from config.Config's fields, presets applied, every value
checked (its Range or choices, the options that depend on each other, the model names) before
anything loads.

    command = parse_command(["--bench", "math500", "--omega", "inf"])
    # mode "train", its checked Config
"""
import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType

from config import (PAPER_EPISODES, PRESETS, REPLAY_OMEGAS, RESUMABLE_CHANGES,
                    TTRL_QUESTIONS_PER_STEP, Config, OptionError, Range, verifier_backend)
from machinery.update import bf16_supported
from machinery.domains import domain_of
from machinery.engine import INSTALL_HINT as VLLM_INSTALL_HINT, vllm_installed
from machinery.model import check_spec
from machinery.runs import run_started, tracker_names


@dataclass
class Command:
    """What the command line asks for: one mode and its inputs. train and eval run `train` (eval
    stops after the baseline evaluation); replay re-votes a run's saved rollouts for each omega and
    loads no model."""
    mode: str                                   # "train" | "eval" | "replay" | "study"
    cfg: Config | None = None                   # train, eval
    replay_dir: Path | None = None              # replay
    omegas: list[float] = field(default_factory=list)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """One parser for every mode. Options default to 'not given' (SUPPRESS), so the parsed namespace
    holds exactly what the user typed, and presets or a resumed config.json fill in the rest."""
    parser = argparse.ArgumentParser(
        description="t3rl: tool-verified test-time RL (T3RL), on top of TTRL",
        argument_default=argparse.SUPPRESS)
    for f in fields(Config):
        allowed = f.metadata["allowed"]
        text = f.metadata["doc"] + (f"; one of {' | '.join(allowed)}"
                                    if isinstance(allowed, tuple) else "")
        text += f" (default: {f.default})".replace("%", "%%")
        if f.type in (bool, "bool"):
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[
                f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag(f.name), type=kind, help=text,
                                **({"nargs": "+"} if f.name == "omega" else {}))
    parser.add_argument("--replay", metavar="RUN_DIR",
                        help="mode: re-vote a run's saved rollouts for each --omega given "
                        f"(default: {' '.join(f'{w:g}' for w in REPLAY_OMEGAS)}) and print the "
                        "ablation table; loads no model")
    return parser


def parse_command(argv=None) -> Command:
    """The mode and its checked inputs; raises OptionError (one line) before anything heavy
    starts."""
    given = vars(build_parser().parse_args(argv))
    if "replay" in given:
        others = sorted(flag(k) for k in given if k not in ("replay", "omega"))
        if others:
            raise OptionError(f"--replay takes only --omega; drop {', '.join(others)}")
        omegas = given.get("omega", REPLAY_OMEGAS)
        for omega in omegas:
            check_value("omega", omega)
        return Command("replay", replay_dir=Path(given["replay"]), omegas=omegas)
    if "omega" in given:
        if len(given["omega"]) > 1:
            raise OptionError(f"--omega {' '.join(f'{w:g}' for w in given['omega'])}: one value "
                              "for a run (several only with --replay RUN_DIR)")
        given["omega"] = given["omega"][0]
    cfg = resumed_config(given) if given.get("resume") else new_config(given)
    return Command("study" if cfg.study else "eval" if cfg.eval_only else "train", cfg=cfg)


def parse_config(argv=None) -> Config:
    """The Config of a train or eval command line, checked (what tests and scripts call)."""
    command = parse_command(argv)
    if command.cfg is None:
        raise OptionError("--replay is a mode of its own: "
                          "run it through t3rl.main or the command line")
    return command.cfg


def new_config(given: dict) -> Config:
    """Defaults, then the preset, then the options typed; the default run name is fixed here,
    once."""
    cfg = Config()
    check_value("preset", given.get("preset", cfg.preset))
    preset = given.get("preset", cfg.preset)
    preset = preset if preset != "auto" else ("paper" if has_gpu() else "cpu")
    for key, value in PRESETS[preset].items():
        setattr(cfg, key, value)
    if preset in ("paper", "ttrl"):
        bench = given.get("bench", cfg.bench)
        cfg.episodes = PAPER_EPISODES.get(bench, cfg.episodes)
        cfg.questions_per_step = TTRL_QUESTIONS_PER_STEP.get(bench, cfg.questions_per_step)
        if preset == "paper":
            cfg.eval_samples = 16 if bench == "aime2024" else 4
            # the paper's scale needs the engine; without it, the kv sampler
            if vllm_installed():
                cfg.backend = cfg.verifier_backend = "vllm"
    if given.get("study"):
        # a study verifies every rollout; the cpu preset's budget and laziness only save training
        # time; it never trains, so the rollouts kept for training only need to fit in whatever
        # --n-votes it samples
        cfg.verify_budget, cfg.lazy_verify = 0, False
        cfg.n_train = min(cfg.n_train, given.get("n_votes", cfg.n_votes))
    if accelerate_asks_fsdp() and "parallel" not in given:
        cfg.parallel = "fsdp"
    for key, value in given.items():
        setattr(cfg, key, value)
    cfg.preset = preset
    # fixed once, like the preset: a resume on another machine samples alike
    if cfg.sample_dtype == "auto":
        cfg.sample_dtype = str(sample_dtype(cfg)).removeprefix("torch.")
    check_config(cfg)
    if not cfg.run_name:
        cfg.run_name = free_run_name(cfg)
    return cfg


def resumed_config(given: dict) -> Config:
    """The saved config.json of the run in --resume; options typed beside --resume must match it,
    except those in RESUMABLE_CHANGES (listed when they change)."""
    run_dir = Path(given["resume"])
    path = run_dir / "config.json"
    if not path.is_file():
        what = "no such folder" if not run_dir.is_dir() else "no config.json in it"
        raise OptionError(f"--resume {run_dir}: {what}; pass a run folder written by t3rl.py "
                          f"(or start a new run without --resume)")
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        cfg = Config(**{k: v for k, v in saved.items() if k in {f.name for f in fields(Config)}})
    except (ValueError, TypeError) as err:
        raise OptionError(f"{path}: damaged ({err}); restore it from a copy, "
                          f"or start a new run") from None
    changed = {k: v for k, v in given.items()
               if k not in ("resume", "preset") and v != getattr(cfg, k)}
    refused = [f"{flag(k)} {v} (the run has {getattr(cfg, k)})" for k, v in changed.items()
               if k not in RESUMABLE_CHANGES
               and not (cfg.study and grows_study(k, getattr(cfg, k), v))]
    if refused:
        raise OptionError(f"--resume {run_dir}: {'; '.join(refused)}; a resumed run keeps its "
                          f"config.json (a study may only grow: a larger --n-votes or --limit): "
                          f"drop {'these options' if len(refused) > 1 else 'that option'}, "
                          f"or start a new run with them")
    for key, value in changed.items():
        print(f"[t3rl] --resume: {flag(key)} {getattr(cfg, key)} -> {value}", file=sys.stderr)
        setattr(cfg, key, value)
    cfg.resume = str(run_dir)
    check_config(cfg, source=f"{path}: ")
    if cfg.sample_dtype == "bfloat16" and not native_bf16():
        print(f"[t3rl] --resume: the run samples in bfloat16 ({path}), which this machine runs "
              f"without native support, far slower than float32 (an AVX2 CPU: some 400x per "
              f"product)", file=sys.stderr)
    return cfg


def grows_study(key: str, saved, given) -> bool:
    """A study resumed with more rollouts per question or more questions (--limit 0: all) keeps what
    it has and adds the rest: its k are nested subsets and --limit's stratified order extends the
    same list."""
    if key == "n_votes":
        return isinstance(given, int) and given > saved
    return (key == "limit" and saved != 0 and isinstance(given, int)
            and (given == 0 or given > saved))


def check_value(name: str, value):
    allowed = Config.__dataclass_fields__[name].metadata["allowed"]
    if isinstance(allowed, Range) and value not in allowed:
        raise OptionError(f"{flag(name)} {value}: must be in {allowed}")
    if isinstance(allowed, tuple) and value not in allowed:
        raise OptionError(f"{flag(name)} {value}: choose one of {', '.join(allowed)}")


def check_config(cfg: Config, source: str = ""):
    """Every option against what it allows, then the ones that depend on each other, then the model
    names (cheaply: a path that exists, a GGUF's magic, a Hub id that is cached or reachable),
    before anything loads."""
    try:
        if isinstance(cfg.temperature, (int, float)) and not cfg.temperature > 0:
            raise OptionError(f"--temperature {cfg.temperature}: must be > 0; GRPO's ratio needs "
                              f"the log-probs of the distribution the rollouts came from, which "
                              f"greedy decoding does not have (greedy@1 is evaluated anyway)")
        for f in fields(Config):
            check_value(f.name, getattr(cfg, f.name))
        if cfg.answer_rule != "strict" and domain_of(cfg.bench).name != "math":
            raise OptionError(f"--answer-rule {cfg.answer_rule}: reads numbers, for math "
                              f"benchmarks only; drop it for --bench {cfg.bench}")
        if cfg.vllm_is_correction and cfg.backend != "vllm":
            raise OptionError(f"--vllm-is-correction: corrects the vLLM engine's rollouts; pass "
                              f"--backend vllm (the policy's is {cfg.backend}) or drop it")
        for option, backend in (("--backend", cfg.backend),
                                ("--verifier-backend", verifier_backend(cfg))):
            if backend == "vllm" and not vllm_installed():
                raise OptionError(f"{option} vllm: vLLM is not installed; {VLLM_INSTALL_HINT}")
        cache = Path(cfg.eval_cache).expanduser()
        if cfg.eval_cache not in ("auto", "none") and cache.exists() and not cache.is_dir():
            raise OptionError(f"--eval-cache {cfg.eval_cache}: a file, not a folder; pass a folder "
                              f"(it is created), auto or none")
        if cfg.question_ids and not Path(cfg.question_ids).expanduser().is_file():
            raise OptionError(f"--question-ids {cfg.question_ids}: no such file; pass a file "
                              f"with one question id a line")
        check_parallel(cfg)
        if cfg.n_train > cfg.n_votes:
            raise OptionError(f"--n-train {cfg.n_train}: must be at most --n-votes "
                              f"({cfg.n_votes}); M rollouts are kept out of the N sampled")
        for name in tracker_names(cfg):
            if name not in LoggerType.list():
                raise OptionError(f"--report-to {name}: choose from "
                                  f"{', '.join(LoggerType.list())} or none")
            if name != "all" and name not in {str(t) for t in get_available_trackers()}:
                raise OptionError(f"--report-to {name}: the {name} package is not installed; "
                                  f"pip install {name}")
    except OptionError as err:
        raise OptionError(f"{source}{err}") from None
    check_spec(cfg.model, "--model")
    if cfg.verify and cfg.verifier_model != "self":
        check_spec(cfg.verifier_model, "--verifier-model")


def accelerate_asks_fsdp() -> bool:
    """Whether accelerate's config asks for FSDP (accelerate launch passes it on in the
    environment)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")


def check_parallel(cfg: Config):
    """--parallel against the launch: FSDP shards over several processes, and an accelerate config
    asking for FSDP gets it (t3rl shards the policy itself: machinery/fsdp.py)."""
    if accelerate_asks_fsdp() and cfg.parallel != "fsdp":
        raise OptionError(f"--parallel {cfg.parallel}: accelerate's config asks for FSDP "
                          f"(ACCELERATE_USE_FSDP); pass --parallel fsdp, or launch with a config "
                          f"without FSDP")
    if cfg.parallel == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise OptionError("--parallel fsdp: shards the policy over processes, and this is one; "
                          "launch several (torchrun --nproc_per_node N, accelerate launch) or "
                          "pass --parallel ddp")


def free_run_name(cfg: Config) -> str:
    """bench-method-time, with a suffix when that folder already holds a run (two runs started in
    one second)."""
    method = ("study" if cfg.study else "ttrl" if not cfg.verify or cfg.omega == 1
              else f"t3rl-w{cfg.omega:g}")
    method += "-agent" if cfg.agent else ""
    name = f"{cfg.bench}-{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while run_started(Path(cfg.out_dir) / (name if suffix == 1 else f"{name}-{suffix}")):
        suffix += 1
    return name if suffix == 1 else f"{name}-{suffix}"


def sampler_options(cfg: Config) -> dict:
    """The policy's backend, and for kv and vllm its compute dtype (hf samples in the model's own
    dtype)."""
    return (dict(backend="hf") if cfg.backend == "hf"
            else dict(backend=cfg.backend, dtype=sample_dtype(cfg)))


def sample_dtype(cfg: Config):
    """Compute dtype for sampling: bfloat16 where the hardware runs it natively, else float32
    (an AVX2 CPU; a GPU before compute capability 8.0, which emulates bfloat16 and where vLLM
    refuses it), unless the user says otherwise."""
    if cfg.sample_dtype == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return getattr(torch, cfg.sample_dtype)


def native_bf16() -> bool:
    """Whether the device a run samples on (a GPU when there is one) runs bfloat16 natively."""
    return bf16_supported(torch.device("cuda" if has_gpu() else "cpu"))


def has_gpu() -> bool:
    return torch.cuda.is_available()
