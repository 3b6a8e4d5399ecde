"""agent.py and the tool calls of the samplers: a policy's ```python block runs in the sandbox and its output is
appended before the policy goes on; the update trains only the policy's own tokens."""
import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import t3rl
from answers import extract_answer
from config import Config, parse_config
from extensions import agent, kv_fast, study
from extensions.agent import Interpreter, ToolCall
from grpo import Rollouts, grpo_step, make_optimization, pad_batch, policy_loss
from helpers import (QUESTIONS, final_weights, interrupted_at_update, make_tiny_model, rows, small_vocab_model,
                     tiny_argv, without_timing, write_bench)
from sampler import Sampling
from sandbox import SandboxPool
from verifier import MATH


class ScriptedPolicy(Qwen2ForCausalLM):
    """A policy that writes `script` (token ids), whatever else its context holds: its next token is the script's
    first token not yet matched, in order, by its completion so far (tokens a tool appended match nothing of
    the script's next part, so they are stepped over), then end-of-sequence. Sampled through "hf" (the kv
    sampler reads a model's weights, which do not hold the script)."""

    def __init__(self, tokenizer, script: str, prompt_length: int):
        config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=1, num_key_value_heads=1, eos_token_id=tokenizer.eos_token_id)
        super().__init__(config)
        self.generation_config.eos_token_id = tokenizer.eos_token_id
        self.script = [tokenizer(part, add_special_tokens=False).input_ids for part in script.split("|")]
        self.script = [t for part in self.script for t in part]
        self.prompt_length, self.context = prompt_length, []

    def forward(self, input_ids=None, **kwargs):
        # generate passes the whole context first, then one new token per step (its cache holds the rest)
        self.context = input_ids[0].tolist() if input_ids.shape[1] > 1 else self.context + input_ids[0].tolist()
        matched = 0
        for token in self.context[self.prompt_length:]:
            if matched < len(self.script) and token == self.script[matched]:
                matched += 1
        logits = torch.full((1, 1, self.config.vocab_size), -1e4)
        logits[0, 0, self.script[matched] if matched < len(self.script) else self.config.eos_token_id] = 1e4
        return CausalLMOutputWithPast(logits=logits)


PROMPT = [9707, 13]  # "Hello."


def scripted_text(tokenizer, pool, script, max_calls=4, max_new_tokens=120):
    policy = ScriptedPolicy(tokenizer, script, len(PROMPT))
    [[completion]] = agent.generate(policy, tokenizer, [PROMPT], 1, Sampling(max_new_tokens, 0.0), None, "hf",
                                    Interpreter(tokenizer, pool, max_calls))
    return completion


def test_a_block_the_policy_writes_runs_and_its_real_output_comes_before_the_policy_goes_on(tokenizer, pool):
    completion = scripted_text(tokenizer, pool, "Compute.\n```python\nprint(sum(range(2, 37)))\n```|So \\boxed{665}.")
    assert completion.text == ("Compute.\n```python\nprint(sum(range(2, 37)))\n```\n```output\n665\n```\n"
                               "So \\boxed{665}.")
    [call] = completion.tool_calls
    assert (call.code, call.status, call.output) == ("print(sum(range(2, 37)))\n", "ok", "665")
    # the tool's tokens are marked, and they are exactly the output block
    tool_ids = [t for t, tool in zip(completion.token_ids, completion.tool_mask) if tool]
    assert tokenizer.decode(tool_ids) == "\n```output\n665\n```\n"


@pytest.mark.parametrize("script,answer", [
    # the call prints an answer, then the row ends: the policy stated none (strict: no vote, reward 0)
    ("Compute.\n```python\nprint('The answer is 12')\n```|", None),
    # the policy's box stands; what a later call prints does not replace it
    ("So \\boxed{8}. Let me double-check.\n```python\nprint('Final answer: 7')\n```|Done.", "8"),
])
def test_an_agent_rollouts_answer_is_what_the_policy_stated_not_its_code_or_tool_output(tokenizer, pool, script,
                                                                                        answer):
    completion = scripted_text(tokenizer, pool, script)
    assert completion.tool_calls and completion.tool_calls[0].status == "ok"
    assert extract_answer(completion.text) not in (None, answer)  # the whole text reads the tool's line
    assert t3rl.read_answers([{"problem": "?"}], [[completion]], MATH) == [[answer]]
    assert "```output" not in completion.policy_text


