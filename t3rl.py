"""t3rl: Tool-verified Test-Time Reinforcement Learning (T3RL), on top of TTRL, in one loop.

Test-time RL trains a model on unlabeled test questions. For each question q:

    y_1..y_N ~ pi_theta(. | q)                 sample N rollouts                  (sampler.py)
    a_i = extract(y_i)                         the final answer of each rollout   (answers.py)
    v_i = [ run(program_i) == a_i ]            program_i, from a verifier LLM, recomputes the answer
                                               in a sandbox            (verifier.py, sandbox.py)
    w_i = (1 - v_i) + v_i * omega              verified rollouts carry omega votes (voting.py)
    label = argmax_a  sum_i w_i * 1[a_i == a]  the pseudo-label (omega = 1 is TTRL's majority vote)
    r_i = 1[a_i == label]                      the reward; ground truth is never used here
    keep M of the N rollouts at random, GRPO on them, an AdamW step per Q questions (grpo.py)

rl_step is that step; train() loops it over the benchmark. What is not the method lives in
machinery/ (the command line, run folder, monitors, benchmarks, models, the study), called as
machinery.<module>.<name>.

    python t3rl.py                                  # CPU, offline: the embedded 0.5B model, demo
    accelerate launch t3rl.py --bench math500       # the paper's setting on GPUs
    torchrun --nproc_per_node 2 t3rl.py             # several processes on CPUs (gloo)
    python t3rl.py --agent --omega 1 --no-verify    # TTRL-Agent: the policy's rollouts call Python
"""
import functools
import hashlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object, set_seed
from tqdm import tqdm

import machinery
from config import Config, OptionError, verifier_backend
from grpo import GRPOSettings, Rollouts, grpo_step
from sampler import generate
from sandbox import SandboxPool
from verifier import model_verifier, verify_batch
from voting import Vote, weighted_vote


def rl_step(step: int, questions: list[dict], learner: "Learner") -> dict:
    """One step of test-time RL on a step's questions; returns the step's metrics row. This process
    samples, verifies and votes on its share of the questions (none, at the end of an episode, when
    processes outnumber them: it still takes part in every collective); the update then runs on
    everyone's rollouts."""
    cfg, accelerator, clock = learner.cfg, learner.accelerator, machinery.metrics.Stopwatch()
    dom = machinery.domains.domain_of(cfg.bench, cfg.answer_rule)
    shard = questions[accelerator.process_index::accelerator.num_processes]
    with clock("sample"):  # 1. y_1..y_N ~ pi_theta(. | q) and their final answers a_i (None: none)
        seeds = [question_seed(cfg.seed, step, rec["id"], "rollout") for rec in shard]
        policy = accelerator.unwrap_model(learner.policy)
        groups = sample_groups(policy, learner.tokenizer, shard, cfg, cfg.n_votes, seeds=seeds,
                               temperature=cfg.temperature, top_p=cfg.top_p, tools=learner.tools)
        answers = read_answers(shard, groups, dom)  # what the policy stated, not a tool's output
    with clock("verify"):  # 2. v_i = 1 when the verifier's program, run in the sandbox, gives a_i
        verdicts = verify_groups(shard, groups, answers, learner.verifier, learner.pool, cfg,
                                 step=step, memory=machinery.verdicts.memory_of(learner, step, dom))
    judged = []
    for rec, ans, ver in zip(shard, answers, verdicts):
        v = [0 if res is None else res.v for res in ver]
        # 3. the weighted vote's winner is the pseudo-label; 4. r_i = 1[a_i in its class]
        vote = weighted_vote(ans, v, omega=cfg.omega, **dom.classes)
        # 5. vote, then sample: M of the N rollouts, chosen at random, go into the update
        draw = random.Random(question_seed(cfg.seed, step, rec["id"], "downsample"))
        judged.append(Judged(vote, v, sorted(draw.sample(range(cfg.n_votes), cfg.n_train))))
    # 6. GRPO on every process's kept rollouts, an optimizer step per Q questions
    kept = gather_kept(shard, groups, judged, accelerator)
    with clock("update"):
        machinery.engine.sleep_engines()  # vLLM on GPUs frees its memory (the next call wakes it)
        machinery.kv_fast.sleep()  # so does the kv verifier: it reads its weights again after
        update = grpo_step(machinery.fsdp.trained_module(learner.policy), learner.optimizer,
                           learner.scheduler, kept, learner.grpo, accelerator=accelerator,
                           ref_model=learner.ref_model)
        machinery.fsdp.refresh(learner.policy)  # --parallel fsdp: the sampling copy's weights
    machinery.loop.log_rollouts(step, shard, groups, answers, verdicts, judged, learner.run_dir,
                                accelerator)
    monitors = [machinery.metrics.question_monitors(*question, cfg)
                for question in zip(shard, groups, answers, verdicts, judged)]
    return machinery.metrics.step_metrics(step, gather_object(monitors), update,
                                          gather_object([clock]))


