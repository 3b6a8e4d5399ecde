"""t3rl: Tool-verified Test-Time Reinforcement Learning (T3RL), on top of TTRL, in one readable loop.

Test-time RL trains a model on unlabeled test questions. For each question q:

    y_1..y_N ~ pi_theta(. | q)                     sample N rollouts                     (sampler.py)
    a_i = extract(y_i)                             the final answer of each rollout      (answers.py)
    v_i = [ run(program_i) == a_i ]                a verifier LLM writes program_i that
                                                   recomputes the answer; the sandbox runs it (verifier.py, sandbox.py)
    w_i = (1 - v_i) + v_i * omega                  verified rollouts carry omega votes    (voting.py)
    label = argmax_a  sum_i w_i * 1[a_i == a]      the pseudo-label (omega = 1 is TTRL's majority vote)
    r_i = 1[a_i == label]                          the reward; ground truth is never used here
    keep M of the N rollouts at random, GRPO update on them, an AdamW step per Q questions (grpo.py)

Run it:
    python t3rl.py                                  # CPU, offline: embedded 0.5B model, demo benchmark
    accelerate launch t3rl.py --bench math500       # the paper's setting on GPUs
    python t3rl.py --bench knk                      # Knights and Knaves puzzles, the verifier writes SMT-LIB2 for z3
    torchrun --nproc_per_node 2 t3rl.py             # several processes on CPUs (gloo)
"""
import argparse
import functools
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import get_available_trackers
from accelerate.utils import LoggerType, gather_object, set_seed
from huggingface_hub import snapshot_download
from tqdm import tqdm

import knk
from answers import extract_answer, is_equiv
from files import DataError, append_jsonl, drop_torn_tail, jsonl_objects, keep_jsonl, read_jsonl_rows, write_atomically
from grpo import bf16_supported, cosine_schedule, grpo_step, make_optimizer
from model import ModelLoadError, check_hub, check_spec, load_model
from sampler import generate, int8_unavailable_reason
from sandbox import SandboxPool
from study import collect, report, stratified
from verifier import DOMAINS as VERIFIER_DOMAINS
from verifier import model_verifier, verify_batch
from voting import Vote, group_metrics, weighted_vote

ROOT = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Domain:
    """A benchmark's kind of answer: extract(text, problem) reads a rollout's final answer (None: none), answers
    vote together when classes' key matches (cheap) or `same` says so, equiv grades against the gold answer,
    and verify_batch takes the verifier's prompt and tool from the same name."""
    name: str
    instruction: str  # the policy's system prompt: how to reason and how to write the answer
    extract: object
    classes: dict
    equiv: object


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# without the form, a small policy boxes one word ("\\boxed{knaves}") or a name and no assignment is read
KNK_INSTRUCTION = ("Please reason step by step, and put your final answer within \\boxed{}, naming every inhabitant "
                   "with a role, in the form \\boxed{Name: knight, Name: knave, ...}.")


# math answers need no problem to be read (the lambda also looks extract_answer up at call time, as tests patch it)
# the vote's classes are the verifier's (a budget and laziness group rollouts by them too): one definition
DOMAINS = {"math": Domain("math", MATH_INSTRUCTION, lambda text, problem: extract_answer(text),
                          VERIFIER_DOMAINS["math"].classes, is_equiv),
           "knk": Domain("knk", KNK_INSTRUCTION, knk.extract_answer, VERIFIER_DOMAINS["knk"].classes, knk.is_equiv)}


def domain_of(bench: str) -> Domain:
    """Knights and Knaves for --bench knk, math for every other benchmark."""
    return DOMAINS["knk" if bench == "knk" else "math"]

# ----------------------------------------------------------------------------------------------------------------
# The method: one step of test-time RL (train(), below, loops it over the benchmark)

@dataclass
class Learner:
    """What a step works with: the policy and its optimiser, the frozen models, the sandbox, the run."""
    cfg: "Config"
    accelerator: Accelerator
    policy: torch.nn.Module              # float32 master weights, prepared by accelerate (DDP over processes)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object                    # stepped once per optimizer step
    verifier: object                     # prompts -> programs (None with --no-verify)
    pool: SandboxPool
    run_dir: Path
    ref_model: torch.nn.Module | None = None   # the starting policy, for the KL term (kl_coef > 0)


@dataclass
class Judged:
    """One question after the vote: the vote (its classes, its label), the verdicts v_i, the rewards r_i and
    the M rollouts kept."""
    vote: Vote                           # voting.Vote: classes best first, every rollout's class
    v: list[int]                         # [N] 1 = verified
    keep: list[int]                      # [M] indices of the rollouts that go into the update

    @property
    def label(self) -> str | None:
        return self.vote.label

    @functools.cached_property
    def rewards(self) -> list[float]:    # [N] 1[a_i in the label's class], from the vote's one class assignment
        return self.vote.rewards()


def rl_step(step: int, questions: list[dict], learner: Learner) -> dict:
    """One step of test-time RL on a step's questions; returns the step's metrics row. This process samples,
    verifies and votes on its share of the questions (none, at the end of an episode, when processes
    outnumber them: it still takes part in every collective); the update then runs on everyone's rollouts."""
    cfg, accelerator, clock, dom = learner.cfg, learner.accelerator, Stopwatch(), domain_of(learner.cfg.bench)
    shard = questions[accelerator.process_index::accelerator.num_processes]
    with clock("sample"):  # 1. y_1..y_N ~ pi_theta(. | q) and their final answers a_i
        groups = sample_groups(accelerator.unwrap_model(learner.policy), learner.tokenizer, shard, cfg,
                               n=cfg.n_votes, temperature=cfg.temperature, step=step, purpose="rollout")  # [q][N] Completion
        answers = [[dom.extract(c.text, rec["problem"]) for c in group] for rec, group in zip(shard, groups)]
    with clock("verify"):  # 2. v_i = 1 when the verifier's program, run in the sandbox, reproduces a_i
        verdicts = verify_groups(shard, groups, answers, learner.verifier, learner.pool, cfg)  # [q][N]
    votes = []
    for rec, ans, ver in zip(shard, answers, verdicts):
        v = [0 if res is None else res.v for res in ver]
        # 3. the weighted vote's winner is the pseudo-label; 4. r_i = 1[a_i in its class], no ground truth here
        vote = weighted_vote(ans, v, omega=cfg.omega, **dom.classes)
        # 5. vote, then sample: M of the N rollouts, chosen at random, go into the update
        keep = random.Random(question_seed(cfg, step, rec["id"], "downsample")).sample(range(cfg.n_votes), cfg.n_train)
        votes.append(Judged(vote, v, sorted(keep)))
    # 6. GRPO on every process's kept rollouts, an optimizer step per Q questions
    kept = gather_kept(shard, groups, votes, accelerator)
    with clock("update"):
        update = grpo_step(learner.policy, learner.optimizer, learner.scheduler, kept.prompts, kept.completions,
                           kept.rewards, cfg.n_train, mini_batch_groups=cfg.mini_batch_questions or None,
                           accelerator=accelerator, ref_model=learner.ref_model, kl_coef=cfg.kl_coef,
                           clip_low=cfg.clip, clip_high=cfg.clip, agg=cfg.loss_agg, norm_len=cfg.max_new_tokens,
                           scale_advantages=cfg.scale_advantages, temperature=cfg.temperature,
                           token_budget=cfg.micro_batch_tokens, bf16=cfg.bf16 and bf16_supported(accelerator.device),
                           gradient_checkpointing=cfg.grad_checkpointing)
    log_rollouts(step, shard, groups, answers, verdicts, votes, learner)
    monitors = [question_monitors(*question, cfg) for question in zip(shard, groups, answers, verdicts, votes)]
    return step_metrics(step, gather_object(monitors), update, gather_object([clock]))


# ----------------------------------------------------------------------------------------------------------------
# Benchmarks

