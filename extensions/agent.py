"""TTRL-Agent: rollouts in which the policy calls a Python interpreter (the paper's T3RL baseline).

T3RL gives the tool to a verifier; TTRL-Agent gives it to the policy. With --agent the policy's
instruction says it may compute in a ```python block. When a row of the sampler closes one, its
generation stops there, the block runs in the sandbox (the verifier's prelude and the pool's
limits), and what it printed is appended as an ```output block, after which the row samples on:

    ... reasoning ```python\\nprint(6 * 7)\\n```    <- the policy's tokens (trained)
    ```output\\n42\\n```                            <- the tool's tokens (context, out of the loss)
    ... so the answer is \\boxed{42}.              <- the policy's tokens again

up to max_calls calls per rollout and the row's token budget (tool output counts against it; what
does not fit is cut). The output is the program's stdout, or the last line of its error, or
"timeout". The rollout is then voted on like any other (TTRL-Agent is --agent --omega 1; --agent
with omega > 1 runs T3RL's verified vote on agent rollouts). The update trains only the policy's
tokens: Completion.tool_mask marks the appended ones, which grpo.pad_batch leaves out of the loss.

Enters at one call: t3rl.setup samples with `sampling` in place of t3rl.sample_groups. kv-fast
appends an output to the row's own cache (ToolRows); hf and vllm sample every open row on from its
whole context, in rounds (sample_with_tools). Interpreter works on token ids:

    triggers             token ids after which a block may have closed (those holding a backtick)
    block_ends(ids)      the code of the python block that the row's tokens since its last output
                         close, or None
    run(codes, segments) one ToolCall per code, run together through the pool's run_many
"""
import functools
import hashlib
import re
from collections import Counter
from dataclasses import dataclass, replace

import torch

import sampler
from sandbox import SandboxPool
from verifier import PYTHON_PRELUDE, last_line, tool_agrees

MAX_CALLS = 4  # tool calls per rollout (a block after them is not run)

# added to the domain's instruction: how to call the tool, and that the answer still goes in its
# form
TOOL_INSTRUCTION = ("\nYou may use Python to compute: a block\n```python\nCODE\n```\nis run, and "
                    "what it prints is shown to you as\n```output\n...\n```\nThen go on reasoning "
                    "and state the final answer as asked.")
# a whole block, up to its closing fence (the tokens since the row's last output: an earlier block
# is not seen); as in markdown a fence closes on a line of its own, so ``` in the code does not
PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)^[ \t]*```[ \t]*$",
                          re.DOTALL | re.IGNORECASE | re.MULTILINE)
OUTPUT_CHARS = 1000  # longer output keeps its end (where the result is printed), marked as cut
# a block that did not run: closed after its code on a line (the policy reads on after the fence),
# or cut off by the token budget
CODE_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n.*?(?:```|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass
class ToolCall:
    """One block the policy wrote and what came back."""
    code: str
    status: str               # the sandbox's: ok, error, timeout, memory, output_limit, killed
    output: str               # what the policy is shown: stdout, the error's last line, "timeout"
    # the ```output block appended to the rollout (cut to the row's budget by the sampler)
    token_ids: list[int]


class Interpreter:
    """The policy's Python tool: blocks of a sampler call run in the sandbox, outputs come back as
    token ids."""

    def __init__(self, tokenizer, pool: SandboxPool, max_calls: int = MAX_CALLS):
        if max_calls < 1:
            raise ValueError(f"max_calls={max_calls}: a rollout needs at least one tool call (or "
                             f"no Interpreter)")
        self.tokenizer, self.pool, self.max_calls = tokenizer, pool, max_calls
        # byte-level BPE spells printable ASCII as itself, so the backtick can be looked for in the
        # vocabulary
        self.triggers = {i for token, i in tokenizer.get_vocab().items() if "`" in token}

    def block_ends(self, token_ids) -> str | None:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        # the first block with code: an empty one before it ran nothing and must not hide it
        return next((m.group(1) for m in PYTHON_BLOCK.finditer(text) if m.group(1).strip()), None)

    def run(self, codes: list[str], segments: list[list[int]]) -> list[ToolCall]:
        """Run the blocks together; segments[i] holds the tokens block_ends read for codes[i] (its
        row's text since its last output), so that the output block starts on a line of its own."""
        calls = []
        results = self.pool.run_many([PYTHON_PRELUDE + c for c in codes])
        for code, result, segment in zip(codes, results, segments):
            output = shown_output(result)
            newline = self.tokenizer.decode(segment[-1:]).endswith("\n")
            text = ("" if newline else "\n") + f"```output\n{output}\n```\n"
            # split_special_tokens: a program that prints <|im_end|> gets those characters, not the
            # token that ends the turn
            calls.append(ToolCall(code, result.status, output, self.tokenizer(
                text, add_special_tokens=False, split_special_tokens=True).input_ids))
        return calls


