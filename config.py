"""The run's settings: a Config of plain defaults (the paper's loop), presets on top, then the
command line.

Every option states what it allows (a Range or a tuple of choices); machinery/options.py parses the
command line and checks every value before anything loads, so a mistake ends in one line that names
the option, the value and what to pass instead. A resumed run takes its saved config.json; options
typed beside --resume must match it (RESUMABLE_CHANGES excepted). Standard library only.

    # what `python t3rl.py ...` runs
    cfg = machinery.options.parse_config(["--bench", "math500", "--omega", "inf"])
"""
import math
from dataclasses import dataclass, field

# the choices of the options that name a thing; the modules that implement them take them from here
BENCHES = ("math500", "aime2024", "amc", "demo", "knk")
ANSWER_RULES = ("strict", "last-number")
BACKENDS = ("kv", "hf", "vllm")
PARALLEL_MODES = ("ddp", "fsdp")
# each named for what it computes where it comes from (docs/grpo.md gives the file and line): verl's
# names give verl's values through its update loop, TRL's its loss types'
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "dapo", "dr_grpo")


@dataclass(frozen=True)
class Range:
    """Allowed numbers, written as an interval:
    [1, inf) excludes inf and nan, [1, inf] allows inf."""
    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = True

    def __contains__(self, x) -> bool:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
            return False
        return ((x > self.low if self.low_open else x >= self.low)
                and (x < self.high if self.high_open else x <= self.high))

    def __str__(self):
        end = lambda x: f"{x:g}" if math.isinf(x) or x != int(x) else str(int(x))  # noqa: E731
        return (f"{'(' if self.low_open else '['}{end(self.low)}, "
                f"{end(self.high)}{')' if self.high_open else ']'}")

COUNT, AT_LEAST_ONE, POSITIVE, NON_NEGATIVE = Range(0), Range(1), Range(0, low_open=True), Range(0)
SHARE = Range(0, 1, high_open=False)


def option(default, doc: str, allowed=None):
    """A Config field: its default, its --help text, and what it allows (a Range, a tuple of
    choices, or None for free text checked where it is used: paths and model names)."""
    return field(default=default, metadata={"doc": doc, "allowed": allowed})