# name -> (Hub dataset, its files that hold the split); the demo benchmark ships with the repository as data/demo.jsonl
HUB_BENCHES = {
    "math500": ("HuggingFaceH4/MATH-500", "test.jsonl"),
    "aime2024": ("HuggingFaceH4/aime_2024", "data/train-*"),
    "amc": ("AI-MO/aimo-validation-amc", "data/train-*"),
}
BENCHES = [*HUB_BENCHES, "demo", "knk"]  # knk: data/knk.jsonl, made by `python knk.py --generate`


class BenchError(DataError):
    """A benchmark could not be found; the message says where and what to do."""


def read_jsonl(path: Path) -> list[dict]:
    """Benchmark records {id, problem, answer, ...} from a JSON-lines file; errors name the file and the line."""
    records, first_line = [], {}
    for lineno, rec in jsonl_objects(path):
        for key in ("problem", "answer"):
            if rec.get(key) in (None, ""):
                raise DataError(f"{path}:{lineno}: record has no '{key}'; every line needs 'problem' and 'answer'")
        if not isinstance(rec["problem"], str):
            raise DataError(f"{path}:{lineno}: 'problem' is a {type(rec['problem']).__name__}, not a string; "
                             f"write the question as a JSON string")
        rec["answer"] = str(rec["answer"])
        rec["id"] = str(rec.get("id", f"{path.stem}-{lineno}"))
        if rec["id"] in first_line:
            raise DataError(f"{path}:{lineno}: id '{rec['id']}' is already used on line {first_line[rec['id']]}; "
                             f"give every question its own id")
        first_line[rec["id"]] = lineno
        records.append(rec)
    if not records:
        raise DataError(f"{path}: no records; the file is empty")
    return records


def download_hub_rows(dataset: str, files: str) -> list[dict]:
    """The rows of a Hub dataset's split, through huggingface_hub: the user's HF_TOKEN, HF_ENDPOINT (a mirror),
    HF_HUB_OFFLINE and cache (HF_HOME) apply as in every other Hub tool. JSON lines or Parquet (read by pyarrow)."""
    folder = Path(snapshot_download(dataset, repo_type="dataset", allow_patterns=files))
    paths = sorted(folder.glob(files))
    if not paths:
        raise FileNotFoundError(f"{dataset} has no file matching {files}")
    rows = []
    for path in paths:
        if path.suffix == ".parquet":
            import pyarrow.parquet
            rows += pyarrow.parquet.read_table(path).to_pylist()
        else:
            rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows


def hub_records(name: str, rows: list[dict]) -> list[dict]:
    """Map a Hub benchmark's rows to {id, problem, answer, ...} (MATH-500 keeps level and subject)."""
    records = []
    for i, row in enumerate(rows):
        qid = row.get("unique_id", row.get("id"))
        rec = {"id": f"{name}-{i}" if qid is None else str(qid), "problem": row["problem"],
               "answer": str(row["answer"])}
        rec.update({k: row[k] for k in ("level", "subject") if k in row})
        records.append(rec)
    return records


def load_bench(name: str) -> list[dict]:
    """Benchmark records, from $T3RL_DATA_DIR/<name>.jsonl, else data/<name>.jsonl, else the Hugging Face Hub."""
    if name not in BENCHES:
        raise BenchError(f"--bench {name}: unknown benchmark; choose one of {', '.join(BENCHES)}")
    local = ROOT / "data" / f"{name}.jsonl"
    data_dir = os.environ.get("T3RL_DATA_DIR")
    if data_dir and (Path(data_dir) / f"{name}.jsonl").is_file():
        return read_jsonl(Path(data_dir) / f"{name}.jsonl")
    if local.is_file():
        return read_jsonl(local)
    dataset, files = HUB_BENCHES[name]
    print(f"[t3rl] {name}: no local file, loading {dataset} through the Hugging Face Hub client", file=sys.stderr)
    try:
        rows = download_hub_rows(dataset, files)
    except OSError as err:  # the client's errors (offline, unreachable, not found, gated) are all OSErrors
        reason = (str(err).strip() or type(err).__name__).splitlines()[0]
        where = "not found locally" if not data_dir else (
            f"not found in T3RL_DATA_DIR={data_dir}{'' if Path(data_dir).is_dir() else ' (no such folder)'} nor in data/")
        raise BenchError(f"--bench {name}: {where} and not available from the Hub ({reason}); put the file "
                         f"at {local} or set T3RL_DATA_DIR to a folder holding {name}.jsonl "
                         f"(one JSON object per line with 'problem' and 'answer')") from None
    return hub_records(name, rows)


# ----------------------------------------------------------------------------------------------------------------
# Configuration: plain defaults (the paper's loop settings), presets on top, then the command line.
# Every option states what it allows (a range or a list of choices); all are checked before anything loads.

