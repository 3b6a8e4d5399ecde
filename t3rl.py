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

rl_step is that step; train() loops it over the benchmark. What is not the method lives beside it: the
options (config.py), the run folder and checkpoints (runs.py), the monitors and reports (metrics.py), the
benchmarks (benchmarks.py), the answer domains (domains.py), the evidence study and --replay (study.py),
the TTRL-Agent baseline, whose policy calls the interpreter itself (agent.py, --agent).

Run it:
    python t3rl.py                                  # CPU, offline: embedded 0.5B model, demo benchmark
    accelerate launch t3rl.py --bench math500       # the paper's setting on GPUs
    python t3rl.py --bench knk                      # Knights and Knaves puzzles, the verifier writes SMT-LIB2 for z3
    torchrun --nproc_per_node 2 t3rl.py             # several processes on CPUs (gloo)
    python t3rl.py --agent --omega 1 --no-verify    # TTRL-Agent: the policy's rollouts call Python themselves
"""
import functools
import hashlib
import os
import random
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, broadcast_object_list, gather_object, set_seed
from tqdm import tqdm

from agent import TOOL_INSTRUCTION, Interpreter, answer_text
from benchmarks import load_bench
from config import Config, OptionError, has_gpu, parse_command, sample_dtype, sampler_options, verifier_backend
from domains import MATH_INSTRUCTION, domain_of
from engine import check_memory, configure as configure_engines, engine_for, sleep_engines
from files import DataError, append_jsonl, read_jsonl_rows
from grpo import GRPOSettings, Rollouts, bf16_supported, cosine_schedule, grpo_step, make_optimizer
from metrics import (Stopwatch, best_evals, eval_metrics, eval_row, format_eval, format_step, plot_run,
                     question_monitors, step_metrics, summary)
from model import ModelLoadError, check_hub, load_model
from runs import (PROCESS_GROUP_TIMEOUT, RunDirError, drop_rows_after, load_checkpoint,
                  open_run_dir, precision_notes, restore_state, run_banner, run_dir_of,
                  save_checkpoint, tracker_names, tracker_row, tracking)
from sampler import generate
from sandbox import SandboxPool
from study import collect, open_study, replay, report, stratified
from verifier import model_verifier, verify_batch
from voting import Vote, weighted_vote


def rl_step(step: int, questions: list[dict], learner: "Learner") -> dict:
    """One step of test-time RL on a step's questions; returns the step's metrics row. This process samples,
    verifies and votes on its share of the questions (none, at the end of an episode, when processes
    outnumber them: it still takes part in every collective); the update then runs on everyone's rollouts."""
    cfg, accelerator, clock = learner.cfg, learner.accelerator, Stopwatch()
    dom = domain_of(cfg.bench, cfg.answer_rule)
    shard = questions[accelerator.process_index::accelerator.num_processes]
    with clock("sample"):  # 1. y_1..y_N ~ pi_theta(. | q) and their final answers a_i (None: states none)
        seeds = [question_seed(cfg.seed, step, rec["id"], "rollout") for rec in shard]
        groups = sample_groups(accelerator.unwrap_model(learner.policy), learner.tokenizer, shard, cfg, cfg.n_votes,
                               temperature=cfg.temperature, top_p=cfg.top_p, seeds=seeds, tools=learner.tools)  # [q][N]
        answers = read_answers(shard, groups, dom)  # from the policy's own tokens, not a tool's output
    with clock("verify"):  # 2. v_i = 1 when the verifier's program, run in the sandbox, reproduces a_i
        verdicts = verify_groups(shard, groups, answers, learner.verifier, learner.pool, cfg, step=step)
    votes = []
    for rec, ans, ver in zip(shard, answers, verdicts):
        v = [0 if res is None else res.v for res in ver]
        # 3. the weighted vote's winner is the pseudo-label; 4. r_i = 1[a_i in its class], no ground truth here
        vote = weighted_vote(ans, v, omega=cfg.omega, **dom.classes)
        # 5. vote, then sample: M of the N rollouts, chosen at random, go into the update
        keep = random.Random(question_seed(cfg.seed, step, rec["id"], "downsample")).sample(range(cfg.n_votes), cfg.n_train)
        votes.append(Judged(vote, v, sorted(keep)))
    # 6. GRPO on every process's kept rollouts, an optimizer step per Q questions
    kept = gather_kept(shard, groups, votes, accelerator)
    with clock("update"):
        sleep_engines()  # vLLM engines on GPUs free their memory for the update (the next call wakes them)
        update = grpo_step(learner.policy, learner.optimizer, learner.scheduler, kept, learner.grpo,
                           accelerator=accelerator, ref_model=learner.ref_model)
    log_rollouts(step, shard, groups, answers, verdicts, votes, learner)
    monitors = [question_monitors(*question, cfg) for question in zip(shard, groups, answers, verdicts, votes)]
    return step_metrics(step, gather_object(monitors), update, gather_object([clock]))


