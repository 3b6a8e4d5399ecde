"""Invariants that cross modules: ground truth never reaches rewards; lazy verification trains as
verifying every rollout; N processes train as one; a resumed run equals an uninterrupted one; the
hard-coding guard's corpora; bench/ imports the library, never the reverse."""
import ast
import dataclasses
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config
import grpo
import t3rl
import verifier
from config import parse_config
from machinery.guard import hardcoded
from helpers import (
    GUARD_PROBLEM,
    QUESTIONS,
    ROOT,
    fake_answer,
    final_weights,
    interrupted_at_update,
    make_tiny_model,
    rows,
    scripted_verifier,
    tensorboard_scalars,
    tiny_argv,
    without_timing,
    write_bench,
)

HARDCODED = [  # the candidate 1320 copied into the program and printed, in the ways small verifiers do it
    "print(1320)", "print('1320')", "print(f'{1320}')", "print(f'The answer is {1320}')", "print(-(-1320))",
    "print(int(1320))", "from fractions import Fraction\nprint(Fraction(1320))", "import sympy\nprint(sympy.Integer(1320))",
    "print(1320 * 1)", "print(1320.0)", "x = [1320]\nprint(x[0])", "ans = 1320\nprint(ans)", "a = 1320\nb = a\nprint(b)",
    "p, q = 5, 1320\nprint(q)", "def solve():\n    # the trace says 1320\n    return 1320\nprint(solve())",
    "r = 0\nr += 1320\nprint(r)", "d = {'n': 1320}\nprint(d['n'])", "print(str(1320))", "import sympy\nprint(sympy.Rational(1320, 1))",
    "import math\nx = math.comb(12, 3)\nprint(x)\nresult = 1320\nprint(result)", "for v in [1320]:\n    pass\nprint(v)",
    "print(max(1320, 0))",
]


COMPUTED = [  # honest recomputations from the problem's numbers (and checks that do not feed the print)
    "import math\nprint(math.comb(12, 3))", "print(11 * 120)", "a, b = 11, 120\nprint(a * b)",
    "x = 1320\nprint(11 * 120)", "r = 11 * 120\nassert r == 1320\nprint(r)", "r = 11 * 120\nif r == 1320:\n    print(r)",
    "import math\nprint(math.perm(12, 3) // 1)", "x = 1\nfor i in range(5):\n    x = x * 2\nprint(x)",
    "n = 0\nn += 3\nprint(n)", "def f(k):\n    return k * 120\nprint(f(11))", "print(sum(120 for _ in range(11)))",
    "import sympy\nx = sympy.Symbol('x')\nprint(sympy.solve(x - 11 * 120, x)[0])", "p, q = 5, 1320\nprint(p * 264)",
    "print(2 * 660)", "from fractions import Fraction\nprint(Fraction(10 * 11, 2 * 1))", "print(", "",
]


@pytest.mark.parametrize("code", HARDCODED)
def test_copied_candidate_is_hardcoded(code):
    assert hardcoded(code, GUARD_PROBLEM, "1320")


@pytest.mark.parametrize("code", COMPUTED)
def test_recomputation_is_not_hardcoded(code):
    assert not hardcoded(code, GUARD_PROBLEM, "1320")


LIBRARY = sorted([p.stem for p in ROOT.glob("*.py")] + [f"{folder}.{p.stem}" for folder in ("machinery", "extensions")
                                                         for p in ROOT.glob(f"{folder}/*.py")])


def library_imports(name: str) -> set[str]:
    """The modules of the repository that module `name` imports, anywhere in its code (functions included)."""
    tree = ast.parse((ROOT / f"{name.replace('.', '/')}.py").read_text())
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    found |= {name.split(".")[0] for name in found}  # bench.sampler is bench's
    return found & (set(LIBRARY) | {"bench"})


def test_the_library_never_imports_bench_and_has_no_import_circle():
    graph = {name: library_imports(name) - {name} for name in LIBRARY}
    assert {name for name, imported in graph.items() if "bench" in imported} == set()
    assert {"t3rl", "sampler", "verifier", "voting", "grpo"} <= set(graph)  # the reader's path is all there

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, (*seen, n))) for n in graph.get(start, ()))
    assert [name for name in LIBRARY if reaches(name, name)] == []


