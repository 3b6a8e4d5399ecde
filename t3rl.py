"""t3rl: Tool-verified Test-Time Reinforcement Learning (T3RL), on top of TTRL, in one loop.

Test-time RL trains a model on unlabeled test questions. For each question q:

    y_1..y_N ~ pi_theta(. | q)                 sample N rollouts                  (sampler.py)
    a_i = extract(y_i)                         each rollout's final answer         (answers.py)
    v_i = [ run(program_i) == a_i ]            program_i, from a verifier LLM, recomputes the answer
                                               in a sandbox            (verifier.py, sandbox.py)
    w_i = (1 - v_i) + v_i * omega              verified rollouts carry omega votes (voting.py)
    label = argmax_a  sum_i w_i * 1[a_i == a]  the pseudo-label (omega = 1 is TTRL's majority vote)
    r_i = 1[a_i == label]                      the reward; ground truth is never used here
    keep M of the N rollouts at random, GRPO on them, an AdamW step per Q questions (grpo.py)

rl_step is that step; train() loops it over the benchmark; setup() is where each extension beyond
the paper enters, at one call (extensions/). What is not the method lives in machinery/.

    python t3rl.py                                  # CPU, offline: the embedded 0.5B model, demo
    accelerate launch t3rl.py --bench math500       # the paper's setting on GPUs
    torchrun --nproc_per_node 2 t3rl.py             # several processes on CPUs (gloo)
"""
import contextlib
import functools
import hashlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import gather_object, set_seed
from tqdm import tqdm

import verifier
from config import Config, OptionError, builds_verifier, parse_config
from grpo import Rollouts, grpo_step, make_optimization
from machinery import benchmarks, metrics, model as models, runs
import sampler
from sampler import Sampling
from sandbox import SandboxPool
from voting import Vote, weighted_vote

EVAL_TEMPERATURE, EVAL_TOP_P = 0.6, 0.95  # the papers' evaluation, whatever the rollouts'


def rl_step(step: int, questions: list[dict], learner: "Learner") -> dict:
    """One step of test-time RL on a step's questions; returns its metrics row. This process
    samples, verifies and votes on its share of the questions (none, when processes outnumber
    them: it still takes part in every collective); the update runs on everyone's rollouts."""
    cfg, accelerator, clock = learner.cfg, learner.accelerator, metrics.Stopwatch()
    shard = questions[accelerator.process_index::accelerator.num_processes]
    with clock("sample"):  # 1. y_1..y_N ~ pi_theta(. | q), and their final answers a_i
        seeds = [question_seed(cfg.seed, step, rec["id"], "rollout") for rec in shard]
        groups = learner.sample(shard, cfg.n_votes, Sampling(cfg.max_new_tokens, cfg.temperature,
                                                              cfg.top_p), seeds, "rollout")
        answers = read_answers(shard, groups, learner.domain)
    with clock("verify"):  # 2. v_i = 1 when the verifier's program, run in the sandbox, gives a_i
        verdicts = verify_groups(learner.verify, cfg.seed, shard, groups, answers, step)
    judged = []
    for rec, ans, ver in zip(shard, answers, verdicts):
        v = [0 if res is None else res.v for res in ver]
        # 3. the weighted vote's winner is the pseudo-label; 4. r_i = 1[a_i in its class]
        vote = weighted_vote(ans, v, cfg.omega, **learner.domain.classes)
        # 5. vote, then sample: M of the N rollouts, chosen at random, go into the update
        draw = random.Random(question_seed(cfg.seed, step, rec["id"], "downsample"))
        judged.append(Judged(vote, v, sorted(draw.sample(range(cfg.n_votes), cfg.n_train))))
    kept = gather_kept(shard, groups, judged, accelerator)
    with clock("update"):  # 6. GRPO on every process's kept rollouts, an AdamW step per Q questions
        for release in learner.before_update:  # what a fast sampler holds between calls
            release()
        update = grpo_step(learner.trained, learner.optimizer, learner.scheduler, kept, cfg,
                           accelerator=accelerator, ref_model=learner.ref_model)
        runs.release_freed_memory()  # the update's activations, before the next step samples
    runs.log_rollouts(step, shard, groups, answers, verdicts, judged, learner.run_dir, accelerator)
    monitors = [metrics.question_monitors(*question, learner.domain, cfg.omega)
                for question in zip(shard, groups, answers, verdicts, judged)]
    for name, monitor in learner.monitors.items():  # an extension's own counts (agent: tool calls)
        for stats, group, ans, ver in zip(monitors, groups, answers, verdicts):
            stats[name] = monitor(group, ans, ver)
    return metrics.step_metrics(step, gather_object(monitors), update, gather_object([clock]),
                                list(learner.monitors))


