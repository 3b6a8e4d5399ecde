"""Helpers shared by the test files: fake servers, scripted verifiers, tiny benchmarks and runs."""
import hashlib
import http.server
import json
import os
import shutil
import threading
import urllib.parse
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import t3rl
from verifier import ToVerify


class FakeHub(http.server.ThreadingHTTPServer):
    """The Hub's HTTP API as huggingface_hub uses it (repo info, file tree, file downloads), on 127.0.0.1, serving
    `files` {repo: {path: bytes}} of `kind` "datasets" or "models"; `requests` records (path, Authorization header)
    for each request about a served repo."""

    def __init__(self, files, kind="datasets"):
        self.files, self.kind, self.requests = files, kind, []
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        self.url = f"http://127.0.0.1:{self.server_port}"
        threading.Thread(target=self.serve_forever, daemon=True).start()


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    commit = "0123456789abcdef0123456789abcdef01234567"

    def do_GET(self):
        path = urllib.parse.urlparse(self.path).path
        kind = self.server.kind
        for repo, files in self.server.files.items():
            if repo in path:
                self.server.requests.append((path, self.headers.get("authorization")))
            if path.startswith(f"/api/{kind}/{repo}/revision/"):
                return self.reply({"id": repo, "sha": self.commit, "siblings": [{"rfilename": f} for f in files]})
            if path.startswith(f"/api/{kind}/{repo}/tree/"):
                return self.reply([{"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                                   for f, data in files.items()])
            name = path.removeprefix(f"{'/datasets' if kind == 'datasets' else ''}/{repo}/resolve/{self.commit}/")
            if name in files:
                etag = f'"{hashlib.sha1(files[name]).hexdigest()}"'
                return self.reply(files[name], {"X-Repo-Commit": self.commit, "ETag": etag})
        if path.startswith(f"/api/{kind}/"):  # what the Hub answers about a repository it does not have
            return self.reply(b"", {"X-Error-Code": "RepoNotFound"}, status=401)
        self.reply(b"", status=404)

    do_HEAD = do_GET

    def reply(self, body, headers=(), status=200):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for key, value in dict(headers).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def sample(model, tokenizer, prompts, n=1, max_new_tokens=16, *, temperature=0.6, top_p=0.95, seed=None,
           backend="kv", ignore_eos=False, dtype=None, memory_budget=None):
    """generate through sampler.py (backend kv or hf), extensions/kv_fast.py (kv-fast, with its wave
    memory budget) or extensions/engine.py (vllm), the sampling settings as keywords."""
    import sampler
    from extensions import kv_fast
    sampling = sampler.Sampling(max_new_tokens, temperature, top_p, dtype, ignore_eos)
    if backend == "vllm":
        from extensions import engine
        return engine.generate(model, tokenizer, prompts, n, sampling, seed=seed)
    if backend != "kv-fast":
        return sampler.generate(model, tokenizer, prompts, n, sampling, seed=seed, backend=backend)
    budget, kv_fast.SETTINGS.memory_budget = kv_fast.SETTINGS.memory_budget, memory_budget
    try:
        return kv_fast.generate(model, tokenizer, prompts, n, sampling, seed=seed)
    finally:
        kv_fast.SETTINGS.memory_budget = budget


def token_rows(result):
    return [[c.token_ids for c in group] for group in result]


def small_vocab_model(vocab_size=48, logit_scale=10.0):
    """A tiny Qwen2 over `vocab_size` tokens whose head is scaled so its next-token distribution is far from flat.

    (make_tiny_model's special-token ids need the real 152k vocabulary, hence its own config here.)
    """
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=vocab_size - 1, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


SMALL_PROMPTS = [[3, 17, 29, 5, 8], [11], [40, 2, 2]]


class ScriptedVerifier:
    """Answers each batch with the given completions, in order, and records what it was asked."""

    def __init__(self, *completions):
        self.completions = list(completions)
        self.batches = []

    def __call__(self, prompts):
        self.batches.append(list(prompts))
        out, self.completions = self.completions[:len(prompts)], self.completions[len(prompts):]
        return out


# the question the verifier's tests verify rollouts of, a rollout of it, and programs for it
PROBLEM = "What is the sum of the integers from 1 to 10?"
ROLLOUT = "Pairing 1+10, 2+9, ... gives 5 pairs of 11, so the sum is $\\boxed{55}$."
RIGHT, WRONG, RAISES = "print(sum(range(1, 11)))", "print(sum(range(1, 10)))", "print(55 / 0)"


def rollouts(*answers, seed=None, step=-1):
    """Rollouts of question q0 with these answers (the same reasoning), as the loop hands them over."""
    return [ToVerify(PROBLEM, ROLLOUT, answer, "q0", seed, step) for answer in answers]


GUARD_PROBLEM = "A club of 12 members picks 3 officers; each of the 11 committees meets 120 times. Find the count."


ROOT = Path(__file__).resolve().parent.parent  # the repository


QUESTIONS = [("What is 1 + 1?", "2"), ("What is 2 + 2?", "4"), ("What is 3 + 3?", "6"), ("What is 4 + 4?", "8")]


def verify_batch(problems, texts, answers, verifier, domain, pool=None, budget=0, omega=None, groups=None,
                 seeds=None):
    """Verify rollouts as a run does (t3rl.verify_function): the paper's, with a budget or lazily at omega
    where given; rollouts of one problem (or of one group) vote together."""
    import config
    import verifier as verifier_module
    batch = [verifier_module.ToVerify(p, t, a, g, s) for p, t, a, g, s in
             zip(problems, texts, answers, groups or problems, seeds or [None] * len(problems))]
    cfg = config.Config(verify_budget=budget, lazy_verify=omega is not None, omega=omega or 1.0)
    return t3rl.verify_function(cfg, verifier, pool, domain)(batch, [None] * len(batch))


def fake_answer(text):
    """The tiny random model never writes \\boxed{}; give each rollout a deterministic answer from its text
    so that votes, rewards and the GRPO update are not all trivial."""
    return str(len(text) % 3)


def scripted_verifier(prompts):
    """A verifier that always writes the same program: rollouts answering 2 get verified."""
    return ["```python\nprint(1 + 1)\n```" for _ in prompts]


def write_bench(folder: Path, questions):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "demo.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "problem": p, "answer": a}) + "\n" for i, (p, a) in enumerate(questions)))


def tiny_argv(tiny_dir, out_dir, **extra):
    # top-p 1: a tiny random model's near-uniform distribution puts every token of 152k in the nucleus, and
    # ranking them all costs more than the rest of its step (test_sampler.py tests top-p)
    options = dict(preset="cpu", model=str(tiny_dir), verifier_model="self", bench="demo", n_votes=4, n_train=2, questions_per_step=2,
                   max_steps=4, max_new_tokens=12, verifier_max_new_tokens=8, lr=1e-3, save_every=2,
                   eval_samples=2, eval_every=0, out_dir=str(out_dir), run_name="run", backend="kv", sample_dtype="bfloat16",
                   grad_checkpointing=False, top_p=1.0)
    options.update(extra)
    flag = lambda k: "--" + k.replace("_", "-")  # noqa: E731
    return [(flag(k) if v else "--no-" + k.replace("_", "-")) if isinstance(v, bool) else f"{flag(k)}={v}"
            for k, v in options.items()]


def rows(run_dir, name):
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def without_timing(metrics):
    return [{k: v for k, v in r.items() if not k.startswith(("seconds/", "grpo/seconds"))} for r in metrics]


def final_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(run_dir / "checkpoint" / "model" / "model.safetensors")


@contextmanager
def interrupted_at_update(monkeypatch, update: int):
    """Ctrl-C in the middle of the update-th GRPO update of whatever runs in the block."""
    real_step, calls = t3rl.grpo_step, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == update:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)
    monkeypatch.setattr(t3rl, "grpo_step", interrupted)
    try:
        yield
    finally:
        monkeypatch.setattr(t3rl, "grpo_step", real_step)


def tensorboard_scalars(folder: Path) -> dict:
    """{tag: [(step, value), ...]} from the TensorBoard event files in a folder, as TensorBoard itself reads them
    (events a resumed writer purged are dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(folder)).Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def copy_run(run: Path, dest: Path, final=True, upto=None) -> Path:
    """A copy of the finished run; without its final evaluation, or cut back to its step-`upto` checkpoint
    (what a kill leaves behind)."""
    shutil.copytree(run, dest)
    if upto is not None:
        shutil.rmtree(dest / "checkpoint")
        os.replace(dest / "checkpoint.old", dest / "checkpoint")
    keep = lambda r: (final or not r.get("final")) and (upto is None or r["step"] < upto or r.get("kind") == "eval" and r["step"] == 0)  # noqa: E731,E501
    for name in ("metrics.jsonl", "rollouts.jsonl"):
        (dest / name).write_text("".join(json.dumps(r) + "\n" for r in rows(dest, name) if keep(r)))
    return dest


def make_tiny_model(vocab_size: int, seed: int = 0, tie_word_embeddings: bool = True, **shape):
    """shape: Qwen2Config sizes that differ from the tiny default (hidden 64, 4 heads of 16, 2 key/value heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    sizes = {**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2), **shape}
    config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings,
                         bos_token_id=151643, eos_token_id=151645, pad_token_id=151643, **sizes)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    return model


def write_tiny_qwen2_gguf(path, name="tiny qwen2"):
    """A whole Qwen2 GGUF a transformers load converts: 2 layers of 32, float32 weights, a byte-level BPE
    tokenizer of 260 tokens (the 256 bytes, one merge, three specials) with a chat template."""
    import gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]  # GPT-2's byte-to-unicode map
    tokens = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(rest))]
    tokens += ["Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    layers = 2
    config = Qwen2Config(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    state = Qwen2ForCausalLM(config).float().state_dict()
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(name)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_pad_token_id(len(tokens) - 3)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    whole = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    part = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
            "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, tensor in state.items():
        if key not in whole:
            _, _, layer, *module, kind = key.split(".")
            whole[key] = f"blk.{layer}.{part['.'.join(module)]}.{kind}"
        writer.add_tensor(whole[key], tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
