"""The sampling backends side by side, hf, kv, kv-fast and vllm, for both roles of a step, in one run:

  policy    n rollouts of each of a few demo questions (the offline 0.5B policy, its chat prompt)
  verifier  the verifier prompts of the sampler bench (the offline 1.5B verifier, problems x rollouts)

Every backend samples the same prompts to the same length (ignore_eos), seeded; reported: start-up seconds
(the first call: the engine's start and first weight load, the kv sampler's weight packing), then the timed
call's seconds, seconds per prompt and generated tokens per second.

    python -m bench.engine [--backends hf kv kv-fast vllm] [--roles policy verifier] [--max-new-tokens 256]
"""
import argparse
import json
import os
import time

import torch

import importlib.util

import t3rl
from bench.sampler import verifier_bench_prompts
from extensions import engine
from machinery.model import load_model
from sampler import Sampling
from verifier import MATH

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def role_inputs(role: str, questions: int, n: int):
    """(model, tokenizer, token-id prompts, samples per prompt, frozen) of one role."""
    if role == "policy":
        model, tokenizer = load_model("embedded")  # float32 master weights, as the loop holds them
        with open(os.path.join(REPO, "data", "demo.jsonl")) as fh:
            records = [json.loads(line) for line in fh][:questions]
        prompts = [tokenizer(t3rl.policy_prompt(tokenizer, r["problem"], MATH.instruction),
                             add_special_tokens=False).input_ids for r in records]
        return model, tokenizer, prompts, n, False
    model, tokenizer = load_model("coder-1.5b")  # bfloat16, as the loop loads the verifier
    return model, tokenizer, verifier_bench_prompts(tokenizer, questions, n), 1, True


def bench_backend(backend, model, tokenizer, prompts, n, frozen, max_new_tokens) -> dict:
    """One warm-up call (start-up: the engine's start, the weights' first load), then the timed one;
    each backend's generate, as t3rl.setup enters it."""
    generate = t3rl.speed_path(backend)[0]
    dtype = None if backend == "hf" else torch.bfloat16
    if backend == "vllm":  # started as a run starts it: the policy's engine sleeps, the verifier's not
        engine.start(model, tokenizer, dtype, frozen=frozen)
    started = time.perf_counter()
    generate(model, tokenizer, prompts[:1], 1, Sampling(1, 0.6, 0.95, dtype, True), seed=[0])
    startup = time.perf_counter() - started
    if not frozen:  # the policy's weights change between calls: a write makes the engine load them again
        with torch.no_grad():
            next(model.parameters()).add_(0.0)
    started = time.perf_counter()
    groups = generate(model, tokenizer, prompts, n, Sampling(max_new_tokens, 0.6, 0.95, dtype, True),
                      seed=list(range(len(prompts))))
    seconds = time.perf_counter() - started
    tokens = sum(c.num_tokens for group in groups for c in group)
    return dict(startup=startup, seconds=seconds, per_prompt=seconds / len(prompts) / n, tokens_per_s=tokens / seconds,
                tokens=tokens)


def main():
    parser = argparse.ArgumentParser(description="hf, kv, kv-fast and vllm side by side on the policy's and the "
                                                 "verifier's prompts")
    parser.add_argument("--backends", nargs="+", default=["hf", "kv", "kv-fast", "vllm"])
    parser.add_argument("--roles", nargs="+", default=["policy", "verifier"])
    parser.add_argument("--questions", type=int, default=4, help="demo questions (policy) / problems (verifier)")
    parser.add_argument("--n", type=int, default=8, help="rollouts per question (policy) / per problem (verifier)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    backends = [b for b in args.backends if b != "vllm" or importlib.util.find_spec("vllm")]
    print(f"{torch.get_num_threads()} threads; backends {', '.join(backends)}; {args.questions} x {args.n} rows of "
          f"{args.max_new_tokens} tokens per role; bfloat16 for kv, kv-fast and vllm, the model's dtype for hf")
    print(f"{'role':<9} {'backend':<8} {'start s':>8} {'total s':>8} {'s/rollout':>9} {'tokens/s':>9}")
    for role in args.roles:
        model, tokenizer, prompts, n, frozen = role_inputs(role, args.questions, args.n)
        for backend in backends:
            r = bench_backend(backend, model, tokenizer, prompts, n, frozen, args.max_new_tokens)
            print(f"{role:<9} {backend:<8} {r['startup']:>8.1f} {r['seconds']:>8.1f} {r['per_prompt']:>9.2f} "
                  f"{r['tokens_per_s']:>9.1f}", flush=True)
        del model


if __name__ == "__main__":
    main()