@dataclass
class Learner:
    """What a step works with: the policy and its optimiser, the frozen models, the sandbox, the run."""
    cfg: Config
    accelerator: Accelerator
    policy: torch.nn.Module              # float32 master weights, prepared by accelerate (DDP over processes)
    tokenizer: object
    optimizer: torch.optim.Optimizer
    scheduler: object                    # stepped once per optimizer step
    verifier: object                     # [VerifierPrompt] -> [VerifierReply] (None with --no-verify)
    pool: SandboxPool
    run_dir: Path
    grpo: GRPOSettings                   # the update's settings, from cfg
    ref_model: torch.nn.Module | None = None   # the starting policy, for the KL term (kl_coef > 0)
    tools: Interpreter | None = None           # --agent: the policy's own Python tool (agent.py)


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


def policy_prompt(tokenizer, problem: str, instruction: str = MATH_INSTRUCTION) -> str:
    """The question as the policy sees it: its chat template when it has one (Qwen-Math's prompt otherwise)."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": instruction}, {"role": "user", "content": problem}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {problem}\n{instruction}\nAnswer:"


def question_seed(seed: int, step: int, qid: str, purpose: str) -> int:
    """A seed per (run seed, step, question, purpose), whichever process or batch the question lands in."""
    return int.from_bytes(hashlib.blake2b(f"{seed}|{step}|{qid}|{purpose}".encode(), digest_size=7).digest(), "big")


def sample_groups(policy, tokenizer, records, cfg: Config, n: int, *, temperature: float, top_p: float, seeds,
                  progress: str = "rollout", tools: Interpreter | None = None):
    """n completions per record, in one batched sampler call. seeds: one per record, so that what a question
    gets does not depend on which process or batch it lands in (None: greedy). tools: agent rollouts, whose
    instruction offers the tool. No records (a process without a question this step): no completions."""
    if not records:
        return []
    prompts = [policy_prompt(tokenizer, rec["problem"], instruction_of(cfg, agent=tools is not None))
               for rec in records]
    return generate(policy, tokenizer, prompts, n=n, max_new_tokens=cfg.max_new_tokens, temperature=temperature,
                    top_p=top_p, seed=seeds if temperature > 0 else None, **sampler_options(cfg), progress=progress,
                    tools=tools)


def instruction_of(cfg: Config, agent: bool) -> str:
    """The policy's system prompt: its domain's, and with the tool the sentence that offers it."""
    return domain_of(cfg.bench).instruction + (TOOL_INSTRUCTION if agent else "")


def read_answers(records, groups, dom) -> list[list[str | None]]:
    """a_i of every rollout, [q][N], read from what the policy stated (an agent's code and tool output left
    out: agent.answer_text)."""
    return [[dom.extract(answer_text(c), rec["problem"]) for c in group] for rec, group in zip(records, groups)]


def verify_groups(records, groups, answers, verifier, pool, cfg: Config, *, step: int, purpose: str = "verify"):
    """v_i for every rollout of every question, through one batched verifier call and one sandbox batch (up to
    two of each with --lazy-verify). Each program is seeded by (run seed, step, question, purpose, rollout),
    as the rollouts are, so a resumed run writes the same programs. Lazy verification skips nothing at
    omega 1, where no verdict can change the label: there the verifier runs for the monitors."""
    if not cfg.verify:
        return [[None] * len(group) for group in groups]
    problems = [rec["problem"] for rec, group in zip(records, groups) for _ in group]
    keys = [q for q, group in enumerate(groups) for _ in group]  # two questions may share a text
    seeds = [question_seed(cfg.seed, step, rec["id"], f"{purpose}|{i}")
             for rec, group in zip(records, groups) for i in range(len(group))]
    texts = [c.text for group in groups for c in group]
    flat = [a for group in answers for a in group]
    lazy = cfg.lazy_verify and cfg.omega > 1
    results = verify_batch(problems, texts, flat, verifier, domain_of(cfg.bench, cfg.answer_rule), pool,
                           budget=cfg.verify_budget, omega=cfg.omega if lazy else None, groups=keys,
                           seeds=seeds)
    it = iter(results)
    return [[next(it) for _ in group] for group in groups]


def gather_kept(shard, groups, votes, accelerator) -> Rollouts:
    """Every process's kept rollouts, in the step's question order: the update, its mini-batches and hence the
    weights do not depend on how the questions were split over processes."""
    rank, processes = accelerator.process_index, accelerator.num_processes
    positions = range(rank, rank + len(shard) * processes, processes)
    mine = [(position, [(group[i].prompt_ids, group[i].token_ids, vote.rewards[i], group[i].token_logprobs,
                         group[i].tool_mask) for i in vote.keep])
            for position, group, vote in zip(positions, groups, votes)]
    rollouts = [r for _, kept in sorted(gather_object(mine), key=lambda question: question[0]) for r in kept]
    prompts, completions, rewards, sampled, tool_masks = (list(column) for column in zip(*rollouts))
    # the sampler's token log-probs (the engine reports them) for the update's mismatch statistics; the tool's
    # tokens of agent rollouts, which the update leaves out
    return Rollouts(prompts, completions, rewards, sampled if all(lp is not None for lp in sampled) else None,
                    tool_masks if any(m is not None for m in tool_masks) else None)


def log_rollouts(step, shard, groups, answers, verdicts, votes, learner: Learner):
    """Append every rollout of the step (text, answer, verdict, reward, kept) to rollouts.jsonl."""
    rows = []
    for rec, group, ans, ver, vote in zip(shard, groups, answers, verdicts, votes):
        for i, (c, res) in enumerate(zip(group, ver)):  # res is None with --no-verify
            rows.append({"step": step, "id": rec["id"], "index": i, "text": c.text, "answer": ans[i], "v": vote.v[i],
                         "result": res and res.result, "status": res and res.status,
                         "inherited": res and res.inferred,
                         "reward": vote.rewards[i], "label": vote.label, "kept": i in vote.keep,
                         "program": res and res.code, **tool_calls_row(c)})
    rows = gather_object(rows)
    if learner.accelerator.is_main_process:
        append_jsonl(learner.run_dir / "rollouts.jsonl", rows)


def tool_calls_row(completion) -> dict:
    """An agent rollout's calls for rollouts.jsonl (nothing for a rollout sampled without the tool)."""
    if completion.tool_calls is None:
        return {}
    return {"tool_calls": [{"code": call.code, "status": call.status, "output": call.output}
                           for call in completion.tool_calls]}


