"""Benchmark of grpo.py: one GRPO update of the embedded 0.5B model per configuration (bf16
autocast, gradient checkpointing, and a plain transformers forward/backward as the reference), each
in a fresh process so that its peak memory is its own, side by side with the floor 6 x params x
tokens / matmul rate.

    python -m bench.grpo [--configs hf-baseline,bf16+ckpt]
"""
import argparse
import json
import math
import resource
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from config import Config
from grpo import Rollouts, aggregate, group_advantages, grpo_step, make_optimization, pad_batch
from machinery.logprobs import set_checkpointing
from machinery.model import load_model

# name -> (bf16 autocast, gradient checkpointing); "hf-baseline" is the plain reference
BENCH_CONFIGS = {
    "hf-baseline": (True, True),
    "bf16+ckpt": (True, True),
    "bf16": (True, False),
    "fp32+ckpt": (False, True),
    "fp32": (False, False),
}


# one micro-batch, as in the loop's cpu preset (--micro-batch-tokens 4096)
BENCH_TOKEN_BUDGET = 4096


def matmul_flops_per_second(dtype, rows=4096, inner=896, cols=4864, repeats=5) -> float:
    """Best measured rate of a model-shaped matmul ([tokens, hidden] x [hidden, mlp]); the best of
    several runs, since other processes on a shared machine only ever slow one down."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * cols / best


def bench_rollouts(sequences=8, length=512, prompt_len=64, group_size=4, seed=0):
    """Random token rollouts of a fixed length, rewards 1 for half of each group."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 150000, (sequences, length), generator=generator).tolist()
    rewards = [float(i % 2) for i in range(sequences)]
    return [s[:prompt_len] for s in ids], [s[prompt_len:] for s in ids], rewards, group_size


def bench_config(name: str) -> dict:
    """One update of the embedded model in this (fresh) process; peak memory is this process's max
    RSS."""
    model, _ = load_model("embedded")
    prompts, completions, rewards, group_size = bench_rollouts()
    bf16, ckpt = BENCH_CONFIGS[name]
    if name == "hf-baseline":  # full logits, float32 log-softmax, no optimizer step
        model.train()
        set_checkpointing(model, True)
        input_ids, attention_mask, response_mask = pad_batch(prompts, completions)
        advantages = group_advantages(rewards, group_size)
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(
                -1, input_ids[:, 1:, None]).squeeze(-1)
            loss = aggregate(-logp * advantages[:, None], response_mask[:, 1:])
        loss.backward()
        seconds = time.perf_counter() - started
    else:
        cfg = Config(n_train=group_size, mini_batch_questions=0, loss_agg="dapo", temperature=1.0,
                     micro_batch_rollouts=0, micro_batch_tokens=BENCH_TOKEN_BUDGET,
                     grad_checkpointing=ckpt)
        optimizer, scheduler = make_optimization(model, cfg, total_steps=100)
        # allocate the AdamW moments first, so the measured update is a steady-state one
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = grpo_step(model, optimizer, scheduler, Rollouts(prompts, completions, rewards),
                            cfg, bf16=bf16)["seconds"]
    return {"name": name, "seconds": seconds,
            "tokens": sum(len(p) + len(c) for p, c in zip(prompts, completions)),
            "params": sum(p.numel() for p in model.parameters()),
            "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30}


def bench(names):
    """Each configuration in a fresh subprocess (honest peak memory), then a table side by side."""
    rates = {"bf16": matmul_flops_per_second(torch.bfloat16),
             "fp32": matmul_flops_per_second(torch.float32)}
    results = []
    for name in tqdm(names, desc="configurations"):
        run = subprocess.run([sys.executable, "-m", "bench.grpo", "--bench-config", name],
                             capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"--bench-config {name} failed:\n{run.stderr[-2000:]}")
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    params, tokens = results[0]["params"], results[0]["tokens"]
    floors = {kind: 6 * params * tokens / rate for kind, rate in rates.items()}
    baseline = next((r for r in results if r["name"] == "hf-baseline"), None)
    print(f"\none update, embedded model ({params / 1e6:.0f}M parameters), 8 x 512 tokens in "
          f"micro-batches of {BENCH_TOKEN_BUDGET} tokens; matmul rate "
          f"bf16 {rates['bf16'] / 1e9:.0f} GFLOP/s, fp32 {rates['fp32'] / 1e9:.0f} GFLOP/s; "
          f"floor = 6 x params x tokens / rate: bf16 {floors['bf16']:.0f} s, "
          f"fp32 {floors['fp32']:.0f} s")
    print("AdamW moments (8 bytes/param) are included in peak for every row but hf-baseline "
          "(forward+backward only)")
    print(f"{'config':<12} {'seconds':>8} {'tok/s':>7} {'x floor':>8} {'x base':>7} "
          f"{'peak GiB':>8} {'w/o moments':>12}")
    for r in results:
        floor = floors["bf16" if BENCH_CONFIGS[r["name"]][0] else "fp32"]
        moments = 0.0 if r["name"] == "hf-baseline" else 8 * params / 2**30
        versus = f"{r['seconds'] / baseline['seconds']:.2f}" if baseline else "-"
        print(f"{r['name']:<12} {r['seconds']:>8.1f} {r['tokens'] / r['seconds']:>7.1f} "
              f"{r['seconds'] / floor:>8.2f} "
              f"{versus:>7} {r['peak_gb']:>8.1f} {r['peak_gb'] - moments:>12.1f}")


def main():
    parser = argparse.ArgumentParser(description="GRPO update benchmark on the embedded model.")
    parser.add_argument("--configs", default=",".join(BENCH_CONFIGS),
                        help="comma-separated subset of: " + ", ".join(BENCH_CONFIGS))
    parser.add_argument("--bench-config", choices=list(BENCH_CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bench_config:
        print(json.dumps(bench_config(args.bench_config)))
    else:
        unknown = set(args.configs.split(",")) - set(BENCH_CONFIGS)
        if unknown:
            parser.error(f"--configs: unknown {', '.join(sorted(unknown))}; "
                         f"use names from {', '.join(BENCH_CONFIGS)}")
        bench(args.configs.split(","))


if __name__ == "__main__":
    main()