def test_the_core_and_machinery_never_import_an_extension_and_t3rl_enters_each_at_one_call():
    """extensions/ plug into the paper's core at one call each, in t3rl.py's functions; no other core or
    machinery module imports one, and t3rl.py imports none at its top."""
    core = [name for name in LIBRARY if not name.startswith("extensions.") and name != "t3rl"]
    assert {name: sorted(n for n in library_imports(name) if n.startswith("extensions"))
            for name in core} == {name: [] for name in core}
    top = ast.parse((ROOT / "t3rl.py").read_text()).body
    at_top = {alias.name for node in top if isinstance(node, ast.Import) for alias in node.names}
    at_top |= {node.module for node in top if isinstance(node, ast.ImportFrom)}
    assert not {name for name in at_top if name.startswith("extensions")}
    assert {n for n in library_imports("t3rl") if n.startswith("extensions.")} >= {
        "extensions.kv_fast", "extensions.engine", "extensions.programs", "extensions.budget",
        "extensions.memory", "extensions.fsdp", "extensions.agent", "extensions.knk", "extensions.eval_cache"}


def test_every_benchmark_runs_as_a_module():
    """`python -m bench.X --help` (as docs/ give them) parses each benchmark's own options, in one interpreter."""
    commands = {"bench.sampler": "--verifier-prompts", "bench.grpo": "--configs", "bench.verifier": "--rescore",
                "bench.sandbox": "--selftest", "bench.answers": "equiv_cases"}
    script = ("import contextlib, io, runpy, sys\n"
              "for name in sys.argv[1:]:\n"
              "    sys.argv, out = [name, '--help'], io.StringIO()\n"
              "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
              "        runpy.run_module(name, run_name='__main__', alter_sys=True)\n"
              "    print(name, repr(out.getvalue()))\n")
    done = subprocess.run([sys.executable, "-c", script, *commands], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    helps = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert {name: option in helps[name] for name, option in commands.items()} == dict.fromkeys(commands, True)


def test_ground_truth_never_reaches_rewards_or_parameters(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "real", QUESTIONS)
    write_bench(tmp_path / "garbage", [(p, "GARBAGE-" + a) for p, a in QUESTIONS])
    runs = []
    for name in ("real", "garbage"):
        monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / name))
        runs.append(t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / f"out-{name}", max_steps=2))))
    real, garbage = (rows(r, "rollouts.jsonl") for r in runs)
    assert [r["reward"] for r in real] == [r["reward"] for r in garbage]
    assert 0 < sum(r["reward"] for r in real) < len(real)  # the rewards are not trivial
    weights = [final_weights(r) for r in runs]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    start = make_tiny_model(weights[0]["model.embed_tokens.weight"].shape[0]).state_dict()
    assert not torch.equal(weights[0]["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])
    # ... while the monitors, which may see the gold answers, do notice the difference
    assert rows(runs[0], "metrics.jsonl")[1]["ground_truth_ratio"] != rows(runs[1], "metrics.jsonl")[1]["ground_truth_ratio"]


@pytest.mark.slow
def test_lazy_verification_trains_exactly_as_verifying_every_rollout(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr("extensions.budget.LAZY_SECOND_CALL", 0)  # the two-call path, the one that could go wrong
    asked = {}
    runs = {}
    for lazy in (False, True):
        def counting(prompts, lazy=lazy):
            asked[lazy] = asked.get(lazy, 0) + len(prompts)
            return scripted_verifier(prompts)
        monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: counting)
        argv = tiny_argv(tiny_dir, tmp_path / f"lazy-{lazy}", n_votes=6, max_steps=2, seed=2, verify_budget=0, lazy_verify=lazy,
                          top_p=0.95)  # draws where laziness leaves verdicts to skip
        runs[lazy] = t3rl.train(parse_config(argv))
    full, lazy = (rows(runs[k], "rollouts.jsonl") for k in (False, True))
    assert [(r["label"], r["reward"], r["kept"]) for r in full] == [(r["label"], r["reward"], r["kept"]) for r in lazy]
    assert 0 < sum(r["reward"] for r in full) < len(full)
    assert "skipped" in {r["status"] for r in lazy} and asked[True] < asked[False]
    weights = [final_weights(runs[k]) for k in (False, True)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_metrics(tiny_dir, tmp_path, monkeypatch, patched):
    """Interrupted in step 4, after the evaluation at step 3 that follows the checkpoint at step 2: the resumed
    run drops that evaluation's rows (metrics and per question) and logs them again, once; 6 steps, so that
    the verdict memory has classes two episodes agreed on to resume with."""
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    argv = lambda out: tiny_argv(tiny_dir, tmp_path / out, max_steps=6, episodes=3, eval_every=1,  # noqa: E731
                                 verdict_memory=True)
    straight = t3rl.train(parse_config(argv("a")))

    with interrupted_at_update(monkeypatch, 4), pytest.raises(SystemExit) as stop:
        t3rl.main(argv("b c"))  # Ctrl-C: one line with the command that continues the run, pasted as it is
    run = tmp_path / "b c" / "run"
    assert stop.value.code == (f"interrupted: {run} holds every step up to its last checkpoint; continue with: "
                               f"python t3rl.py --resume '{run}'")
    resumed = t3rl.train(parse_config(["--resume", str(run)]))

    assert without_timing(rows(resumed, "metrics.jsonl")) == without_timing(rows(straight, "metrics.jsonl"))
    assert rows(resumed, "rollouts.jsonl") == rows(straight, "rollouts.jsonl")
    assert rows(resumed, "evaluations.jsonl") == rows(straight, "evaluations.jsonl")
    assert [r["step"] for r in rows(resumed, "evaluations.jsonl")] == [s for s in range(7) for _ in QUESTIONS]
    # the verdict memory resumes too: the third episode reuses what the first two agreed on
    assert rows(resumed, "verdicts.jsonl") == rows(straight, "verdicts.jsonl")
    remembered = sum(r.get("remembered", False) for r in rows(straight, "rollouts.jsonl") if r["step"] == 4)
    step_4 = next(r for r in rows(straight, "metrics.jsonl") if r.get("step") == 4 and r["kind"] == "train")
    assert remembered > 0 and step_4["extensions"]["memory"]["reused"] == remembered
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_resumed_run_writes_the_programs_an_uninterrupted_one_writes(tiny_dir, tmp_path, monkeypatch):
    """A model verifier (the tiny policy verifying itself, sampling at T 0.6) seeds each program from what it
    verifies, so the steps a resumed run redoes get the same programs, verdicts and weights."""
    monkeypatch.setattr(verifier, "MATH", dataclasses.replace(verifier.MATH, extract=lambda text, p: fake_answer(text)))
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    replies, real_verifier = [], verifier.model_verifier

    def recording_verifier(*args, **kwargs):
        verify = real_verifier(*args, **kwargs)
        return lambda prompts: [replies.append((p.user, r.text)) or r for p, r in zip(prompts, verify(prompts))]
    monkeypatch.setattr(verifier, "model_verifier", recording_verifier)
    argv = dict(max_steps=3, verify_budget=0, lazy_verify=False, top_p=0.95)
    straight = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "a", **argv)))
    written, replies[:] = set(replies), []
    with interrupted_at_update(monkeypatch, 3), pytest.raises(SystemExit):
        t3rl.main(tiny_argv(tiny_dir, tmp_path / "b", **argv))
    replies[:] = []
    resumed = t3rl.train(parse_config(["--resume", str(tmp_path / "b" / "run")]))
    assert len({text for _, text in written}) > 1  # the programs are sampled, not all alike
    assert replies and set(replies) <= written  # the redone step and the final evaluation: the same programs
    assert rows(resumed, "rollouts.jsonl") == rows(straight, "rollouts.jsonl")
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