# ----------------------------------------------------------------------------------------------------------------
# Evaluation (ground truth is used here, and only here and in the monitors of metrics.py)

def evaluate(policy, tokenizer, records, cfg: Config, accelerator, verifier, pool, tools=None) -> dict:
    """greedy@1 (greedy decoding) and, with k = eval_samples, the papers' Pass@1: avg@k, the mean accuracy of k
    sampled runs at the evaluation's own temperature and top-p, run j seeded as a single run with seed + j
    (so avg@k is the mean of k single runs), with avg@k_std, the std of the k runs' accuracies; maj@k and,
    when verifying, verified_maj@k (T3RL's vote used at inference on the same k samples); and the share of
    rollouts that state no answer (greedy_no_answer, no_answer@k). An agent policy (tools) is evaluated with
    its tool."""
    shard = records[accelerator.process_index::accelerator.num_processes]
    unwrapped, dom, k = accelerator.unwrap_model(policy), domain_of(cfg.bench, cfg.answer_rule), cfg.eval_samples
    greedy = sample_groups(unwrapped, tokenizer, shard, cfg, 1, temperature=0.0, top_p=1.0, seeds=None,
                           progress="greedy", tools=tools)
    runs = [rec for _ in range(k) for rec in shard]  # run-major: run j is the j-th block of len(shard) rows
    seeds = [question_seed(cfg.seed + j, -1, rec["id"], "eval") for j in range(k) for rec in shard]
    flat = sample_groups(unwrapped, tokenizer, runs, cfg, 1, temperature=cfg.eval_temperature, top_p=cfg.eval_top_p,
                         seeds=seeds, progress="eval", tools=tools)
    sampled = [[flat[j * len(shard) + i][0] for j in range(k)] for i in range(len(shard))]  # [q][k]
    answers = read_answers(shard, sampled, dom)
    verdicts = (verify_groups(shard, sampled, answers, verifier, pool, cfg, step=-1, purpose="eval")
                if k and verifier else [None] * len(shard))
    rows = [eval_row(rec, g[0], a, [r.v for r in v] if v else None, dom, cfg.omega)
            for rec, g, a, v in zip(shard, read_answers(shard, greedy, dom), answers, verdicts)]
    return eval_metrics(gather_object(rows), k)