@dataclass
class Learner:
    """What a step works with: the policy and its optimizer, the samplers, the verifier, the run."""
    cfg: Config
    accelerator: object
    policy: torch.nn.Module       # what samples: float32 master weights (DDP: the prepared module)
    trained: torch.nn.Module      # what the optimizer trains: the policy (FSDP: its shards)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object             # stepped once per training step
    domain: verifier.Domain       # the benchmark's answers, prompts and tool (math, knk)
    run_dir: Path
    sample: object = None         # (records, n, Sampling, seeds, progress) -> [[Completion]]
    # the sampler, --backend's: (model, tokenizer, prompts, n, Sampling, *, seed, progress) ->
    # [[Completion]]; kv and hf are sampler.py's, a speed path sets its own (extensions/)
    generate: object = sampler.generate
    hold_verifier: object = None  # (model, tokenizer, dtype, device): a speed path keeps weights
    verify: object = None         # ([ToVerify], known) -> [Verification] (None: no verifier)
    evaluate: object = None       # (records, step) -> each question's evaluation row
    ref_model: torch.nn.Module | None = None  # the starting policy, for the KL term
    before_update: list = field(default_factory=list)  # extensions' memory given back
    releases: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)  # at the run's end
    monitors: dict = field(default_factory=dict)  # name -> (group, answers, verdicts) -> counts
    full_state: object = None     # (trained, optimizer) -> both in full, for a checkpoint (FSDP)
    load_optimizer: object = None  # state -> None: a resume's, onto the shards (FSDP)


@dataclass
class Judged:
    """One question after the vote: the vote, the verdicts v_i, the M rollouts kept."""
    vote: Vote
    v: list        # [N] 1 = verified
    keep: list     # [M] indices of the rollouts that go into the update

    @functools.cached_property
    def rewards(self) -> list:  # [N] r_i = 1[a_i in the label's class]
        return self.vote.rewards()