SIGTERMED = """import os, signal, sys
sys.path.insert(0, {root!r})
import dataclasses
import t3rl
import verifier
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
t3rl.build_verifier = lambda cfg, device, **kw: (lambda prompts: ["```python\\nprint(1 + 1)\\n```" for _ in prompts])
real_step, calls = t3rl.grpo_step, []


def stopped_at_third_update(*args, **kwargs):  # SIGTERM in the middle of step 3 (the checkpoint is at step 2)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_step(*args, **kwargs)


t3rl.grpo_step = stopped_at_third_update
t3rl.main()
"""


@pytest.mark.slow
def test_sigterm_ends_a_run_as_ctrl_c_does_and_it_resumes(tiny_dir, tmp_path, monkeypatch, patched):
    """A scheduler's SIGTERM (a time limit, scancel) ends the run with the resume line, not with a dead process."""
    write_bench(tmp_path / "data", QUESTIONS)
    script = tmp_path / "sigtermed.py"
    script.write_text(SIGTERMED.format(root=str(ROOT)))
    env = {**os.environ, "T3RL_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), *tiny_argv(tiny_dir, tmp_path / "out", max_steps=3)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    run = tmp_path / "out" / "run"
    assert done.returncode == 1, done.stderr[-3000:]  # SystemExit with a message; SIGTERM's default is -15
    assert (f"interrupted: {run} holds every step up to its last checkpoint; continue with: python t3rl.py "
            f"--resume {run}") in done.stderr.splitlines()
    assert [r["step"] for r in rows(run, "metrics.jsonl") if r["kind"] == "train"] == [0, 1]

    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    t3rl.train(parse_config(["--resume", str(run)]))  # from the checkpoint at 2: step 3, the final eval
    metrics = rows(run, "metrics.jsonl")
    assert [r["step"] for r in metrics if r["kind"] == "train"] == [0, 1, 2] and metrics[-1].get("final")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_slurm_script_launches_one_run_over_two_nodes(tiny_dir, tmp_path):
    """launch/slurm.sbatch as Slurm runs it on 2 nodes x 1 GPU, here on this CPU: a stand-in srun runs its launch
    line once per node with that node's SLURM_NODEID, scontrol names the main node; the two processes meet at
    that address and form one run of world size 2, which logs (metrics.jsonl, TensorBoard) from one process."""
    write_bench(tmp_path / "data", QUESTIONS[:2])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\n'
                                  'for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node "$@" & done\n'
                                  'for job in $(jobs -p); do wait "$job" || exit 1; done\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "1", "MAIN_PORT": str(free_port()), "T3RL_DATA_DIR": str(tmp_path / "data"),
           "OMP_NUM_THREADS": "1"}
    argv = tiny_argv(tiny_dir, tmp_path / "out", max_steps=1, eval_samples=0, verifier_model="none",
                     report_to="tensorboard")
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm.sbatch"), *argv], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 questions, 1 steps, 2 processes on cpu" in done.stderr
    run = tmp_path / "out" / "run"
    assert [m["kind"] for m in rows(run, "metrics.jsonl")] == ["eval", "train", "eval"]
    assert len(list((run / "t3rl").glob("events.out.tfevents.*"))) == 1
    assert [step for step, _ in tensorboard_scalars(run / "t3rl")["greedy@1"]] == [0, 1]


