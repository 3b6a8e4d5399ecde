"""Benchmarks of the samplers: hf, the plain kv loop (sampler.py) and its fast path
(extensions/kv_fast.py) side by side (tokens per second, milliseconds per decode step, and the
floors the machine allows: bytes per step over the memory bandwidth, FLOP per step over the matmul
rate), and, with --verifier-prompts, kv against kv-fast on one step's verifier prompts (shared
prefixes, packed weights).

    python -m bench.sampler [--n 8 32] [--dtypes float32 bfloat16]
    python -m bench.sampler --verifier-prompts [--max-new-tokens 256]
"""
import argparse
import json
import os
import sys
import time
from copy import deepcopy

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from extensions import kv_fast
from extensions.kv_fast import prefix_plan
from grpo import bf16_supported
from machinery.model import load_model, offline_model
from sampler import Sampling, generate
from verifier import MATH, ToVerify, verifier_prompt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN25_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                   num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                   max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
BENCH_PROMPT = ("<|im_start|>system\nPlease reason step by step, and put your final answer within "
                "\\boxed{}.<|im_end|>\n<|im_start|>user\nLet $f(x) = x^4 - 4x^3 + 6x^2 - 4x + 1$ "
                "and let $g(x) = f(x+1) - f(x)$. A sequence is defined by $a_1 = 2$ and "
                "$a_{n+1} = g(a_n) \\bmod 97$ for $n \\ge 1$. Find the "
                "smallest positive integer $k$ with $a_k = a_1$, and "
                "determine the sum $a_1 + a_2 + \\cdots + a_{10}$ modulo $97$.<|im_end|>\n"
                "<|im_start|>assistant\n")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sample(backend, model, tokenizer, prompts, n, max_new_tokens, dtype=None, temperature=0.6):
    """generate on one backend (kv-fast: extensions/kv_fast.py), seeded, EOS ignored."""
    sampling = Sampling(max_new_tokens, temperature, 0.95, dtype, ignore_eos=True)
    if backend == "kv-fast":
        return kv_fast.generate(model, tokenizer, prompts, n, sampling, seed=0)
    return generate(model, tokenizer, prompts, n, sampling, seed=0, backend=backend)


def bench_model(spec: str, device: str):
    """(float32 model, tokenizer or None): an offline model ('embedded', 'coder-1.5b', ...),
    'qwen2.5-1.5b' (random weights) or a config.json path."""
    if offline_model(spec):
        model, tokenizer = load_model(spec)
        return model.to(device), tokenizer
    config = (Qwen2Config(**QWEN25_1_5B) if spec == "qwen2.5-1.5b"
              else AutoConfig.from_pretrained(spec))
    torch.manual_seed(0)
    # speed does not depend on the weights' values, so random ones will do
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model, None


def measure_bandwidth(device, seconds=1.0) -> float:
    """Bytes per second read by summing a 512 MiB tensor (decoding streams the weights like
    this)."""
    x = torch.ones(128 << 20, device=device)
    return x.numel() * x.element_size() * _rate(lambda: x.sum(), device, seconds)


def measure_matmul(device, dtype, seconds=1.0) -> float:
    """Matmul FLOP per second at a large square shape."""
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    return 2 * 2048**3 * _rate(lambda: a @ a, device, seconds)


