"""config.py: options, presets, the command line, and bad inputs answered in one line."""
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config
from machinery import options
from machinery.options import parse_config
import machinery
import t3rl
from helpers import ROOT, copy_run, tiny_argv
from machinery.runs import verifier_line


def test_unknown_option_is_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--no-such-option", "1"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


def test_cpu_preset_is_picked_without_gpu_and_explicit_options_win():
    cfg = parse_config(["--n-votes", "16"])
    assert cfg.preset == "cpu" and cfg.model == "embedded" and cfg.bench == "demo"
    assert cfg.verifier_model == "coder-1.5b"
    assert cfg.n_votes == 16 and cfg.n_train == config.PRESETS["cpu"]["n_train"]


@pytest.mark.parametrize("argv,loaded", [([], ["coder-1.5b"]), (["--verifier-model", "self"], ["embedded"])])
def test_cpu_preset_verifies_with_the_1_5b_and_self_verification_loads_the_policy(monkeypatch, argv, loaded):
    seen = []

    def load_model(spec, dtype=None):
        seen.append(spec)
        return torch.nn.Linear(2, 2), None
    monkeypatch.setattr(machinery.model, "load_model", load_model)
    monkeypatch.setattr(t3rl, "model_verifier", lambda model, tok, **kw: ("verifier", model, kw["max_new_tokens"]))
    cfg = parse_config(argv)
    verifier = t3rl.build_verifier(cfg, torch.device("cpu"))
    assert seen == loaded and verifier[0] == "verifier" and verifier[2] == cfg.verifier_max_new_tokens


def test_the_verifier_samples_at_its_own_top_p_not_the_policys(monkeypatch):
    """TTRL's preset samples rollouts at top-p 1.0; the verifier keeps the 0.95 it was measured at."""
    monkeypatch.setattr(machinery.model, "load_model", lambda spec, dtype=None: (torch.nn.Linear(2, 2), None))
    monkeypatch.setattr(t3rl, "model_verifier", lambda model, tok, **kw: kw)
    cfg = parse_config(["--preset", "ttrl", "--verify", "--verifier-model", "coder-1.5b"])
    assert cfg.top_p == 1.0 and t3rl.build_verifier(cfg, torch.device("cpu"))["top_p"] == 0.95
    cfg = parse_config(["--verifier-top-p", "0.8"])
    assert t3rl.build_verifier(cfg, torch.device("cpu"))["top_p"] == 0.8


@pytest.mark.parametrize("native,dtype", [(True, "bfloat16"), (False, "float32")])
def test_a_new_run_fixes_its_sampling_dtype_in_its_config(monkeypatch, native, dtype, tmp_path, capsys):
    """--sample-dtype auto is decided once, when the run starts, and saved: a resume samples in the same dtype
    on any machine, and says so where that machine has no native bfloat16."""
    monkeypatch.setattr(options, "bf16_supported", lambda device: native)
    cfg = parse_config(["--out-dir", str(tmp_path)])
    assert cfg.sample_dtype == dtype and options.sample_dtype(cfg) == getattr(torch, dtype)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(vars(cfg)))
    monkeypatch.setattr(options, "bf16_supported", lambda device: not native)  # the run moves to another machine
    resumed = parse_config(["--resume", str(tmp_path / "run")])
    assert resumed.sample_dtype == dtype
    warned = "which this machine runs without native support" in capsys.readouterr().err
    assert warned == (dtype == "bfloat16")