def log_evaluation(learner: Learner, records: list[dict], step: int, log, final: bool = False):
    """Evaluate the policy, log the row (the final one with each accuracy's best over the run) and print it."""
    result = evaluate(learner.policy, learner.tokenizer, records, learner.cfg, learner.accelerator, learner.verifier,
                      learner.pool, learner.tools)
    row = {"kind": "eval", "step": step, **result}
    if final:  # each run's peak beside its end, as the papers' robustness figures use
        row["final"] = True
        if learner.accelerator.is_main_process:
            row.update(best_evals(read_jsonl_rows(learner.run_dir / "metrics.jsonl") + [row]))
    log(row)
    learner.accelerator.print(f"eval at step {step}: {format_eval(result)}")


# ----------------------------------------------------------------------------------------------------------------
# The loop

def train(cfg: Config) -> Path:
    # t3rl sets its own numerics (grpo.py's bf16 autocast, the sampling dtype): the mixed
    # precision an accelerate config may ask for would add an autocast and a GradScaler. The
    # process group waits out a checkpoint save (runs.PROCESS_GROUP_TIMEOUT).
    timeout = InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT)
    accelerator = Accelerator(cpu=not has_gpu(), mixed_precision="no", kwargs_handlers=[timeout],
                              log_with=tracker_names(cfg) or None, project_dir=run_dir_of(cfg))
    # each process named the run by its own clock as it parsed its command line: rank 0's holds
    cfg.run_name = broadcast_object_list([cfg.run_name])[0]
    if accelerator.is_main_process:
        asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        for note in precision_notes(cfg, accelerator.device, asked):
            print(f"[t3rl] {note}", file=sys.stderr)
    set_seed(cfg.seed)
    configure_engines(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization)
    records = load_bench(cfg.bench)[:cfg.limit or None]  # bad input ends here, before a run folder exists
    batches = question_batches(records, cfg)
    for spec, option in ((cfg.model, "--model"), (cfg.verifier_model, "--verifier-model"))[:1 + cfg.verify]:
        check_hub(cfg.model if spec == "self" else spec, option)
    run_dir = open_run_dir(cfg) if accelerator.is_main_process else run_dir_of(cfg)
    accelerator.wait_for_everyone()
    with accelerator.main_process_first():  # the main process sets a damaged checkpoint aside before the others look
        checkpoint, state = load_checkpoint(run_dir) if cfg.resume else (None, None)

    # float32 master weights whatever the source's dtype (an offline model's cache is bfloat16): an AdamW
    # step of 5e-7 rounds away in bfloat16; sampling casts to its own dtype
    policy, tokenizer = load_model(str(checkpoint / "model") if checkpoint else cfg.model, dtype=torch.float32)
    check_prompts_fit(records, tokenizer, policy, cfg)
    check_gpu_memory(cfg, policy, accelerator)
    # an engine serving the verifier holds its weights: the verifier's own copy stays in CPU memory
    served = verifier_backend(cfg) == "vllm"
    verifier = build_verifier(cfg, torch.device("cpu") if served else accelerator.device)
    ref_model = load_model(cfg.model)[0].requires_grad_(False).to(accelerator.device) if cfg.kl_coef > 0 else None
    policy.train()
    optimizer, scheduler = make_optimization(policy, batches, cfg)
    start = restore_state(state, optimizer, scheduler) if state else 0
    # the scheduler stays unprepared: accelerate would step it once per process per step
    policy, optimizer = accelerator.prepare(policy, optimizer)
    if cfg.backend == "vllm":  # now, on every process, as build_verifier started the verifier's
        engine_for(accelerator.unwrap_model(policy), tokenizer, sample_dtype(cfg), sleeps=True)

    if accelerator.is_main_process:
        drop_rows_after(run_dir, start)
        print(f"[t3rl] {run_banner(run_dir, records, batches, accelerator, start, resume=cfg.resume)}", file=sys.stderr)

    def log(row):
        if accelerator.is_main_process:
            append_jsonl(run_dir / "metrics.jsonl", [row])
            accelerator.log(tracker_row(row), step=row["step"] + (row["kind"] == "train"))

    with SandboxPool(timeout=cfg.sandbox_timeout) as pool, tracking(accelerator, cfg, run_dir, start):
        learner = Learner(cfg=cfg, accelerator=accelerator, policy=policy, tokenizer=tokenizer, optimizer=optimizer,
                          scheduler=scheduler, verifier=verifier, pool=pool, run_dir=run_dir,
                          grpo=grpo_settings(cfg, accelerator.device), ref_model=ref_model,
                          tools=Interpreter(tokenizer, pool, cfg.agent_max_calls) if cfg.agent else None)
        if accelerator.is_main_process:
            workers = f"{pool.workers} worker{'s' if pool.workers > 1 else ''}"
            print(f"[t3rl] sandbox, {workers} per process:\n{pool.report}", file=sys.stderr)
        if start == 0:
            log_evaluation(learner, records, 0, log, final=cfg.eval_only)
            if cfg.eval_only:
                return run_dir
        for step in tqdm(range(start, len(batches)), desc="steps", initial=start, total=len(batches),
                         disable=not accelerator.is_main_process):
            row = rl_step(step, batches[step], learner)
            log(row)
            accelerator.print(format_step(row, len(batches)))
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < len(batches):
                log_evaluation(learner, records, done, log)
            if done % cfg.save_every == 0 or done == len(batches):
                save_checkpoint(run_dir, done, policy, tokenizer, optimizer, scheduler, accelerator)
        log_evaluation(learner, records, len(batches), log, final=True)
    if accelerator.is_main_process:
        print(summary(run_dir))
        plot_run(run_dir)
    return run_dir


