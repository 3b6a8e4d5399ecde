"""The GPU path's decisions, shown on a CPU: the precision whatever accelerate's config asks,
bfloat16 without emulation, the engines' sleep mode and memory shares, the fast sampler's budget
beside PyTorch's cache, the study under a launcher, Slurm's cores for srun. launch/device-check/run.sh
runs the path itself on a GPU."""
import os
import subprocess
import sys
import types
import weakref

import pytest
import torch
from accelerate.state import AcceleratorState

import config
import grpo
import t3rl
from config import parse_config
from extensions import engine, kv_fast, study
from helpers import QUESTIONS, ROOT, make_tiny_model, rows, tiny_argv, write_bench
from machinery import runs

GIB = 1 << 30
PAPER_POLICY = 1_543_714_304  # parameters of Qwen2.5-Math-1.5B


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_where_the_gpu_runs_it_natively_and_float32_where_emulated(monkeypatch, native):
    """A V100 or T4 runs bfloat16 emulated, and torch's default answer, which counts emulation, is
    yes; asked without it, t3rl samples and updates in float32 there, and says so."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: native or including_emulation)
    cuda = torch.device("cuda")
    cfg = config.Config()  # --sample-dtype auto
    assert grpo.bf16_supported(cuda) is native  # the update's autocast
    runs.settle(cfg, gpu=True)  # as a new run fixes it
    assert cfg.sample_dtype == ("bfloat16" if native else "float32")


@pytest.fixture()
def fresh_accelerate_state():
    """accelerate's state, one per process, is fixed by its first Accelerator: unset it around."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_precision_is_t3rls_whatever_accelerates_config_asks(tiny_dir, tmp_path, monkeypatch,
                                                                  patched, capsys,
                                                                  fresh_accelerate_state):
    """accelerate launch passes its config's mixed precision on as ACCELERATE_MIXED_PRECISION; bf16
    there would wrap the policy's forward in accelerate's autocast, on a CPU too."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    built = []

    class Recorded(runs.Accelerator):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            built.append(self)
    monkeypatch.setattr(runs, "Accelerator", Recorded)
    argv = tiny_argv(tiny_dir, tmp_path / "out", max_steps=1, eval_samples=0, verifier_model="none")
    run = t3rl.train(parse_config(argv))
    assert [r["kind"] for r in rows(run, "metrics.jsonl")] == ["eval", "train", "eval"]
    [accelerator] = built
    assert accelerator.mixed_precision == "no"
    assert not accelerator.native_amp and accelerator.scaler is None  # no autocast, no GradScaler
    assert ("[t3rl] accelerate's config asks for mixed precision bf16; t3rl keeps it off and sets "
            "its own: bfloat16 autocast in the update where the hardware has it, sampling in "
            "bfloat16") in capsys.readouterr().err.splitlines()


def test_the_sampler_budgets_the_gpus_free_memory_and_pytorchs_unused_cache(monkeypatch):
    """After an update PyTorch keeps its freed blocks reserved: the driver does not count them."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 * GIB)
    assert kv_fast.free_memory(torch.device("cuda")) == (10 + 30 - 20) * GIB


class FakeLLM:
    """vllm.LLM as Engine uses it: records how it was started and, in order, what it was asked."""
    calls = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def sleep(self, level):
        self.calls.append(("sleep", self.kwargs["enable_sleep_mode"], level))

    def wake_up(self):
        self.calls.append(("wake_up", self.kwargs["enable_sleep_mode"]))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, sum(1 for _ in kwargs["weights_iterator"])))

    def reset_prefix_cache(self):
        pass


@pytest.fixture()
def fake_gpu_engines(monkeypatch):
    """Engines built on a pretend GPU, with FakeLLM for vllm.LLM; the calls it records."""
    FakeLLM.calls = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    monkeypatch.setattr(engine, "_ENGINES", weakref.WeakKeyDictionary())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    emptied = ("empty_cache", None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: FakeLLM.calls.append(emptied))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return FakeLLM.calls


def test_only_the_policys_engine_sleeps_and_wakes_after_empty_cache(tokenizer, fake_gpu_engines):
    """vLLM's sleep mode allows one engine per process: the policy's sleeps during the update, the
    verifier's (its model never trains) runs without it; waking follows torch.cuda.empty_cache."""
    policy, verifier, other = (make_tiny_model(len(tokenizer), seed=s) for s in range(3))
    served = engine.start(policy, tokenizer, torch.bfloat16, sleeps=True)
    checker = engine.start(verifier, tokenizer, torch.bfloat16, frozen=True)
    assert served.llm.kwargs["enable_sleep_mode"] and not checker.llm.kwargs["enable_sleep_mode"]
    assert served.llm.kwargs["gpu_memory_utilization"] == engine.GPU_MEMORY_UTILIZATION
    with pytest.raises(engine.EngineUnavailable, match="one sleep-mode engine per process"):
        engine.start(other, tokenizer, torch.bfloat16, sleeps=True)
    engine.sleep()
    served.wake()
    checker.wake()
    assert fake_gpu_engines == [("sleep", True, 2), ("empty_cache", None), ("wake_up", True)]