@dataclass
class Config:
    # what to train
    bench: str = option("demo", "benchmark", BENCHES)
    limit: int = option(0, "use only the first LIMIT questions of the benchmark (0 = all)", COUNT)
    question_ids: str = option("", "file of question ids, one a line (# starts a comment): use "
                               "only those questions of the benchmark, in its order, before "
                               "--limit (empty = all)")
    model: str = option("embedded", "policy: Hub id, local folder, .gguf file, or 'embedded' "
                        "(offline Qwen2.5-Coder-0.5B-Instruct)")
    verifier_model: str = option("self", "verifier LLM: 'self' = frozen copy of the policy's "
                                 "starting weights (self-verification), or any --model value "
                                 "(coder-1.5b: the offline paper verifier)")
    preset: str = option("auto", "auto (cpu without a GPU, paper with one); ttrl: TTRL's own "
                         "scripts; explicit options override it",
                         ("auto", "paper", "ttrl", "cpu", "none"))
    # test-time RL
    n_votes: int = option(64, "N: rollouts sampled per question for the vote", AT_LEAST_ONE)
    n_train: int = option(32, "M: rollouts per question kept (at random) for the GRPO update "
                          "('vote then sample'); GRPO compares rollouts within a group, so at "
                          "least 2, at most N", Range(2))
    questions_per_step: int = option(8, "questions per step, all processes together", AT_LEAST_ONE)
    episodes: int = option(10, "passes over the benchmark "
                           "(paper: 10 MATH-500, 30 AMC, 80 AIME 2024)", AT_LEAST_ONE)
    max_steps: int = option(0, "stop after this many steps (0 = as many as the episodes take)",
                            COUNT)
    drop_last: bool = option(True, "drop each episode's last partial step, as verl's dataloader "
                             "does (drop_last=True)")
    temperature: float = option(0.6, "rollout sampling temperature (> 0: GRPO's ratio needs the "
                                "log-probs of the distribution the rollouts came from)", POSITIVE)
    top_p: float = option(0.95, "rollout nucleus sampling mass",
                          Range(0, 1, low_open=True, high_open=False))
    max_new_tokens: int = option(2560, "policy tokens per rollout", AT_LEAST_ONE)
    backend: str = option("kv", "policy's sampler: the hand-written KV-cache sampler, transformers "
                          "generate, or the vLLM engine (colocated, weights synced before each "
                          "sampling call that follows an update)", BACKENDS)
    sample_dtype: str = option("auto", "sampling compute dtype (auto: bfloat16 where supported, "
                               "fixed in the run's config.json when it starts)",
                               ("auto", "float32", "bfloat16"))
    answer_rule: str = option("strict", "how a math rollout's answer is read: strict (a box or a "
                              "stated answer, else none: no vote, reward 0) | last-number (else "
                              "the last number, TTRL's original parser)", ANSWER_RULES)
    # verification
    verify: bool = option(True,
                          "tool-verify rollouts (--no-verify is TTRL, without the verifier's cost)")
    omega: float = option(5.0, "vote weight of a verified rollout: 1 = TTRL, inf = hard filtering "
                          "(several values with --replay)", Range(1, high_open=False))
    verify_budget: int = option(0, "verify at most K rollouts per answer class, the rest inherit "
                                "(0 = verify all)", COUNT)
    lazy_verify: bool = option(False, "verify only the rollouts whose verdicts can still change "
                               "the pseudo-label: the labels and rewards of verifying all, at "
                               "fewer verifier prompts (one or two calls a step); at omega 1 no "
                               "verdict can, so every rollout is verified for the monitors")
    verifier_programs: int = option(3, "programs the verifier writes per rollout sent, each "
                                    "with its own seed; v_i = 1 when one reproduces a_i",
                                    AT_LEAST_ONE)
    verifier_repair: bool = option(True, "a program that raises, hits a sandbox limit or prints "
                                   "nothing gets one more verifier turn showing it its error")
    verdict_memory: bool = option(True, "an answer class whose last --verdict-attempts steps "
                                  "agreed (reproduced each time, or failed each time) keeps that "
                                  "verdict in later steps without a verifier call (verdicts.jsonl "
                                  "in the run folder)")
    verdict_attempts: int = option(2, "with --verdict-memory: the steps, in a row, whose verdicts "
                                   "on an answer class must agree before it is kept (one step "
                                   "never settles a class)", Range(2))
    verifier_max_new_tokens: int = option(1024, "verifier tokens per program", AT_LEAST_ONE)
    verifier_temperature: float = option(0.6, "verifier sampling temperature (0 = greedy)",
                                         NON_NEGATIVE)
    verifier_top_p: float = option(0.95, "verifier nucleus sampling mass (the paper's 0.95, "
                                   "whatever the policy's)",
                                   Range(0, 1, low_open=True, high_open=False))
    verifier_backend: str = option("auto", "verifier's sampler (auto: the policy's --backend)",
                                   ("auto", *BACKENDS))
    sandbox_timeout: float = option(5.0, "seconds each program (the verifier's, the agent's) "
                                    "may run", POSITIVE)
    # TTRL-Agent (agent.py): the policy calls the interpreter itself
    agent: bool = option(False, "agent rollouts: the policy may write ```python blocks, which run "
                         "in the sandbox, their output appended before it goes on (TTRL-Agent: "
                         "--agent --omega 1; with --study: agent rollouts beside the plain ones)")
    agent_max_calls: int = option(4, "tool calls per agent rollout (a block after them is not run)",
                                  AT_LEAST_ONE)
    # optimisation (GRPO)
    lr: float = option(5e-7, "peak learning rate (AdamW, cosine schedule)", NON_NEGATIVE)
    lr_schedule_unit: str = option("step", "what the cosine schedule counts: step (once per "
                                   "training step, its AdamW steps share a learning rate, as verl) "
                                   "| optimizer-step", ("step", "optimizer-step"))
    warmup_ratio: float = option(0.03, "share of the schedule spent warming the learning rate up "
                                 "(TTRL: 0.03)", SHARE)
    mini_batch_questions: int = option(1, "Q: an optimizer step per Q questions' kept rollouts, so "
                                       "ceil(questions per step / Q) per step (TTRL: 1; 0 = one "
                                       "per step)", COUNT)
    scale_advantages: bool = option(True, "divide advantages by their group's std "
                                    "(--no-scale-advantages: Dr. GRPO)")
    weight_decay: float = option(0.01, "AdamW weight decay", NON_NEGATIVE)
    clip_low: float = option(0.2, "PPO ratio clip below: rho >= 1 - CLIP_LOW",
                             Range(0, 1, low_open=True, high_open=False))
    clip_high: float = option(0.2, "PPO ratio clip above: rho <= 1 + CLIP_HIGH (DAPO's "
                              "clip-higher: 0.28)", POSITIVE)
    clip_ratio_c: float = option(3.0, "dual clip: a token with A < 0 loses at most C |A| (verl's "
                                 "clip_ratio_c; inf = off)",
                                 Range(1, low_open=True, high_open=False))
    kl_coef: float = option(0.0, "KL loss to the starting policy, verl's low_var_kl (paper: 0; "
                            "TTRL's scripts: 0.001)", NON_NEGATIVE)
    loss_agg: str = option("dapo", "loss aggregation (grpo.py; docs/grpo.md): verl's token-mean "
                           "(a token-mean per micro-batch, weighted by its share of the mini-batch's "
                           "rollouts; TTRL's scripts), seq-mean-token-mean, seq-mean-token-sum-norm, "
                           "or TRL's dapo (one token-mean over the mini-batch) and dr_grpo",
                           AGGREGATIONS)
    micro_batch_tokens: int = option(8192, "tokens per micro-batch "
                                     "(gradient accumulation over the rest)", AT_LEAST_ONE)
    micro_batch_rollouts: int = option(0, "rollouts per micro-batch, in order, whatever their "
                                       "length (verl's ppo_micro_batch_size_per_gpu; TTRL's "
                                       "scripts: 2); 0 = as many as --micro-batch-tokens holds",
                                       COUNT)
    grad_checkpointing: bool = option(True,
                                      "recompute activations in the backward pass to save memory")
    bf16: bool = option(True, "bfloat16 autocast over float32 master weights "
                        "where the hardware supports it")
    parallel: str = option("ddp", "how several processes hold the policy: ddp (a replica each) "
                           "or fsdp (FSDP2: weights, gradients and AdamW state sharded; "
                           "docs/distributed.md); an accelerate config asking for FSDP picks fsdp",
                           PARALLEL_MODES)
    # the inference engine (--backend vllm)
    vllm_gpu_memory_utilization: float = option(0.3, "share of each GPU's memory an engine takes "
                                                "(colocated beside the trainer)",
                                                Range(0, 1, low_open=True, high_open=False))
    vllm_is_correction: bool = option(False, "truncated importance sampling: weight each token's "
                                      "loss by min(pi_old / pi_engine, --vllm-is-cap), as TRL's "
                                      "vllm_importance_sampling_correction")
    vllm_is_cap: float = option(3.0, "cap of the truncated importance weight", Range(1))
    # evaluation and bookkeeping
    eval_every: int = option(2, "evaluate every K steps, and before and after training (0 = only "
                             "before and after)", COUNT)
    eval_on: str = option("trained", "the questions every evaluation covers: trained (those the "
                          "run's steps visit: test-time RL is scored on what it trains on) | all "
                          "(the benchmark after --limit) | held-out (those no step visits)",
                          ("trained", "all", "held-out"))
    eval_cache: str = option("auto", "folder keeping the evaluation before training, taken by a "
                             "later run with the same model, questions, evaluation settings, seed "
                             "and code: auto (T3RL_CACHE/evals, ~/.cache/t3rl/evals by default), a "
                             "path, or none (always evaluate)")
    eval_samples: int = option(4, "k: sampled evaluation runs for avg@k (the papers' Pass@1) and "
                               "maj@k (paper: 16 for AIME 2024, 4 otherwise; 0 = greedy@1 only)",
                               COUNT)
    eval_temperature: float = option(0.6, "sampling temperature of the k evaluation runs", POSITIVE)
    eval_top_p: float = option(0.95, "nucleus mass of the k evaluation runs",
                               Range(0, 1, low_open=True, high_open=False))
    save_every: int = option(10, "checkpoint every K steps (and at the end)", AT_LEAST_ONE)
    report_to: str = option("none", "experiment trackers, comma-separated, through accelerate: "
                            "tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, "
                            "trackio | all (every one installed) | none")
    out_dir: str = option("runs", "folder that holds the run folders")
    run_name: str = option("", "run folder name (default: bench-method-time)")
    seed: int = option(0, "seed for sampling, downsampling and initialisation",
                       Range(0, 2**32 - 1, high_open=False))
    resume: str = option("", "continue the run in this folder from its last checkpoint")
    eval_only: bool = option(False,
                             "evaluate the starting policy and stop: the baseline, no training")
    study: bool = option(False, "the evidence study (study.py): sample n_votes rollouts for LIMIT "
                         "level-stratified questions once, verify all, vote at k = 4..n_votes and "
                         "omega 1, 2, 5, 10, inf; no training")