def question_batches(records: list[dict], cfg: Config) -> list[list[dict]]:
    """Every step's questions: each episode is one pass over the benchmark in a fresh seeded order, without
    its last partial step under --drop-last (verl's dataloader: 30 questions at 8 a step are 3 steps)."""
    per_step = cfg.questions_per_step
    if cfg.drop_last and len(records) < per_step:
        raise OptionError(f"--questions-per-step {per_step} with --drop-last: the benchmark has {len(records)} "
                          f"questions, so no step is left; lower --questions-per-step or pass --no-drop-last")
    batches = []
    for episode in range(cfg.episodes):
        order = list(records)
        random.Random(cfg.seed * 1000 + episode).shuffle(order)
        end = len(order) - len(order) % per_step if cfg.drop_last else len(order)
        batches += [order[i:i + per_step] for i in range(0, end, per_step)]
    return batches[:cfg.max_steps] if cfg.max_steps else batches


def check_prompts_fit(records: list[dict], tokenizer, model, cfg: Config):
    """Stop before any sampling when a question's prompt plus --max-new-tokens exceeds the policy's context
    (skipping it silently would change the benchmark)."""
    context = getattr(model.config, "max_position_embeddings", None)
    for rec in records if context else []:
        prompt = policy_prompt(tokenizer, rec["problem"], instruction_of(cfg, cfg.agent))
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > context:
            fix = f"lower --max-new-tokens to {context - n}, or " if n < context else ""
            raise DataError(f"question {rec['id']} of --bench {cfg.bench}: its prompt ({n} tokens) + --max-new-tokens "
                            f"{cfg.max_new_tokens} exceeds the policy's context of {context} tokens; the run stops "
                            f"here: {fix}remove that question from the benchmark file")