def test_a_woken_engine_reloads_the_weights_even_when_no_update_changed_them(tokenizer, fake_gpu_engines):
    """Level 2 sleep drops the engine's weights (level 1 would copy them to host memory and back, only
    for the sync to overwrite them): after waking, the next sync loads them again although no optimizer
    step moved them (a step whose updates were all skipped), and a second sync does not."""
    policy = make_tiny_model(len(tokenizer))
    served = engine.start(policy, tokenizer, torch.bfloat16, sleeps=True)
    tensors = len(policy.state_dict())
    served.sync(policy)
    served.sync(policy)
    engine.sleep()
    served.wake()
    served.sync(policy)
    served.sync(policy)
    assert [c for c in fake_gpu_engines if c[0] in ("reload_weights", "sleep")] == [
        ("reload_weights", tensors), ("sleep", True, 2), ("reload_weights", tensors)]


def test_an_engine_of_a_launched_process_joins_the_launcher(monkeypatch):
    """vLLM's external_launcher whenever torchrun or accelerate launch started the process, one process
    included (its engine then joins that process group, as on several GPUs); the in-process executor for
    python t3rl.py."""
    assert engine.executor({"LOCAL_RANK": "0", "WORLD_SIZE": "1"}) == {
        "distributed_executor_backend": "external_launcher"}
    assert engine.executor({}) == {}


def test_the_engines_shares_are_checked_against_the_gpus_memory_before_anything_starts(monkeypatch):
    """The paper's 1.5B policy (16 bytes a parameter in the trainer) and two engines at 0.3 of the
    GPU each: an 80 GiB GPU holds them, a 40 GiB one does not, and the line says what to change."""
    monkeypatch.setattr(engine, "GPU_MEMORY_UTILIZATION", 0.3)
    trainer = PAPER_POLICY * 16
    line, fits = engine.check_memory(80 * GIB, trainer, ["policy", "verifier"])
    assert fits and line == ("GPU memory 80.0 GiB: policy's engine 24.0 GiB (asleep during the "
                             "update), verifier's engine 24.0 GiB, trainer 23.0 GiB, 9.0 GiB left")
    line, fits = engine.check_memory(40 * GIB, trainer, ["policy", "verifier"])
    assert not fits and "\n" not in line
    assert line.endswith("-7.0 GiB left: does not fit; pass --backend kv-fast (it fits itself into "
                         "what is left)")
    assert engine.check_memory(40 * GIB, trainer, ["policy"])[1]

    # train's check, before any model goes to the GPU: both roles on engines, a 40 GiB GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=40 * GIB))
    policy = types.SimpleNamespace(parameters=lambda: [torch.empty(1).expand(PAPER_POLICY)])
    accelerator = types.SimpleNamespace(device=torch.device("cuda"), num_processes=1)
    with pytest.raises(config.OptionError, match="^GPU memory 40.0 GiB: .* does not fit; pass"):
        engine.check_gpu_memory(policy, True, "ddp", accelerator)

    # --kl-coef (--preset ttrl) holds a float32 reference model beside the trainer: 5.8 GiB more
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=70 * GIB))
    lines = []
    accelerator.print = lines.append
    engine.check_gpu_memory(policy, True, "ddp", accelerator)
    assert lines[-1].endswith("trainer 23.0 GiB, 5.0 GiB left")
    with pytest.raises(config.OptionError, match="trainer 28.8 GiB, -0.8 GiB left: does not fit"):
        engine.check_gpu_memory(policy, True, "ddp", accelerator, ref_model=policy)


def test_a_study_under_a_launcher_is_refused_in_one_line(tiny_dir, tmp_path, monkeypatch):
    """Every process of accelerate launch would sample the whole study on GPU 0 into one folder."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(study, "open_study", lambda cfg: pytest.fail("the study started"))
    with pytest.raises(SystemExit) as stop:
        study.main(tiny_argv(tiny_dir, tmp_path / "out"))
    assert stop.value.code == ("error: the study runs in one process (it never trains, nothing is "
                               "split over processes): start it with python -m extensions.study, not "
                               "accelerate launch or torchrun")


def test_slurm_gives_srun_the_jobs_cores_per_task(tmp_path):
    """srun does not inherit --cpus-per-task (Slurm 22.05 and later): the script passes it on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "srun.args"}\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "32"}
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), "--bench", "math500"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    srun_options = (tmp_path / "srun.args").read_text().split()[:2]
    assert srun_options == ["--kill-on-bad-exit=1", "--cpus-per-task=32"]
