"""The device check's calls into t3rl, one subcommand per check; run.sh runs each under its own
timeout and prints the lines that start with "result: ". Every call into the project is in this
file, so that a renamed interface is fixed here alone.

    python3 check.py models WORK          the two random models, WORK/policy and WORK/verifier
    python3 check.py math-verify SITE     math-verify from the carried wheels (SITE), through t3rl
    python3 check.py sandbox              the sandbox pool starts and runs a program
    TORCHRUN check.py sample ROLE WORK    the kv sampler at the paper's size (policy | verifier)
    TORCHRUN check.py update MODE WORK    one GRPO update at the paper's size (ddp | fsdp)
    python3 check.py stopped-run WORK     a t3rl.py run under TORCHRUN, stopped after step 1's save
    python3 check.py resumed-run WORK     that run resumed; it must not restart
    TORCHRUN check.py t3rl [--stop-at-update K] ARGS...   t3rl.main(ARGS), Ctrl-C in update K

TORCHRUN is `python3 -m torch.distributed.run --standalone --nproc_per_node 1`.

The models: the policy Qwen2.5-Math-1.5B and the verifier Qwen2.5-Coder-1.5B-Instruct with random
weights, built from the config.json, generation_config.json and tokenizer_config.json in
qwen2.5-math-1.5b/ and qwen2.5-coder-1.5b-instruct/ beside this file. Their values are those of
the models' published config.json on the Hugging Face Hub (Qwen/Qwen2.5-Math-1.5B,
Qwen/Qwen2.5-Coder-1.5B-Instruct; written here by hand, the sliding-window fields left out: off in
both): hidden 1536, intermediate 8960, 28 layers, 12 heads, 2 key-value heads, vocabulary 151936,
RMSNorm eps 1e-6, the head tied; the policy 4096 positions, rope theta 10000, bos = eos = 151643;
the verifier 32768 positions, rope theta 1e6, eos 151645. The Qwen2.5 family shares one tokenizer:
tokenizer.json.gz (from Qwen2.5-Coder-1.5B-Instruct) goes into both folders. The policy's chat
template is Qwen2.5-Math's (system prompt "Please reason step by step, and put your final answer
within \\boxed{}."), the verifier's Qwen2.5-Coder-Instruct's.

Dry (T3RL_DEVICE_CHECK_DRY=1, run.sh --dry): the same files with tiny shapes (2 layers, hidden
64), on the CPU (gloo), a few tokens: every check's code runs, no figure means anything.
"""
import gzip
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the repository
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DRY = os.environ.get("T3RL_DEVICE_CHECK_DRY", "0") == "1"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
# the committed folder of each role's model
MODELS = {"policy": HERE / "qwen2.5-math-1.5b", "verifier": HERE / "qwen2.5-coder-1.5b-instruct"}
TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)
# a math run needs none of them: gguf reads offline models, z3 Knights and Knaves, vllm its engine
ABSENT = ("gguf", "z3", "vllm")
PROBLEM = "Find the sum of all positive integers n such that n^2 - 19n + 99 is a perfect square."


@dataclass(frozen=True)
class Sizes:
    """What each check samples and trains: the paper's sizes, or a few tokens when dry."""
    rollouts: int = 64            # N: the policy's rollouts for one question
    new_tokens: int = 2560        # the policy's new tokens per rollout
    verifier_prompts: int = 64    # the verifier's prompts in one call
    verifier_prompt_tokens: int = 1000
    verifier_new_tokens: int = 1024
    trained: int = 32             # M: rollouts in the GRPO update
    update_prompt_tokens: int = 200
    run_new_tokens: int = 64      # the stopped and resumed run's tokens per rollout and program
    top_p: float = 0.95           # the paper's, for both roles


# top-p 1 when dry: the tiny random model's near-flat distribution puts every one of the 152k
# tokens in the nucleus, and ranking them costs more than the rest of its step
SIZES = Sizes(rollouts=4, new_tokens=8, verifier_prompts=4, verifier_prompt_tokens=24,
              verifier_new_tokens=8, trained=4, update_prompt_tokens=12,
              run_new_tokens=8, top_p=1.0) if DRY else Sizes()