LAUNCHED = """import sys
sys.path.insert(0, {root!r})
import torch.distributed as dist
import grpo
grpo.bf16_supported = lambda device: False  # float32 updates: equal whatever the micro-batches hold
import dataclasses
import t3rl
import verifier
verifier.MATH = dataclasses.replace(verifier.MATH, extract=lambda text, problem: str(len(text) % 3))
t3rl.build_verifier = lambda cfg, device, **kw: (lambda prompts: ["```python\\nprint(1 + 1)\\n```" for _ in prompts])
t3rl.main()
print(f"process {{dist.get_rank()}} of {{dist.get_world_size()}} done")
"""


@pytest.fixture()
def sharp_dir(tmp_path_factory, tokenizer):
    """The tiny model with an untied head scaled 20x. One and several processes' updates differ by float
    rounding (summation order); sampled in float32 from peaked next-token distributions, that cannot flip a
    drawn token, as it can on a near-flat distribution over 152k tokens or in bfloat16 (where a weight whose
    rounding flips moves logits by 2^-8)."""
    folder = tmp_path_factory.mktemp("sharp")
    model = make_tiny_model(len(tokenizer), tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def train_like_one(model_dir, tmp_path, monkeypatch, processes, questions, **options):
    """Train with `processes` real processes (torchrun, gloo) and in this one process; both run folders."""
    write_bench(tmp_path / "data", questions)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    # float32 updates: bfloat16 autocast rounds alike only for the same micro-batches, and the processes cut them
    # differently
    monkeypatch.setattr(grpo, "bf16_supported", lambda device: False)
    options = dict(sample_dtype="float32", **options)
    one = t3rl.train(parse_config(tiny_argv(model_dir, tmp_path / "one", **options)))
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED.format(root=str(ROOT)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
           str(script), *tiny_argv(model_dir, tmp_path / "many", **options)]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # the world size, as each process saw it inside the run
    seen = re.findall(r"process (\d+) of (\d+) done", done.stdout)  # the processes' lines may interleave
    assert sorted(seen) == [(str(rank), str(processes)) for rank in range(processes)]
    return one, tmp_path / "many" / "run"


def assert_trained_alike(one, many):
    """Same rollouts, same metrics (the update's statistics to float tolerance), weights to tolerance."""
    key = lambda r: (r["step"], r["id"], r["index"])  # noqa: E731
    assert sorted(rows(one, "rollouts.jsonl"), key=key) == sorted(rows(many, "rollouts.jsonl"), key=key)
    a, b = without_timing(rows(one, "metrics.jsonl")), without_timing(rows(many, "metrics.jsonl"))
    assert [{k: v for k, v in r.items() if not k.startswith("grpo/")} for r in a] == \
        [{k: v for k, v in r.items() if not k.startswith("grpo/")} for r in b]
    for ra, rb in zip(a, b):
        assert {k: pytest.approx(v, rel=1e-3, abs=1e-6) for k, v in ra.items() if k.startswith("grpo/")} == \
            {k: v for k, v in rb.items() if k.startswith("grpo/")}
    # AdamW moves a weight by about lr whatever its gradient's size, so where a gradient is at rounding level
    # the summation order shows as a small fraction of lr (1e-3 here)
    w1, w2 = final_weights(one), final_weights(many)
    assert all(torch.allclose(w1[k], w2[k], rtol=1e-4, atol=1e-5) for k in w1)


@pytest.mark.slow
def test_three_processes_on_steps_of_two_questions_train_like_one(sharp_dir, tmp_path, monkeypatch, patched):
    """Every step leaves one process without a question; two optimizer steps per step, the second against the
    log-probs of the policy that sampled (ratio != 1)."""
    one, many = train_like_one(sharp_dir, tmp_path, monkeypatch, 3, QUESTIONS, max_steps=2, eval_samples=0,
                               mini_batch_questions=1)
    assert_trained_alike(one, many)
    train_rows = [r for r in rows(many, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["grpo/optimizer_steps"] for r in train_rows] == [2, 2]
    assert any(abs(r["grpo/ratio"] - 1) > 1e-4 for r in train_rows)


@pytest.mark.slow
def test_four_processes_on_steps_of_one_question_train_like_one(sharp_dir, tmp_path, monkeypatch, patched):
    """Steps of one question for four processes: three of them hold no rollout in each step and still join
    every collective."""
    one, many = train_like_one(sharp_dir, tmp_path, monkeypatch, 4, QUESTIONS[:2], episodes=1, max_steps=0,
                               questions_per_step=1, eval_samples=0, verifier_model="none")
    assert_trained_alike(one, many)
    train_rows = [r for r in rows(many, "metrics.jsonl") if r["kind"] == "train"]
    assert [r["questions"] for r in train_rows] == [1, 1]