class ToolRows:
    """The kv sampler's decode hook for a wave's tool calls: the rows that closed a block, their
    outputs appended to their cache rows (one forward, sampler.forward, over the output's tokens:
    the row keeps its cache, nothing is prefilled again), and each row's tokens with the tool's
    marked."""

    def __init__(self, tools, n_rows: int, device):
        self.tools = tools
        self.triggers = torch.tensor(sorted(tools.triggers), dtype=torch.long, device=device)
        self.made = [[] for _ in range(n_rows)]  # per wave row: (step, appended ids, ToolCall)
        self.segment = [0] * n_rows              # per wave row: its first step after its output

    def run(self, batch, tokens, out, step: int, room) -> list:
        """The blocks that the tokens of `step` close, in live rows with calls and budget left
        (room), run together: [(wave row, ToolCall)]."""
        maybe = batch.alive & room & torch.isin(tokens, self.triggers)
        codes, segments, rows = [], [], []
        for row in batch.rows[maybe].tolist():
            if len(self.made[row]) < self.tools.max_calls:
                segment = out[row, self.segment[row]:step + 1].tolist()
                code = self.tools.block_ends(segment)
                if code is not None:
                    codes.append(code), segments.append(segment), rows.append(row)
        return list(zip(rows, self.tools.run(codes, segments))) if codes else []

    def append(self, run, cache, batch, row: int, call, logits, *, step: int, ends):
        """Wave row `row`'s tool output into its cache row from its next column on, cut to fit the
        cache's columns; the row's logits become those after the output. A row the output fills
        finishes."""
        limit = cache.k.shape[3]  # the wave's prompt width + max_new_tokens
        b = batch.rows.tolist().index(row)
        column, first = int(batch.columns[b]), int(batch.start[b])
        ids = call.token_ids[:limit - column]
        self.made[row].append((step, ids, call))
        self.segment[row] = step + 1
        t = torch.arange(len(ids), device=logits.device)
        keys = torch.arange(column + len(ids), device=logits.device)
        mask = ((keys >= first) & (keys <= column + t[:, None]))[None, None]  # (1, 1, L, columns)
        one_row = type(cache)(cache.k[:, b:b + 1], cache.v[:, b:b + 1])
        logits[b] = sampler.forward(run.w, torch.tensor([ids], device=logits.device),
                                    (column - first + t)[None], column + t, one_row, mask,
                                    run.rotary)[0].float()
        batch.aligned = False
        # a row the output fills writes no more that is read
        batch.columns[b] = min(column + len(ids), limit - 1)
        if column + len(ids) >= limit:
            batch.alive[b] = False
            ends[row] = step + 1

    def interleave(self, row: int, sampled: list[int]):
        """(token_ids, tool_mask, tool_calls) of wave row `row`: its outputs between its sampled
        tokens."""
        tokens, mask, last = [], [], 0
        for step, ids, _ in self.made[row]:
            tokens += sampled[last:step + 1] + ids
            mask += [False] * (step + 1 - last) + [True] * len(ids)
            last = step + 1
        tokens += sampled[last:]
        mask += [False] * (len(sampled) - last)
        return tokens, mask, [call for _, _, call in self.made[row]]


def shown_output(result) -> str:
    """What the policy sees of a sandbox Result: its stdout (its end, when long), the last line of
    its error, or "timeout"."""
    if result.status == "timeout":
        return "timeout"
    if result.status == "ok":
        text = result.stdout.strip()
    else:
        text = last_line(result.stderr) or result.status
    return text if len(text) <= OUTPUT_CHARS else "[... cut ...]" + text[-OUTPUT_CHARS:]