def policy_prompt(tokenizer, problem: str, instruction: str) -> str:
    """The question as the policy sees it: in its chat template when it has one (Qwen-Math's
    prompt otherwise)."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": instruction},
                    {"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {problem}\n{instruction}\nAnswer:"


def question_seed(seed: int, step: int, qid: str, purpose: str) -> int:
    """A seed per (run seed, step, question, purpose), whichever process or batch the question is
    in."""
    text = f"{seed}|{step}|{qid}|{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=7).digest(), "big")


def sample_groups(learner: Learner, records, n: int, sampling: Sampling, seeds, progress: str):
    """n completions per record in one sampler call. seeds: one per record (None: greedy)."""
    if not records:  # a process without a question this step
        return []
    sampling.dtype = getattr(torch, learner.cfg.sample_dtype)
    prompts = [policy_prompt(learner.tokenizer, rec["problem"], learner.domain.instruction)
               for rec in records]
    return learner.generate(learner.accelerator.unwrap_model(learner.policy), learner.tokenizer,
                            prompts, n, sampling, seed=seeds, progress=progress)


def read_answers(records, groups, domain) -> list:
    """a_i of every rollout, [q][N], read from what the policy wrote (not a tool's output)."""
    return [[domain.extract(c.policy_text, rec["problem"]) for c in group]
            for rec, group in zip(records, groups)]


def verify_groups(verify, seed: int, records, groups, answers, step: int, purpose="verify"):
    """v_i of every rollout of every question, [q][N] Verifications (None without a verifier).
    Each program is seeded by (run seed, step, question, purpose, rollout), as the rollouts are, so
    a resumed run writes the same programs."""
    if verify is None:
        return [[None] * len(group) for group in groups]
    rollouts = [verifier.ToVerify(rec["problem"], c.text, a, rec["id"],
                                  question_seed(seed, step, rec["id"], f"{purpose}|{i}"),
                                  step if purpose == "verify" else -1)
                for rec, group, ans in zip(records, groups, answers)
                for i, (c, a) in enumerate(zip(group, ans))]
    results = iter(verify(rollouts, [None] * len(rollouts)))
    return [[next(results) for _ in group] for group in groups]


def gather_kept(shard, groups, judged, accelerator) -> Rollouts:
    """Every process's kept rollouts, in the step's question order: the update does not depend on
    how the questions were split over processes."""
    rank, processes = accelerator.process_index, accelerator.num_processes
    positions = range(rank, rank + len(shard) * processes, processes)
    mine = [(position, [(group[i].prompt_ids, group[i].token_ids, question.rewards[i],
                         group[i].token_logprobs, group[i].tool_mask) for i in question.keep])
            for position, group, question in zip(positions, groups, judged)]
    in_order = sorted(gather_object(mine), key=lambda question: question[0])
    rollouts = [r for _, kept in in_order for r in kept]
    prompts, completions, rewards, sampled, tool_masks = (list(column) for column in zip(*rollouts))
    # the engine's token log-probs, for the update's mismatch statistic; the agent's tool tokens
    return Rollouts(prompts, completions, rewards,
                    sampled if all(lp is not None for lp in sampled) else None,
                    tool_masks if any(m is not None for m in tool_masks) else None)


# ------------------------------------------------------------------------------------------------
# Evaluation: ground truth is read here, and only here and in the monitors of machinery/metrics.py

def evaluate(learner: Learner, records) -> list:
    """Every question's row (all processes'): greedy@1 and, with k = eval_samples, the results of
    k sampled runs at the papers' evaluation temperature (run j seeded as a run with seed + j: avg@k
    is the mean of k single runs), maj@k and, verifying at omega > 1, verified_maj@k (T3RL's vote
    at inference on the same k samples)."""
    cfg, accelerator = learner.cfg, learner.accelerator
    shard, k = records[accelerator.process_index::accelerator.num_processes], cfg.eval_samples
    greedy = learner.sample(shard, 1, Sampling(cfg.max_new_tokens, 0.0, 1.0), None, "greedy")
    runs_ = [rec for _ in range(k) for rec in shard]  # run-major: run j is the shard's j-th block
    seeds = [question_seed(cfg.seed + j, -1, rec["id"], "eval") for j in range(k) for rec in shard]
    flat = learner.sample(runs_, 1, Sampling(cfg.max_new_tokens, EVAL_TEMPERATURE, EVAL_TOP_P),
                          seeds, "eval")
    sampled = [[flat[j * len(shard) + i][0] for j in range(k)] for i in range(len(shard))]
    answers = read_answers(shard, sampled, learner.domain)
    verdicts = (verify_groups(learner.verify, cfg.seed, shard, sampled, answers, -1, "eval")
                if learner.verify and cfg.omega > 1 and k else [None] * len(shard))
    return gather_object([metrics.eval_row(rec, g[0], a, [r.v for r in v] if v else None,
                                           learner.domain, cfg.omega)
                          for rec, g, a, v in zip(shard, read_answers(shard, greedy,
                                                                       learner.domain),
                                                  answers, verdicts)])


def log_evaluation(learner: Learner, records, step: int, log, coverage: dict, final=False):
    """Evaluate, log the row (the final one with each accuracy's best over the run) and each
    question's (evaluations.jsonl), and print it."""
    rows = learner.evaluate(records, step)
    if learner.accelerator.is_main_process:
        runs.append_jsonl(learner.run_dir / "evaluations.jsonl",
                          [{"step": step, **row} for row in rows])
    result = metrics.eval_metrics(rows, learner.cfg.eval_samples)
    row = {"kind": "eval", "step": step, **coverage, **result}
    if final:  # each run's peak beside its end, as the papers' robustness figures use
        row["final"] = True
        if learner.accelerator.is_main_process:
            earlier = runs.read_jsonl_rows(learner.run_dir / "metrics.jsonl")
            row.update(metrics.best_evals(earlier + [row]))
    log(row)
    learner.accelerator.print(f"eval at step {step}: {metrics.format_eval(result)}")


# ------------------------------------------------------------------------------------------------
# The loop

def train(cfg: Config, gpu: bool = False) -> Path:
    """The run: set up, evaluate before, rl_step over every step's questions with evaluations and
    checkpoints between, evaluate after, print the summary."""
    clock, started = metrics.Stopwatch(), time.time()  # where this sitting's time goes
    runs.settle(cfg, gpu)
    records = benchmarks.load_bench(cfg.bench)[:cfg.limit or None]  # bad input ends here
    batches = question_batches(records, cfg)
    if not cfg.run_name and not cfg.resume:
        cfg.run_name = runs.free_run_name(cfg)  # claims its folder
    accelerator = runs.make_accelerator(cfg, gpu)
    set_seed(cfg.seed)
    # test-time RL is scored on the questions it trains on (all of them when it only evaluates)
    trained = {rec["id"] for batch in batches for rec in batch} or {rec["id"] for rec in records}
    questions = [rec for rec in records if rec["id"] in trained]
    coverage = {"questions": len(questions),
                "trained_questions": len({rec["id"] for batch in batches for rec in batch})}
    with runs.sigterm_as_ctrl_c(), SandboxPool(timeout=verifier.SANDBOX_TIMEOUT) as pool:
        with clock("load"):
            learner, start = setup(cfg, accelerator, records, batches, pool)
        log = runs.metrics_logger(learner.run_dir, accelerator)
        with runs.tracking(accelerator, cfg, learner.run_dir, start), learner.releases:
            if start == 0:
                with clock("evaluation"):
                    log_evaluation(learner, questions, 0, log, coverage, final=not batches)
            for step in tqdm(range(start, len(batches)), desc="steps", initial=start,
                             total=len(batches), disable=not accelerator.is_main_process):
                row = rl_step(step, batches[step], learner)
                log(row)
                accelerator.print(metrics.format_step(row, len(batches)))
                for phase in ("sample", "verify", "update"):
                    clock[phase] = clock.get(phase, 0.0) + row[f"seconds/{phase}"]
                done = step + 1
                if cfg.eval_every and done % cfg.eval_every == 0 and done < len(batches):
                    with clock("evaluation"):
                        log_evaluation(learner, questions, done, log, coverage)
                if done % cfg.save_every == 0 or done == len(batches):
                    runs.save_checkpoint(learner.run_dir, done, learner.trained, learner.tokenizer,
                                         learner.optimizer, learner.scheduler, accelerator,
                                         learner.full_state)
            if batches:
                runs.drop_optimizer_state(learner.optimizer)  # the last checkpoint holds it
                with clock("evaluation"):
                    log_evaluation(learner, questions, len(batches), log, coverage, final=True)
    if accelerator.is_main_process:
        runs.finish_run(learner.run_dir)
        print(metrics.summary(learner.run_dir))
        print(metrics.time_line(clock | {"wall": time.time() - started}))
        metrics.plot_run(learner.run_dir)
    return learner.run_dir


def setup(cfg: Config, accelerator, records, batches, pool) -> tuple:
    """The run folder, the models (from the last checkpoint on --resume), the optimizer, and each
    extension the options ask for, entered here at one call each. Returns the Learner and the first
    step to run."""
    runs.on_main(accelerator, runs.open_run_dir, cfg)  # the others wait, and end in its error
    run_dir = runs.run_dir_of(cfg)
    with accelerator.main_process_first():  # the main process sets a damaged checkpoint aside first
        checkpoint, state = runs.load_checkpoint(run_dir) if cfg.resume else (None, None)
    # float32 master weights whatever the source's dtype: an AdamW step of 5e-7 rounds away in
    # bfloat16; sampling casts to its own dtype
    policy, tokenizer = models.load_model(str(checkpoint / "model") if checkpoint else cfg.model,
                                          dtype=torch.float32)
    domain = bench_domain(cfg.bench)
    ref_model = (models.load_model(cfg.model)[0].requires_grad_(False).to(accelerator.device)
                 if cfg.kl_coef > 0 else None)
    policy.train()
    learner = Learner(cfg, accelerator, policy, policy, tokenizer, None, None, domain, run_dir,
                      ref_model=ref_model)
    learner.sample = functools.partial(sample_groups, learner)
    learner.evaluate = lambda records, step: evaluate(learner, records)
    if cfg.agent:  # TTRL-Agent: the policy runs its own python blocks in the sandbox
        from extensions import agent
        learner.sample = agent.sampling(learner, pool, policy_prompt)
        learner.monitors["agent"] = agent.monitor
    if cfg.parallel == "fsdp":  # the update trains shards, the samplers read a full copy of them
        from extensions import fsdp
        fsdp.shard(learner)
    learner.optimizer, learner.scheduler = make_optimization(learner.trained, cfg,
                                                             total_steps=max(len(batches), 1))
    load_optimizer = learner.load_optimizer or learner.optimizer.load_state_dict
    start = runs.restore_state(state, load_optimizer, learner.scheduler) if state else 0
    # the scheduler stays unprepared: accelerate would step it once per process
    if cfg.parallel == "ddp":
        learner.policy, learner.optimizer = accelerator.prepare(learner.policy,
                                                                 learner.optimizer)
        learner.trained = learner.policy
    prompts = [(rec["id"], policy_prompt(tokenizer, rec["problem"], domain.instruction))
               for rec in records]
    runs.check_prompts_fit(prompts, tokenizer, accelerator.unwrap_model(learner.policy), cfg)
    learner.generate, fast = speed_path(cfg.backend)
    if fast:  # its hold on the verifier's weights, what it gives back for the update
        fast.serve(learner)
    learner.verify = build_verify(learner, pool, start) if builds_verifier(cfg) else None
    if cfg.eval_cache != "none":  # the evaluation before training, kept for a later run
        from extensions import eval_cache
        learner.evaluate = eval_cache.cached(learner.evaluate, cfg, accelerator)
    runs.announce(run_dir, records, batches, accelerator, start, cfg, pool)
    return learner, start


def speed_path(backend: str) -> tuple:
    """A --backend's (generate, module): sampler.py's generate for kv and hf (module None); for a
    speed path its module's generate, the module holding its hold_verifier and serve(learner),
    which enters both into a run."""
    if backend == "kv-fast":  # the kv sampler's fast path, the verifier's weights kept its way
        from extensions import kv_fast
        return kv_fast.generate, kv_fast
    if backend == "vllm":  # an engine per model and process, the policy's asleep in the update
        from extensions import engine
        return engine.generate, engine
    return functools.partial(sampler.generate, backend=backend), None


def build_verify(learner: Learner, pool, start: int):
    """The run's verify function ([ToVerify], known) -> [Verification], with the verdict memory
    when asked (a class two steps agreed on keeps its verdict)."""
    cfg, accelerator, domain = learner.cfg, learner.accelerator, learner.domain
    call = build_verifier(cfg, accelerator.device, generate=learner.generate,
                          hold=learner.hold_verifier)
    verify = verify_function(cfg, call, pool, domain, learner.monitors)
    if cfg.verdict_memory:
        from extensions import memory
        verify = memory.remembering(verify, memory.open_memory(
            runs.run_dir_of(cfg), start, domain, accelerator.is_main_process), gather_object)
        learner.monitors["memory"] = memory.monitor
    return verify


def verify_function(cfg: Config, call, pool, domain, monitors=None):
    """The paper's verification (one program per rollout, every rollout) with the verifier LLM
    `call`, or what the options beyond it make of it, each entered here with its monitor (into
    `monitors`: Learner.monitors)."""
    monitors = {} if monitors is None else monitors
    verify = functools.partial(verifier.verify_batch, verifier=call, pool=pool, domain=domain)
    if cfg.verifier_programs > 1 or cfg.verifier_repair:  # several programs, repair
        from extensions import programs
        verify = functools.partial(programs.several, verifier=call, pool=pool, domain=domain,
                                   programs=cfg.verifier_programs, repair=cfg.verifier_repair)
        monitors["programs"] = programs.monitor
    if cfg.verify_budget or cfg.lazy_verify:  # verify a class by some of its rollouts
        from extensions import budget
        verify = budget.budgeted(verify, cfg.verify_budget,
                                 cfg.omega if cfg.lazy_verify and cfg.omega > 1 else None, domain)
        monitors["budget"] = budget.monitor
    return verify


def build_verifier(cfg: Config, device, generate=sampler.generate, hold=None, loaded=None):
    """The verifier LLM as a callable [VerifierPrompt] -> [VerifierReply] that samples with
    `generate`. 'self' is a frozen copy of the policy's starting weights (--model, not a
    checkpoint), kept in the sampling dtype. hold: a speed path's (model, tokenizer, dtype, device)
    -> None, which keeps the weights its own way (kv-fast's layout, vLLM's engine). loaded: its
    (model, tokenizer) when already in memory (the study)."""
    spec, option = ((cfg.model, "--model") if cfg.verifier_model == "self"
                    else (cfg.verifier_model, "--verifier-model"))
    dtype = getattr(torch, cfg.sample_dtype)
    vmodel, vtok = loaded or models.load_model(spec, dtype, option)
    vmodel.requires_grad_(False)
    if hold:
        hold(vmodel, vtok, dtype, device)
    else:
        vmodel.to(device)
    return verifier.model_verifier(vmodel, vtok, cfg.verifier_max_new_tokens, cfg.seed, generate)


def bench_domain(bench: str) -> verifier.Domain:
    """What the loop needs of a benchmark's answers and its verifier's programs."""
    if bench == "knk":  # Knights and Knaves: role answers, SMT-LIB2 programs for z3
        from extensions.knk import KNK
        return KNK
    return verifier.MATH


def question_batches(records: list[dict], cfg: Config) -> list:
    """Every step's questions: each episode one pass over the benchmark in a fresh seeded order,
    without its last partial step (verl's dataloader: 30 questions at 8 a step are 3 steps)."""
    per_step = cfg.questions_per_step
    if cfg.episodes and len(records) < per_step:
        raise OptionError(f"--questions-per-step {per_step}: the benchmark has {len(records)} "
                          f"questions, so no step is left; lower --questions-per-step or raise "
                          f"--limit")
    batches = []
    for episode in range(cfg.episodes):
        order = list(records)
        random.Random(cfg.seed * 1000 + episode).shuffle(order)
        end = len(order) - len(order) % per_step
        batches += [order[i:i + per_step] for i in range(0, end, per_step)]
    return batches[:cfg.max_steps] if cfg.max_steps else batches


def check_models(cfg: Config):
    """Each model the run loads can be had (a folder, a .gguf file, a Hub id its cache or the Hub
    gives), checked before a run folder exists; ModelLoadError names the option."""
    specs = [(cfg.model, "--model")]
    if builds_verifier(cfg) and cfg.verifier_model != "self":
        specs.append((cfg.verifier_model, "--verifier-model"))
    for spec, option in specs:
        models.check_spec(spec, option)
        models.check_hub(spec, option)


def main(argv=None):
    """Parse, check, train. A user's mistake, a damaged file, Ctrl-C or SIGTERM ends in one
    line."""
    cfg = None
    try:
        gpu = torch.cuda.is_available()
        cfg = parse_config(argv, gpu)
        check_models(cfg)
        train(cfg, gpu)
    except (OptionError, runs.DataError, models.ModelLoadError, runs.RunDirError) as err:
        raise SystemExit(f"error: {err}") from None
    except KeyboardInterrupt:
        run_dir = runs.run_dir_of(cfg) if cfg is not None else None
        if run_dir is None or not (run_dir / "config.json").is_file():  # before the run folder
            raise SystemExit("interrupted") from None
        raise SystemExit(f"interrupted: {run_dir} holds every step up to its last checkpoint; "
                         f"continue with: {runs.resume_command(run_dir)}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