@dataclass(frozen=True)
class GRPOSettings:
    """How grpo_step updates: the loss's constants (see the top of the file) and how the work
    is cut."""
    group_size: int                # M: rollouts per question; rewards come group after group
    # Q: an optimizer step per Q groups (None: one for the whole batch)
    mini_batch_groups: int | None = None
    clip_low: float = 0.2          # eps_low
    clip_high: float = 0.2         # eps_high
    clip_ratio_c: float = 3.0      # c of the dual clip (inf: none)
    kl_coef: float = 0.0           # beta (> 0 needs ref_model)
    # scheduler.step() per optimizer step, or once per call ("step")
    lr_schedule_unit: str = "optimizer-step"
    agg: str = "dapo"              # AGG, one of AGGREGATIONS
    norm_len: int | None = None    # L_max of the -sum-norm and dr_grpo: the rollouts' max new tokens
    scale_advantages: bool = True  # divide by the group's std (False: Dr. GRPO)
    temperature: float = 1.0       # T: the sampling temperature, log pi = log softmax(logits / T)
    token_budget: int = 4096       # padded tokens per micro-batch (gradient accumulation)
    # > 0: micro-batches of that many rollouts, in order (verl's fixed size)
    micro_batch_rollouts: int = 0
    max_grad_norm: float = 1.0
    bf16: bool | None = None       # bfloat16 autocast over float32 weights (None: where supported)
    gradient_checkpointing: bool = False
    chunk_rows: int = 256          # response rows per chunk of the output head (token_logprobs)
    # C of truncated importance sampling (None: off; needs the sampler's log-probs)
    is_cap: float | None = None