def check_gpu_memory(cfg: Config, policy, accelerator):
    """On a GPU with engines, their shares and the trainer's against its memory, before anything
    starts: one line saying them (engine.check_memory), or an OptionError naming what to lower."""
    verifies = cfg.verify and not (cfg.eval_only and not cfg.eval_samples)  # build_verifier's rule
    engines = ["policy"] * (cfg.backend == "vllm")
    engines += ["verifier"] * (verifies and verifier_backend(cfg) == "vllm")
    if not engines or not has_gpu():
        return
    # float32 weights, gradients and AdamW's two moments (16 bytes), and the float32 reference model
    trainer = sum(p.numel() for p in policy.parameters()) * (16 + 4 * (cfg.kl_coef > 0))
    total = torch.cuda.get_device_properties(accelerator.device).total_memory
    line, fits = check_memory(total, trainer, engines)
    if not fits:
        raise OptionError(line)
    accelerator.print(f"[t3rl] {line}")


def build_verifier(cfg: Config, device, loaded=None):
    """The verifier callable (prompts -> completions). 'self' is a frozen copy of the policy's starting weights,
    loaded from --model (not from a checkpoint), kept in the sampling dtype since it never trains.
    loaded: the verifier's (model, tokenizer) when already in memory (--study: its policy never trains)."""
    if not cfg.verify or (cfg.eval_only and not cfg.eval_samples):
        return None
    spec = cfg.model if cfg.verifier_model == "self" else cfg.verifier_model
    vmodel, vtok = loaded or load_model(spec, dtype=sample_dtype(cfg))
    vmodel.requires_grad_(False).to(device)
    if verifier_backend(cfg) == "vllm":  # its engine starts now, on every process (engine.py)
        engine_for(vmodel, vtok)
    return model_verifier(vmodel, vtok, max_new_tokens=cfg.verifier_max_new_tokens,
                          temperature=cfg.verifier_temperature, top_p=cfg.verifier_top_p, seed=cfg.seed,
                          backend=verifier_backend(cfg))