def test_paper_preset_follows_the_paper():
    cfg = parse_config(["--preset", "paper", "--bench", "aime2024"])
    assert (cfg.n_votes, cfg.n_train, cfg.temperature, cfg.top_p) == (64, 32, 0.6, 0.95)
    assert (cfg.max_new_tokens, cfg.verifier_max_new_tokens, cfg.lr, cfg.kl_coef, cfg.omega) == (2560, 1024, 5e-7, 0.0, 5.0)
    assert (cfg.episodes, cfg.eval_samples) == (80, 16)
    assert (cfg.mini_batch_questions, cfg.warmup_ratio, cfg.clip_low, cfg.clip_high) == (1, 0.03, 0.2, 0.2)  # TTRL's scripts
    # where the paper is silent, TTRL's scripts: prompts per step, the schedule, the evaluation, drop_last
    assert (cfg.questions_per_step, cfg.lr_schedule_unit, cfg.drop_last, cfg.answer_rule) == (8, "step", True, "strict")
    assert (cfg.eval_every, cfg.eval_temperature, cfg.eval_top_p) == (2, 0.6, 0.95)
    assert parse_config(["--preset", "paper", "--bench", "amc"]).episodes == 30
    assert parse_config(["--preset", "paper"]).questions_per_step == 32


PAPERS_VERIFIER = dict(verifier_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", verifier_programs=1,
                       verifier_repair=False, verdict_memory=False, verify_budget=0,
                       lazy_verify=False, verifier_max_new_tokens=1024, verifier_temperature=0.6,
                       verifier_top_p=0.95)


@pytest.mark.parametrize("argv", [["--preset", "paper"], ["--preset", "ttrl", "--verify", "--omega", "5"]])
def test_paper_and_ttrl_presets_verify_as_the_paper(argv):
    """One program per rollout, no repair, no memory, every rollout verified: every verifier field, and the
    line a run prints about it."""
    cfg = parse_config(argv + ["--bench", "demo"])
    assert {key: getattr(cfg, key) for key in PAPERS_VERIFIER} == PAPERS_VERIFIER
    assert cfg.verify and cfg.omega == 5.0
    assert verifier_line(cfg) == ("verifier Qwen/Qwen2.5-Coder-1.5B-Instruct: 1 program per rollout, "
                                  "no repair, no memory, every rollout verified, 1024 tokens at T 0.6 / top-p 0.95")


def test_ttrl_preset_is_ttrls_scripts():
    """TTRL's verl/examples/ttrl/Qwen2.5-Math/{math,amc,aime}.sh and verl's defaults (README's preset table)."""
    cfg = parse_config(["--preset", "ttrl", "--bench", "aime2024"])
    assert (cfg.model, cfg.verify, cfg.omega, cfg.n_votes, cfg.n_train) == ("Qwen/Qwen2.5-Math-1.5B", False, 1.0, 64, 32)
    assert (cfg.temperature, cfg.top_p, cfg.max_new_tokens) == (1.0, 1.0, 3072)
    assert (cfg.lr, cfg.warmup_ratio, cfg.lr_schedule_unit, cfg.mini_batch_questions) == (5e-7, 0.03, "step", 1)
    assert (cfg.kl_coef, cfg.clip_low, cfg.clip_high, cfg.clip_ratio_c) == (0.001, 0.2, 0.2, 3.0)
    assert (cfg.eval_every, cfg.eval_samples, cfg.eval_temperature, cfg.eval_top_p) == (2, 16, 0.6, 0.95)
    assert (cfg.drop_last, cfg.answer_rule, cfg.questions_per_step, cfg.episodes) == (True, "strict", 8, 80)
    # verl's update_policy: a token-mean per micro-batch of 2 rollouts (ppo_micro_batch_size_per_gpu=2)
    assert (cfg.loss_agg, cfg.micro_batch_rollouts) == ("token-mean", 2)
    paper = parse_config(["--preset", "paper"])  # silent: TTRL's scripts
    assert (paper.loss_agg, paper.micro_batch_rollouts) == ("token-mean", 2)
    assert parse_config(["--preset", "cpu"]).loss_agg == "dapo"
    assert [(c.questions_per_step, c.episodes) for c in (parse_config(["--preset", "ttrl", "--bench", b])
                                                         for b in ("math500", "amc"))] == [(32, 10), (8, 30)]
    assert parse_config(["--preset", "ttrl", "--temperature", "0.6"]).temperature == 0.6  # options win


