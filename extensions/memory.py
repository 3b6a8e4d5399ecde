"""The verdict memory (--verdict-memory): an answer class of a question whose last VERDICT_ATTEMPTS
steps agreed on it (reproduced each time, or failed each time) keeps that verdict in later steps
without a verifier call; one step's evidence never settles a class, and a class whose steps
disagree is verified afresh. Kept in the run folder's verdicts.jsonl, so that --resume goes on
exactly. Enters at one call: t3rl.build_verify wraps the verify function in `remembering`. How
this changes the vote against verifying afresh:
docs/verifier.md#several-programs-repair-and-the-verdict-memory.
"""
from machinery.runs import append_jsonl, keep_jsonl, read_jsonl_rows
from verifier import Verification
from voting import answer_classes

VERDICT_ATTEMPTS = 2  # steps in a row that must agree on a class before it is kept


def remembering(verify, memory: "VerdictMemory", gather):
    """verify(rollouts, known) taking the settled classes' verdicts from the memory and teaching it
    what the fresh ones showed (every process's: gather, which every process calls, once a call).
    An evaluation (step -1) verifies afresh and teaches nothing."""
    def verify_remembered(rollouts, known):
        training = bool(rollouts) and rollouts[0].step >= 0
        groups, answers = [r.question for r in rollouts], [r.answer for r in rollouts]
        known = list(known)
        for i, row in memory.recall(groups, answers, known) if training else []:
            known[i] = Verification(row["v"], row["status"], row["result"], inferred=True,
                                    details={"remembered": True})
        results = verify(rollouts, known)
        lessons = memory.lessons(rollouts[0].step, groups, answers, results) if training else []
        memory.learn(gather(lessons))
        return results
    return verify_remembered


def monitor(group, answers, verdicts) -> dict:
    """One question's verdicts taken from the memory (a step's metrics row sums them:
    extensions.memory), each a verifier call spared."""
    return {"reused": sum(res is not None and res.details.get("remembered", False)
                          for res in verdicts)}


def open_memory(run_dir, start_step: int, domain, main: bool) -> "VerdictMemory":
    """The run's memory from its verdicts.jsonl, the rows before the step it starts at (the main
    process drops the later ones: a resumed run goes on from its checkpoint, as one that never
    stopped)."""
    path = run_dir / "verdicts.jsonl"
    memory = VerdictMemory(domain, VERDICT_ATTEMPTS, path if main else None)
    memory.learn([r for r in read_jsonl_rows(path) if r["step"] < start_step], write=False)
    if main:
        keep_jsonl(path, lambda r: r["step"] < start_step)
    return memory


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

    def question_classes(self, groups, answers) -> list[list[int]]:
        """The batch's answer classes, question by question: lists of rollout indices."""
        by_question = {}
        for i, qid in enumerate(groups):
            by_question.setdefault(qid, []).append(i)
        return [[indices[m] for m in members] for indices in by_question.values()
                for members in answer_classes([answers[i] for i in indices], **self.domain.classes)]

    def recall(self, groups, answers, results):
        """(i, verdict row) for each rollout not judged yet (results[i] None) whose answer class is
        settled."""
        remembered = []
        for members in self.question_classes(groups, answers):
            e = self.entry(groups[members[0]], answers[members[0]])
            known = e and self.settled(e)
            if known:
                remembered += [(i, known) for i in members if results[i] is None]
        return remembered

    def lessons(self, step, groups, answers, results) -> list[dict]:
        """What this step's fresh verdicts showed, one row per question and answer class: v = 1 when
        one of its rollouts was reproduced (that rollout's status and result), else 0 (the
        first's)."""
        rows = []
        for members in self.question_classes(groups, answers):
            fresh = [i for i in members if not results[i].inferred
                     and results[i].status != "skipped"]
            if fresh:
                shown = results[next((i for i in fresh if results[i].v > 0), fresh[0])]
                rows.append((fresh[0], {"step": step, "id": groups[fresh[0]],
                                        "answer": answers[fresh[0]], "v": int(shown.v > 0),
                                        "status": shown.status, "result": shown.result}))
        return [row for _, row in sorted(rows, key=lambda first_row: first_row[0])]

    def learn(self, rows, write=True):
        """Take a step's lessons (every process's); the main process appends them to the file."""
        for row in rows:
            e = self.entry(row["id"], row["answer"])
            if e is None:
                e = {"answer": row["answer"], "outcomes": []}
                self.classes.setdefault(row["id"], []).append(e)
            if e["outcomes"] and e["outcomes"][-1][0] == row["step"]:  # one step, one outcome
                if row["v"] > e["outcomes"][-1][1]["v"]:
                    e["outcomes"][-1] = (row["step"], row)
            else:
                e["outcomes"].append((row["step"], row))
        if write and self.path is not None and rows:
            append_jsonl(self.path, rows)