# episodes (the T3RL paper and TTRL's scripts agree) and prompts per step (TTRL's scripts) for each
# benchmark; where README's preset table cites them, in TTRL's
# verl/examples/ttrl/Qwen2.5-Math/{math,amc,aime}.sh
PAPER_EPISODES = {"math500": 10, "amc": 30, "aime2024": 80}
TTRL_QUESTIONS_PER_STEP = {"math500": 32, "amc": 8, "aime2024": 8}

# the paper's verifier: one program per rollout, no repair, no memory, every rollout verified
PAPER_VERIFIER = dict(verifier_programs=1, verifier_repair=False,
                      verdict_memory=False, verify_budget=0, lazy_verify=False,
                      verifier_max_new_tokens=1024, verifier_temperature=0.6, verifier_top_p=0.95)

# Each preset states every choice of the protocol; README's preset table gives each value's source.
PRESETS = {
    # the T3RL paper; where it is silent, TTRL's scripts, which it builds on
    "paper": dict(model="Qwen/Qwen2.5-Math-1.5B", verifier_model="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                  bench="math500", temperature=0.6, top_p=0.95, max_new_tokens=2560, kl_coef=0.0,
                  lr_schedule_unit="step", loss_agg="token-mean", micro_batch_rollouts=2,
                  answer_rule="strict", drop_last=True, eval_every=2, eval_temperature=0.6,
                  eval_top_p=0.95, **PAPER_VERIFIER),
    # TTRL's verl 0.4.1 scripts: the TTRL row, no verifier (--verify puts T3RL's on the same
    # settings)
    "ttrl": dict(model="Qwen/Qwen2.5-Math-1.5B", verifier_model="Qwen/Qwen2.5-Coder-1.5B-Instruct",
                 bench="math500", verify=False, omega=1.0, n_votes=64, n_train=32, temperature=1.0,
                 top_p=1.0, max_new_tokens=3072, lr=5e-7, warmup_ratio=0.03,
                 lr_schedule_unit="step", mini_batch_questions=1, kl_coef=0.001, clip_low=0.2,
                 clip_high=0.2, clip_ratio_c=3.0, loss_agg="token-mean",
                 micro_batch_rollouts=2, answer_rule="strict", drop_last=True, eval_every=2,
                 eval_samples=16, eval_temperature=0.6, eval_top_p=0.95, **PAPER_VERIFIER),
    # the kv sampler for both roles: on CPUs it is faster than vLLM's CPU engine
    # (docs/results.md, engine bench)
    "cpu": dict(bench="demo", verifier_model="coder-1.5b", backend="kv", verifier_backend="kv",
                limit=6, episodes=2, questions_per_step=3, n_votes=8, n_train=4,
                max_new_tokens=320, verifier_max_new_tokens=256, verify_budget=1,
                lazy_verify=True, lr=2e-6, answer_rule="strict", drop_last=True, eval_every=0,
                eval_samples=8, save_every=2, micro_batch_tokens=4096, mini_batch_questions=2),
    "none": {},
}

# options a resumed run may change: they decide when to evaluate and save, not what is computed
RESUMABLE_CHANGES = ("eval_every", "save_every")

REPLAY_OMEGAS = [1.0, 2.0, 5.0, 10.0, math.inf]


class OptionError(ValueError):
    """An option's value is outside what it allows; the message names the option, the value
    and the range."""


def verifier_backend(cfg: Config) -> str:
    return cfg.backend if cfg.verifier_backend == "auto" else cfg.verifier_backend