def result(line: str):
    """A line run.sh prints after the check's name."""
    print(f"result: {line}", flush=True)


def local_device() -> torch.device:
    """This process's GPU under torchrun (LOCAL_RANK), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def peak_memory(device: torch.device) -> str:
    """The GPU's peak memory since start_clock, as PyTorch's allocator counts it."""
    if device.type != "cuda":
        return "peak GPU memory n/a (cpu)"
    gib = 2 ** 30
    return (f"peak GPU memory {torch.cuda.max_memory_allocated(device) / gib:.1f} GiB allocated, "
            f"{torch.cuda.max_memory_reserved(device) / gib:.1f} GiB reserved")


def start_clock(device: torch.device) -> float:
    """Synchronise, zero the peak memory counters, and return the time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    return time.perf_counter()


def seconds_since(started: float, device: torch.device) -> float:
    """Seconds since start_clock, the GPU's queued work done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def report_absent():
    """Fail when this process imported gguf, z3 or vllm (the GPU machine has none of them)."""
    imported = [name for name in ABSENT if name in sys.modules]
    if imported:
        raise SystemExit(f"imported {', '.join(imported)}: the GPU machine has none of them")
    result(f"imported none of {', '.join(ABSENT)}")


# ------------------------------------------------------------------------------------ the models

def write_model_files(role: str, dest: Path):
    """The committed config and tokenizer files of a role's model (tiny shapes when dry)."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in MODELS[role].iterdir():
        shutil.copy(path, dest / path.name)
    with gzip.open(HERE / "tokenizer.json.gz", "rb") as packed:
        (dest / "tokenizer.json").write_bytes(packed.read())
    if DRY:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **TINY_SHAPES}, indent=2))


def build_models(work: Path):
    """WORK/policy and WORK/verifier: the committed files and random bfloat16 weights, built once
    (on the GPU when there is one) and linked into both folders (the shapes are the same)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    for role in MODELS:
        write_model_files(role, work / role)
    device, started = local_device(), time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work / "policy"),
                                                 dtype=torch.bfloat16)
    model.save_pretrained(work / "weights")
    for role in MODELS:
        (work / role / "model.safetensors").unlink(missing_ok=True)  # a WORK_DIR used before
        os.link(work / "weights" / "model.safetensors", work / role / "model.safetensors")
    parameters = sum(p.numel() for p in model.parameters())
    result(f"policy and verifier: {type(model).__name__}, {parameters:,} parameters, random "
           f"bfloat16 weights, built in {time.perf_counter() - started:.0f} s")
    report_absent()


def load(role: str, work: Path, dtype):
    from machinery.model import load_model
    return load_model(str(work / role), dtype=dtype)


# ------------------------------------------------------------------- math-verify and the sandbox

def check_math_verify(site: str):
    """math-verify is imported from the wheels' target (unless dry without wheels), and t3rl's
    is_equiv reaches it through its helper process."""
    import answers
    from machinery.symbolic import worker
    origin = importlib.util.find_spec("math_verify").origin
    if site and not origin.startswith(site):
        raise SystemExit(f"math_verify comes from {origin}, not from the wheels in {site}")
    if not site and not DRY:
        raise SystemExit("no wheels installed: run launch/device-check/fetch-wheels.sh here and "
                         "carry launch/device-check/wheels")
    if not answers.is_equiv(r"\frac{\sqrt{8}}{2}", r"\sqrt{2}") or worker.process is None:
        raise SystemExit("is_equiv(\\frac{\\sqrt{8}}{2}, \\sqrt{2}) did not reach math-verify")
    from importlib.metadata import version
    result(f"math-verify {version('math-verify')} from {Path(origin).parent.parent}, reached "
           f"by is_equiv through its helper process")
    report_absent()


def check_sandbox():
    """The sandbox pool starts (its warm-up imports included) and runs a program."""
    from sandbox import SandboxPool
    code = ("import sys\nprint(6 * 7, *[m for m in %r if m in sys.modules])" % (ABSENT,))
    with SandboxPool(workers=1, timeout=10.0) as pool:
        ran = pool.run(code)
    if ran.status != "ok" or not ran.stdout.startswith("42"):
        raise SystemExit(f"the sandbox ran print(6 * 7) as {ran}")
    held = ran.stdout.split()[1:]
    result(f"a program ran in the sandbox, whose warm workers imported "
           f"{', '.join(held) if held else 'none of ' + ', '.join(ABSENT)}")
    report_absent()


# ---------------------------------------------------------------------------------- the sampler

def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    """count prompts of `length` random ordinary token ids (below the special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151643, (count, length), generator=generator).tolist()