@dataclass
class Learner:
    """What a step works with: the policy and its optimiser, the frozen models, the sandbox, the
    run."""
    cfg: Config
    accelerator: Accelerator
    policy: torch.nn.Module          # float32 master weights, prepared by accelerate (DDP); under
    #                                  --parallel fsdp a full copy to sample from (machinery/fsdp.py)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object                # stepped once per optimizer step
    verifier: object                 # [VerifierPrompt] -> [VerifierReply] (None with --no-verify)
    pool: SandboxPool
    run_dir: Path
    grpo: GRPOSettings               # the update's settings, from cfg
    ref_model: torch.nn.Module | None = None  # the starting policy, for the KL term (kl_coef > 0)
    tools: object = None             # --agent: the policy's own tool (machinery.agent.Interpreter)
    verdicts: object = None          # --verdict-memory: machinery.verdicts.VerdictMemory


@dataclass
class Judged:
    """One question after the vote: the vote (its classes, its label), the verdicts v_i, the rewards
    r_i and the M rollouts kept."""
    vote: Vote                       # voting.Vote: classes best first, every rollout's class
    v: list[int]                     # [N] 1 = verified
    keep: list[int]                  # [M] indices of the rollouts that go into the update

    @functools.cached_property
    def rewards(self) -> list[float]:  # [N] 1[a_i in the label's class], from the vote's classes
        return self.vote.rewards()


def policy_prompt(tokenizer, problem: str, instruction: str) -> str:
    """The question as the policy sees it: its chat template when it has one (Qwen-Math's prompt
    otherwise)."""
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


def sample_groups(policy, tokenizer, records, cfg: Config, n: int, *, temperature: float,
                  top_p: float, seeds, progress: str = "rollout", tools=None):
    """n completions per record, in one batched sampler call. seeds: one per record, so that what a
    question gets does not depend on which process or batch it lands in (None: greedy). tools: agent
    rollouts, whose instruction offers the tool. No records (a process without a question this
    step): no completions."""
    if not records:
        return []
    instruction = instruction_of(cfg, agent=tools is not None)
    prompts = [policy_prompt(tokenizer, rec["problem"], instruction) for rec in records]
    return generate(policy, tokenizer, prompts, n=n, max_new_tokens=cfg.max_new_tokens,
                    temperature=temperature, top_p=top_p, seed=seeds if temperature > 0 else None,
                    **machinery.options.sampler_options(cfg), progress=progress, tools=tools)


def instruction_of(cfg: Config, agent: bool) -> str:
    """The policy's system prompt: its domain's, and with the tool the sentence that offers it."""
    tool = machinery.agent.TOOL_INSTRUCTION if agent else ""
    return machinery.domains.domain_of(cfg.bench).instruction + tool


def read_answers(records, groups, dom) -> list[list[str | None]]:
    """a_i of every rollout, [q][N], read from what the policy stated (an agent's code and tool
    output left out: machinery.agent.answer_text)."""
    return [[dom.extract(machinery.agent.answer_text(c), rec["problem"]) for c in group]
            for rec, group in zip(records, groups)]