@dataclass(frozen=True)
class Range:
    """Allowed numbers, written as an interval: [1, inf) excludes inf and nan, [1, inf] allows inf."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, x) -> bool:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
            return False
        return (x > self.low if self.low_open else x >= self.low) and (x < self.high if self.high_open else x <= self.high)

    def __str__(self):
        end = lambda x: f"{x:g}" if math.isinf(x) or x != int(x) else str(int(x))  # noqa: E731
        return f"{'(' if self.low_open else '['}{end(self.low)}, {end(self.high)}{')' if self.high_open else ']'}"


COUNT, AT_LEAST_ONE, POSITIVE, NON_NEGATIVE = Range(0), Range(1), Range(0, low_open=True), Range(0)
SHARE = Range(0, 1, high_open=False)


def option(default, doc: str, allowed=None):
    """A Config field: its default, its --help text, and what it allows (a Range, a tuple of choices, or None
    for free text checked where it is used: paths and model names)."""
    return field(default=default, metadata={"doc": doc, "allowed": allowed})


@dataclass
class Config:
    # what to train
    bench: str = option("demo", "benchmark", tuple(BENCHES))
    limit: int = option(0, "use only the first LIMIT questions of the benchmark (0 = all)", COUNT)
    model: str = option("embedded", "policy: Hub id, local folder, .gguf file, or 'embedded' (offline Qwen2.5-Coder-0.5B-Instruct)")
    verifier_model: str = option("self", "verifier LLM: 'self' = frozen copy of the policy's starting weights "
                                 "(self-verification), or any --model value (coder-1.5b: the offline paper verifier)")
    preset: str = option("auto", "auto (cpu without a GPU, paper with one); explicit options override it",
                         ("auto", "paper", "cpu", "none"))
    # test-time RL
    n_votes: int = option(64, "N: rollouts sampled per question for the vote", AT_LEAST_ONE)
    n_train: int = option(32, "M: rollouts per question kept (at random) for the GRPO update ('vote then sample'); "
                          "GRPO compares rollouts within a group, so at least 2, at most N", Range(2))
    questions_per_step: int = option(8, "questions per step, all processes together", AT_LEAST_ONE)
    episodes: int = option(10, "passes over the benchmark (paper: 10 MATH-500, 30 AMC, 80 AIME 2024)", AT_LEAST_ONE)
    max_steps: int = option(0, "stop after this many steps (0 = as many as the episodes take)", COUNT)
    temperature: float = option(0.6, "policy sampling temperature (0 = greedy)", NON_NEGATIVE)
    top_p: float = option(0.95, "policy nucleus sampling mass", Range(0, 1, low_open=True, high_open=False))
    max_new_tokens: int = option(2560, "policy tokens per rollout", AT_LEAST_ONE)
    backend: str = option("kv", "sampler backend: hand-written KV-cache sampler or transformers generate", ("kv", "hf"))
    sample_dtype: str = option("auto", "sampling compute dtype (auto: bfloat16 where supported)",
                               ("auto", "float32", "bfloat16"))
    # verification
    verify: bool = option(True, "tool-verify rollouts (--no-verify is TTRL, without the verifier's cost)")
    omega: float = option(5.0, "vote weight of a verified rollout: 1 = TTRL, inf = hard filtering (several values "
                          "with --replay)", Range(1, high_open=False))
    verify_budget: int = option(0, "verify at most K rollouts per answer class, the rest inherit (0 = verify all)", COUNT)
    lazy_verify: bool = option(False, "verify only the rollouts whose verdicts can still change the pseudo-label: the "
                               "labels and rewards of verifying all, at fewer verifier prompts (one or two calls a step)")
    verifier_max_new_tokens: int = option(1024, "verifier tokens per program", AT_LEAST_ONE)
    verifier_temperature: float = option(0.6, "verifier sampling temperature (0 = greedy)", NON_NEGATIVE)
    verifier_int8: bool = option(False, "the verifier's matrix products in 8-bit integers (weights per row, activations "
                                 "per token; CPU, kv backend): faster, but a weaker verifier (README: how much of "
                                 "each)")
    sandbox_timeout: float = option(5.0, "seconds each verifier program may run", POSITIVE)
    # optimisation (GRPO)
    lr: float = option(5e-7, "peak learning rate (AdamW, cosine schedule over optimizer steps)", NON_NEGATIVE)
    warmup_ratio: float = option(0.03, "share of the optimizer steps spent warming the learning rate up (TTRL: 0.03)", SHARE)
    mini_batch_questions: int = option(1, "Q: an optimizer step per Q questions' kept rollouts, so ceil(questions per "
                                          "step / Q) per step (TTRL: 1; 0 = one per step)", COUNT)
    scale_advantages: bool = option(True, "divide advantages by their group's std (--no-scale-advantages: Dr. GRPO)")
    weight_decay: float = option(0.01, "AdamW weight decay", NON_NEGATIVE)
    clip: float = option(0.2, "PPO ratio clip range (both sides)", Range(0, 1, low_open=True, high_open=False))
    kl_coef: float = option(0.0, "KL penalty to the starting policy (paper: 0)", NON_NEGATIVE)
    loss_agg: str = option("token-mean", "loss aggregation", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
    micro_batch_tokens: int = option(8192, "tokens per micro-batch (gradient accumulation over the rest)", AT_LEAST_ONE)
    grad_checkpointing: bool = option(True, "recompute activations in the backward pass to save memory")
    bf16: bool = option(True, "bfloat16 autocast over float32 master weights where the hardware supports it")
    # evaluation and bookkeeping
    eval_every: int = option(0, "evaluate every K steps (0 = only before and after training)", COUNT)
    eval_samples: int = option(4, "k for avg@k and maj@k (paper: 16 for AIME 2024, 4 otherwise; 0 = greedy only)", COUNT)
    save_every: int = option(10, "checkpoint every K steps (and at the end)", AT_LEAST_ONE)
    report_to: str = option("none", "experiment trackers, comma-separated, through accelerate: tensorboard, wandb, "
                            "mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio | all (every one installed) | none")
    out_dir: str = option("runs", "folder that holds the run folders")
    run_name: str = option("", "run folder name (default: bench-method-time)")
    seed: int = option(0, "seed for sampling, downsampling and initialisation", Range(0, 2**32 - 1, high_open=False))
    resume: str = option("", "continue the run in this folder from its last checkpoint")
    eval_only: bool = option(False, "evaluate the starting policy and stop: the baseline, no training")
    study: bool = option(False, "the evidence study (study.py): sample n_votes rollouts for LIMIT level-stratified "
                         "questions once, verify all, vote at k = 4..n_votes and omega 1, 2, 5, 10, inf; no training")


PAPER_EPISODES = {"math500": 10, "amc": 30, "aime2024": 80}
PRESETS = {
    "paper": dict(model="Qwen/Qwen2.5-Math-1.5B", verifier_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", bench="math500"),
    "cpu": dict(bench="demo", verifier_model="coder-1.5b", n_votes=8, n_train=4, questions_per_step=3, max_steps=4,
                max_new_tokens=320, verifier_max_new_tokens=256, verify_budget=1, lazy_verify=True, lr=2e-6,
                eval_samples=0, save_every=3,
                micro_batch_tokens=4096, mini_batch_questions=2),
    "none": {},
}
# options a resumed run may change: they decide when to evaluate and save, not what is computed
RESUMABLE_CHANGES = ("eval_every", "save_every")
REPLAY_OMEGAS = [1.0, 2.0, 5.0, 10.0, math.inf]


class OptionError(ValueError):
    """An option's value is outside what it allows; the message names the option, the value and the range."""


@dataclass
class Command:
    """What the command line asks for: one mode and its inputs. train and eval run `train` (eval stops after
    the baseline evaluation); replay re-votes a run's saved rollouts for each omega and loads no model."""
    mode: str                                   # "train" | "eval" | "replay" | "study"
    cfg: Config | None = None                   # train, eval
    replay_dir: Path | None = None              # replay
    omegas: list[float] = field(default_factory=list)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """One parser for every mode. Options default to 'not given' (SUPPRESS), so the parsed namespace holds
    exactly what the user typed, and presets or a resumed config.json fill in the rest."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], argument_default=argparse.SUPPRESS)
    for f in fields(Config):
        allowed = f.metadata["allowed"]
        text = f.metadata["doc"] + (f"; one of {' | '.join(allowed)}" if isinstance(allowed, tuple) else "")
        text += f" (default: {f.default})".replace("%", "%%")
        if f.type in (bool, "bool"):
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=text)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag(f.name), type=kind, help=text, **({"nargs": "+"} if f.name == "omega" else {}))
    parser.add_argument("--replay", metavar="RUN_DIR", help="mode: re-vote a run's saved rollouts for each --omega given "
                        f"(default: {' '.join(f'{w:g}' for w in REPLAY_OMEGAS)}) and print the ablation table; "
                        "loads no model")
    return parser


def parse_command(argv=None) -> Command:
    """The mode and its checked inputs; raises OptionError (one line) before anything heavy starts."""
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
            raise OptionError(f"--omega {' '.join(f'{w:g}' for w in given['omega'])}: one value for a run "
                              "(several only with --replay RUN_DIR)")
        given["omega"] = given["omega"][0]
    cfg = resumed_config(given) if given.get("resume") else new_config(given)
    return Command("study" if cfg.study else "eval" if cfg.eval_only else "train", cfg=cfg)


def parse_config(argv=None) -> Config:
    """The Config of a train or eval command line (what tests and scripts call); --replay is main's."""
    command = parse_command(argv)
    if command.cfg is None:
        raise OptionError("--replay is a mode of its own: run it through t3rl.main or the command line")
    return command.cfg


def new_config(given: dict) -> Config:
    """Defaults, then the preset, then the options typed; the default run name is fixed here, once."""
    cfg = Config()
    check_value("preset", given.get("preset", cfg.preset))
    preset = given.get("preset", cfg.preset)
    preset = preset if preset != "auto" else ("paper" if _has_gpu() else "cpu")
    for key, value in PRESETS[preset].items():
        setattr(cfg, key, value)
    if preset == "paper":
        bench = given.get("bench", cfg.bench)
        cfg.episodes = PAPER_EPISODES.get(bench, cfg.episodes)
        cfg.eval_samples = 16 if bench == "aime2024" else 4
    if given.get("study"):
        # a study verifies every rollout; the cpu preset's budget and laziness only save training time; it never
        # trains, so the rollouts kept for training only need to fit in whatever --n-votes it samples
        cfg.verify_budget, cfg.lazy_verify = 0, False
        cfg.n_train = min(cfg.n_train, given.get("n_votes", cfg.n_votes))
    for key, value in given.items():
        setattr(cfg, key, value)
    cfg.preset = preset
    check_config(cfg)
    if not cfg.run_name:
        cfg.run_name = free_run_name(cfg)
    return cfg


