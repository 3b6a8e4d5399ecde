"""launch/device-check, the check for the GPU machine, run dry on this CPU (run.sh --dry): the
committed model files with tiny shapes (2 layers, hidden 64), gloo, a few tokens. Every check must
print its line with what proves it ran; a check removed, added or broken fails here."""
import gzip
import json
import os
import re
import subprocess

import pytest

from helpers import ROOT, rows

CHECK = ROOT / "launch" / "device-check"
ABSENT = "imported none of gguf, z3, vllm"
# each check, in the order run.sh runs them, and what its line says after "ok in N s: "
EXPECTED = {
    "math-verify": r"math-verify [\d.]+ from .+, reached by is_equiv through its helper process",
    "sandbox": r"a program ran in the sandbox, whose warm workers imported ",
    "models": r"policy and verifier: Qwen2ForCausalLM, [\d,]+ parameters, random bfloat16 weights",
    "sample-policy": r"policy: 1 prompt\(s\) of \d+ tokens x 4 of 8 new tokens, [\d,]+ tokens/s "
                     r"\([\d.]+ s\), peak GPU memory n/a \(cpu\)",
    "sample-verifier": r"verifier: 4 prompt\(s\) of 24 tokens x 1 of 8 new tokens, [\d,]+ tokens/s",
    "update-ddp": r"ddp \(DistributedDataParallel, 1 process, cpu\S*\): 4 rollouts x \(12 \+ 8\) "
                  r"tokens, micro-batches of 2, token-mean, bf16 \w+, checkpointing True: [\d.]+ s",
    "update-fsdp": r"fsdp \(FSDP2 fully_shard, 1 process, cpu\S*\): 4 rollouts x \(12 \+ 8\) "
                   r"tokens, micro-batches of 2, token-mean, bf16 \w+, checkpointing True",
    "run-stopped": r"stopped in step 1's update \(exit [1-9]\d*\): steps '0', a checkpoint after "
                   r"step 1",
    "run-resumed": r"'resuming after step 1', then steps '0 1 final', each once",
}


@pytest.mark.slow
def test_dry_run_runs_every_check(tmp_path):
    done = subprocess.run(["bash", str(CHECK / "run.sh"), "--dry"], cwd=ROOT, text=True,
                          env={**os.environ, "WORK_DIR": str(tmp_path)}, capture_output=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    lines = dict(re.findall(r"^check (\S+): (.*)$", done.stdout, re.MULTILINE))
    assert list(lines) == list(EXPECTED), done.stdout
    for name, line in lines.items():
        assert re.match(rf"ok in \d+ s: .*{EXPECTED[name]}", line), (name, line)
        assert ABSENT in line, (name, line)
    assert re.search(r"^device check: ok in \d+ s", done.stdout, re.MULTILINE)
    # the resumed run, read back from its own folder and log: steps 0 and 1 once each, step 0's
    # evaluation not redone
    run = tmp_path / "runs" / "resume"
    metrics = rows(run, "metrics.jsonl")
    assert [r["step"] for r in metrics if r["kind"] == "train"] == [0, 1]
    assert [r["step"] for r in metrics if r["kind"] == "eval"] == [0, 2]
    assert "resuming after step 1" in (tmp_path / "run-resumed.log").read_text()
    assert "interrupted: " in (tmp_path / "run-stopped.log").read_text()


def test_model_files_have_the_papers_shapes():
    shared = dict(architectures=["Qwen2ForCausalLM"], hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  vocab_size=151936, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643)
    own = {"qwen2.5-math-1.5b": dict(max_position_embeddings=4096, rope_theta=10000.0,
                                     eos_token_id=151643),
           "qwen2.5-coder-1.5b-instruct": dict(max_position_embeddings=32768,
                                               rope_theta=1000000.0, eos_token_id=151645)}
    for folder, values in own.items():
        config = json.loads((CHECK / folder / "config.json").read_text())
        assert {key: config[key] for key in {**shared, **values}} == {**shared, **values}
    math_template = json.loads(
        (CHECK / "qwen2.5-math-1.5b" / "tokenizer_config.json").read_text())["chat_template"]
    assert "Please reason step by step, and put your final answer within \\\\boxed{}." in \
        math_template
    packed = CHECK / "tokenizer.json.gz"
    assert packed.stat().st_size < 3_000_000
    with gzip.open(packed) as tokenizer:
        assert json.load(tokenizer)["model"]["type"] == "BPE"