def verify_groups(records, groups, answers, verifier, pool, cfg: Config, *, step: int,
                  purpose: str = "verify", memory=None):
    """v_i for every rollout of every question, through one batched verifier call and one sandbox
    batch (up to two of each with --lazy-verify, one more of each for repairs). Each program is
    seeded by (run seed, step, question, purpose, rollout), as the rollouts are, so a resumed run
    writes the same programs. Lazy verification skips nothing at omega 1, where no verdict can
    change the label: there the verifier runs for the monitors. memory: the answer classes settled
    in earlier steps keep their verdicts, and every process's verdicts of this step teach it."""
    if not cfg.verify:
        return [[None] * len(group) for group in groups]
    problems = [rec["problem"] for rec, group in zip(records, groups) for _ in group]
    keys = [rec["id"] for rec, group in zip(records, groups) for _ in group]  # texts may repeat
    seeds = [question_seed(cfg.seed, step, rec["id"], f"{purpose}|{i}")
             for rec, group in zip(records, groups) for i in range(len(group))]
    texts = [c.text for group in groups for c in group]
    flat = [a for group in answers for a in group]
    lazy = cfg.lazy_verify and cfg.omega > 1
    domain = machinery.domains.domain_of(cfg.bench, cfg.answer_rule)
    results = verify_batch(problems, texts, flat, verifier, domain, pool, groups=keys, seeds=seeds,
                           budget=cfg.verify_budget, omega=cfg.omega if lazy else None,
                           programs=cfg.verifier_programs, repair=cfg.verifier_repair,
                           memory=memory)
    if memory is not None:
        memory.learn(gather_object(memory.lessons(step, keys, flat, results)))
    results = iter(results)
    return [[next(results) for _ in group] for group in groups]


def gather_kept(shard, groups, judged, accelerator) -> Rollouts:
    """Every process's kept rollouts, in the step's question order: the update, its mini-batches and
    hence the weights do not depend on how the questions were split over processes."""
    rank, processes = accelerator.process_index, accelerator.num_processes
    positions = range(rank, rank + len(shard) * processes, processes)
    mine = [(position, [(group[i].prompt_ids, group[i].token_ids, question.rewards[i],
                         group[i].token_logprobs, group[i].tool_mask) for i in question.keep])
            for position, group, question in zip(positions, groups, judged)]
    in_order = sorted(gather_object(mine), key=lambda question: question[0])
    rollouts = [r for _, kept in in_order for r in kept]
    prompts, completions, rewards, sampled, tool_masks = (list(column) for column in zip(*rollouts))
    # the sampler's token log-probs (the engine reports them) for the update's mismatch statistics;
    # the tool's tokens of agent rollouts, which the update leaves out
    sampled = sampled if all(lp is not None for lp in sampled) else None
    return Rollouts(prompts, completions, rewards, sampled,
                    tool_masks if any(m is not None for m in tool_masks) else None)


# ------------------------------------------------------------------------------------------------
# Evaluation (ground truth is used here, and only here and in the monitors of machinery/metrics.py)

