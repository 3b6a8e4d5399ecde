"""What t3rl.py's loop calls beside the method: the accelerator with t3rl's own numerics, the checks
before the first step (prompts against the context, engines against the GPU), the metrics and
rollout logs, the guard that turns SIGTERM into Ctrl-C, and the study's process check."""
import os
import signal
import sys
import threading
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import (DistributedDataParallelKwargs, InitProcessGroupKwargs,
                               broadcast_object_list, gather_object)

from config import Config, OptionError, verifier_backend
from machinery.engine import check_memory
from machinery.files import DataError, append_jsonl
from machinery import options
from machinery.model import check_hub
from machinery.runs import (PROCESS_GROUP_TIMEOUT, drop_rows_after, precision_notes, run_banner,
                            run_dir_of, tracker_names, tracker_row, verifier_line)


def make_accelerator(cfg: Config) -> Accelerator:
    """accelerate's Accelerator as t3rl runs it, and every process on the main one's run name.

    t3rl sets its own numerics (grpo.py's bf16 autocast, the sampling dtype): the mixed precision an
    accelerate config may ask for would add an autocast and a GradScaler, so it stays off, with a
    line saying so. The process group waits out a checkpoint save (runs.PROCESS_GROUP_TIMEOUT). DDP
    keeps the gradients in its all-reduce buckets (gradient_as_bucket_view): accelerate's default
    holds a second copy of them."""
    timeout = InitProcessGroupKwargs(timeout=PROCESS_GROUP_TIMEOUT)
    buckets = DistributedDataParallelKwargs(gradient_as_bucket_view=True)
    accelerator = Accelerator(cpu=not options.has_gpu(), mixed_precision="no",
                              kwargs_handlers=[timeout, buckets],
                              log_with=tracker_names(cfg) or None, project_dir=run_dir_of(cfg))
    # each process named the run by its own clock as it parsed its command line: rank 0's holds
    cfg.run_name = broadcast_object_list([cfg.run_name])[0]
    if accelerator.is_main_process:
        asked = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        for note in precision_notes(cfg, accelerator.device, asked):
            print(f"[t3rl] {note}", file=sys.stderr)
    return accelerator


def metrics_logger(run_dir, accelerator):
    """log(row): the main process appends the row to metrics.jsonl and hands it to the trackers."""
    def log(row):
        if accelerator.is_main_process:
            append_jsonl(run_dir / "metrics.jsonl", [row])
            accelerator.log(tracker_row(row), step=row["step"] + (row["kind"] == "train"))
    return log


def check_prompts_fit(prompts: list, tokenizer, model, cfg: Config):
    """Stop before any sampling when a question's prompt plus --max-new-tokens exceeds the policy's
    context (skipping it silently would change the benchmark). prompts: (question id, prompt)."""
    context = getattr(model.config, "max_position_embeddings", None)
    for qid, prompt in prompts if context else []:
        n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if n + cfg.max_new_tokens > context:
            fix = f"lower --max-new-tokens to {context - n}, or " if n < context else ""
            raise DataError(f"question {qid} of --bench {cfg.bench}: its prompt ({n} tokens) + "
                            f"--max-new-tokens {cfg.max_new_tokens} exceeds the policy's context "
                            f"of {context} tokens; the run stops here: {fix}remove that question "
                            f"from the benchmark file")


def needs_verifier(cfg: Config) -> bool:
    """Whether the run loads a verifier: it verifies, and it trains or its evaluation samples."""
    return cfg.verify and not (cfg.eval_only and not cfg.eval_samples)


def check_gpu_memory(cfg: Config, policy, accelerator):
    """On a GPU with engines, their shares and the trainer's against its memory, before anything
    starts: one line saying them (engine.check_memory), or an OptionError naming what to lower."""
    engines = ["policy"] * (cfg.backend == "vllm")
    engines += ["verifier"] * (needs_verifier(cfg) and verifier_backend(cfg) == "vllm")
    if not engines or not options.has_gpu():
        return
    # float32 weights, gradients and AdamW's two moments (16 bytes), and the float32 reference model
    parameters = sum(p.numel() for p in policy.parameters())
    trainer = parameters * (16 + 4 * (cfg.kl_coef > 0))
    if cfg.parallel == "fsdp":  # those sharded, beside the kv or hf sampler's full copy (fsdp.py)
        copy_bytes = (cfg.backend != "vllm") * options.sampler_options(cfg).get(
            "dtype", torch.float32).itemsize
        trainer = trainer // accelerator.num_processes + parameters * copy_bytes
    total = torch.cuda.get_device_properties(accelerator.device).total_memory
    line, fits = check_memory(total, trainer, engines)
    if not fits:
        raise OptionError(line)
    accelerator.print(f"[t3rl] {line}")


def log_rollouts(step, shard, groups, answers, verdicts, judged, run_dir, accelerator):
    """Append every rollout of the step (text, answer, verdict, reward, kept) to rollouts.jsonl."""
    rows = []
    for rec, group, ans, ver, question in zip(shard, groups, answers, verdicts, judged):
        for i, (c, res) in enumerate(zip(group, ver)):  # res is None with --no-verify
            rows.append({"step": step, "id": rec["id"], "index": i, "text": c.text,
                         "answer": ans[i], "v": question.v[i], "result": res and res.result,
                         "status": res and res.status, "inherited": res and res.inferred,
                         "reward": question.rewards[i], "label": question.vote.label,
                         "kept": i in question.keep, "program": res and res.code,
                         "repaired_from": res and res.repaired_from,
                         "remembered": res and res.remembered, "programs": res and res.programs,
                         **tool_calls_row(c)})
    rows = gather_object(rows)
    if accelerator.is_main_process:
        append_jsonl(run_dir / "rollouts.jsonl", rows)


def tool_calls_row(completion) -> dict:
    """An agent rollout's calls for rollouts.jsonl (nothing for a rollout sampled without the
    tool)."""
    if completion.tool_calls is None:
        return {}
    return {"tool_calls": [{"code": call.code, "status": call.status, "output": call.output}
                           for call in completion.tool_calls]}


def check_one_process(mode: str):
    """--study never trains and splits nothing over processes: under a launcher every process would
    sample all of it, on GPU 0, into the same folder."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise OptionError(f"{mode} runs in one process (it never trains, nothing is split over "
                          f"processes): start it with python t3rl.py, not accelerate launch or "
                          f"torchrun")


@contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM (a Slurm time limit or scancel, a launcher stopping the other processes when one
    fails) raises KeyboardInterrupt, so the run ends as after Ctrl-C: the sandbox pool and the
    trackers close and the resume command is printed, instead of the process dying where it stands.
    Python takes signals in the main thread only; elsewhere SIGTERM keeps its handler."""
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


def check_models_reachable(cfg: Config):
    """Each model the run loads is cached, local or on a reachable Hub, before a run folder
    exists."""
    specs = ((cfg.model, "--model"), (cfg.verifier_model, "--verifier-model"))[:1 + cfg.verify]
    for spec, option in specs:
        check_hub(cfg.model if spec == "self" else spec, option)


def announce(run_dir, records, batches, accelerator, start: int, cfg: Config):
    """The main process drops the metrics rows after the step it resumes from, and prints the
    banner."""
    if accelerator.is_main_process:
        drop_rows_after(run_dir, start)
        banner = run_banner(run_dir, records, batches, accelerator, start, resume=cfg.resume)
        print(f"[t3rl] {banner}\n[t3rl] {verifier_line(cfg)}", file=sys.stderr)