def test_an_error_shows_its_last_line_and_a_loop_is_cut_by_the_timeout_and_the_row_goes_on(tokenizer):
    with SandboxPool(workers=1, timeout=1.0) as pool:
        completion = scripted_text(tokenizer, pool, "```python\n1 / 0\n```|Then:\n```python\nwhile True:\n    pass\n```"
                                                    "|So \\boxed{1}.")
    assert [(c.status, c.output) for c in completion.tool_calls] == [
        ("error", "ZeroDivisionError: division by zero"), ("timeout", "timeout")]
    assert completion.text.endswith("```\n```output\ntimeout\n```\nSo \\boxed{1}.")


def test_an_empty_block_does_not_hide_the_block_after_it(tokenizer, pool):
    completion = scripted_text(tokenizer, pool, "```python\n\n```\nNow:\n```python\nprint(6 * 7)\n```|So \\boxed{42}.")
    assert [(c.status, c.output) for c in completion.tool_calls] == [("ok", "42")]


def test_a_program_printing_special_tokens_gives_their_characters_not_the_tokens(tokenizer, pool):
    """A program that prints <|im_end|><|im_start|>assistant must not end the policy's turn: its output
    is text, tokenized as text."""
    bar = "chr(124)"  # the script's parts are split at |
    program = f"print('<' + {bar} + 'im_end' + {bar} + '><' + {bar} + 'im_start' + {bar} + '>assistant')"
    completion = scripted_text(tokenizer, pool, f"```python\n{program}\n```|Done.")
    tool_ids = [t for t, tool in zip(completion.token_ids, completion.tool_mask) if tool]
    assert not set(tool_ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(tool_ids) == "\n```output\n<|im_end|><|im_start|>assistant\n```\n"


def test_agent_max_calls_leaves_a_later_block_unrun(tokenizer, pool):
    script = "```python\nprint(1)\n```|Again:\n```python\nprint(2)\n```|So \\boxed{1}."
    completion = scripted_text(tokenizer, pool, script, max_calls=1)
    assert [c.output for c in completion.tool_calls] == ["1"]
    assert completion.text == "```python\nprint(1)\n```\n```output\n1\n```\nAgain:\n```python\nprint(2)\n```So \\boxed{1}."
    assert completion.text.count("```output") == 1


def test_fences_inside_the_code_do_not_close_the_block(tokenizer, pool):
    """Markdown closes a block at a fence that starts a line: a string holding ``` is code, the whole block runs,
    and a box inside the code is never the rollout's answer."""
    script = "```python\ns = 'a```b'  # not ```\nt = '\\\\boxed{99}'\nprint(len(s))\n```|So \\boxed{5}."
    completion = scripted_text(tokenizer, pool, script)
    assert [(c.status, c.output) for c in completion.tool_calls] == [("ok", "5")]
    assert "print" not in completion.policy_text  # the block that ran leaves the text whole
    assert t3rl.read_answers([{"problem": "?"}], [[completion]], MATH) == [["5"]]


def test_an_answer_after_a_block_closed_mid_line_is_read(tokenizer, pool):
    """A fence after the code on its line does not run the block (markdown's rule), but the policy reads on after
    it: its answer is there, and the code is not in the text the answer is read from."""
    completion = scripted_text(tokenizer, pool, "Check:\n```python\nprint(2+3)```\nSo \\boxed{5}.")
    assert completion.tool_calls == [] and "print" not in completion.policy_text
    assert t3rl.read_answers([{"problem": "?"}], [[completion]], MATH) == [["5"]]


def test_a_block_closed_by_the_budgets_last_token_is_not_run(tokenizer, pool):
    """No room is left for its output: the row ends as kv-fast ends it, without a call."""
    script = "So \\boxed{1}.\n```python\nprint(1)\n```"
    budget = len(tokenizer(script, add_special_tokens=False).input_ids)
    completion = scripted_text(tokenizer, pool, script, max_new_tokens=budget)
    assert completion.num_tokens == budget and completion.tool_calls == []


def test_a_tool_output_is_cut_to_the_rows_token_budget(tokenizer, pool):
    script = "```python\nprint('x ' * 200)\n```|So \\boxed{1}."
    completion = scripted_text(tokenizer, pool, script, max_new_tokens=40)
    assert completion.num_tokens == 40 and completion.finish_reason == "length"
    assert completion.tool_mask[-1] and "\\boxed" not in completion.text


class EveryFewTokens:
    """A tool for a random tiny model: a 'block' closes once a row has sampled `every` tokens since its last
    output, and its output is a fixed list of token ids (the run call records each batch of codes)."""

    def __init__(self, vocab: int, every: int = 3, output=(7, 8, 9), max_calls: int = 2):
        self.triggers, self.every, self.output, self.max_calls = set(range(vocab)), every, list(output), max_calls
        self.batches = []

    def block_ends(self, token_ids):
        return f"print({len(token_ids)})" if len(token_ids) >= self.every else None

    def run(self, codes, segments):
        self.batches.append(len(codes))
        return [ToolCall(code, "ok", "7", self.output) for code in codes]


def test_the_kv_sampler_appends_the_output_to_the_rows_cache_and_matches_resampling_the_whole_context(monkeypatch):
    model = small_vocab_model(200, logit_scale=3.0)
    model.generation_config.eos_token_id = 199
    prompts = [[3, 17, 29, 5, 8], [11], [40, 2, 2]]
    prefills = []
    real_prefill = kv_fast.prefill_shared
    monkeypatch.setattr(kv_fast, "prefill_shared", lambda *args: prefills.append(1) or real_prefill(*args))
    tools = {backend: EveryFewTokens(200) for backend in ("kv-fast", "hf")}
    out = {backend: agent.generate(model, None, prompts, 2, Sampling(15, 0.0), None, backend, tools[backend])
           for backend in ("kv-fast", "hf")}
    kv, hf = ([(c.token_ids, c.tool_mask, c.finish_reason) for g in out[b] for c in g] for b in ("kv-fast", "hf"))
    assert kv == hf  # hf samples on from the whole context each round; kv-fast from the row's cache
    assert prefills == [1]  # one wave, prefilled once: the outputs went into the cache, no row was prefilled again
    assert all(c.tool_mask[3:6] == [True] * 3 and c.token_ids[3:6] == [7, 8, 9] for g in out["kv-fast"] for c in g)
    assert tools["kv-fast"].batches == [6, 6]  # every row's first call in one run, then every row's second


class OneLongOutput(EveryFewTokens):
    """Calls after 3 tokens; the row whose segment starts with the largest token id gets a long output, the
    others a one-token one: that row fills its budget alone while the others go on."""

    def run(self, codes, segments):
        longest = max(segment[0] for segment in segments)
        return [ToolCall(code, "ok", "7", [7] * (5 if segment[0] == longest else 1))
                for code, segment in zip(codes, segments)]


def test_the_kv_sampler_cuts_an_output_to_the_rows_budget_while_other_rows_go_on():
    model = small_vocab_model(200, logit_scale=3.0)
    model.generation_config.eos_token_id = 199
    # 12 rows: a row that finishes alone stays in the batch (compaction waits for an eighth of it)
    prompts = [[k, k + 20] for k in range(1, 13)]
    out = {backend: agent.generate(model, None, prompts, 1, Sampling(7, 0.0), None, backend, OneLongOutput(200))
           for backend in ("kv-fast", "hf")}
    kv, hf = ([(c.token_ids, c.tool_mask, c.finish_reason) for g in out[b] for c in g] for b in ("kv-fast", "hf"))
    assert kv == hf and all(len(tokens) == 7 for tokens, _, _ in kv)
    assert sorted(sum(mask) for _, mask, _ in kv)[-2:] == [1, 4]  # one output cut from 5 to 4 tokens, alone


def test_tool_output_gets_no_gradient_and_the_policys_tokens_do():
    model = small_vocab_model(50)
    prompts, completions = [[1, 2, 3], [4, 5]], [[10, 11, 12, 13, 14, 15], [16, 17, 18]]
    tool_masks = [[False, False, True, True, False, False], [False, True, False]]
    input_ids, attention_mask, response_mask = pad_batch(prompts, completions, tool_masks=tool_masks)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.detach().requires_grad_()
    # position t - 1 predicts token t
    logp = torch.zeros(input_ids.shape)
    logp[:, 1:] = torch.log_softmax(logits[:, :-1] / 0.6, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ref_logp = logp.detach() + 0.3  # a KL term too: it must not reach the tool's tokens either
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), response_mask, ref_logp=ref_logp, kl_coef=0.5)
    loss.backward()
    predicts = logits.grad.abs().sum(-1)  # [B, T]: the gradient at the position that predicts token t + 1
    for i, (prompt, mask) in enumerate(zip(prompts, tool_masks)):
        for t, tool in enumerate(mask):
            at = predicts[i, len(prompt) + t - 1]
            assert (at == 0) if tool else (at > 0), (i, t)