def evaluate(policy, tokenizer, records, cfg: Config, accelerator, verifier, pool,
             tools=None) -> list[dict]:
    """Every question's row (all processes'), for machinery.metrics.eval_metrics: greedy@1
    (greedy decoding) and, with k = eval_samples, the k results of sampled runs at the evaluation's
    own temperature and top-p, run j seeded as a single run with seed + j (so avg@k, the papers'
    Pass@1, is the mean of k single runs); maj@k and, when verifying at omega > 1,
    verified_maj@k (T3RL's vote used at inference on the same k samples); and whether rollouts
    state no answer. An agent policy (tools) is evaluated with its tool."""
    shard = records[accelerator.process_index::accelerator.num_processes]
    unwrapped, k = accelerator.unwrap_model(policy), cfg.eval_samples
    dom = machinery.domains.domain_of(cfg.bench, cfg.answer_rule)
    greedy = sample_groups(unwrapped, tokenizer, shard, cfg, 1, temperature=0.0, top_p=1.0,
                           seeds=None, progress="greedy", tools=tools)
    runs = [rec for _ in range(k) for rec in shard]  # run-major: run j is the shard's j-th block
    seeds = [question_seed(cfg.seed + j, -1, rec["id"], "eval") for j in range(k) for rec in shard]
    flat = sample_groups(unwrapped, tokenizer, runs, cfg, 1, temperature=cfg.eval_temperature,
                         top_p=cfg.eval_top_p, seeds=seeds, progress="eval", tools=tools)
    sampled = [[flat[j * len(shard) + i][0] for j in range(k)] for i in range(len(shard))]  # [q][k]
    answers = read_answers(shard, sampled, dom)
    verifies = verifier and machinery.evals.verifies(cfg)  # at omega 1 it is the majority vote
    verdicts = (verify_groups(shard, sampled, answers, verifier, pool, cfg, step=-1, purpose="eval")
                if verifies else [None] * len(shard))
    greedy_answers = read_answers(shard, greedy, dom)
    row = machinery.metrics.eval_row
    return gather_object([row(rec, g[0], a, [r.v for r in v] if v else None, dom, cfg.omega)
                          for rec, g, a, v in zip(shard, greedy_answers, answers, verdicts)])


def log_evaluation(learner: Learner, records: list[dict], step: int, log, final: bool = False,
                   coverage: dict | None = None):
    """Evaluate the policy on records, log the row (the final one with each accuracy's best over
    the run), its questions' rows (evaluations.jsonl), and print it. The evaluation before training
    comes from machinery/evals.py's cache when an earlier run made the same one."""
    cfg, accelerator, evals = learner.cfg, learner.accelerator, machinery.evals
    rows, slot = evals.load_cached(cfg, records, accelerator) if step == 0 else (None, None)
    if rows is None:
        rows = evaluate(learner.policy, learner.tokenizer, records, cfg, accelerator,
                        learner.verifier, learner.pool, learner.tools)
        evals.store(cfg, rows, slot)
    evals.log_questions(learner.run_dir, step, rows, accelerator)
    result = machinery.metrics.eval_metrics(rows, cfg.eval_samples)
    row = {"kind": "eval", "step": step, **(coverage or {}), **result}
    if final:  # each run's peak beside its end, as the papers' robustness figures use
        row["final"] = True
        if learner.accelerator.is_main_process:
            earlier = machinery.files.read_jsonl_rows(learner.run_dir / "metrics.jsonl")
            row.update(machinery.metrics.best_evals(earlier + [row]))
    log(row)
    learner.accelerator.print(f"eval at step {step}: {machinery.metrics.format_eval(result)}")


# ------------------------------------------------------------------------------------------------
# The loop