def test_last_number_rule_is_refused_for_knights_and_knaves():
    with pytest.raises(config.OptionError, match="--answer-rule last-number: reads numbers, for math benchmarks only"):
        parse_config(["--bench", "knk", "--answer-rule", "last-number"])


def test_every_option_is_read_by_the_run():
    """An option nothing reads does nothing (--sandbox-timeout once did): each Config field is read as cfg.<name>
    somewhere in the library, besides the preset that picks the others."""
    source = "\n".join(path.read_text() for path in [*ROOT.glob("*.py"), *ROOT.glob("machinery/*.py")])
    unread = [name for name in config.Config.__dataclass_fields__
              if name != "preset" and not re.search(rf"\bcfg\.{name}\b(?!\s*=[^=])", source)]
    assert unread == []


def test_omega_inf_and_no_verify_parse():
    cfg = parse_config(["--omega", "inf", "--no-verify"])
    assert cfg.omega == float("inf") and cfg.verify is False


def test_help_lists_every_option_with_its_default():
    out = subprocess.run([sys.executable, "t3rl.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    for name in config.Config.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out
    assert "(default: 5.0)" in out and "--replay" in out


def test_report_to_names_unknown_and_missing_trackers(monkeypatch):
    with pytest.raises(config.OptionError, match="--report-to tensorbored: choose from"):
        parse_config(["--report-to", "tensorbored"])
    monkeypatch.setattr(options, "get_available_trackers", lambda: [])
    with pytest.raises(config.OptionError, match="--report-to tensorboard: the tensorboard package is not installed; "
                                               "pip install tensorboard"):
        parse_config(["--report-to", "tensorboard,wandb"])


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


Q = lambda i, problem="What is 1 + 1?", **extra: json.dumps({"id": f"q{i}", "problem": problem, "answer": "2", **extra})  # noqa: E731,E501


# (name, the bad input: ctx -> argv, the line it must get)
BAD_INPUTS = [
    ("limit", lambda c: argv_for(c, limit=-5), r"--limit -5: must be in \[0, inf\)"),
    ("max-steps", lambda c: argv_for(c, max_steps=-1), r"--max-steps -1: must be in \[0, inf\)"),
    ("omega nan", lambda c: argv_for(c, omega="nan"), r"--omega nan: must be in \[1, inf\]"),
    ("omega below 1", lambda c: argv_for(c, omega=0.5), r"--omega 0.5: must be in \[1, inf\]"),
    ("omega list", lambda c: argv_for(c, "--omega", "1", "5"), r"--omega 1 5: one value for a run \(several only with --replay"),
    ("max-new-tokens", lambda c: argv_for(c, max_new_tokens=0), r"--max-new-tokens 0: must be in \[1, inf\)"),
    ("lr negative", lambda c: argv_for(c, lr=-1), r"--lr -1.0: must be in \[0, inf\)"),
    ("lr inf", lambda c: argv_for(c, lr="inf"), r"--lr inf: must be in \[0, inf\)"),
    ("questions-per-step", lambda c: argv_for(c, questions_per_step=0), r"--questions-per-step 0: must be in \[1, inf\)"),
    ("top-p", lambda c: argv_for(c, top_p=2), r"--top-p 2.0: must be in \(0, 1\]"),
    ("temperature", lambda c: argv_for(c, temperature=-1), r"--temperature -1.0: must be > 0; GRPO's ratio needs"),
    ("temperature 0", lambda c: argv_for(c, temperature=0), r"--temperature 0.0: must be > 0; GRPO's ratio needs the "
                                                            r"log-probs .*greedy@1 is evaluated anyway"),
    ("verifier-top-p", lambda c: argv_for(c, verifier_top_p=0), r"--verifier-top-p 0.0: must be in \(0, 1\]"),
    ("verify-budget", lambda c: argv_for(c, verify_budget=-1), r"--verify-budget -1: must be in \[0, inf\)"),
    ("verifier-programs", lambda c: argv_for(c, verifier_programs=0), r"--verifier-programs 0: must be in \[1, inf\)"),
    ("verdict-attempts", lambda c: argv_for(c, verdict_attempts=1), r"--verdict-attempts 1: must be in \[2, inf\)"),
    ("eval-samples", lambda c: argv_for(c, eval_samples=-1), r"--eval-samples -1: must be in \[0, inf\)"),
    ("question-ids missing", lambda c: argv_for(c, question_ids=str(c["tiny"] / "no-such.txt")),
     r"--question-ids .*no-such.txt: no such file; pass a file with one question id a line"),
    ("eval-cache a file", lambda c: argv_for(c, eval_cache=str(c["tiny"] / "config.json")),
     r"--eval-cache .*config.json: a file, not a folder; pass a folder \(it is created\), auto or none"),
    ("eval-on", lambda c: argv_for(c, eval_on="test"), r"--eval-on test: choose one of trained, all, held-out"),
    ("episodes", lambda c: argv_for(c, episodes=0), r"--episodes 0: must be in \[1, inf\)"),
    ("save-every", lambda c: argv_for(c, save_every=0), r"--save-every 0: must be in \[1, inf\)"),
    ("n-votes", lambda c: argv_for(c, n_votes=0), r"--n-votes 0: must be in \[1, inf\)"),
    ("n-train one", lambda c: argv_for(c, n_train=1), r"--n-train 1: must be in \[2, inf\)"),
    ("n-train above n-votes", lambda c: argv_for(c, n_train=5), r"--n-train 5: must be at most --n-votes \(4\)"),
    ("warmup-ratio", lambda c: argv_for(c, warmup_ratio=1.5), r"--warmup-ratio 1.5: must be in \[0, 1\]"),
    ("sandbox-timeout", lambda c: argv_for(c, sandbox_timeout=0), r"--sandbox-timeout 0.0: must be in \(0, inf\)"),
    ("seed", lambda c: argv_for(c, seed=-1), r"--seed -1: must be in \[0, 4294967295\]"),
    ("bench", lambda c: argv_for(c, bench="gsm8k"), r"--bench gsm8k: choose one of math500, aime2024, amc, demo, knk"),
    ("backend", lambda c: argv_for(c, backend="tpu"), r"--backend tpu: choose one of kv, hf"),
    ("verifier-model", lambda c: argv_for(c, verifier_model="nonexistent"), r"--verifier-model nonexistent: not a folder"),
    ("model folder", lambda c: argv_for(c, model="./no/such/folder"), r"--model ./no/such/folder: not a folder"),
    ("model not gguf", lambda c: (c["tmp"] / "m.gguf").write_bytes(b"PK\x03\x04") and argv_for(c, model=c["tmp"] / "m.gguf"),
     r"--model .*m.gguf: not a GGUF file \(bad magic\)"),
    ("out-dir is a file", lambda c: (c["tmp"] / "f").write_text("x") and argv_for(c, out_dir=c["tmp"] / "f"),
     r"--out-dir .*/f: cannot write the run folder .*; pass a writable --out-dir"),
    ("out-dir under /proc", lambda c: argv_for(c, out_dir="/proc/t3rl-runs"), r"--out-dir /proc/t3rl-runs: cannot write"),
    ("reused run name", lambda c: argv_for(c, out_dir=run_copy(c).parent),
     r"run folder .*/run already holds a run; continue it with --resume .*/run, or pick another --run-name"),
    ("resume a finished run", lambda c: ["--resume", str(run_copy(c))], r"the run is finished .*read it with --replay"),
    ("resume with other options", lambda c: ["--resume", str(run_copy(c, final=False)), "--lr", "0.5", "--n-votes=8"],
     r"--lr 0.5 \(the run has 0.001\); --n-votes 8 \(the run has 4\); a resumed run keeps its config.json"),
    ("resume without config.json", lambda c: (run_copy(c, final=False) / "config.json").unlink() or ["--resume", str(c["run"])],
     r"--resume .*/run: no config.json in it; pass a run folder written by t3rl.py"),
    ("resume a damaged config.json", lambda c: (run_copy(c, final=False) / "config.json").write_text('{"lr": ') and
     ["--resume", str(c["run"])], r"run/config.json: damaged .*restore it"),
    ("resume a config.json edited wrong", lambda c: ["--resume", str(edit_config(run_copy(c, final=False), lr=-1))],
     r"run/config.json: --lr -1: must be in \[0, inf\)"),
    ("resume no folder", lambda c: ["--resume", str(c["tmp"] / "nothing")], r"--resume .*/nothing: no such folder"),
    ("replay with training options", lambda c: ["--replay", str(run_copy(c)), "--lr", "1"], r"--replay takes only --omega; drop --lr"),
    ("replay an empty folder", lambda c: ["--replay=" + str(c["tmp"])], r"--replay .*: no config.json there"),
    ("replay bad omega", lambda c: ["--replay", str(run_copy(c)), "--omega", "5", "0"], r"--omega 0.0: must be in \[1, inf\]"),
    ("replay damaged rollouts", lambda c: (run_copy(c) / "rollouts.jsonl").write_text('{"step": 0}\n{"ste\n{"step": 1}\n') and
     ["--replay", str(c["run"])], r"rollouts.jsonl:2: invalid JSON .*fix or delete that line"),
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
        monkeypatch.setattr(machinery.model, "load_model", lambda *a, **k: loaded.append(a) or pytest.fail("a model was loaded"))
    monkeypatch.setattr(t3rl, "build_verifier", lambda *a: pytest.fail("the verifier was loaded"))
    before = snapshot(ctx["run"]) if ctx["run"] else None
    with pytest.raises(SystemExit) as stop:
        t3rl.main(argv)
    message = str(stop.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    assert re.search(line, message), message
    assert not loaded
    if before is not None:
        assert snapshot(ctx["run"]) == before  # nothing of the run was touched


def test_the_table_covers_thirty_bad_inputs_and_every_option_has_a_range():
    assert len(BAD_INPUTS + NEEDS_A_MODEL) >= 30
    for f in dataclasses.fields(config.Config):
        # free text, checked elsewhere: model names by check_spec, tracker names by check_config
        free_text = f.name in ("model", "verifier_model", "out_dir", "run_name", "resume", "report_to", "eval_cache",
                                    "question_ids")
        assert f.type in (bool, "bool") or free_text or f.metadata["allowed"] is not None, f"--{f.name} has no range"


@pytest.mark.parametrize("argv,named", [(["--backend", "vllm"], "--backend vllm"),
                                        (["--verifier-backend", "vllm"], "--verifier-backend vllm")])
def test_the_engine_asked_for_without_vllm_installed_is_one_line_naming_what_to_install(argv, named, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # find_spec answers None: as where vLLM is not installed
    with pytest.raises(SystemExit) as stop:
        t3rl.main(["--preset", "cpu", *argv])
    message = str(stop.value.code)
    assert message.startswith(f"error: {named}: vLLM is not installed") and "\n" not in message
    assert "requirements-vllm-cpu.txt" in message


def test_the_paper_preset_samples_on_the_engine_only_where_vllm_is_installed(monkeypatch):
    monkeypatch.setattr(options, "check_spec", lambda *a: None)  # the paper's Hub models need not be here
    monkeypatch.setattr(options, "vllm_installed", lambda: True)
    cfg = parse_config(["--preset", "paper"])
    assert (cfg.backend, cfg.verifier_backend) == ("vllm", "vllm")
    monkeypatch.setattr(options, "vllm_installed", lambda: False)
    cfg = parse_config(["--preset", "paper"])
    assert (cfg.backend, config.verifier_backend(cfg)) == ("kv", "kv")


def test_importance_sampling_correction_needs_the_engine():
    with pytest.raises(config.OptionError, match="--vllm-is-correction.*--backend vllm"):
        parse_config(["--preset", "cpu", "--vllm-is-correction"])