def test_a_rollout_without_calls_trains_as_a_plain_one_and_tool_tokens_do_not_count(tiny_model):
    prompts, completions = [[1, 2, 3], [4, 5], [6, 7], [8]], [[11, 12], [13, 14, 15, 16], [17], [18, 19, 20]]
    settings = Config(n_train=2, temperature=0.6, mini_batch_questions=0, loss_agg="dapo", micro_batch_rollouts=0,
                      micro_batch_tokens=4096, grad_checkpointing=False)
    weights = []
    for masks in (None, [[False] * len(c) for c in completions], [[False, True], [False] * 4, [False], [False] * 3]):
        model = make_tiny_model(tiny_model.config.vocab_size)
        optimizer, scheduler = make_optimization(model, Config(lr=1e-3), 1)
        metrics = grpo_step(model, optimizer, scheduler, Rollouts(prompts, completions,
                            [1.0, 0.0, 0.0, 1.0], tool_masks=masks), settings, bf16=False)
        weights.append([p.detach().clone() for p in model.parameters()])
        assert metrics["response_tokens"] == 10 - (masks is not None and sum(map(sum, masks)))
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[2]))


class CountingInterpreter(Interpreter):
    """The real interpreter (the sandbox runs the code, the tokenizer spells the output), with a block 'closed'
    once a row has sampled five tokens since its last output: a random tiny model never writes a fence."""

    def __init__(self, tokenizer, pool, max_calls=2):
        super().__init__(tokenizer, pool, max_calls)
        self.triggers = set(range(len(tokenizer)))

    def block_ends(self, token_ids):
        return f"print({len(token_ids)} * 6)" if len(token_ids) >= 5 else None