def resumed_config(given: dict) -> Config:
    """The saved config.json of the run in --resume; options typed beside --resume must match it, except
    those in RESUMABLE_CHANGES (listed when they change)."""
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
        raise OptionError(f"{path}: damaged ({err}); restore it from a copy, or start a new run") from None
    changed = {k: v for k, v in given.items() if k not in ("resume", "preset") and v != getattr(cfg, k)}
    refused = [f"{flag(k)} {v} (the run has {getattr(cfg, k)})" for k, v in changed.items()
               if k not in RESUMABLE_CHANGES and not (cfg.study and grows_study(k, getattr(cfg, k), v))]
    if refused:
        raise OptionError(f"--resume {run_dir}: {'; '.join(refused)}; a resumed run keeps its config.json "
                          f"(a study may only grow: a larger --n-votes or --limit): drop "
                          f"{'these options' if len(refused) > 1 else 'that option'}, or start a new run with them")
    for key, value in changed.items():
        print(f"[t3rl] --resume: {flag(key)} {getattr(cfg, key)} -> {value}", file=sys.stderr)
        setattr(cfg, key, value)
    cfg.resume = str(run_dir)
    check_config(cfg, source=f"{path}: ")
    return cfg


def grows_study(key: str, saved, given) -> bool:
    """A study resumed with more rollouts per question or more questions (--limit 0: all) keeps what it has
    and adds the rest: its k are nested subsets and --limit's stratified order extends the same list."""
    if key == "n_votes":
        return isinstance(given, int) and given > saved
    return key == "limit" and saved != 0 and isinstance(given, int) and (given == 0 or given > saved)


def check_value(name: str, value):
    allowed = Config.__dataclass_fields__[name].metadata["allowed"]
    if isinstance(allowed, Range) and value not in allowed:
        raise OptionError(f"{flag(name)} {value}: must be in {allowed}")
    if isinstance(allowed, tuple) and value not in allowed:
        raise OptionError(f"{flag(name)} {value}: choose one of {', '.join(allowed)}")


def check_config(cfg: Config, source: str = ""):
    """Every option against what it allows, then the ones that depend on each other, then the model names
    (cheaply: a path that exists, a GGUF's magic, a Hub id that is cached or reachable), before anything loads."""
    try:
        for f in fields(Config):
            check_value(f.name, getattr(cfg, f.name))
        if cfg.verifier_int8 and cfg.backend == "hf":
            raise OptionError("--verifier-int8: the int8 products are the kv sampler's; add --backend kv or "
                              "--no-verifier-int8")
        if cfg.n_train > cfg.n_votes:
            raise OptionError(f"--n-train {cfg.n_train}: must be at most --n-votes ({cfg.n_votes}); "
                              f"M rollouts are kept out of the N sampled")
        for name in tracker_names(cfg):
            if name not in LoggerType.list():
                raise OptionError(f"--report-to {name}: choose from {', '.join(LoggerType.list())} or none")
            if name != "all" and name not in {str(t) for t in get_available_trackers()}:
                raise OptionError(f"--report-to {name}: the {name} package is not installed; pip install {name}")
    except OptionError as err:
        raise OptionError(f"{source}{err}") from None
    check_spec(cfg.model, "--model")
    if cfg.verifier_model != "self":
        check_spec(cfg.verifier_model, "--verifier-model")


def free_run_name(cfg: Config) -> str:
    """bench-method-time, with a suffix when that folder already holds a run (two runs started in one second)."""
    method = "study" if cfg.study else "ttrl" if not cfg.verify or cfg.omega == 1 else f"t3rl-w{cfg.omega:g}"
    name = f"{cfg.bench}-{method}-{time.strftime('%Y%m%d-%H%M%S')}"
    suffix = 1
    while run_started(Path(cfg.out_dir) / (name if suffix == 1 else f"{name}-{suffix}")):
        suffix += 1
    return name if suffix == 1 else f"{name}-{suffix}"


def _has_gpu() -> bool:
    return torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------------------
# Prompts and answers

def policy_prompt(tokenizer, problem: str, instruction: str = MATH_INSTRUCTION) -> str:
    """The question as the policy sees it: its chat template when it has one (Qwen-Math's prompt otherwise)."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": instruction}, {"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {problem}\n{instruction}\nAnswer:"


def question_seed(cfg: Config, step: int, qid: str, purpose: str) -> int:
    """A seed per (run, step, question, purpose): results do not depend on how questions are split over processes."""
    return int.from_bytes(hashlib.blake2b(f"{cfg.seed}|{step}|{qid}|{purpose}".encode(), digest_size=7).digest(), "big")


def sample_groups(policy, tokenizer, records, cfg: Config, n: int, temperature: float, step: int, purpose: str):
    """n completions per record, in one batched sampler call. Each question has its own seed, so what it gets
    does not depend on which process or which batch it lands in. No records (a process without a question
    this step): no completions."""
    if not records:
        return []
    instruction = domain_of(cfg.bench).instruction
    prompts = [policy_prompt(tokenizer, rec["problem"], instruction) for rec in records]
    seeds = [question_seed(cfg, step, rec["id"], purpose) for rec in records] if temperature > 0 else None
    return generate(policy, tokenizer, prompts, n=n, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                    top_p=cfg.top_p, seed=seeds, **sampler_options(cfg), progress=purpose)


def sampler_options(cfg: Config) -> dict:
    """The backend, and for the kv backend its compute dtype (hf samples in the model's own dtype)."""
    return dict(backend="kv", dtype=sample_dtype(cfg)) if cfg.backend == "kv" else dict(backend="hf")


def sample_dtype(cfg: Config):
    """Compute dtype for sampling: bfloat16 where the hardware runs it fast, unless the user says otherwise."""
    if cfg.sample_dtype == "auto":
        device = torch.device("cuda" if _has_gpu() else "cpu")
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    return getattr(torch, cfg.sample_dtype)


def verify_groups(records, groups, answers, verifier, pool, cfg: Config):
    """v_i for every rollout of every question, through one batched verifier call and one sandbox batch (up to
    two of each with --lazy-verify)."""
    if not cfg.verify:
        return [[None] * len(group) for group in groups]
    problems = [rec["problem"] for rec, group in zip(records, groups) for _ in group]
    texts = [c.text for group in groups for c in group]
    flat = [a for group in answers for a in group]
    results = verify_batch(problems, texts, flat, verifier, sandbox=pool, budget=cfg.verify_budget,
                           domain=domain_of(cfg.bench).name, omega=cfg.omega if cfg.lazy_verify else None)
    it = iter(results)
    return [[next(it) for _ in group] for group in groups]


def is_correct(answer, gold, domain: Domain) -> bool:
    return answer is not None and domain.equiv(answer, gold)


# ----------------------------------------------------------------------------------------------------------------
# Evaluation (ground truth is used here, and only here and in monitoring metrics)

def evaluate(policy, tokenizer, records, cfg: Config, accelerator, verifier, pool) -> dict:
    """Greedy pass@1; with k = eval_samples also avg@k, maj@k and, when verifying, the verified-weighted maj@k:
    T3RL's vote used at inference on the same k samples, the equal-budget baseline for training."""
    shard = records[accelerator.process_index::accelerator.num_processes]
    unwrapped = accelerator.unwrap_model(policy)
    greedy = sample_groups(unwrapped, tokenizer, shard, cfg, n=1, temperature=0.0, step=-1, purpose="greedy")
    k = cfg.eval_samples
    sampled = sample_groups(unwrapped, tokenizer, shard, cfg, n=k, temperature=cfg.temperature, step=-1,
                            purpose="eval") if k else []
    dom = domain_of(cfg.bench)
    answers = [[dom.extract(c.text, rec["problem"]) for c in group] for rec, group in zip(shard, sampled)]
    verdicts = verify_groups(shard, sampled, answers, verifier, pool, cfg) if k and verifier else []
    rows = []
    for i, rec in enumerate(shard):
        greedy_answer = dom.extract(greedy[i][0].text, rec["problem"])
        row = {"level": rec.get("level"), "pass@1": float(is_correct(greedy_answer, rec["answer"], dom))}
        if k:
            row[f"avg@{k}"] = sum(is_correct(a, rec["answer"], dom) for a in answers[i]) / k
            majority = weighted_vote(answers[i], [0] * k, omega=1.0, **dom.classes).label
            row[f"maj@{k}"] = float(is_correct(majority, rec["answer"], dom))
            if verdicts:
                label = weighted_vote(answers[i], [r.v for r in verdicts[i]], omega=cfg.omega, **dom.classes).label
                row[f"verified_maj@{k}"] = float(is_correct(label, rec["answer"], dom))
        rows.append(row)
    rows = gather_object(rows)
    keys = [key for key in rows[0] if key != "level"]
    result = {key: sum(r[key] for r in rows) / len(rows) for key in keys}
    levels = sorted({r["level"] for r in rows if r["level"] is not None})
    if levels:
        result["by_level"] = {lv: {key: sum(r[key] for r in rows if r["level"] == lv) /
                                   sum(r["level"] == lv for r in rows) for key in keys} for lv in levels}
    return result


def format_eval(result: dict) -> str:
    line = "  ".join(f"{k} {v:.3f}" for k, v in result.items() if k != "by_level")
    if "by_level" in result:
        line += "\n" + "\n".join(f"    level {lv}: " + "  ".join(f"{k} {v:.3f}" for k, v in m.items())
                                 for lv, m in result["by_level"].items())
    return line


# ----------------------------------------------------------------------------------------------------------------
# Run folder: config.json, metrics.jsonl, rollouts.jsonl, checkpoint/ and the previous one, checkpoint.old/.
# Every file is replaced atomically (written aside, then renamed) or appended to; resume repairs what a kill
# can leave: a half-written last JSONL line, a damaged newest checkpoint, a leftover temporary folder.

class RunDirError(RuntimeError):
    """A run folder cannot be used as asked; the message names the folder or file and what to do."""


def run_dir_of(cfg: Config) -> Path:
    return Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / cfg.run_name


def run_started(run_dir: Path) -> bool:
    """Whether a folder holds a run's results (a folder with only config.json is a start that never ran)."""
    return any((run_dir / name).exists() for name in ("metrics.jsonl", "rollouts.jsonl", "checkpoint", "checkpoint.old"))


def open_run_dir(cfg: Config) -> Path:
    """Create (or, with --resume, check) the run folder before any model loads: an unwritable --out-dir, a
    reused name or a finished run stop here, in one line."""
    run_dir = run_dir_of(cfg)
    if cfg.resume:
        for name in ("metrics.jsonl", "rollouts.jsonl"):
            drop_torn_tail(run_dir / name)
        finished = [r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r.get("final")]
        if finished:
            raise RunDirError(f"--resume {run_dir}: the run is finished (final evaluation at step {finished[-1]['step']} "
                              f"in metrics.jsonl); read it with --replay {run_dir}, or start a new run with another "
                              f"--run-name")
        saved = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
        if {**asdict(cfg), "resume": saved.get("resume", "")} != saved:  # --eval-every / --save-every changed
            write_atomically(run_dir / "config.json", json.dumps({**asdict(cfg), "resume": ""}, indent=2))
        return run_dir
    if run_started(run_dir):
        raise RunDirError(f"run folder {run_dir} already holds a run; continue it with --resume {run_dir}, or "
                          f"pick another --run-name (or --out-dir)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(run_dir / "config.json", json.dumps(asdict(cfg), indent=2))
    except OSError as err:
        raise RunDirError(f"--out-dir {cfg.out_dir}: cannot write the run folder {run_dir} "
                          f"({err.strerror or err}); pass a writable --out-dir") from None
    return run_dir


def save_checkpoint(run_dir: Path, step: int, policy, tokenizer, optimizer, scheduler, accelerator):
    """checkpoint/ = model and tokenizer (save_pretrained, a loadable --model folder) + optimizer, scheduler,
    RNG states and step. Written as checkpoint.tmp/, then swapped in; the one it replaces stays as
    checkpoint.old/, the fallback if the new one is ever found damaged."""
    if accelerator.is_main_process:
        tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(policy).save_pretrained(tmp / "model")
        tokenizer.save_pretrained(tmp / "model")
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "rng": {"python": random.getstate(), "torch": torch.get_rng_state()}}, tmp / "state.pt")
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()