def train(cfg: Config) -> Path:
    """The run: set up (machinery), evaluate before, rl_step over every step's questions with
    evaluations and checkpoints between, evaluate after, print the summary."""
    clock, started = machinery.metrics.Stopwatch(), time.time()  # where this sitting's time goes
    accelerator = machinery.loop.make_accelerator(cfg)
    set_seed(cfg.seed)
    machinery.engine.configure(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization)
    records = machinery.benchmarks.run_questions(cfg)[:cfg.limit or None]  # bad input ends here
    batches = question_batches(records, cfg)
    # test-time RL is scored on the questions it trains on (--eval-on)
    questions, coverage = machinery.evals.eval_questions(records, batches, cfg)
    with clock("load"):
        learner, start = setup(cfg, accelerator, records, batches)
    run_dir, log = learner.run_dir, machinery.loop.metrics_logger(learner.run_dir, accelerator)
    evaluation = lambda step, final=False: log_evaluation(  # noqa: E731
        learner, questions, step, log, final=final, coverage=coverage)
    with SandboxPool(timeout=cfg.sandbox_timeout) as learner.pool, \
            machinery.runs.tracking(accelerator, cfg, run_dir, start):
        if cfg.agent:
            learner.tools = machinery.agent.Interpreter(learner.tokenizer, learner.pool,
                                                        cfg.agent_max_calls)
        if accelerator.is_main_process:
            workers = f"{learner.pool.workers} worker{'s' if learner.pool.workers > 1 else ''}"
            print(f"[t3rl] sandbox, {workers} per process:\n{learner.pool.report}", file=sys.stderr)
        if start == 0:
            with clock("evaluation"):
                evaluation(0, final=cfg.eval_only)
            if cfg.eval_only:
                return run_dir
        steps = range(start, len(batches))
        for step in tqdm(steps, desc="steps", initial=start, total=len(batches),
                         disable=not accelerator.is_main_process):
            row = rl_step(step, batches[step], learner)
            log(row)
            accelerator.print(machinery.metrics.format_step(row, len(batches)))
            for phase in ("sample", "verify", "update"):
                clock[phase] = clock.get(phase, 0.0) + row[f"seconds/{phase}"]
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < len(batches):
                with clock("evaluation"):
                    evaluation(done)
            if done % cfg.save_every == 0 or done == len(batches):
                machinery.runs.save_checkpoint(run_dir, done, learner.policy, learner.tokenizer,
                                               learner.optimizer, learner.scheduler, accelerator)
        machinery.runs.drop_optimizer_state(learner.optimizer)  # the last checkpoint holds it
        with clock("evaluation"):
            evaluation(len(batches), final=True)
    if accelerator.is_main_process:
        machinery.runs.finish_run(run_dir)
        print(machinery.metrics.summary(run_dir))
        print(machinery.metrics.time_line(clock | {"wall": time.time() - started}))
        machinery.metrics.plot_run(run_dir)
    return run_dir


def setup(cfg: Config, accelerator, records, batches) -> tuple[Learner, int]:
    """The run folder, the models (from the last checkpoint on --resume), the optimizer and the
    engines; returns the Learner (its pool and tools set by train) and the first step to run."""
    machinery.loop.check_models_reachable(cfg)
    runs = machinery.runs
    run_dir = runs.open_run_dir(cfg) if accelerator.is_main_process else runs.run_dir_of(cfg)
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():  # the main process sets a damaged checkpoint aside first
        checkpoint, state = runs.load_checkpoint(run_dir) if cfg.resume else (None, None)
    # float32 master weights whatever the source's dtype (an offline model's cache is bfloat16): an
    # AdamW step of 5e-7 rounds away in bfloat16; sampling casts to its own dtype
    source = str(checkpoint / "model") if checkpoint else cfg.model
    policy, tokenizer = machinery.model.load_model(source, dtype=torch.float32)
    instruction = instruction_of(cfg, cfg.agent)
    prompts = [(rec["id"], policy_prompt(tokenizer, rec["problem"], instruction))
               for rec in records]
    machinery.loop.check_prompts_fit(prompts, tokenizer, policy, cfg)
    machinery.loop.check_gpu_memory(cfg, policy, accelerator)
    # an engine serving the verifier holds its weights: the verifier's own copy stays in CPU memory
    served = verifier_backend(cfg) == "vllm"
    verifier = (build_verifier(cfg, torch.device("cpu") if served else accelerator.device)
                if machinery.loop.needs_verifier(cfg) else None)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = machinery.model.load_model(cfg.model)[0].requires_grad_(False)
        ref_model.to(accelerator.device)
    policy.train()
    trained = policy
    if cfg.parallel == "fsdp":  # the update trains the shards, the samplers read a full copy
        trained, policy, ref_model = machinery.fsdp.shard_models(policy, ref_model, cfg,
                                                                 accelerator.device)
    optimizer, scheduler = machinery.optim.make_optimization(trained, batches, cfg)
    start = runs.restore_state(state, optimizer, scheduler, trained) if state else 0
    if cfg.parallel == "ddp":  # the scheduler stays unprepared: accelerate would step it per process
        policy, optimizer = accelerator.prepare(policy, optimizer)
    if cfg.backend == "vllm":  # now, on every process, as build_verifier started the verifier's
        machinery.engine.engine_for(accelerator.unwrap_model(policy), tokenizer,
                                    machinery.options.sample_dtype(cfg), sleeps=True)
    machinery.loop.announce(run_dir, records, batches, accelerator, start, cfg)
    learner = Learner(cfg=cfg, accelerator=accelerator, policy=policy, tokenizer=tokenizer,
                      optimizer=optimizer, scheduler=scheduler, verifier=verifier, pool=None,
                      run_dir=run_dir, ref_model=ref_model,
                      grpo=machinery.optim.grpo_settings(cfg, accelerator.device))
    return learner, start


