"""The verifier beyond the paper's one program per rollout, beside verifier.verify_rollouts, which
calls it (docs/verifier.md#several-programs-repair-and-the-verdict-memory):

    program_seed    k programs per rollout (--verifier-programs), each sampled with its own seed
    repair_prompt   a program that raised, ran too long or printed nothing gets one more turn that
                    shows it its error (--verifier-repair); `repaired` makes its verdict
    combine         a rollout's v from its programs: 1 when any reproduces a_i
    VerdictMemory   an answer class of a question whose last --verdict-attempts steps agreed
                    (reproduced each time, or failed each time) keeps that verdict in later steps
                    without a verifier call (--verdict-memory); kept in the run folder's
                    verdicts.jsonl so that --resume goes on exactly
"""
import dataclasses
import hashlib

from machinery.files import append_jsonl, keep_jsonl, read_jsonl_rows
from voting import answer_classes

REPRODUCED = ("verified", "repaired")  # a clean program printed a_i and did not copy it in
# a rollout none of whose programs reproduced a_i takes the status of the one that got furthest:
# a program that ran and printed something else says more than one that raised beside it
FURTHEST = ("mismatch", "hardcoded", "exec_error", "timeout", "no_code")
# what the repair turn shows of a failed program's output: its last lines, bounded
REPAIR_LINES, REPAIR_CHARS = 8, 800


def program_seed(seed, j: int):
    """The seed of a rollout's j-th program: the rollout's own for the first (so one program per
    rollout is sampled as the paper's single one), a hash of it and j for the others."""
    if j == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}|program {j}".encode(), digest_size=7).digest(),
                          "big")


def needs_repair(run, domain) -> bool:
    """The program raised, hit a sandbox limit or printed nothing, and the domain has a repair
    turn."""
    failed = run.status in ("exec_error", "timeout") or (run.status == "mismatch"
                                                         and run.result is None)
    return failed and domain.verifier_repair is not None


def repair_prompt(problem, run, domain, seed):
    """The repair turn's user message and seed: the problem, the failed program and the end of what
    running it gave."""
    lines = run.output.strip().splitlines()[-REPAIR_LINES:]
    error = "\n".join(lines)[-REPAIR_CHARS:] or "(it printed nothing)"
    if run.status == "timeout":
        error = f"{error}\n(it ran past the sandbox's time limit)"
    return (domain.verifier_repair.format(problem=problem.strip(), program=run.code.strip(),
                                         error=error),
            None if seed is None else program_seed(seed, -1))


def repaired(first, fix):
    """The verdict of a repaired program: the fix's, status "repaired" when it reproduced a_i, the
    tokens and run time of both."""
    tokens = None if first.tokens is None or fix.tokens is None else first.tokens + fix.tokens
    return dataclasses.replace(fix, status="repaired" if fix.status == "verified" else fix.status,
                               repaired_from=first.status, tokens=tokens,
                               tool_seconds=first.tool_seconds + fix.tool_seconds)


def combine(runs, seconds: float):
    """One rollout's Verification from its programs' (one each): v = 1 when any reproduced a_i; the
    first reproducing program (else the first that got furthest, FURTHEST) speaks for it, the tokens
    are all of theirs."""
    reproduced = [run for run in runs if run.status in REPRODUCED]
    speaker = reproduced[0] if reproduced else furthest(runs)
    tokens = [run.tokens for run in runs]
    return dataclasses.replace(
        speaker, v=int(bool(reproduced)), seconds=seconds,
        tokens=None if None in tokens else sum(tokens),
        tool_seconds=sum(run.tool_seconds for run in runs),
        programs=[{"status": run.status, "v": run.v, "repaired_from": run.repaired_from,
                   "tokens": run.tokens} for run in runs]
        if len(runs) > 1 else None)


def furthest(runs):
    """The first of these unreproducing programs' verdicts whose status comes first in FURTHEST."""
    return min(runs, key=lambda run: FURTHEST.index(run.status))


def programs_written(result) -> int:
    """The verifier completions a rollout's verdict took: its programs and their repairs (0 for an
    inherited, remembered or skipped verdict)."""
    if result is None or result.inferred or result.code is None and result.completion is None:
        return 0
    programs = result.programs or [{"repaired_from": result.repaired_from}]
    return sum(1 + (p["repaired_from"] is not None) for p in programs)