def _rate(fn, device, seconds) -> float:
    """Calls per second of fn at its best (the fastest call), so other load on the machine lowers
    it least."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 1 / best


def decode_floor(model, rows, context, dtype, bandwidth, flops_rate):
    """Seconds per decode step the machine allows: (bytes read / bandwidth, FLOP / matmul rate).

    Each step reads every weight matrix once (not the embedding table, only `rows` of it, unless the
    head is tied to it) and the keys and values of `context` columns; it does 2 FLOP per weight per
    row, plus 2 * 2 * heads * head_dim FLOP per row, layer and context column for attention.
    """
    config, head_dim = model.config, head_dim_of(model.config)
    weights = sum(p.numel() for p in model.parameters())
    if not config.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel()
    element = torch.empty((), dtype=dtype).element_size()
    cache = (2 * config.num_hidden_layers * rows * config.num_key_value_heads * context * head_dim
             * element)
    flop = (2 * rows * weights
            + 4 * rows * config.num_hidden_layers * config.num_attention_heads * head_dim * context)
    return (weights * element + cache) / bandwidth, flop / flops_rate


def matmul_seconds(model, rows, dtype, device) -> float:
    """One decode step's matrix products alone (every layer's projections and the head) on `rows`
    rows with the model's weights, at their best: what a step would cost if nothing else took any
    time."""
    w, config = kv_fast.sampling_weights(model, dtype), model.config
    hidden, attention = config.hidden_size, config.num_attention_heads * head_dim_of(config)
    products = [(lin, width) for layer in w.layers
                for lin, width in ((layer.qkv, hidden), (layer.o, attention),
                                   (layer.gate_up, hidden), (layer.down, config.intermediate_size))]
    products += [(w.head, hidden)]
    inputs = {width: torch.randn(rows, width, dtype=dtype, device=device) for _, width in products}
    return 1 / _rate(lambda: [lin(inputs[width]) for lin, width in products], device, 1.0)


def bench(spec, device, ns, max_new_tokens, dtypes):
    device = torch.device(device)
    base, tokenizer = bench_model(spec, device)
    prompt = (tokenizer(BENCH_PROMPT, add_special_tokens=False).input_ids if tokenizer
              else list(range(1000, 1150)))
    bandwidth = measure_bandwidth(device)
    print(f"model {spec} ({sum(p.numel() for p in base.parameters()) / 1e6:.0f}M parameters) on "
          f"{device}, prompt {len(prompt)} tokens, {max_new_tokens} new tokens, EOS ignored, "
          f"temperature 0.6, top_p 0.95; "
          f"memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    runs = []  # (label, backend, model, options)
    for dtype in dtypes:
        model = base if dtype == torch.float32 else deepcopy(base).to(dtype)
        name = str(dtype).removeprefix("torch.")
        runs += [(name, backend, model, {}) for backend in ("hf", "kv", "kv-fast")]
        if dtype == torch.bfloat16:
            runs += [("f32 weights, dtype=bf16", backend, base, {"dtype": dtype})
                     for backend in ("kv", "kv-fast")]
    rates = {dtype: measure_matmul(device, dtype) for dtype in (torch.float32, torch.bfloat16)}
    table = []
    for n in ns:
        for label, backend, model, options in tqdm(runs, desc=f"n={n}", file=sys.stderr):
            sample(backend, model, tokenizer, [prompt], n, 4, **options)  # warm-up
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t0 = time.perf_counter()
            out = sample(backend, model, tokenizer, [prompt], n, max_new_tokens, **options)
            sync()
            seconds = time.perf_counter() - t0
            assert all(c.num_tokens == max_new_tokens for c in out[0])
            dtype = options.get("dtype") or next(model.parameters()).dtype
            by_bytes, by_flop = decode_floor(model, n, len(prompt) + max_new_tokens / 2, dtype,
                                             bandwidth, rates[dtype])
            matmuls = matmul_seconds(model, n, dtype, device)
            table.append((n, label, backend, dtype, n * max_new_tokens / seconds,
                          seconds / max_new_tokens, by_bytes, by_flop, matmuls))
    print(f"\n{'n':>3} {'dtype':<24} {'backend':<16} {'tok/s':>8} {'ms/step':>8} {'x hf':>6} "
          f"{'floor ms (bytes)':>16} {'floor ms (FLOP)':>15} {'x floor':>7} {'matmuls ms':>10}")
    for n, label, backend, dtype, tps, step_s, by_bytes, by_flop, matmuls in table:
        hf = next(t for t in table if t[0] == n and t[2] == "hf" and t[3] == dtype)
        print(f"{n:>3} {label:<24} {backend:<16} {tps:>8.1f} {step_s * 1e3:>8.1f} "
              f"{tps / hf[4]:>6.2f} {by_bytes * 1e3:>16.1f} {by_flop * 1e3:>15.1f} "
              f"{step_s / max(by_bytes, by_flop):>7.2f} {matmuls * 1e3:>10.1f}")
    print(f"matmul rate: float32 {rates[torch.float32] / 1e9:.3g} GFLOP/s, "
          f"bfloat16 {rates[torch.bfloat16] / 1e9:.3g} GFLOP/s; x hf compares with hf in the "
          f"same dtype (bfloat16 for the dtype=bf16 row); x floor = ms/step over the larger floor; "
          f"matmuls = the step's matrix products alone, timed on their own with these weights")


# --------------------------------------------------------------------------- the verifier's prompts

def written_rollout(problem: dict, k: int) -> str:
    """A rollout for the bench: k + 2 reasoning steps, then the right answer (k even) or a wrong
    one."""
    steps = "\n".join(f"Step {i + 1}: take the quantities the problem gives and combine them as it "
                      f"asks; check the units and the arithmetic once more."
                      for i in range(2 + 3 * k))
    answer = problem["answer"] if k % 2 == 0 else problem["answer"] + "1"
    return (f"We read the problem carefully.\n{problem['problem']}\n{steps}\nSo the answer is "
            f"$\\boxed{{{answer}}}$.")


def verifier_bench_prompts(tokenizer, problems: int, rollouts: int) -> list[list[int]]:
    """Token ids of problems x rollouts verifier prompts (demo problems, written rollouts), in the
    verifier's chat template as model_verifier sends them: a step's N rollouts of one question share
    the system prompt and the problem."""
    with open(os.path.join(REPO, "data", "demo.jsonl")) as fh:
        records = [json.loads(line) for line in fh][:problems]
    requests = [verifier_prompt(ToVerify(r["problem"], written_rollout(r, k), None, r["id"], None),
                                MATH) for r in records for k in range(rollouts)]
    chats = [tokenizer.apply_chat_template([{"role": "system", "content": p.system},
                                            {"role": "user", "content": p.user}],
                                           tokenize=False, add_generation_prompt=True)
             for p in requests]
    return [tokenizer(chat, add_special_tokens=False).input_ids for chat in chats]


def prefill_flop(model, tokens: int) -> int:
    """FLOP of the weight matrix products for `tokens` prompt tokens (2 per weight and token; the
    tied or separate head counted for one token per prompt, so left out)."""
    body = sum(p.numel() for name, p in model.named_parameters() if ".layers." in name)
    return 2 * body * tokens


def bench_verifier(spec, device, dtype, max_new_tokens, problems, rollouts):
    """kv against kv-fast on the verifier prompts of one step: prefill alone (max_new_tokens=1),
    then whole verifier generations, seeded, so both give the same tokens."""
    device = torch.device(device)
    model, tokenizer = bench_model(spec, device)
    # random weights: the embedded model's tokenizer (Qwen2.5's vocabulary) writes the prompts
    if tokenizer is None:
        tokenizer = load_model("embedded")[1]
    prompts = verifier_bench_prompts(tokenizer, problems, rollouts)
    plan = prefix_plan([list(p) for p in dict.fromkeys(map(tuple, prompts))])
    total = sum(map(len, prompts))
    own = sum(len(p) - step.shared for p, step in zip(dict.fromkeys(map(tuple, prompts)), plan))
    matmul_rate = measure_matmul(device, dtype)
    print(f"model {spec}, {dtype}, {device}, {torch.get_num_threads()} threads; {len(prompts)} "
          f"verifier prompts, "
          f"{total} tokens (mean {total / len(prompts):.0f}), {own} of them after a shared start; "
          f"matmul rate {matmul_rate / 1e9:.0f} GFLOP/s")
    results = {}
    for backend in ("kv", "kv-fast"):
        sample(backend, model, None, prompts[:1], 1, 1, dtype)  # warm-up
        prefill_s, out = _timed(sample, backend, model, None, prompts, 1, 1, dtype)
        total_s = prefill_s
        if max_new_tokens > 1:
            total_s, out = _timed(sample, backend, model, None, prompts, 1, max_new_tokens, dtype)
        results[backend] = (prefill_s, total_s, [g[0].token_ids for g in out])
    print(f"{max_new_tokens} new tokens per prompt (EOS ignored); same tokens on both: "
          f"{results['kv'][2] == results['kv-fast'][2]}")
    print(f"{'backend':<8} {'':>4} {'prefill s':>9} {'prompt tok/s':>12} {'x matmul rate':>13} "
          f"{'total s':>8} {'s/rollout':>9}")
    for backend, (prefill_s, total_s, _) in results.items():
        ran = total if backend == "kv" else own
        for clock, i in (("wall", 0), ("cpu", 1)):
            print(f"{backend:<8} {clock:>4} {prefill_s[i]:>9.1f} {total / prefill_s[i]:>12.0f} "
                  f"{prefill_flop(model, ran) / prefill_s[i] / matmul_rate:>13.2f} "
                  f"{total_s[i]:>8.1f} {total_s[i] / len(prompts):>9.2f}")
    fast, plain = results["kv-fast"], results["kv"]
    print("kv-fast / kv: " + ", ".join(f"{clock} prefill {fast[0][i] / plain[0][i]:.2f}, total "
                                       f"{fast[1][i] / plain[1][i]:.2f}"
                                       for clock, i in (("wall", 0), ("cpu", 1))))


def _timed(fn, *args, **kwargs):
    """((wall seconds, this process's CPU seconds), fn's result)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args, **kwargs)
    return (time.perf_counter() - wall, time.process_time() - cpu), out