def checkpoint_damage(checkpoint: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed from (a missing file, truncated weights), or None. Cheap:
    reads the safetensors headers, not the weights."""
    model_dir = checkpoint / "model"
    weights = sorted(model_dir.glob("*.safetensors"))
    for needed in (checkpoint / "state.pt", model_dir / "config.json", *(weights or [model_dir / "model.safetensors"])):
        if not needed.is_file():
            return f"{needed.relative_to(checkpoint.parent)} is missing"
    for path in weights:
        with open(path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            try:
                header = json.loads(fh.read(size))
                end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
            except (ValueError, KeyError, TypeError):
                return f"{path.relative_to(checkpoint.parent)} has a damaged header"
        if path.stat().st_size < 8 + size + end:
            return f"{path.relative_to(checkpoint.parent)} is truncated"
    return None


def load_checkpoint(run_dir: Path) -> tuple[Path | None, dict | None]:
    """The newest complete checkpoint and its state (step, optimizer, scheduler, RNG). A damaged one is set
    aside as checkpoint.damaged/ (kept for inspection) and the previous one, checkpoint.old/, is used."""
    for name in ("checkpoint", "checkpoint.old"):
        checkpoint = run_dir / name
        if not checkpoint.exists():
            continue
        problem = checkpoint_damage(checkpoint)
        if problem is None:
            try:
                return checkpoint, torch.load(checkpoint / "state.pt", weights_only=False, map_location="cpu")
            except Exception as err:  # truncated or corrupt pickle: EOFError, RuntimeError, UnpicklingError, ...
                problem = f"{name}/state.pt is damaged ({type(err).__name__})"
        damaged = run_dir / "checkpoint.damaged"
        shutil.rmtree(damaged, ignore_errors=True)
        os.replace(checkpoint, damaged)
        print(f"[t3rl] {run_dir}: {problem}; moved it to {damaged.name}/ and falling back to the previous "
              f"checkpoint", file=sys.stderr)
    return None, None


# ----------------------------------------------------------------------------------------------------------------
# Experiment trackers (--report-to, through accelerate): each metrics.jsonl row also goes to the trackers, main
# process only. Their x axis is updates done: the evaluation before training at 0, train row `step` s at s + 1.

def tracker_names(cfg: Config) -> list[str]:
    return [name.strip() for name in cfg.report_to.split(",") if name.strip() not in ("", "none")]


@contextmanager
def tracking(accelerator, cfg: Config, run_dir: Path, start: int):
    """Trackers started with the run's config for the body of the run, finished (flushed, closed) after it. A
    resumed run continues its tracker run: W&B by the run id kept in the run folder, TensorBoard in the same
    folder with what was logged after the checkpoint purged."""
    names = tracker_names(cfg)
    if accelerator.is_main_process and names:
        init_kwargs = {"tensorboard": {"purge_step": start + 1} if start else {}}
        if {"wandb", "all"} & set(names):
            id_file = run_dir / "wandb_id"
            if not id_file.is_file():
                id_file.write_text(uuid.uuid4().hex[:12])
            init_kwargs["wandb"] = {"name": run_dir.name, "id": id_file.read_text(), "resume": "allow",
                                    "dir": str(run_dir)}
        accelerator.init_trackers("t3rl", config=asdict(cfg), init_kwargs=init_kwargs)
    try:
        yield
    finally:
        # not accelerator.end_training(): it also ends the process group, which belongs to the launcher
        for tracker in accelerator.trackers:
            tracker.finish()


def tracker_row(row: dict, prefix: str = "") -> dict:
    """A metrics row as trackers take it: its numbers under the same names, nested ones as 'status/verified'."""
    flat = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update(tracker_row(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            flat[f"{prefix}{key}"] = value
    return flat


# ----------------------------------------------------------------------------------------------------------------
# The loop

def question_batches(records: list[dict], cfg: Config) -> list[list[dict]]:
    """Every step's questions: each episode is one pass over the benchmark in a fresh seeded order."""
    batches = []
    for episode in range(cfg.episodes):
        order = list(records)
        random.Random(cfg.seed * 1000 + episode).shuffle(order)
        batches += [order[i:i + cfg.questions_per_step] for i in range(0, len(order), cfg.questions_per_step)]
    return batches[:cfg.max_steps] if cfg.max_steps else batches


def build_verifier(cfg: Config, device, loaded=None):
    """The verifier callable (prompts -> completions). 'self' is a frozen copy of the policy's starting weights,
    loaded from --model (not from a checkpoint), kept in the sampling dtype since it never trains.
    loaded: the verifier's (model, tokenizer) when already in memory (--study: its policy never trains)."""
    if not cfg.verify or (cfg.eval_only and not cfg.eval_samples):
        return None
    if cfg.verifier_int8 and (reason := int8_unavailable_reason(torch.device(device))):
        raise OptionError(f"--verifier-int8: {reason}; pass --no-verifier-int8 (a bfloat16 verifier)")
    spec = cfg.model if cfg.verifier_model == "self" else cfg.verifier_model
    vmodel, vtok = loaded or load_model(spec, dtype=sample_dtype(cfg))
    vmodel.requires_grad_(False).to(device)
    return model_verifier(vmodel, vtok, max_new_tokens=cfg.verifier_max_new_tokens,
                          temperature=cfg.verifier_temperature, top_p=cfg.top_p, seed=cfg.seed, backend=cfg.backend,
                          int8=cfg.verifier_int8)


def check_prompts_fit(records: list[dict], tokenizer, model, cfg: Config):
    """Stop before any sampling when a question's prompt plus --max-new-tokens exceeds the policy's context
    (skipping it silently would change the benchmark)."""
    context = getattr(model.config, "max_position_embeddings", None)
    for rec in records if context else []:
        prompt = policy_prompt(tokenizer, rec["problem"], domain_of(cfg.bench).instruction)
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > context:
            fix = f"lower --max-new-tokens to {context - n}, or " if n < context else ""
            raise DataError(f"question {rec['id']} of --bench {cfg.bench}: its prompt ({n} tokens) + --max-new-tokens "
                            f"{cfg.max_new_tokens} exceeds the policy's context of {context} tokens; the run stops "
                            f"here: {fix}remove that question from the benchmark file")


def make_optimization(policy, batches: list[list[dict]], cfg: Config):
    """AdamW on the policy and its cosine schedule over the run's optimizer steps."""
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # the schedule counts optimizer steps: one per mini-batch of questions, so ceil(questions / Q) per step
    optimizer_steps = sum(-(-len(b) // (cfg.mini_batch_questions or len(b))) for b in batches)
    scheduler = cosine_schedule(optimizer, total_steps=optimizer_steps, warmup_steps=int(cfg.warmup_ratio * optimizer_steps))
    return optimizer, scheduler


def restore_state(state: dict, optimizer, scheduler) -> int:
    """Optimizer, schedule and RNG states from a checkpoint's state.pt; returns the steps done."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    random.setstate(state["rng"]["python"])
    torch.set_rng_state(state["rng"]["torch"])
    return state["step"]


def drop_rows_after(run_dir: Path, start: int):
    """Rows written after the checkpoint of step `start` are computed again; from step 0 that is all of them."""
    keep_jsonl(run_dir / "metrics.jsonl",
               lambda r: start and (r["step"] < start or (r["kind"] == "eval" and r["step"] <= start)))
    keep_jsonl(run_dir / "rollouts.jsonl", lambda r: r["step"] < start)


def run_banner(run_dir: Path, records, batches, accelerator, start: int, *, resume: str) -> str:
    processes = accelerator.num_processes
    return (f"run folder {run_dir}; {len(records)} questions, {len(batches)} steps, "
            f"{processes} process{'es' if processes > 1 else ''} on {accelerator.device.type}"
            + (f", resuming after step {start}" if start else ", no checkpoint yet: from step 0" if resume else ""))


def train(cfg: Config) -> Path:
    accelerator = Accelerator(cpu=not _has_gpu(), log_with=tracker_names(cfg) or None, project_dir=run_dir_of(cfg))
    set_seed(cfg.seed)
    run_dir = open_run_dir(cfg) if accelerator.is_main_process else run_dir_of(cfg)
    accelerator.wait_for_everyone()
    records = load_bench(cfg.bench)[:cfg.limit or None]
    batches = question_batches(records, cfg)
    for spec, option in ((cfg.model, "--model"), (cfg.verifier_model, "--verifier-model")):
        check_hub(cfg.model if spec == "self" else spec, option)
    with accelerator.main_process_first():  # the main process sets a damaged checkpoint aside before the others look
        checkpoint, state = load_checkpoint(run_dir) if cfg.resume else (None, None)

    policy, tokenizer = load_model(str(checkpoint / "model") if checkpoint else cfg.model)
    check_prompts_fit(records, tokenizer, policy, cfg)
    verifier = build_verifier(cfg, accelerator.device)
    ref_model = load_model(cfg.model)[0].requires_grad_(False).to(accelerator.device) if cfg.kl_coef > 0 else None
    policy.train()
    optimizer, scheduler = make_optimization(policy, batches, cfg)
    start = restore_state(state, optimizer, scheduler) if state else 0
    # the scheduler stays unprepared: accelerate would step it once per process per step
    policy, optimizer = accelerator.prepare(policy, optimizer)

    if accelerator.is_main_process:
        drop_rows_after(run_dir, start)
        print(f"[t3rl] {run_banner(run_dir, records, batches, accelerator, start, resume=cfg.resume)}", file=sys.stderr)

    def log(row):
        if accelerator.is_main_process:
            append_jsonl(run_dir / "metrics.jsonl", [row])
            accelerator.log(tracker_row(row), step=row["step"] + (row["kind"] == "train"))

    with SandboxPool(timeout=cfg.sandbox_timeout) as pool, tracking(accelerator, cfg, run_dir, start):
        learner = Learner(cfg=cfg, accelerator=accelerator, policy=policy, tokenizer=tokenizer, optimizer=optimizer,
                          scheduler=scheduler, verifier=verifier, pool=pool, run_dir=run_dir, ref_model=ref_model)
        if accelerator.is_main_process:
            print(f"[t3rl] sandbox: {pool.report}", file=sys.stderr)
        if start == 0:
            before = evaluate(policy, tokenizer, records, cfg, accelerator, verifier, pool)
            log({"kind": "eval", "step": 0, **before, **({"final": True} if cfg.eval_only else {})})
            accelerator.print(f"eval before training: {format_eval(before)}")
            if cfg.eval_only:
                return run_dir
        for step in tqdm(range(start, len(batches)), desc="steps", initial=start, total=len(batches),
                         disable=not accelerator.is_main_process):
            row = rl_step(step, batches[step], learner)
            log(row)
            accelerator.print(format_step(row, len(batches)))
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < len(batches):
                log({"kind": "eval", "step": done,
                     **evaluate(policy, tokenizer, records, cfg, accelerator, verifier, pool)})
            if done % cfg.save_every == 0 or done == len(batches):
                save_checkpoint(run_dir, done, policy, tokenizer, optimizer, scheduler, accelerator)
        after = evaluate(policy, tokenizer, records, cfg, accelerator, verifier, pool)
        log({"kind": "eval", "step": len(batches), "final": True, **after})
    if accelerator.is_main_process:
        print(summary(run_dir))
        plot_run(run_dir)
    return run_dir


def study(cfg: Config) -> Path:
    """--study: k_max = n_votes rollouts per question, sampled and verified once, saved, then study.py's report.
    Each question has its own sampling seed, so a resumed study samples what an uninterrupted one would."""
    if not cfg.verify or cfg.verify_budget or cfg.lazy_verify:
        raise SystemExit("--study verifies every rollout: drop --no-verify, --verify-budget and --lazy-verify")
    run_dir = Path(cfg.resume) if cfg.resume else Path(cfg.out_dir) / (
        cfg.run_name or f"{cfg.bench}-study-{time.strftime('%Y%m%d-%H%M%S')}")
    saved = run_dir / "config.json"
    before = json.loads(saved.read_text()) if saved.is_file() and not cfg.resume else {}
    changed = sorted(key for key, value in asdict(cfg).items() if key in before and before[key] != value)
    if changed:
        raise SystemExit(f"{run_dir} holds a study with other {', '.join(changed)}: pass --resume {run_dir} to "
                         f"continue it (a larger --n-votes or --limit beside it grows it), or another --run-name")
    run_dir.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({**asdict(cfg), "resume": ""}, indent=2))
    records = stratified(load_bench(cfg.bench), cfg.limit, cfg.seed)
    device = torch.device("cuda" if _has_gpu() else "cpu")
    policy, tokenizer = load_model(cfg.model, dtype=sample_dtype(cfg))  # it never trains: sampling dtype
    policy.to(device)
    dom = domain_of(cfg.bench)
    weights = (policy, tokenizer) if cfg.verifier_model == "self" else load_model(cfg.verifier_model,
                                                                                  dtype=sample_dtype(cfg))
    with SandboxPool() as pool:
        def sample_and_verify(batch, first: int, n: int):
            # rollouts from `first` on (a grown study) get seeds of their own: new draws, not the first ones again
            grown = f"+{first}" if first else ""
            groups = sample_groups(policy, tokenizer, batch, cfg, n, cfg.temperature, -1, "study" + grown)
            answers = [[dom.extract(c.text, rec["problem"]) for c in group] for rec, group in zip(batch, groups)]
            # the verifier is seeded per batch, so a resumed study draws the programs an uninterrupted one would
            seeded = replace(cfg, seed=question_seed(cfg, -1, batch[0]["id"], "verify" + grown))
            verifier = build_verifier(seeded, device, loaded=weights)
            return groups, answers, verify_groups(batch, groups, answers, verifier, pool, cfg)
        collect(records, run_dir, sample_and_verify, cfg.questions_per_step, cfg.n_votes)
    print(report(run_dir, dom.classes, dom.equiv))
    return run_dir


# ----------------------------------------------------------------------------------------------------------------
# A step's helpers: the clock, the kept rollouts, the rollout log and the monitors

class Stopwatch(dict):
    """Seconds per phase: `with clock("sample"): ...` adds the time the block took to clock["sample"]."""

    @contextmanager
    def __call__(self, phase: str):
        started = time.time()
        yield
        self[phase] = self.get(phase, 0.0) + time.time() - started


@dataclass
class Rollouts:
    """The rollouts that go into the update, group after group (M per question): token ids and rewards."""
    prompts: list[list[int]]
    completions: list[list[int]]
    rewards: list[float]


def gather_kept(shard, groups, votes, accelerator) -> Rollouts:
    """Every process's kept rollouts, in the step's question order: the update, its mini-batches and hence the
    weights do not depend on how the questions were split over processes."""
    rank, processes = accelerator.process_index, accelerator.num_processes
    positions = range(rank, rank + len(shard) * processes, processes)
    mine = [(position, [(group[i].prompt_ids, group[i].token_ids, vote.rewards[i]) for i in vote.keep])
            for position, group, vote in zip(positions, groups, votes)]
    rollouts = [r for _, kept in sorted(gather_object(mine), key=lambda question: question[0]) for r in kept]
    return Rollouts(*(list(column) for column in zip(*rollouts)))


def log_rollouts(step, shard, groups, answers, verdicts, votes, learner: Learner):
    """Append every rollout of the step (text, answer, verdict, reward, kept) to rollouts.jsonl."""
    rows = []
    for rec, group, ans, ver, vote in zip(shard, groups, answers, verdicts, votes):
        for i, (c, res) in enumerate(zip(group, ver)):
            rows.append({"step": step, "id": rec["id"], "index": i, "text": c.text, "answer": ans[i], "v": vote.v[i],
                         "result": getattr(res, "result", None), "status": getattr(res, "status", None),
                         "reward": vote.rewards[i], "label": vote.label, "kept": i in vote.keep,
                         "program": getattr(res, "code", None)})
    rows = gather_object(rows)
    if learner.accelerator.is_main_process:
        append_jsonl(learner.run_dir / "rollouts.jsonl", rows)


def question_monitors(rec, group, answers, verdicts, vote: Judged, cfg: Config) -> dict:
    """How one question's vote went, against the gold answer: monitors only, never rewards."""
    dom = domain_of(cfg.bench)
    stats = group_metrics(vote.vote, vote.v, gold=rec["answer"], **dom.classes)
    # TTRL's label is the plain majority: it differs from ours exactly where a flip fixed or broke it
    stats["majority_label_accuracy"] = stats["label_accuracy"] - stats["flip_fixed"] + stats["flip_broke"]
    correct = [is_correct(a, rec["answer"], dom) for a in answers]
    results = [res for res in verdicts if res is not None]
    stats["verified"] = sum(vote.v)
    stats["verified_correct"] = sum(vi and ci for vi, ci in zip(vote.v, correct))
    stats["correct"] = sum(correct)
    # recall's denominator: the right rollouts that got a verdict (a skipped one was never asked)
    stats["correct_judged"] = sum(ci for ci, res in zip(correct, verdicts) if getattr(res, "status", None) != "skipped")
    stats["statuses"] = [res.status for res in results]
    stats["verifier_tokens"] = sum(res.tokens or 0 for res in results)
    stats["verifier_calls_saved"] = sum(getattr(res, "inferred", False) or res.status == "skipped" for res in results)
    stats["response_tokens"] = [c.num_tokens for c in group]
    return stats


def step_metrics(step, per_question, update, seconds) -> dict:
    """One metrics row: per-question monitors (means), the update's statistics (whole step, all processes)
    and each phase's time (the slowest process)."""
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    row = {"kind": "train", "step": step, "questions": len(per_question)}
    for key in ("label_accuracy", "majority_label_accuracy", "reward_accuracy", "majority_ratio",
                "ground_truth_ratio", "verified_ratio", "flipped", "flip_fixed", "flip_broke", "pass@N"):
        row[key] = mean([q[key] for q in per_question])
    verified = sum(q["verified"] for q in per_question)
    statuses = [s for q in per_question for s in q["statuses"]]  # empty when no rollout went to the verifier
    row["status"] = {s: statuses.count(s) for s in sorted(set(statuses))}
    # the verifier against the hidden gold answers (reporting only): precision = right share of the verified,
    # recall = verified share of the right rollouts it judged; neither exists where nothing was verified (--no-verify)
    row["verified_rollouts"], row["correct_rollouts"] = verified, sum(q["correct"] for q in per_question)
    row["correct_judged_rollouts"] = sum(q["correct_judged"] for q in per_question)
    row["verified_correct"] = sum(q["verified_correct"] for q in per_question)
    row["verifier_precision"] = row["verified_correct"] / verified if verified else None
    row["verifier_recall"] = (row["verified_correct"] / row["correct_judged_rollouts"]
                              if statuses and row["correct_judged_rollouts"] else None)
    lengths = [n for q in per_question for n in q["response_tokens"]]
    row["response_length"] = mean(lengths)
    row["policy_tokens"] = sum(lengths)
    row["verifier_tokens"] = sum(q["verifier_tokens"] for q in per_question)
    row["verifier_calls_saved"] = sum(q["verifier_calls_saved"] for q in per_question)
    row.update({f"grpo/{key}": value for key, value in update.items()})
    for phase in seconds[0]:
        row[f"seconds/{phase}"] = max(s[phase] for s in seconds)
    return row


def format_step(row: dict, total: int) -> str:
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    timing = " ".join(f"{key[len('seconds/'):]} {value:.0f}s" for key, value in row.items() if key.startswith("seconds/"))
    return (f"step {row['step'] + 1}/{total} | label {fmt(row['label_accuracy'])} (maj {fmt(row['majority_label_accuracy'])})"
            f" reward {fmt(row['reward_accuracy'])} | maj-ratio {fmt(row['majority_ratio'])}"
            f" gt-ratio {fmt(row['ground_truth_ratio'])} | verified {fmt(row['verified_ratio'])}"
            f" prec {fmt(row['verifier_precision'])} rec {fmt(row['verifier_recall'])} | flips {row['flipped'] * row['questions']:.0f}"
            f" (+{row['flip_fixed'] * row['questions']:.0f}/-{row['flip_broke'] * row['questions']:.0f})"
            f" | len {row['response_length']:.0f} ent {fmt(row.get('grpo/entropy'))} loss {row.get('grpo/loss', 0):+.4f}"
            f" opt-steps {row.get('grpo/optimizer_steps', 0):.0f} clip {row.get('grpo/clip_frac', 0):.4f} | {timing}")


# ----------------------------------------------------------------------------------------------------------------
# Reports: summary table, curves, and the omega ablation replayed from saved rollouts

def summary(run_dir: Path) -> str:
    """Before vs after evaluation, and TTRL (majority) vs T3RL (weighted) pseudo-label accuracy during training."""
    rows = read_jsonl_rows(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if r["kind"] == "train"]
    # "before" is the step-0 evaluation only: if metrics.jsonl lost it, the table says so instead of showing another
    before = next((r for r in rows if r["kind"] == "eval" and r["step"] == 0 and not r.get("final")), {})
    after = next((r for r in reversed(rows) if r.get("final")), {})
    lines = [f"summary of {run_dir}", f"{'metric':<28}{'before':>10}{'after':>10}"]
    if not before:
        lines.append(f"(no step-0 evaluation in {run_dir / 'metrics.jsonl'}: the file was cut or deleted; 'before' is unknown)")
    for key in before or after:
        if key not in ("kind", "step", "final", "by_level") and isinstance((before or after)[key], (int, float)):
            fmt = lambda row: f"{row[key]:>10.3f}" if key in row else f"{'-':>10}"  # noqa: E731
            lines.append(f"{key:<28}{fmt(before)}{fmt(after)}")
    if train_rows:
        mean = lambda key: sum(r[key] for r in train_rows) / len(train_rows)  # noqa: E731
        lines.append(f"{'training steps':<28}{len(train_rows):>10}")
        lines.append(f"{'label acc. TTRL (majority)':<28}{mean('majority_label_accuracy'):>10.3f}")
        lines.append(f"{'label acc. T3RL (weighted)':<28}{mean('label_accuracy'):>10.3f}")
        lines.append(f"{'reward accuracy':<28}{mean('reward_accuracy'):>10.3f}")
        lines.append(f"{'verified ratio':<28}{mean('verified_ratio'):>10.3f}")
        verifying = [r for r in train_rows if r.get("status")]  # steps whose rollouts went to the verifier
        hits, verified = sum(r["verified_correct"] for r in verifying), sum(r["verified_rollouts"] for r in verifying)
        # a run logged before --lazy-verify existed judged every right rollout
        judged = sum(r.get("correct_judged_rollouts", r["correct_rollouts"]) for r in verifying)
        for name, of in (("verifier precision", verified), ("verifier recall", judged)):
            lines.append(f"{name:<28}" + (f"{hits / of:>10.3f}" if of else f"{'-':>10}"))
        lines.append(f"{'flips (fixed / broke)':<28}{sum(r['flipped'] * r['questions'] for r in train_rows):>10.0f}"
                     f"   ({sum(r['flip_fixed'] * r['questions'] for r in train_rows):.0f} / "
                     f"{sum(r['flip_broke'] * r['questions'] for r in train_rows):.0f})")
    return "\n".join(lines)


def plot_run(run_dir: Path):
    """curves.png: pseudo-label accuracy (TTRL vs T3RL), reward accuracy, verified ratio and loss per step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in read_jsonl_rows(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    if not rows:
        return
    steps = [r["step"] + 1 for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for key, name in [("label_accuracy", "label acc. (T3RL)"), ("majority_label_accuracy", "label acc. (majority)"),
                      ("reward_accuracy", "reward acc."), ("ground_truth_ratio", "ground-truth ratio")]:
        axes[0].plot(steps, [r[key] for r in rows], marker="o", label=name)
    axes[1].plot(steps, [r["verified_ratio"] for r in rows], marker="o", label="verified ratio")
    axes[1].plot(steps, [r["majority_ratio"] for r in rows], marker="o", label="majority ratio")
    axes[2].plot(steps, [r.get("grpo/loss", 0) for r in rows], marker="o", label="GRPO loss")
    axes[2].plot(steps, [r["response_length"] / max(r["response_length"] for r in rows) for r in rows],
                 marker="o", label="response length (rel.)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    fig.savefig(run_dir / "curves.png", dpi=100)
    plt.close(fig)


def replay(run_dir: Path, omegas: list[float]) -> str:
    """Re-vote every saved rollout group with each omega: label accuracy, reward accuracy and flips, no model
    needed. A --study folder gets its study report (study.py) instead."""
    if (run_dir / "study.jsonl").is_file():
        dom = domain_of(json.loads((run_dir / "config.json").read_text())["bench"])
        return report(run_dir, dom.classes, dom.equiv)
    for name in ("config.json", "rollouts.jsonl"):
        if not (run_dir / name).is_file():
            raise RunDirError(f"--replay {run_dir}: no {name} there; pass a run folder written by t3rl.py")
    cfg = json.loads((run_dir / "config.json").read_text())
    gold = {r["id"]: r["answer"] for r in load_bench(cfg["bench"])}
    groups = {}
    for r in read_jsonl_rows(run_dir / "rollouts.jsonl"):
        groups.setdefault((r["step"], r["id"]), []).append(r)
    unsettled = [omega for omega in omegas if omega not in (1.0, cfg["omega"])]
    if unsettled and any(r["status"] == "skipped" for rows in groups.values() for r in rows):
        raise RunDirError(f"--replay {run_dir} --omega {' '.join(f'{o:g}' for o in unsettled)}: the run verified "
                          f"lazily (--lazy-verify), so its verdicts settle the vote at omega {cfg['omega']:g} (and 1) "
                          f"only; replay those, or train with --no-lazy-verify for the ablation")
    lines = [f"omega ablation replayed on {len(groups)} rollout groups of {run_dir}",
             f"{'omega':>7}{'label acc':>11}{'reward acc':>12}{'flips':>7}{'fixed':>7}{'broke':>7}"]
    for omega in omegas:
        totals = {"label_accuracy": 0.0, "reward_accuracy": 0.0, "flipped": 0.0, "flip_fixed": 0.0, "flip_broke": 0.0}
        for (_, qid), rows in groups.items():
            answers, v = [r["answer"] for r in rows], [r["v"] for r in rows]
            vote = weighted_vote(answers, v, omega=omega, **domain_of(cfg["bench"]).classes)
            stats = group_metrics(vote, v, gold=gold[qid], **domain_of(cfg["bench"]).classes)
            for key in totals:
                totals[key] += stats[key]
        n = max(len(groups), 1)
        lines.append(f"{omega:>7g}{totals['label_accuracy'] / n:>11.3f}{totals['reward_accuracy'] / n:>12.3f}"
                     f"{totals['flipped']:>7.0f}{totals['flip_fixed']:>7.0f}{totals['flip_broke']:>7.0f}")
    return "\n".join(lines)


def main(argv=None):
    """One parser, one dispatch on the mode. A user's mistake, a damaged file or Ctrl-C ends in one line."""
    command = None
    try:
        command = parse_command(argv)
        if command.mode == "replay":
            print(replay(command.replay_dir, command.omegas))
        elif command.mode == "study":
            study(command.cfg)
        else:  # train, and eval: train stops after the baseline evaluation
            train(command.cfg)
    except (OptionError, DataError, ModelLoadError, RunDirError) as err:
        raise SystemExit(f"error: {err}") from None
    except KeyboardInterrupt:
        if command is None or command.cfg is None:
            raise SystemExit("interrupted") from None
        run_dir = run_dir_of(command.cfg)
        raise SystemExit(f"interrupted: {run_dir} holds every step up to its last checkpoint; continue with: "
                         f"python t3rl.py --resume {run_dir}") from None


if __name__ == "__main__":
    main()