class VerdictMemory:
    """What earlier steps showed of each question's answer classes: per class, the outcome of every
    step that verified some of its rollouts afresh (reproduced: one of its programs recomputed the
    answer; failed: none did). A class is settled, and its rollouts take its verdict without a
    verifier call, when its last `attempts` (>= 2) such steps agree; one step's evidence settles
    nothing, and a class whose steps disagree is verified afresh. recall names a batch's settled
    rollouts; lessons are what a step showed (one row per question and class verified afresh),
    learn takes them."""

    def __init__(self, domain, attempts: int, path=None):
        if attempts < 2:
            raise ValueError(f"attempts={attempts}: a class is settled by at least 2 steps that "
                             f"agree (one step's verdict is never kept)")
        self.domain, self.attempts, self.path = domain, attempts, path
        self.classes = {}  # question id -> [entry]; entry: answer, outcomes [(step, row)]

    def entry(self, qid, answer):
        key = self.domain.key(answer)
        return next((e for e in self.classes.get(qid, ())
                     if self.domain.key(e["answer"]) == key
                     or self.domain.same(e["answer"], answer)), None)

    def settled(self, entry) -> dict | None:
        """The class's verdict (its latest step's row) when its last `attempts` steps agree."""
        last = [row for _, row in entry["outcomes"][-self.attempts:]]
        if len(last) < self.attempts or len({row["v"] > 0 for row in last}) > 1:
            return None
        return last[-1]

    def recall(self, groups, answers, results):
        """(i, verdict row) for each rollout not judged yet (results[i] None) whose answer class is
        settled."""
        remembered, by_question = [], {}
        for i, answer in enumerate(answers):
            if answer is not None:
                by_question.setdefault(groups[i], []).append(i)
        for qid, indices in by_question.items():
            for members in answer_classes([answers[i] for i in indices], **self.domain.classes):
                e = self.entry(qid, answers[indices[members[0]]])
                known = e and self.settled(e)
                if known:
                    remembered += [(indices[m], known) for m in members
                                   if results[indices[m]] is None]
        return remembered

    def lessons(self, step, groups, answers, results) -> list[dict]:
        """What this step's fresh verdicts showed, per question and answer class: v = 1 when one of
        its rollouts was reproduced (that rollout's status and result), else 0 (the first's)."""
        rows = {}
        for i, (answer, res) in enumerate(zip(answers, results)):
            if answer is None or res.inferred or res.status == "skipped":
                continue
            e = self.entry(groups[i], answer)
            key = (groups[i], self.domain.key(e["answer"] if e else answer))
            row = rows.setdefault(key, {"step": step, "id": groups[i], "answer": answer, "v": 0,
                                        "status": res.status, "result": res.result})
            if res.v > row["v"]:
                row.update(v=1, status=res.status, result=res.result)
        return list(rows.values())

    def learn(self, rows, write=True):
        """Take a step's lessons (every process's); the main process appends them to the file."""
        for row in rows:
            e = self.entry(row["id"], row["answer"])
            if e is None:
                e = {"answer": row["answer"], "outcomes": []}
                self.classes.setdefault(row["id"], []).append(e)
            e["outcomes"].append((row["step"], row))
        if write and self.path is not None and rows:
            append_jsonl(self.path, rows)


def memory_of(learner, start_step: int, domain):
    """The run's VerdictMemory (None without --verdict-memory or --verify), on the run's domain,
    made on the first step a process runs: from the run folder's verdicts.jsonl, its rows before
    that step (the main process drops the later ones: a resumed run goes on from its checkpoint, as
    one that never stopped)."""
    cfg = learner.cfg
    if not (cfg.verdict_memory and cfg.verify):
        return None
    if learner.verdicts is None:
        path = learner.run_dir / "verdicts.jsonl"
        main = learner.accelerator.is_main_process
        rows = [r for r in read_jsonl_rows(path) if r["step"] < start_step]
        memory = VerdictMemory(domain, cfg.verdict_attempts, path if main else None)
        memory.learn(rows, write=False)
        if main:
            keep_jsonl(path, lambda r: r["step"] < start_step)
        learner.verdicts = memory
    return learner.verdicts
