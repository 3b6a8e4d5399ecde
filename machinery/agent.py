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
tokens: Completion.tool_mask marks the appended ones and batches.pad_batch leaves them out of the
response mask (loss, entropy, KL).

Interpreter is what sampler.generate(tools=...) calls (machinery/sampler_tools.py); it works on
token ids, so the sampler needs no text:

    triggers             token ids after which a block may have closed (those holding a backtick)
    block_ends(ids)      the code of the python block that the row's tokens since its last output
                         close, or None
    run(codes, segments) one ToolCall per code, run together through the pool's run_many
"""
import re
from collections import Counter
from dataclasses import dataclass

from sandbox import SandboxPool
from machinery.python_tool import PYTHON_PRELUDE, last_line, tool_agrees

# added to the domain's instruction (domains.py): how to call the tool, and that the answer still
# goes in its form
TOOL_INSTRUCTION = ("\nYou may use Python to compute: a block\n```python\nCODE\n```\nis run, and "
                    "what it prints is shown to you as\n```output\n...\n```\nThen go on reasoning "
                    "and state the final answer as asked.")
# a whole block, up to its closing fence (the tokens since the row's last output: an earlier block
# is not seen)
PYTHON_BLOCK = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
OUTPUT_CHARS = 1000  # longer output keeps its end (where the result is printed), marked as cut
# a block in a rollout's text, closed or cut off by the token budget
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

    def __init__(self, tokenizer, pool: SandboxPool, max_calls: int = 4):
        if max_calls < 1:
            raise ValueError(f"max_calls={max_calls}: a rollout needs at least one tool call (or "
                             f"no Interpreter)")
        self.tokenizer, self.pool, self.max_calls = tokenizer, pool, max_calls
        # byte-level BPE spells printable ASCII as itself, so the backtick can be looked for in the
        # vocabulary
        self.triggers = {i for token, i in tokenizer.get_vocab().items() if "`" in token}

    def block_ends(self, token_ids) -> str | None:
        match = PYTHON_BLOCK.search(self.tokenizer.decode(token_ids, skip_special_tokens=True))
        return match.group(1) if match and match.group(1).strip() else None

    def run(self, codes: list[str], segments: list[list[int]]) -> list[ToolCall]:
        """Run the blocks together; segments[i] holds the tokens block_ends read for codes[i] (its
        row's text since its last output), so that the output block starts on a line of its own."""
        calls = []
        results = self.pool.run_many([PYTHON_PRELUDE + c for c in codes])
        for code, result, segment in zip(codes, results, segments):
            output = shown_output(result)
            newline = self.tokenizer.decode(segment[-1:]).endswith("\n")
            text = ("" if newline else "\n") + f"```output\n{output}\n```\n"
            calls.append(ToolCall(code, result.status, output,
                                  self.tokenizer(text, add_special_tokens=False).input_ids))
        return calls


def answer_text(completion) -> str:
    """The text a rollout's answer is read from: what the policy stated. Its tool's output is not (a
    call that prints 'The answer is 12' states nothing), nor is the code it asked to run; a rollout
    sampled without the tool is its whole text."""
    if completion.tool_calls is None:
        return completion.text
    return CODE_BLOCK.sub("", completion.policy_text)


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


def agent_monitors(group, answers) -> dict:
    """One question's tool use: calls per rollout, their statuses, the rollouts whose final answer
    is what a call printed (its last line), and the tool tokens in the rollouts. Monitoring only."""
    calls = [c.tool_calls or [] for c in group]
    from_tool = sum(answer is not None
                    and any(tool_agrees(last_line(call.output), answer) for call in made)
                    for made, answer in zip(calls, answers))
    return {"tool_calls": sum(map(len, calls)),
            "rollouts_calling": sum(bool(made) for made in calls),
            "answer_from_tool": from_tool,
            "tool_tokens": sum(sum(c.tool_mask or []) for c in group),
            "tool_statuses": dict(Counter(call.status for made in calls for call in made))}

