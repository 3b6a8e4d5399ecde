"""engine.py: rollouts on vLLM through sampler.generate, weight sync, log-probs, and runs on one and two processes.

These tests start real vLLM engines (about 20 s each on a CPU) and run only with `-m engine` where vLLM is
installed; T3RL_REQUIRE_VLLM=1 (CI) turns a missing vLLM into a failure instead of a skip.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

import grpo
import t3rl
from config import Config, parse_config
from sampler import Sampling
from verifier import MATH
from grpo import Rollouts, grpo_step, make_optimization, pad_batch
from machinery.logprobs import token_logprobs
from helpers import (QUESTIONS, ROOT, sample, interrupted_at_update, make_tiny_model, rows, tiny_argv,
                     write_bench)
from test_invariants import assert_trained_alike, train_like_one

pytestmark = pytest.mark.engine
if os.environ.get("T3RL_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")
from extensions import agent, engine  # noqa: E402

CHAT = ["Say hi.", "What is 2 + 3? Reply with the number only."]
OPEN = ["Write one sentence about the sea.", "Name an animal and say why you like it."]  # many likely replies


def chat_prompts(tokenizer, questions=CHAT):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def tiny_engine_model(vocab_size: int):
    """The tiny Qwen2 with head dimension 64 (vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 256), its
    untied head scaled so that next-token distributions are peaked: float rounding cannot flip a token."""
    model = make_tiny_model(vocab_size, tie_word_embeddings=False, hidden_size=128, intermediate_size=256,
                            num_attention_heads=2, num_key_value_heads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="class")
def policy():
    """The embedded 0.5B policy, for the tests in TestTheEmbeddedPolicy; its engine is shut down after them,
    before the runs below start theirs."""
    from machinery.model import load_model
    yield load_model("embedded")
    engine.stop()


@pytest.fixture()
def engine_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("engine-tiny")
    tiny_engine_model(len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class TestTheEmbeddedPolicy:
    """Sampling on the engine against transformers, on the embedded 0.5B policy."""

    def test_greedy_rows_equal_transformers_greedy_and_end_at_eos(self, policy):
        model, tokenizer = policy
        prompts = chat_prompts(tokenizer)
        served = sample(model, tokenizer, prompts, n=2, max_new_tokens=32, temperature=0, backend="vllm",
                          dtype=torch.float32)
        reference = sample(model, tokenizer, prompts, n=1, max_new_tokens=32, temperature=0, backend="hf")
        eos = model.generation_config.eos_token_id
        for prompt, group, (ref,) in zip(prompts, served, reference):
            assert [c.token_ids for c in group] == [ref.token_ids] * 2
            assert group[0].finish_reason == "eos" and group[0].token_ids[-1] == eos
            assert group[0].text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
            assert group[0].prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
        assert "5" in served[1][0].text


    def test_seeded_samples_repeat_whatever_they_are_batched_with(self, policy):
        model, tokenizer = policy
        prompts = chat_prompts(tokenizer, OPEN)
        options = dict(n=4, max_new_tokens=12, temperature=1.0, top_p=1.0, backend="vllm", dtype=torch.float32)
        both = sample(model, tokenizer, prompts, seed=[11, 12], **options)
        alone = sample(model, tokenizer, prompts[1:], seed=[12], **options)
        other = sample(model, tokenizer, prompts[1:], seed=[13], **options)
        assert [c.token_ids for c in both[1]] == [c.token_ids for c in alone[0]]
        assert [c.token_ids for c in other[0]] != [c.token_ids for c in alone[0]]
        assert len({tuple(c.token_ids) for c in both[0]}) > 1  # n samples of a prompt are n draws, not one repeated
        for c in both[0] + both[1]:
            assert len(c.token_logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.token_logprobs)
            assert c.logprob == pytest.approx(sum(c.token_logprobs))


    def test_engine_logprobs_are_the_trainers_at_the_sampling_temperature(self, policy):
        """Without top-p the engine's log-prob of each drawn token is log softmax(logits / T), as the trainer
        computes it (float32 on both sides: equal to rounding)."""
        model, tokenizer = policy
        prompts = chat_prompts(tokenizer, OPEN)
        groups = sample(model, tokenizer, prompts, n=2, max_new_tokens=16, temperature=0.7, top_p=1.0, seed=[1, 2],
                          backend="vllm", dtype=torch.float32)
        rollouts = [c for group in groups for c in group]
        batch = pad_batch([c.prompt_ids for c in rollouts], [c.token_ids for c in rollouts])
        with torch.no_grad():
            trainer = token_logprobs(model, *batch, temperature=0.7)[0][batch[2]]
        served = torch.tensor([lp for c in rollouts for lp in c.token_logprobs])
        assert (trainer - served).abs().max() < 2e-3


    def test_agent_rollouts_on_the_engine_run_the_blocks_like_transformers(self, policy, pool):
        """The engine stops a row after a fence, and sample_with_tools appends the block's output and samples on: the
        same greedy rollouts as transformers with its stopping criterion, and sampled ones with a log-prob for
        each token the policy sampled (none for the tool's)."""
        model, tokenizer = policy
        prompt = t3rl.policy_prompt(tokenizer, "What is $123 \\times 456 + 789$?",
                                    MATH.instruction + agent.TOOL_INSTRUCTION)
        tools = agent.Interpreter(tokenizer, pool, max_calls=2)
        [[served]], [[reference]] = (agent.generate(model, tokenizer, [prompt], 1, Sampling(
            200, 0.0, dtype=torch.float32 if backend == "vllm" else None), None, backend, tools)
            for backend in ("vllm", "hf"))
        assert [c.output for c in served.tool_calls] == ["56877"]
        assert (served.token_ids, served.tool_mask) == (reference.token_ids, reference.tool_mask)
        assert "```output\n56877\n```" in served.text
        [sampled] = agent.generate(model, tokenizer, [prompt], 2, Sampling(200, 0.6, dtype=torch.float32), 1, "vllm",
                                   tools)
        for c in sampled:
            assert len(c.token_logprobs) == c.tool_mask.count(False)


def test_the_engine_follows_each_update_and_only_then_reloads(engine_dir, tokenizer):
    """After a GRPO update the engine's greedy continuation is the updated model's (and not the old one's); a
    call with unchanged weights loads nothing."""
    from machinery.model import load_model
    model, _ = load_model(str(engine_dir))
    prompts = [[9707, 11, 1879, 0], [785, 4226, 553]]
    greedy = dict(n=1, max_new_tokens=10, temperature=0, backend="vllm", dtype=torch.float32)
    before = [g[0].token_ids for g in sample(model, tokenizer, prompts, **greedy)]
    served = engine.start(model, tokenizer, torch.float32)
    syncs = served.syncs
    assert [g[0].token_ids for g in sample(model, tokenizer, prompts, **greedy)] == before
    assert served.syncs == syncs                                    # nothing changed: nothing loaded
    optimizer, scheduler = make_optimization(model, Config(lr=0.05), 10)
    rollouts = Rollouts([prompts[0]] * 2 + [prompts[1]] * 2, [before[0], [42] * 10, before[1], [7] * 10],
                        [0.0, 1.0, 0.0, 1.0])
    grpo_step(model, optimizer, scheduler, rollouts, Config(n_train=2, mini_batch_questions=0, temperature=1.0,
                                                            grad_checkpointing=False), bf16=False)
    after = [g[0].token_ids for g in sample(model, tokenizer, prompts, **greedy)]
    assert served.syncs == syncs + 1
    assert after == [g[0].token_ids for g in sample(model, tokenizer, prompts, **{**greedy, "dtype": None,
                                                                                      "backend": "hf"})]
    assert after != before


def test_a_run_on_the_engine_logs_the_logprob_gap(engine_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(grpo, "bf16_supported", lambda device: False)  # a float32 trainer
    run = t3rl.train(parse_config(tiny_argv(engine_dir, tmp_path / "out", max_steps=2, backend="vllm",
                                            sample_dtype="float32", mini_batch_questions=1, top_p=1.0)))
    train = [r for r in rows(run, "metrics.jsonl") if r["kind"] == "train"]
    assert len(train) == 2
    # float32 engine against the float32 trainer, no top-p (which renormalises the engine's log-probs over the
    # nucleus): a gap at rounding level
    for row in train:
        assert 0 <= row["grpo/logprob_mismatch"] < 1e-2


def test_two_processes_on_the_engine_train_like_one(engine_dir, tmp_path, monkeypatch, patched):
    """torchrun, 2 processes, each with its own engine sampling its own questions: the run of one process."""
    one, many = train_like_one(engine_dir, tmp_path, monkeypatch, 2, QUESTIONS, max_steps=2, eval_samples=1,
                               backend="vllm", mini_batch_questions=1)
    assert_trained_alike(one, many)
    assert all("grpo/logprob_mismatch" in r for r in rows(many, "metrics.jsonl") if r["kind"] == "train")


def test_a_resumed_run_samples_from_the_checkpoints_weights(engine_dir, tmp_path, monkeypatch, patched):
    """Interrupted in step 2's update and resumed from the step-1 checkpoint, a run draws the uninterrupted
    run's step-2 rollouts: the resumed run's engine serves the checkpoint's weights. Step 1 moved the weights
    enough (lr 0.05) that the starting model's step-2 rollouts differ."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    options = dict(backend="vllm", sample_dtype="float32", save_every=1, eval_samples=0, lr=0.05, max_steps=2)
    whole = t3rl.train(parse_config(tiny_argv(engine_dir, tmp_path / "whole", **options)))
    unmoved = t3rl.train(parse_config(tiny_argv(engine_dir, tmp_path / "unmoved", **{**options, "lr": 0.0})))
    with interrupted_at_update(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        t3rl.train(parse_config(tiny_argv(engine_dir, tmp_path / "parts", **options)))
    resumed = t3rl.train(parse_config(["--resume", str(tmp_path / "parts" / "run")]))
    step_two = lambda run: [r["text"] for r in rows(run, "rollouts.jsonl") if r["step"] == 1]  # noqa: E731
    assert step_two(resumed) == step_two(whole)
    assert step_two(unmoved) != step_two(whole)



def run_script(source, tmp_path, engine_dir, questions, processes=0, **options):
    """The script `source` (a template with {root}) run as t3rl.py with the tiny engine model's options for one
    step on `questions`, under torchrun with `processes` processes (0: plain python); it must exit 0."""
    write_bench(tmp_path / "data", questions)
    script = tmp_path / "script.py"
    script.write_text(source.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "T3RL_DATA_DIR": str(tmp_path / "data")}
    argv = tiny_argv(engine_dir, tmp_path / "out", max_steps=1, backend="vllm", sample_dtype="float32", **options)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes else []
    done = subprocess.run([sys.executable, *launcher, str(script), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


FREED = """import gc
import sys
import weakref
sys.path.insert(0, {root!r})
import dataclasses
import t3rl
import verifier
from extensions import engine
from machinery import model as models
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
loaded, load_model = [], models.load_model


def recorded(*args, **kwargs):
    model, tokenizer = load_model(*args, **kwargs)
    loaded.append(weakref.ref(model))
    return model, tokenizer


models.load_model = recorded
t3rl.main()
gc.collect()
print(f"after the run: {{len(engine._ENGINES)}} engines, {{sum(m() is not None for m in loaded)}} of "
      f"{{len(loaded)}} models alive")
"""


def test_a_finished_run_gives_back_its_engines_and_models(engine_dir, tmp_path):
    """A process's first run on the engines (the policy's and the verifier's): when train() returns, both engines
    are shut down and nothing keeps the run's models alive, so that the process can run again."""
    done = run_script(FREED, tmp_path, engine_dir, QUESTIONS[:2], questions_per_step=2, eval_samples=0)
    assert "[engine] vLLM engine for Qwen2ForCausalLM" in done.stderr  # it sampled on engines
    assert "after the run: 0 engines, 0 of 2 models alive" in done.stdout


STARTED = """import sys
sys.path.insert(0, {root!r})
import accelerate
import torch.distributed as dist
import dataclasses
from extensions import engine
import t3rl
import verifier
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
events = []


def recorded(name, real):
    def call(*args, **kwargs):
        events.append(name)
        return real(*args, **kwargs)
    return call


accelerate.Accelerator.prepare = recorded("prepare", accelerate.Accelerator.prepare)
engine.Engine.__init__ = recorded("engine", engine.Engine.__init__)
t3rl.log_evaluation = recorded("eval", t3rl.log_evaluation)
t3rl.rl_step = recorded("step", t3rl.rl_step)
t3rl.main()
print(f"process {{dist.get_rank()}} of {{dist.get_world_size()}}: {{' '.join(events)}}")
"""


def test_every_process_starts_its_engines_right_after_prepare(engine_dir, tmp_path):
    """torchrun, 2 processes, one question: process 1 samples nothing in the whole run, and still
    starts the verifier's engine and the policy's with process 0, after prepare and before the first
    evaluation."""
    done = run_script(STARTED, tmp_path, engine_dir, QUESTIONS[:1], processes=2, questions_per_step=1,
                      eval_samples=1)
    # the processes share stdout: another's summary may follow a line without a newline between
    events = r"(?:engine|prepare|eval|step)(?: (?:engine|prepare|eval|step))*"
    seen = sorted(re.findall(rf"process (\d) of (\d): ({events})", done.stdout))
    assert seen == [(str(rank), "2", "prepare engine engine eval step eval") for rank in range(2)]
    assert len(rows(tmp_path / "out" / "run", "rollouts.jsonl")) == 4  # one question's N rollouts


ONE_LAUNCHED = """import os
import sys
sys.path.insert(0, {root!r})
import dataclasses
import vllm
import t3rl
import verifier
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
executors, real = [], vllm.LLM.__init__


def recorded(self, *args, **kwargs):
    executors.append(kwargs.get("distributed_executor_backend", "default"))
    return real(self, *args, **kwargs)


vllm.LLM.__init__ = recorded
t3rl.main()
print(f"process {{os.environ['RANK']}} of {{os.environ['WORLD_SIZE']}}: executors {{' '.join(executors)}}")
"""


def test_one_launched_process_starts_its_engines_on_the_launchers_executor(engine_dir, tmp_path):
    """torchrun with one process: both engines take vLLM's external_launcher, as on several GPUs, and the
    run trains and evaluates on them."""
    done = run_script(ONE_LAUNCHED, tmp_path, engine_dir, QUESTIONS[:2], processes=1, questions_per_step=2,
                      eval_samples=1)
    assert "process 0 of 1: executors external_launcher external_launcher" in done.stdout
    assert [r["kind"] for r in rows(tmp_path / "out" / "run", "metrics.jsonl")] == ["eval", "train", "eval"]


def test_starting_an_engine_leaves_the_global_generators_as_they_were(engine_dir, tokenizer):
    """vLLM's worker seeds Python's, numpy's and torch's generators as it starts in this process: a run's
    restored or seeded state must survive it."""
    import random

    import numpy as np
    from machinery.model import load_model
    model, _ = load_model(str(engine_dir))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    engine.start(model, tokenizer, torch.float32)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected
    engine.stop()


def test_the_engine_runs_in_the_trainers_process_whatever_the_user_set(engine_dir, tokenizer, monkeypatch):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 would put the engine in a child, which the weights (a generator of
    tensors) cannot reach: it is set to 0, and the engine samples the trainer's weights."""
    from machinery.model import load_model
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    model, _ = load_model(str(engine_dir))
    greedy = dict(n=1, max_new_tokens=4, temperature=0, dtype=torch.float32)
    assert (sample(model, tokenizer, [[9707, 11]], backend="vllm", **greedy)[0][0].token_ids
            == sample(model, tokenizer, [[9707, 11]], backend="hf", **{**greedy, "dtype": None})[0][0].token_ids)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    engine.stop()


def test_a_context_the_engines_memory_cannot_hold_is_named_in_one_line(tmp_path, tokenizer):
    from machinery.model import load_model
    folder = tmp_path / "long"
    model = tiny_engine_model(len(tokenizer))
    model.config.max_position_embeddings = 1 << 21  # 2M positions of 1 KiB: past the 1 GiB KV budget
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, _ = load_model(str(folder))
    with pytest.raises(engine.EngineUnavailable, match=r"vLLM cannot start for Qwen2ForCausalLM: .*KV cache.*; give "
                                                       r"its KV cache more memory .* or pass --backend kv-fast"):
        engine.start(model, tokenizer, torch.float32)