def role_workload(role: str, work: Path, device):
    """(model, tokenizer, prompts, n, new tokens, frozen) as a run samples for the role: the
    policy from its float32 master weights, the verifier from bfloat16 weights that never train."""
    if role == "policy":
        import t3rl
        from verifier import MATH
        model, tokenizer = load(role, work, torch.float32)
        prompts = [t3rl.policy_prompt(tokenizer, PROBLEM, MATH.instruction)]
        return model.to(device), tokenizer, prompts, SIZES.rollouts, SIZES.new_tokens, False
    model, tokenizer = load(role, work, torch.bfloat16)
    prompts = random_prompts(SIZES.verifier_prompts, SIZES.verifier_prompt_tokens)
    return model.to(device), tokenizer, prompts, 1, SIZES.verifier_new_tokens, True


def sample(role: str, work: Path):
    """The paper preset's sampler without vLLM (kv-fast) in bfloat16 at the paper's temperature and
    top-p, every row to its length; the verifier's weights read from its files, as a run reads
    them."""
    from extensions import kv_fast
    from sampler import Sampling
    device = local_device()
    model, tokenizer, prompts, n, new, frozen = role_workload(role, work, device)
    if frozen:
        kv_fast.sampling_only(model, work / role)
    sampling = lambda tokens: Sampling(tokens, 0.6, SIZES.top_p, torch.bfloat16, True)  # noqa: E731
    kv_fast.generate(model, tokenizer, prompts[:1], 2, sampling(4), seed=0)  # warm-up
    started = start_clock(device)
    # the progress bar leaves the rate in the log should the check run out of time
    groups = kv_fast.generate(model, tokenizer, prompts, n, sampling(new), seed=0, progress=role)
    seconds = seconds_since(started, device)
    tokens = sum(len(c.token_ids) for group in groups for c in group)
    if tokens != len(prompts) * n * new:
        raise SystemExit(f"{tokens} tokens sampled, expected {len(prompts)} x {n} x {new}")
    prompt_tokens = len(tokenizer(prompts[0])["input_ids"]) if role == "policy" else len(prompts[0])
    result(f"{role}: {len(prompts)} prompt(s) of {prompt_tokens} tokens x {n} of {new} new tokens, "
           f"{tokens / seconds:,.0f} tokens/s ({seconds:.1f} s), {peak_memory(device)}")
    report_absent()


# ------------------------------------------------------------------------------ the GRPO update

def run_arguments(work: Path, run_name: str, *extra: str) -> list[str]:
    """The paper preset on the two random models (its sampler without vLLM: kv-fast), the run
    under WORK/runs."""
    return ["--preset", "paper", "--model", str(work / "policy"),
            "--verifier-model", str(work / "verifier"), "--backend", "kv-fast",
            "--bench", "math500", "--out-dir", str(work / "runs"), "--run-name", run_name, *extra]


