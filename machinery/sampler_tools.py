"""The samplers' tool calls (generate's `tools`, an agent.Interpreter): the agent's tool loop.

A row whose tokens close a block stops, the blocks closed together run together, and each output is
appended to its row, which samples on (tools.max_calls calls, max_new_tokens tokens in all):

    ToolRows           the kv sampler's decode hook: the output goes through the model into the
                       row's own cache from its next column on, nothing is prefilled again
    sample_with_tools  for backends that cannot append to a row's cache ("hf", "vllm"): rounds,
                       each sampling every open row on from its whole context (continue_rows_hf for
                       "hf", engine.Engine.continue_rows for "vllm")

Both give each row's tokens with the tool's marked (tool_mask: not sampled, the update masks them
out) and the calls made, in order.
"""
import hashlib
from dataclasses import replace

import torch


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
            if reason == "stop" and (code := tools.block_ends(segment)) is not None:
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
    """sample_with_tools' continue_rows on transformers generate (generate_hf: sampler._generate_hf
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
                           not eos_ids, stopping=[criterion] if stop else [])
        results.append((row.token_ids, "stop" if criterion.fired else row.finish_reason, None))
    return results


class ToolRows:
    """The kv sampler's decode hook for a wave's tool calls: the rows that closed a block, their
    outputs appended to their cache rows (one forward, sampler.forward, over the output's tokens:
    the row keeps its cache, nothing is prefilled again), and each row's tokens with the tool's
    marked."""

    def __init__(self, tools, n_rows: int, device, forward):
        self.tools, self.forward = tools, forward
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

    def append(self, run, cache, batch, row: int, call, logits, limit: int, *, step: int, ends):
        """Wave row `row`'s tool output into its cache row from its next column on, cut to fit the
        cache (limit: its width); the row's logits become those after the output. A row the output
        fills finishes."""
        b = batch.rows.tolist().index(row)
        column, first = int(batch.columns[b]), int(batch.start[b])
        ids = call.token_ids[:limit - column]
        self.made[row].append((step, ids, call))
        self.segment[row] = step + 1
        t = torch.arange(len(ids), device=logits.device)
        keys = torch.arange(column + len(ids), device=logits.device)
        mask = ((keys >= first) & (keys <= column + t[:, None]))[None, None]  # (1, 1, L, columns)
        one_row = type(cache)(cache.k[:, b:b + 1], cache.v[:, b:b + 1])
        logits[b] = self.forward(run.w, torch.tensor([ids], device=logits.device),
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
