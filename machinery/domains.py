"""A domain: what the loop needs to know about a benchmark's answers, and how the verifier checks
them.

    math    answers are LaTeX (answers.py); the verifier writes Python, the sandbox runs it
            (verifier.py), the hard-coding guard reads the program (guard.py)
    knk     Knights and Knaves: answers are role assignments; the verifier writes SMT-LIB2 and z3
            solves it in the sandbox (knk.py)

--bench knk is the knk domain, every other benchmark the math one (domain_of). --answer-rule
last-number reads a math rollout that states no answer by its last number, as TTRL's original
parser does (strict: no answer). knk.py and guard.py are imported where they are first used: a math
run never loads knk.py, and the guard loads with the first program it reads.
"""
from dataclasses import dataclass, replace
from typing import Callable

from answers import answer_key, extract_answer, is_equiv, last_number, same_answer
from machinery.python_tool import python_tool, tool_agrees
from verifier import REPAIR_USER, VERIFIER_SYSTEM, VERIFIER_USER, extract_code


@dataclass(frozen=True)
class Domain:
    name: str
    instruction: str           # the policy's system prompt: how to reason, how to write the answer
    extract: Callable          # (rollout text, problem) -> its final answer, or None
    same: Callable             # (answer, answer) -> in one vote class (voting's `same`)
    key: Callable              # answer -> a cheap class key (voting's `key`)
    # (answer, gold) -> right: evaluation and monitors only, never rewards
    equiv: Callable
    verifier_system: str       # the verifier's system prompt
    verifier_user: str         # its user message, with {problem} and {rollout}
    extract_program: Callable  # verifier completion -> the program, or None (no_code)
    tool: Callable             # (programs, sandbox) -> one verifier.ToolRun per program
    agrees: Callable           # (ToolRun, rollout's answer) -> the tool computed that answer
    # (program, problem, answer) -> the program copied the answer in
    hardcoded: Callable | None = None
    # the repair turn's user message, with {problem}, {program}, {error} (None: no repair)
    verifier_repair: str | None = None

    @property
    def classes(self) -> dict:
        """same= and key=, as voting's functions take them."""
        return dict(same=self.same, key=self.key)


MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# without the form, a small policy boxes one word ("\\boxed{knaves}") or a name and no assignment is
# read
KNK_INSTRUCTION = ("Please reason step by step, and put your final answer within \\boxed{}, naming "
                   "every inhabitant with a role, in the form "
                   "\\boxed{Name: knight, Name: knave, ...}.")


def math_answer(text, problem):
    """A math rollout's final answer (its problem is not needed to read it)."""
    return extract_answer(text)


def math_answer_or_last_number(text, problem):
    """--answer-rule last-number: the final answer, else the last number the rollout writes."""
    answer = extract_answer(text)
    return last_number(text) if answer is None else answer


def math_agrees(run, answer):
    return tool_agrees(run.result, answer, run.latex)


def math_hardcoded(program, problem, answer):
    """guard.hardcoded: the program copied the rollout's answer in."""
    from machinery.guard import hardcoded
    return hardcoded(program, problem, answer)


def knk_agrees(run, answer):
    from machinery import knk
    return knk.smt_agrees(run.result, answer)


MATH = Domain("math", MATH_INSTRUCTION, math_answer, same_answer, answer_key, is_equiv,
              VERIFIER_SYSTEM, VERIFIER_USER, extract_code, python_tool, math_agrees,
              math_hardcoded, REPAIR_USER)


def knk_domain() -> Domain:
    """The knk Domain, from knk.py's answers, prompts and z3 tool."""
    from machinery import knk
    # knk's tool refuses a script that asserts a role as a fact itself (status "hardcoded"): no
    # guard after it
    return Domain("knk", KNK_INSTRUCTION, knk.extract_answer, knk.same_answer, knk.answer_key,
                  knk.is_equiv, knk.KNK_SYSTEM, knk.KNK_USER, knk.extract_smt, knk.smt_tool,
                  knk_agrees)


class _Domains(dict):
    """name -> Domain; the knk entry is made on its first lookup, so that a math run never loads
    knk.py."""

    def __missing__(self, name):
        if name != "knk":
            raise KeyError(name)
        self[name] = knk_domain()
        return self[name]


DOMAINS = _Domains(math=MATH)



def domain_of(bench: str, answer_rule: str = "strict") -> Domain:
    """Knights and Knaves for --bench knk, math for every other benchmark; answer_rule picks how the
    math domain reads a rollout's answer (config.py refuses last-number for knk)."""
    domain = DOMAINS["knk" if bench == "knk" else "math"]
    return (replace(domain, extract=math_answer_or_last_number) if answer_rule == "last-number"
            else domain)