def monitor(group, answers, verdicts) -> dict:
    """One question's tool use, as counts (a step's metrics row sums them: extensions.agent): the
    calls, the rollouts calling, the calls' statuses, the rollouts whose final answer is what a call
    printed (its last line), and the tool tokens in the rollouts. Monitoring only; the verdicts are
    the verifier's, not the agent's."""
    calls = [c.tool_calls or [] for c in group]
    from_tool = sum(answer is not None
                    and any(tool_agrees(last_line(call.output), answer) for call in made)
                    for made, answer in zip(calls, answers))
    return {"tool_calls": sum(map(len, calls)),
            "rollouts_calling": sum(bool(made) for made in calls),
            "answer_from_tool": from_tool,
            "tool_tokens": sum(sum(c.tool_mask or []) for c in group),
            "tool_statuses": dict(Counter(call.status for made in calls for call in made))}



def sampling(learner, pool, policy_prompt):
    """t3rl.sample_groups for agent rollouts: the instruction offers the tool, and a row that closes
    a ```python block runs it (its output appended) before it samples on. policy_prompt: t3rl's."""
    tools = Interpreter(learner.tokenizer, pool)
    instruction = learner.domain.instruction + TOOL_INSTRUCTION

    def sample(records, n, sampling_, seeds, progress):
        if not records:
            return []
        sampling_.dtype = getattr(torch, learner.cfg.sample_dtype)
        model = learner.accelerator.unwrap_model(learner.policy)
        prompts = [policy_prompt(learner.tokenizer, rec["problem"], instruction) for rec in records]
        return generate(model, learner.tokenizer, prompts, n, sampling_, seeds,
                        learner.cfg.backend, tools)
    return sample


