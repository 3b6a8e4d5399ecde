"""Fewer verifier prompts than the paper's one per rollout (--verify-budget K, --lazy-verify): of
each answer class only the first K rollouts are verified, the others taking the majority outcome of
those K (an approximation); or, lazily, only the classes whose verdicts can still change the
weighted vote (exact: the labels and rewards of verifying every rollout), in one or two calls.
Enters at one call: t3rl.verify_function wraps the verify function in `budgeted`.
docs/verifier.md#lazy-verification-and-the-budget.
"""
from verifier import Verification
from voting import answer_classes, rank_classes, vote_weights

# A second verifier call pays again for prefilling the prompts' shared start and for its own decode
# tail: about five prompts' worth for the 1.5B verifier on a CPU (python -m bench.verifier --steps
# RUN). Lazy verification makes one only when it can spare more prompts than this.
LAZY_SECOND_CALL = 8


def budgeted(verify, budget: int, omega: float | None, domain):
    """verify(rollouts, known) sending, call by call, only what verification_rounds picks: the first
    `budget` rollouts of each class (0: all), and lazily (omega given) only the classes that can
    still change the label. Rollouts never sent: their class's verdict (budget) or "skipped"."""
    def verify_some(rollouts, known):
        results = list(known)
        groups, answers = [r.question for r in rollouts], [r.answer for r in rollouts]
        for classes in verification_rounds(groups, answers, results, domain, budget, omega):
            classes = [members for members in classes if any(results[i] is None for i in members)]
            sent = sorted(i for members in classes
                          for i in (members[:budget] if budget else members) if results[i] is None)
            if sent:
                verdicts = verify([rollouts[i] for i in sent], [None] * len(sent))
                for i, verdict in zip(sent, verdicts):
                    results[i] = verdict
                inherit_verdicts(classes, results, budget)
        return [Verification(0, "no_answer", None) if answer is None
                else Verification(0, "skipped", None) if result is None else result
                for answer, result in zip(answers, results)]
    return verify_some


def monitor(group, answers, verdicts) -> dict:
    """One question's verifier calls spared (a step's metrics row sums them: extensions.budget):
    rollouts that took their class's verdict, and rollouts never sent (lazily: no verdict of theirs
    could change the label)."""
    made = [res for res in verdicts if res is not None]
    return {"inherited": sum(res.details.get("class_verdict", False) for res in made),
            "skipped": sum(res.status == "skipped" for res in made)}


def verification_rounds(groups, answers, results, domain, budget=0, omega=None):
    """The verifier calls of one batch: yields, call by call, the answer classes (lists of rollout
    indices) whose rollouts go into it; the caller fills `results` in before asking for the next.
    omega None: one call, every answered rollout. omega given: only the classes whose verdicts can
    still change the vote (undecided_classes), every one that can still win in one call; or, when
    that spares more than LAZY_SECOND_CALL prompts, in two: first the likeliest winning class of
    each question, then every class that can still beat it."""
    by_problem = {}  # question -> its answered rollouts' indices
    for i, answer in enumerate(answers):
        if answer is not None:
            by_problem.setdefault(groups[i], []).append(i)

    def classes_of(indices, open_only):
        group = [answers[i] for i in indices]
        local = (undecided_classes(group, [None if results[i] is None else results[i].v
                                           for i in indices], omega, **domain.classes)
                 if open_only else answer_classes(group, **domain.classes))
        return [[indices[m] for m in members] for members in local]

    if omega is None:  # every answered rollout; classes matter only to a budget
        yield [members for indices in by_problem.values()
               for members in (classes_of(indices, False) if budget else [indices])]
        return
    undecided = [classes_of(indices, True) for indices in by_problem.values()]
    second_call_spares = sum(min(len(m), budget or len(m))
                             for group in undecided for m in group[1:])
    if second_call_spares > LAZY_SECOND_CALL:  # the likeliest winners; then what can beat them
        yield [group[0] for group in undecided if group]
        yield [members for indices in by_problem.values() for members in classes_of(indices, True)]
    else:  # every class that can win: the vote is settled after one call
        yield [members for group in undecided for members in group]


def inherit_verdicts(classes, results, budget):
    """budget K > 0: the rollouts of a class after its first K take the majority outcome of those K
    (their lower median: a tie counts as unverified), marked inferred and, in their details, as a
    class_verdict."""
    for members in classes if budget else []:
        outcomes = sorted((results[i] for i in members[:budget]), key=lambda r: r.v)
        like = outcomes[(len(outcomes) - 1) // 2]
        for i in members[budget:]:
            results[i] = Verification(like.v, like.status, like.result, inferred=True,
                                      details={"class_verdict": True})


def undecided_classes(answers, verified, omega=5.0, same=None, key=None) -> list:
    """The answer classes whose verdicts can still change the pseudo-label, likeliest winner first;
    [] once the label is decided. verified[i]: 0/1, or None while rollout i is not verified yet.

    A class's score grows with its own verdicts alone, so two outcomes of the unverified rollouts
    settle each question exactly. Class c wins under every outcome iff it wins when its own fail
    and all others pass, and when all fail (at omega = inf "all fail" is the plain-majority
    fallback). c can win under some outcome iff it wins when its own pass and all others fail, or
    when all fail. A class that cannot win cannot change the label either. Verifying, in any order,
    the classes this returns until it returns [] gives the label of verifying every rollout.

    >>> undecided_classes(["7"] * 6 + ["9", "4"], [None] * 8)  # 9 or 4: 5 at most, 7: 6 at least
    []
    >>> undecided_classes(["7"] * 4 + ["9", "4"], [None] * 6)  # 7 (4 to 20) first; 9, 4 (1 to 5)
    [[0, 1, 2, 3], [4], [5]]
    """
    classes = answer_classes(answers, same, key)
    if not classes:  # every answer is missing: the label is None whatever the verdicts
        return []

    def winner(passing: set) -> list:
        """The winning class when exactly the unverified rollouts in `passing` pass."""
        filled = [int(i in passing) if v is None else v for i, v in enumerate(verified)]
        return rank_classes(classes, vote_weights(filled, omega))[0]

    unverified = lambda members: {i for i in members if verified[i] is None}  # noqa: E731
    everyone, all_fail = set().union(*map(unverified, classes)), winner(set())
    if winner(everyone - unverified(all_fail)) == all_fail:  # wins when its own fail, others pass
        return []
    contenders = [c for c in classes if unverified(c) and (c == all_fail
                                                           or winner(unverified(c)) == c)]
    return rank_classes(contenders, vote_weights([1 if v is None else v for v in verified], omega))