def rollouts(count: int, prompt_tokens: int, new_tokens: int):
    """One question's rollouts of random token ids, half rewarded 1, half 0."""
    from grpo import Rollouts
    prompt = random_prompts(1, prompt_tokens, seed=1)[0]
    completions = random_prompts(count, new_tokens, seed=2)
    return Rollouts([prompt] * count, completions, [1.0, 0.0] * (count // 2))


def prepare_update(mode: str, cfg, accelerator):
    """(the module grpo_step trains, optimizer, scheduler, the sampling copy or None): the policy
    in float32 under DDP (accelerate's prepare) or FSDP2 (fsdp.shard_models on this one process),
    AdamW and the cosine schedule."""
    from extensions import fsdp
    from grpo import make_optimization
    from machinery.model import load_model
    policy, _ = load_model(cfg.model, dtype=torch.float32)
    policy.train()
    copy = None
    if mode == "fsdp":
        policy, copy, _ = fsdp.shard_models(policy, None, cfg, accelerator.device)
    optimizer, scheduler = make_optimization(policy, cfg, total_steps=10)
    if mode == "ddp":
        policy, optimizer = accelerator.prepare(policy, optimizer)
    return policy, optimizer, scheduler, copy


def wrapper_name(trained, mode: str) -> str:
    """What grpo_step trains, checked: a DDP replica or FSDP2 shards."""
    wanted = {"ddp": isinstance(trained, torch.nn.parallel.DistributedDataParallel),
              "fsdp": any(hasattr(p, "to_local") for p in trained.parameters())}  # DTensor shards
    if not wanted[mode]:
        raise SystemExit(f"update {mode}: grpo_step would train a {type(trained).__name__}")
    return {"ddp": "DistributedDataParallel", "fsdp": "FSDP2 fully_shard"}[mode]


def update(mode: str, work: Path):
    """One GRPO update on M rollouts under the paper's settings (micro-batches of 2, token-mean,
    bf16 autocast, gradient checkpointing, AdamW), after a small warm-up update."""
    from config import parse_config
    from extensions import fsdp
    from grpo import bf16_supported, grpo_step
    from machinery import runs
    gpu = torch.cuda.is_available()
    cfg = parse_config(run_arguments(work, f"update-{mode}", "--n-train", str(SIZES.trained),
                                     "--max-new-tokens", str(SIZES.new_tokens)), gpu)
    runs.settle(cfg, gpu)
    accelerator = runs.make_accelerator(cfg, gpu)
    device = accelerator.device
    trained, optimizer, scheduler, copy = prepare_update(mode, cfg, accelerator)
    kind = wrapper_name(trained, mode)
    step = lambda batch, c: grpo_step(trained, optimizer, scheduler, batch, c,  # noqa: E731
                                      accelerator=accelerator)
    step(rollouts(2, 8, 8), replace(cfg, n_train=2))  # warm-up
    started = start_clock(device)
    metrics = step(rollouts(SIZES.trained, SIZES.update_prompt_tokens, SIZES.new_tokens), cfg)
    if copy is not None:  # the sampling copy gets the trained weights, as before a run samples
        fsdp.refreshing(lambda: None, trained, copy)()
    seconds = seconds_since(started, device)
    if not math.isfinite(metrics["loss"]) or metrics["optimizer_steps"] != 1:
        raise SystemExit(f"update {mode}: loss {metrics['loss']}, "
                         f"{metrics['optimizer_steps']} optimizer steps")
    result(f"{mode} ({kind}, {accelerator.num_processes} process, {device}): "
           f"{SIZES.trained} rollouts x ({SIZES.update_prompt_tokens} + {SIZES.new_tokens}) "
           f"tokens, micro-batches of {cfg.micro_batch_rollouts}, {cfg.loss_agg}, bf16 "
           f"{bf16_supported(device)}, checkpointing {cfg.grad_checkpointing}: {seconds:.1f} s, "
           f"grad norm {metrics['grad_norm']:.3g}, {peak_memory(device)}")
    report_absent()


# --------------------------------------------------------------------- a stopped and resumed run

def write_math500(folder: Path):
    """A math500.jsonl of four questions for T3RL_DATA_DIR (../shared/data does not travel)."""
    questions = [("What is $3 \\cdot 4 + 5$?", "17", 1), ("Solve $2x + 3 = 11$ for $x$.", "4", 2),
                 ("What is $\\frac{1}{2} + \\frac{1}{3}$?", "\\frac{5}{6}", 2),
                 ("How many positive divisors does 12 have?", "6", 3)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "math500.jsonl").write_text("".join(
        json.dumps({"id": f"check-{i}", "problem": p, "answer": a, "level": level}) + "\n"
        for i, (p, a, level) in enumerate(questions)))


def launch_t3rl(work: Path, *argv: str) -> tuple[int, str]:
    """`TORCHRUN check.py t3rl ARGV`, its output copied to ours as it comes: (exit code, output)."""
    env = {**os.environ, "T3RL_DATA_DIR": str(work / "data")}
    process = subprocess.Popen([*TORCHRUN, __file__, "t3rl", *argv], env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    lines = []
    for line in process.stdout:
        print(line, end="", flush=True)
        lines.append(line)
    return process.wait(), "".join(lines)


def train_steps(run: Path) -> list[str]:
    """The train steps in RUN/metrics.jsonl, and "final" after a final evaluation."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [str(row["step"]) for row in rows if row["kind"] == "train"]
    return steps + ["final"] * bool(rows[-1].get("final"))


def expect(output: str, *needed: str):
    missing = [text for text in needed if text not in output]
    if missing:
        raise SystemExit(f"the run's output lacks {missing}")


def stopped_run(work: Path):
    """The paper preset at a tiny size, Ctrl-C in its second update, after step 1's checkpoint."""
    write_math500(work / "data")
    shutil.rmtree(work / "runs" / "resume", ignore_errors=True)  # a WORK_DIR used before
    size, top_p = str(SIZES.run_new_tokens), str(SIZES.top_p)
    code, output = launch_t3rl(work, "--stop-at-update", "2", *run_arguments(
        work, "resume", "--limit", "4", "--questions-per-step", "2", "--n-votes", "4",
        "--n-train", "2", "--max-new-tokens", size, "--verifier-max-new-tokens", size,
        "--top-p", top_p, "--eval-samples", "0", "--max-steps", "2",
        "--save-every", "1", "--eval-cache", "none"))
    run = work / "runs" / "resume"
    expect(output, "interrupted: ", f"--resume {run}", "result: imported none")
    steps = train_steps(run)
    if code == 0 or steps != ["0"] or not (run / "checkpoint" / "state.pt").is_file():
        raise SystemExit(f"stopped run: exit {code}, steps {steps}, expected a failure, step 0 "
                         f"and a checkpoint")
    result(f"stopped in step 1's update (exit {code}): steps '{' '.join(steps)}', a checkpoint "
           f"after step 1")


def resumed_run(work: Path):
    """The stopped run resumed: it says so, runs step 1 alone, and logs steps 0 and 1 once."""
    run = work / "runs" / "resume"
    code, output = launch_t3rl(work, "--resume", str(run))
    expect(output, "resuming after step 1", "result: imported none")
    steps = train_steps(run)
    if code != 0 or steps != ["0", "1", "final"]:
        raise SystemExit(f"resumed run: exit {code}, steps {steps}, expected '0 1 final'")
    if not DRY:  # two checkpoints of the 1.5B policy and its AdamW state: 37 GB
        shutil.rmtree(run)
    result(f"'resuming after step 1', then steps '{' '.join(steps)}', each once")


def run_t3rl(argv: list[str]):
    """t3rl.main(argv) as `python t3rl.py` runs it; --stop-at-update K: Ctrl-C in the K-th GRPO
    update, where a run's checkpoints are whole."""
    import t3rl
    if argv[:1] == ["--stop-at-update"]:
        stop_at, argv = int(argv[1]), argv[2:]
        real, calls = t3rl.grpo_step, []

        def stopped(*args, **kwargs):
            calls.append(1)
            if len(calls) == stop_at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        t3rl.grpo_step = stopped
    try:
        t3rl.main(argv)
    finally:
        report_absent()


COMMANDS = {"models": lambda work: build_models(Path(work)),
            "math-verify": check_math_verify,
            "sandbox": check_sandbox,
            "sample": lambda role, work: sample(role, Path(work)),
            "update": lambda mode, work: update(mode, Path(work)),
            "stopped-run": lambda work: stopped_run(Path(work)),
            "resumed-run": lambda work: resumed_run(Path(work))}

if __name__ == "__main__":
    if sys.argv[1] == "t3rl":
        run_t3rl(sys.argv[2:])
    else:
        COMMANDS[sys.argv[1]](*sys.argv[2:])