@pytest.mark.slow
def test_an_interrupted_agent_run_resumes_exactly_and_logs_its_tool_use(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(agent, "Interpreter", CountingInterpreter)
    options = dict(agent=True, backend="kv-fast", max_new_tokens=24, max_steps=3)
    straight = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path / "a", **options)))
    with interrupted_at_update(monkeypatch, 3), pytest.raises(SystemExit):
        t3rl.main(tiny_argv(tiny_dir, tmp_path / "b", **options))
    resumed = t3rl.train(parse_config(["--resume", str(tmp_path / "b" / "run")]))

    assert without_timing(rows(resumed, "metrics.jsonl")) == without_timing(rows(straight, "metrics.jsonl"))
    assert rows(resumed, "rollouts.jsonl") == rows(straight, "rollouts.jsonl")
    a, b = final_weights(straight), final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the tool really ran: its output (5 * 6) is in the rollouts, and the step's monitors count the calls
    logged = rows(straight, "rollouts.jsonl")
    calls = [call for r in logged for call in r["tool_calls"]]
    assert calls and {(c["status"], c["output"]) for c in calls} == {("ok", "30")}
    assert all("```output\n30\n```" in r["text"] for r in logged if r["tool_calls"])
    step = next(r for r in rows(straight, "metrics.jsonl") if r["kind"] == "train")
    first = [r for r in logged if r["step"] == 0]
    counts = step["extensions"]["agent"]
    assert counts["tool_calls"] == sum(len(r["tool_calls"]) for r in first) > 0
    assert counts["tool_statuses"] == {"ok": counts["tool_calls"]}
    assert counts["rollouts_calling"] == sum(bool(r["tool_calls"]) for r in first)


def test_agent_monitor_counts_the_rollouts_whose_answer_a_call_printed(tokenizer, pool):
    from extensions.agent import monitor
    right = scripted_text(tokenizer, pool, "```python\nprint(6 * 7)\n```|So \\boxed{42}.")
    other = scripted_text(tokenizer, pool, "```python\nprint(6 * 7)\n```|So \\boxed{41}.")
    stats = monitor([right, other], ["42", "41"], [None, None])
    assert stats["tool_calls"] == 2 and stats["rollouts_calling"] == 2 and stats["answer_from_tool"] == 1
    assert stats["tool_statuses"] == {"ok": 2}
    assert stats["tool_tokens"] == sum(right.tool_mask) + sum(other.tool_mask) > 0


def test_the_study_with_agent_votes_on_agent_rollouts_beside_the_plain_ones(tiny_dir, tmp_path, monkeypatch, patched):
    write_bench(tmp_path / "data", QUESTIONS)
    monkeypatch.setenv("T3RL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(agent, "Interpreter", CountingInterpreter)
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: lambda prompts: ["no code"] * len(prompts))
    argv = tiny_argv(tiny_dir, tmp_path, agent=True, backend="kv-fast", n_votes=4, n_train=2, max_new_tokens=40)
    run_dir = study.run_study(study.study_config(argv, gpu=False))
    [first, *_] = [json.loads(line) for line in (run_dir / "study.jsonl").read_text().splitlines()]
    assert len(first["agent_answers"]) == 4 and all(len(calls) == 2 for calls in first["agent_calls"])
    assert first["agent_text"] != first["text"]  # the plain rollouts have no tool output
    assert all("```output\n" not in text for text in first["text"])
    table = (run_dir / "table.txt").read_text()
    assert "TTRL-Agent" in table and "1.000 of them call it, 2.00 calls per rollout (ok 32); right" in table