def generate(model, tokenizer, prompts, n, sampling_, seed, backend, tools):
    """sampler.generate with tool calls: [[Completion] * n per prompt], text without the tool's
    output in policy_text, and the answer read from what the policy stated (answer_text)."""
    prompt_ids, eos, seeds = sampler.checked_arguments(model, tokenizer, prompts, n, sampling_,
                                                       seed)
    backend = sampler.runnable_backend(model, backend)
    with torch.inference_mode():
        if backend == "kv-fast":
            from extensions import kv_fast
            rows = kv_fast.generate_rows(model, prompt_ids, n, sampling_, seeds, eos, "agent",
                                         functools.partial(ToolRows, tools))
        else:
            if backend == "vllm":
                from extensions import engine
                continue_rows = functools.partial(
                    engine.start(model, tokenizer, sampling_.dtype).continue_rows, model,
                    eos_ids=eos)
            else:
                continue_rows = functools.partial(
                    continue_rows_hf, functools.partial(sampler.generate_hf, model, tokenizer),
                    eos_ids=eos, tools=tools)
            rows = [sampler.Completion(prompt_ids[r // n], text=None, **row) for r, row in
                    enumerate(sample_with_tools(continue_rows, prompt_ids, n, sampling_, seeds,
                                                tools))]
    sampler.decode_texts(rows, tokenizer)
    for c in rows if tokenizer is not None else ():  # the answer is what the policy stated
        if c.tool_calls is not None:
            c.policy_text = policy_text(c, tokenizer)
    return [rows[p * n:(p + 1) * n] for p in range(len(prompt_ids))]


def policy_text(c, tokenizer) -> str:
    """What the policy wrote, without code: its own tokens between the tools' outputs, each part
    before an output without the block that ran there, then without any block left (not run)."""
    parts = [[]]
    for token, tool in zip(c.token_ids, c.tool_mask):
        if not tool:
            parts[-1].append(token)
        elif parts[-1]:
            parts.append([])
    texts = [tokenizer.decode(part, skip_special_tokens=True) for part in parts]
    texts = [PYTHON_BLOCK.sub("", text) for text in texts[:-1]] + texts[-1:]
    return CODE_BLOCK.sub("", "\n".join(texts))


def sample_with_tools(continue_rows, prompt_ids, n, sampling, prompt_seeds, tools) -> list[dict]:
    """Rows with tool calls, in rounds: a round samples every open row on from its whole context
    (prompt, its tokens, the outputs appended) until it ends or may have closed a block
    (continue_rows: contexts, token budgets, seeds, may-stop flags, sampling -> (new tokens, "eos" |
    "length" | "stop", their log-probs or None) per row); then the blocks closed run together, their
    outputs are appended and those rows stay open. Returns each row's Completion fields (token_ids,
    finish_reason, logprob, token_logprobs, tool_mask, tool_calls), n rows per prompt in order."""
    rows = [dict(context=list(prompt_ids[r // n]), tokens=[], mask=[], calls=[], logprobs=[],
                 segment=0, reason="length") for r in range(len(prompt_ids) * n)]
    open_rows, round_ = list(range(len(rows))), 0
    while open_rows:
        budgets = [sampling.max_new_tokens - len(rows[r]["tokens"]) for r in open_rows]
        seeds = [row_seed(prompt_seeds[r // n], r % n, round_) for r in open_rows]
        may_stop = [len(rows[r]["calls"]) < tools.max_calls for r in open_rows]
        contexts = [rows[r]["context"] for r in open_rows]
        blocks = []  # (row, code, segment)
        for r, (new, reason, logprobs) in zip(open_rows, continue_rows(contexts, budgets, seeds,
                                                                       may_stop, sampling)):
            row = rows[r]
            row["context"] += new
            row["tokens"] += new
            row["mask"] += [False] * len(new)
            row["logprobs"] = (None if logprobs is None or row["logprobs"] is None
                               else row["logprobs"] + logprobs)
            row["reason"] = reason
            segment = row["tokens"][row["segment"]:]
            # a block closed by the budget's last token is not run: no room for its output
            if (reason == "stop" and len(row["tokens"]) < sampling.max_new_tokens
                    and (code := tools.block_ends(segment)) is not None):
                blocks.append((r, code, segment))
        calls = tools.run([b[1] for b in blocks], [b[2] for b in blocks]) if blocks else []
        for (r, _, _), call in zip(blocks, calls):
            row = rows[r]
            ids = call.token_ids[:sampling.max_new_tokens - len(row["tokens"])]
            row["context"] += ids
            row["tokens"] += ids
            row["mask"] += [True] * len(ids)
            row["calls"].append(call)
            row["segment"] = len(row["tokens"])
        open_rows = [r for r in open_rows if rows[r]["reason"] == "stop"
                     and len(rows[r]["tokens"]) < sampling.max_new_tokens]
        round_ += 1
    return [dict(token_ids=row["tokens"],
                 finish_reason="length" if row["reason"] == "stop" else row["reason"],
                 logprob=None if row["logprobs"] is None else sum(row["logprobs"]),
                 token_logprobs=row["logprobs"], tool_mask=row["mask"], tool_calls=row["calls"])
            for row in rows]


def row_seed(prompt_seed: int, index: int, round_: int) -> int:
    """The seed of round `round_` of a prompt's row `index`: a function of the three alone."""
    digest = hashlib.blake2b(f"{prompt_seed}|{index}|{round_}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def continue_rows_hf(generate_hf, contexts, budgets, seeds, may_stop, sampling, *, eos_ids, tools):
    """sample_with_tools' continue_rows on transformers generate (generate_hf: sampler.generate_hf
    on the model and tokenizer): one call per row, stopped by a criterion once the tokens of this
    call close a block."""
    from transformers import StoppingCriteria

    class BlockClosed(StoppingCriteria):
        def __init__(self, prompt_length):
            self.prompt_length, self.fired = prompt_length, False

        def __call__(self, input_ids, scores, **kwargs):
            self.fired = (int(input_ids[0, -1]) in tools.triggers and
                          tools.block_ends(input_ids[0, self.prompt_length:].tolist()) is not None)
            return torch.full((len(input_ids),), self.fired, dtype=torch.bool,
                              device=input_ids.device)

    results = []
    for context, budget, seed, stop in zip(contexts, budgets, seeds, may_stop):
        criterion = BlockClosed(len(context))
        row, = generate_hf([context], 1, replace(sampling, max_new_tokens=budget), seed, eos_ids,
                           stopping=[criterion] if stop else [])
        results.append((row.token_ids, "stop" if criterion.fired else row.finish_reason, None))
    return results
