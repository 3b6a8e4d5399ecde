"""Which rollouts a step sends to the verifier: all of them; K per answer class, the rest inheriting
their class's verdict (--verify-budget); or, lazily, only the classes whose verdicts can still
change the weighted vote (--lazy-verify), in one or two calls, with the labels and rewards of
verifying everything. A speed-up beside verifier.verify_batch, which makes the calls
(docs/verifier.md#lazy-verification-and-the-budget)."""
from voting import answer_classes, undecided_classes

# A second verifier call pays again for prefilling the prompts' shared start and for its own decode
# tail: about five prompts' worth for the 1.5B verifier on a CPU (python -m bench.verifier --steps
# RUN). Lazy verification makes one only when it can spare more prompts than this.
LAZY_SECOND_CALL = 8


def verification_rounds(groups, answers, results, domain, budget=0, omega=None):
    """The verifier calls of one batch: yields, call by call, the answer classes (lists of rollout
    indices) whose rollouts go into it; the caller fills `results` in before asking for the next
    call. groups: one key per rollout, the same for the rollouts that vote together.

    omega None: one call, every answered rollout. omega given (lazy verification): only the classes
    whose verdicts can still change the weighted vote at this omega (voting.undecided_classes),
    every one that can still win in one call; or, when that spares more than LAZY_SECOND_CALL
    prompts, in two calls: first the likeliest winning class of each problem, then every class that
    can still beat it. budget K > 0: of each class only the first K are sent (inherit_verdicts gives
    the others their class's verdict)."""
    by_problem = {}  # group key -> its answered rollouts' indices
    for i, answer in enumerate(answers):
        if answer is not None:
            by_problem.setdefault(groups[i], []).append(i)

    def classes_of(indices, open_only):
        """A problem's answer classes (rollout indices); open_only: those whose verdicts can change
        its vote."""
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
    if second_call_spares > LAZY_SECOND_CALL:
        # the likeliest winners; then what can beat them
        yield [group[0] for group in undecided if group]
        yield [members for indices in by_problem.values() for members in classes_of(indices, True)]
    else:  # every class that can win: the vote is settled after one call
        yield [members for group in undecided for members in group]


def inherit_verdicts(classes, results, budget):
    """budget K > 0: the rollouts of a class after its first K take the majority outcome of those K
    (their lower median: a tie counts as unverified), marked inferred."""
    for members in classes if budget else []:
        outcomes = sorted((results[i] for i in members[:budget]), key=lambda r: r.v)
        like = outcomes[(len(outcomes) - 1) // 2]
        for i in members[budget:]:
            results[i] = type(like)(v=like.v, status=like.status, result=like.result, inferred=True)