def question_batches(records: list[dict], cfg: Config) -> list[list[dict]]:
    """Every step's questions: each episode is one pass over the benchmark in a fresh seeded order,
    without its last partial step under --drop-last (verl's dataloader: 30 questions at 8 a step are
    3 steps)."""
    per_step = cfg.questions_per_step
    if cfg.drop_last and len(records) < per_step:
        raise OptionError(f"--questions-per-step {per_step} with --drop-last: the benchmark has "
                          f"{len(records)} questions, so no step is left; lower "
                          f"--questions-per-step or pass --no-drop-last")
    batches = []
    for episode in range(cfg.episodes):
        order = list(records)
        random.Random(cfg.seed * 1000 + episode).shuffle(order)
        end = len(order) - len(order) % per_step if cfg.drop_last else len(order)
        batches += [order[i:i + per_step] for i in range(0, end, per_step)]
    return batches[:cfg.max_steps] if cfg.max_steps else batches


def build_verifier(cfg: Config, device, loaded=None):
    """The verifier callable (prompts -> completions). 'self' is a frozen copy of the policy's
    starting weights, loaded from --model (not from a checkpoint), kept in the sampling dtype since
    it never trains. loaded: the verifier's (model, tokenizer) when already in memory (--study)."""
    if not cfg.verify:
        return None
    spec = cfg.model if cfg.verifier_model == "self" else cfg.verifier_model
    dtype = machinery.options.sample_dtype(cfg)
    vmodel, vtok = loaded or machinery.model.load_model(spec, dtype=dtype)
    vmodel.requires_grad_(False).to(device)
    folder = getattr(vmodel, "name_or_path", "")  # a checkpoint folder (a Hub snapshot's included)
    if (verifier_backend(cfg) == "kv" and loaded is None and folder
            and machinery.kv_fast.unsupported_reason(vmodel) is None):  # its only reader
        machinery.kv_fast.sampling_only(vmodel, folder)
    if verifier_backend(cfg) == "vllm":  # its engine starts now, on every process
        machinery.engine.engine_for(vmodel, vtok)
    return model_verifier(vmodel, vtok, max_new_tokens=cfg.verifier_max_new_tokens,
                          temperature=cfg.verifier_temperature, top_p=cfg.verifier_top_p,
                          seed=cfg.seed, backend=verifier_backend(cfg))


def main(argv=None):
    """One parser, one dispatch on the mode. A user's mistake, a damaged file, Ctrl-C or SIGTERM
    ends in one line."""
    command = None
    stops = (OptionError, machinery.files.DataError, machinery.model.ModelLoadError,
             machinery.runs.RunDirError)
    try:
        with machinery.loop.sigterm_as_ctrl_c():
            command = machinery.options.parse_command(argv)
            if command.mode == "replay":
                print(machinery.study.replay(command.replay_dir, command.omegas))
            elif command.mode == "study":
                machinery.study.run_study(command.cfg)
            else:  # train, and eval: train stops after the baseline evaluation
                train(command.cfg)
    except stops as err:
        raise SystemExit(f"error: {err}") from None
    except KeyboardInterrupt:
        if command is None or command.cfg is None:
            raise SystemExit("interrupted") from None
        run_dir = machinery.runs.run_dir_of(command.cfg)
        raise SystemExit(f"interrupted: {run_dir} holds every step up to its last checkpoint; "
                         f"continue with: python t3rl.py --resume {run_dir}") from None


if __name__ == "__main__":
    main()