def main():
    parser = argparse.ArgumentParser(description="Benchmark the hf, kv and kv-fast samplers side "
                                                 "by side, or (with --verifier-prompts) kv against "
                                                 "kv-fast on the verifier's prompts.")
    parser.add_argument("--model-config", default="embedded",
                        help="an offline model: 'embedded' (default), 'coder-1.5b'; 'qwen2.5-1.5b' "
                             "(random weights) or a config.json path")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                        help="model dtypes to run (default: float32, and bfloat16 where the device "
                             "runs it natively; bfloat16 adds the dtype=bf16 row on float32 "
                             "weights; --verifier-prompts takes the first)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--verifier-prompts", action="store_true",
                        help="kv against kv-fast on one step's verifier prompts")
    parser.add_argument("--problems", type=int, default=8, help="--verifier-prompts: demo problems")
    parser.add_argument("--rollouts", type=int, default=4,
                        help="--verifier-prompts: written rollouts per problem")
    args = parser.parse_args()
    native = bf16_supported(torch.device(args.device))
    if args.dtypes is None and not native:  # an AVX2 CPU multiplies bfloat16 some 400x slower
        print(f"bfloat16 left out: {args.device} has no native bfloat16 (pass --dtypes bfloat16 to "
              f"time it anyway)")
    dtypes = [getattr(torch, name) for name in args.dtypes or ["float32"] + ["bfloat16"] * native]
    if args.verifier_prompts:
        bench_verifier(args.model_config, args.device, dtypes[0], args.max_new_tokens,
                       args.problems, args.rollouts)
    else:
        bench(args.model_config, args.device, args.n, args.max_new_tokens, dtypes)


if __name__ == "__main__":
    main()