def make_optimization(policy, batches: list[list[dict]], cfg: Config):
    """AdamW on the policy and its cosine schedule over the run's training steps (verl) or optimizer steps."""
    optimizer = make_optimizer(policy, lr=cfg.lr, weight_decay=cfg.weight_decay)
    # an optimizer step per mini-batch of questions: ceil(questions / Q) per training step
    total = len(batches) if cfg.lr_schedule_unit == "step" else sum(
        -(-len(b) // (cfg.mini_batch_questions or len(b))) for b in batches)
    scheduler = cosine_schedule(optimizer, total_steps=total, warmup_steps=int(cfg.warmup_ratio * total))
    return optimizer, scheduler


def grpo_settings(cfg: Config, device) -> GRPOSettings:
    """The update's settings from the run's: M rollouts per question, Q questions per optimizer step, the loss."""
    return GRPOSettings(group_size=cfg.n_train, mini_batch_groups=cfg.mini_batch_questions or None,
                        clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_ratio_c=cfg.clip_ratio_c,
                        kl_coef=cfg.kl_coef, agg=cfg.loss_agg, lr_schedule_unit=cfg.lr_schedule_unit,
                        norm_len=cfg.max_new_tokens, scale_advantages=cfg.scale_advantages,
                        temperature=cfg.temperature, token_budget=cfg.micro_batch_tokens,
                        micro_batch_rollouts=cfg.micro_batch_rollouts,
                        bf16=cfg.bf16 and bf16_supported(device), gradient_checkpointing=cfg.grad_checkpointing,
                        is_cap=cfg.vllm_is_cap if cfg.vllm_is_correction else None)


def run_study(cfg: Config) -> Path:
    """--study: k_max = n_votes rollouts per question, sampled and verified once, saved, then study.py's report
    (--agent: and k_max agent rollouts per question on the same seeds, for TTRL-Agent's vote). Each question has
    its own sampling seed, so a resumed study samples what an uninterrupted one would."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each process would sample all of it on GPU 0
        raise OptionError("--study runs in one process (it never trains, nothing is split over "
                          "processes): start it with python t3rl.py, not accelerate launch or "
                          "torchrun")
    run_dir = open_study(cfg)
    records = stratified(load_bench(cfg.bench), cfg.limit, cfg.seed)
    device = torch.device("cuda" if has_gpu() else "cpu")
    policy, tokenizer = load_model(cfg.model, dtype=sample_dtype(cfg))  # it never trains: sampling dtype
    policy.to(device)
    dom = domain_of(cfg.bench, cfg.answer_rule)
    weights = (policy, tokenizer) if cfg.verifier_model == "self" else load_model(cfg.verifier_model,
                                                                                  dtype=sample_dtype(cfg))
    verifier = build_verifier(cfg, device, loaded=weights)
    with SandboxPool(timeout=cfg.sandbox_timeout) as pool:
        tools = Interpreter(tokenizer, pool, cfg.agent_max_calls) if cfg.agent else None

        def sample_and_verify(batch, first: int, n: int):
            # rollouts from `first` on (a grown study) get seeds of their own: new draws, not the first ones again
            grown = f"+{first}" if first else ""
            seeds = [question_seed(cfg.seed, -1, rec["id"], "study" + grown) for rec in batch]
            groups = sample_groups(policy, tokenizer, batch, cfg, n, temperature=cfg.temperature, top_p=cfg.top_p,
                                   seeds=seeds, progress="study")
            answers = read_answers(batch, groups, dom)
            # programs seeded per question and rollout: a resumed study writes what an uninterrupted one would
            verdicts = verify_groups(batch, groups, answers, verifier, pool, cfg, step=-1, purpose="study" + grown)
            if not tools:
                return groups, answers, verdicts, None
            # --agent: the same questions and seeds, the policy with its own interpreter (TTRL-Agent's rollouts)
            agent = sample_groups(policy, tokenizer, batch, cfg, n, temperature=cfg.temperature, top_p=cfg.top_p,
                                  seeds=seeds, progress="study agent", tools=tools)
            return groups, answers, verdicts, list(zip(agent, read_answers(batch, agent, dom)))
        collect(records, run_dir, sample_and_verify, cfg.questions_per_step, cfg.n_votes)
    print(report(run_dir, dom.classes, dom.equiv))
    return run_dir


def main(argv=None):
    """One parser, one dispatch on the mode. A user's mistake, a damaged file, Ctrl-C or SIGTERM ends in one line."""
    command = None
    try:
        with sigterm_as_ctrl_c():
            command = parse_command(argv)
            if command.mode == "replay":
                print(replay(command.replay_dir, command.omegas))
            elif command.mode == "study":
                run_study(command.cfg)
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


@contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (a Slurm time limit or scancel, a launcher stopping the other processes when one fails) raises
    KeyboardInterrupt, so the run ends as after Ctrl-C: the sandbox pool and the trackers close and the resume
    command is printed, instead of the process dying where it stands. Python takes signals in the main thread
    only; elsewhere SIGTERM keeps its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    main()
