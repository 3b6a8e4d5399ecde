"""Verification-weighted majority voting: the pseudo-label and rewards of test-time RL.

Test-time RL has no ground truth. For each question the policy samples N rollouts with final answers
a_1..a_N; the group votes on a pseudo-label and each rollout is rewarded for agreeing with it
(TTRL). T3RL adds a tool verifier that marks each rollout v_i in {0, 1}, and lets verified rollouts
vote louder:

    w_i  = (1 - v_i) * 1 + v_i * omega                  (omega >= 1)
    y*   = argmax_c  sum_i w_i * 1[class(a_i) = c]      (the winning answer class: the pseudo-label)
    r_i  = 1[class(a_i) = y*]                           (the binary reward)

omega = 1 is plain majority voting (TTRL); omega = inf is hard filtering: only verified answers
count, and with none verified the vote falls back to plain majority.

Answer classes. Rollouts are first bucketed by key(a) (default: the answer with all whitespace
removed); then two buckets join when same(a, b) holds for their spellings, and `same` must be an
equivalence relation, "the same answer" (docs/verifier.md#the-vote). A missing answer (None) belongs
to no class, so it never wins unless every answer is missing; then the label is None.

Rewards, flips and monitoring numbers all come from the one class assignment the vote made, so a
rollout is rewarded exactly when its class won. Ties are broken deterministically: higher weighted
score, then more rollouts, then the class whose first rollout comes earliest in `answers`.

The paper's worked example: 11 unverified rollouts say 1260, 5 verified rollouts say 1320.

>>> answers = ["1260"] * 11 + ["1320"] * 5
>>> verified = [0] * 11 + [1] * 5
>>> vote = weighted_vote(answers, verified, omega=5.0)
>>> vote.label, vote.scores
('1320', {'1320': 25.0, '1260': 11.0})
>>> vote.assignment[-6:]                    # each rollout's class, best class first (0 won)
[1, 0, 0, 0, 0, 0]
>>> vote.rewards()[-6:]
[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
>>> weighted_vote(answers, verified, omega=1.0).label
'1260'
>>> group_metrics(vote, verified, gold="1320")["flip_fixed"]
1.0
>>> # rollout indices per class, in order of first appearance
>>> answer_classes(["2", "3", " 2", None])
[[0, 2], [1]]

Standard library only, so this file can be copied into another project as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

Answer = Optional[str]
Same = Optional[Callable[[str, str], bool]]
Key = Optional[Callable[[str], str]]


def weighted_vote(answers: Sequence[Answer], verified: Sequence[int], omega: float = 5.0,
                  same: Same = None, key: Key = None) -> Vote:
    """Vote on a pseudo-label; returns a Vote (label, scores, classes best first, each rollout's
    class).

    answers: answer strings or None; verified: 0/1 (or bools, or the share of the verifier's
    programs that reproduced the answer: w_i = 1 + (omega - 1) * v_i), one per answer. With
    omega = inf a score is the sum of the class's v_i (plain counts when no answer is verified)."""
    _check_group(answers, verified, omega)
    classes = answer_classes(answers, same, key)
    weight = _vote_weight(classes, verified, omega)
    ranked = [VoteClass(_representative(answers, members), members, sum(weight(i) for i in members))
              for members in _ranked(classes, weight)]
    assignment: list[Optional[int]] = [None] * len(answers)
    for k, vote_class in enumerate(ranked):
        for i in vote_class.members:
            assignment[i] = k
    return Vote(list(answers), ranked, assignment, omega)


@dataclass(frozen=True)
class Vote:
    """The outcome of weighted_vote: the classes best first, and which class each rollout is in."""
    answers: list[Answer]
    classes: list[VoteClass]        # best first: classes[0] won (empty when every answer is None)
    # rollout i is in classes[assignment[i]]; None: it gave no answer
    assignment: list[Optional[int]]
    omega: float

    @property
    def label(self) -> Answer:
        """The pseudo-label: the winning class's representative, or None when every answer is
        None."""
        return self.classes[0].answer if self.classes else None

    @property
    def scores(self) -> dict[str, float]:
        """{representative: weighted score}, best first."""
        return {c.answer: c.score for c in self.classes}

    def rewards(self) -> list[float]:
        """r_i = 1 when rollout i's class won the vote, else 0 (and 0 for a missing answer)."""
        return [1.0 if k == 0 else 0.0 for k in self.assignment]


@dataclass(frozen=True)
class VoteClass:
    """One answer class of a vote."""
    answer: str          # its representative: the most frequent spelling among its rollouts
    members: list[int]   # indices of its rollouts in `answers`, ascending
    score: float         # sum of its rollouts' vote weights


def _default_key(answer: str) -> str:
    return "".join(answer.split())


def answer_classes(answers: Sequence[Answer], same: Same = None,
                   key: Key = None) -> list[list[int]]:
    """Group answer indices into vote classes: buckets by key, joined where `same` holds between
    buckets (connected components, so the grouping does not depend on the order of `answers`).

    Returns a list of ascending index lists, in order of each class's first appearance."""
    key = key or _default_key
    buckets: dict[str, list[int]] = {}
    for i, a in enumerate(answers):
        if a is not None:
            buckets.setdefault(key(a), []).append(i)
    groups = list(buckets.values())
    parent = list(range(len(groups)))  # union-find over buckets

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    if same is not None:
        for g in range(len(groups)):
            for h in range(g + 1, len(groups)):
                if root(g) != root(h) and same(answers[groups[g][0]], answers[groups[h][0]]):
                    parent[max(root(g), root(h))] = min(root(g), root(h))
    classes: dict[int, list[int]] = {}
    for g, members in enumerate(groups):
        classes.setdefault(root(g), []).extend(members)
    return [sorted(members) for members in classes.values()]


def _representative(answers: Sequence[Answer], indices: list[int]) -> str:
    counts: dict[str, int] = {}
    for i in indices:
        counts[answers[i]] = counts.get(answers[i], 0) + 1
    return max(counts, key=lambda spelling: counts[spelling])  # max keeps the first of equals


def _check_group(answers: Sequence[Answer], verified: Sequence[int], omega: float) -> None:
    if len(answers) != len(verified):
        raise ValueError(f"answers has {len(answers)} entries but verified has {len(verified)}; "
                         f"pass one flag per answer")
    for v in verified:
        if not 0 <= v <= 1:
            raise ValueError(f"verified must hold 0/1, booleans or shares in [0, 1], got {v!r}")
    if not omega >= 1:
        raise ValueError(f"omega must be >= 1 (1 = plain majority, float('inf') = hard filter), "
                         f"got {omega!r}")


def _ranked(classes: list[list[int]], weight: Callable[[int], float]) -> list[list[int]]:
    """Classes best first: higher weighted score, then more rollouts, then earlier first rollout."""
    return sorted(classes, key=lambda members: (-sum(weight(i) for i in members), -len(members),
                                                members[0]))


def _vote_weight(classes: list[list[int]], verified: Sequence[int],
                 omega: float) -> Callable[[int], float]:
    """w_i = 1 + (omega - 1) * v_i (1 or omega for v_i in {0, 1}; a share of the verifier's programs
    between); with omega = inf, v_i itself, unless no rollout in any class is verified (plain
    counts)."""
    hard_filter = math.isinf(omega) and any(verified[i] for members in classes for i in members)
    return lambda i: (float(verified[i]) if hard_filter
                      else 1.0 + (omega - 1.0) * verified[i] if verified[i] else 1.0)


def undecided_classes(answers: Sequence[Answer], verified: Sequence[Optional[int]],
                      omega: float = 5.0, same: Same = None, key: Key = None) -> list[list[int]]:
    """The answer classes whose verdicts can still change the pseudo-label, likeliest winner first;
    [] once the label is decided. verified[i]: 0/1, or None while rollout i is not verified yet.

    A class's score grows with its own verdicts and with no one else's, so two outcomes of the
    unverified rollouts settle each question exactly. Class c wins under every outcome iff it wins
    when its own fail and all others pass, and when all fail (with omega = inf "all fail" is the
    plain-majority fallback, the one outcome that ordering misses). c can win under some outcome iff
    it wins when its own pass and all others fail, or when all fail. A class that cannot win cannot
    change the label either: the winner is decided among the others, whose scores do not depend on
    it. Verifying, in any order, the classes this returns until it returns [] therefore gives the
    label that verifying every rollout gives, and the same rewards.

    >>> # 9 or 4 scores 5 at most, 7 at least 6
    >>> undecided_classes(["7"] * 6 + ["9", "4"], [None] * 8)
    []
    >>> # 7 (4 to 20) first; 9 or 4 (1 to 5) may beat 4
    >>> undecided_classes(["7"] * 4 + ["9", "4"], [None] * 6)
    [[0, 1, 2, 3], [4], [5]]
    >>> # 20 against at most 5: decided
    >>> undecided_classes(["7"] * 4 + ["9", "4"], [1] * 4 + [None] * 2)
    []
    """
    for v in verified:
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"verified must hold 0/1 (or a share in [0, 1]), or None for a "
                             f"rollout not verified yet, got {v!r}")
    _check_group(answers, [0] * len(verified), omega)
    classes = answer_classes(answers, same, key)
    open_ = [members for members in classes if any(verified[i] is None for i in members)]

    def winner(passing: set[int]) -> list[int]:
        """The winning class when exactly the unverified rollouts in `passing` pass."""
        filled = [int(i in passing) if v is None else v for i, v in enumerate(verified)]
        return _ranked(classes, _vote_weight(classes, filled, omega))[0]

    if not classes:  # every answer is missing: the label is None whatever the verdicts
        return []
    unverified = lambda members: {i for i in members if verified[i] is None}  # noqa: E731
    everyone, all_fail = set().union(*map(unverified, classes)), winner(set())
    # it also wins when its own fail and all others pass
    if winner(everyone - unverified(all_fail)) == all_fail:
        return []
    contenders = [c for c in open_ if c == all_fail or winner(unverified(c)) == c]
    return _ranked(contenders,
                   _vote_weight(classes, [1 if v is None else v for v in verified], omega))


def _class_of(vote: Vote, answer: Answer, same: Same, key: Key) -> Optional[int]:
    """Index of the vote class that `answer` (not a rollout, e.g. the gold answer) belongs to, or
    None."""
    if answer is None:
        return None
    key = key or _default_key
    for k, vote_class in enumerate(vote.classes):
        if any(key(vote.answers[i]) == key(answer) for i in vote_class.members):
            return k
        if same is not None and same(vote_class.answer, answer):
            return k
    return None


def group_metrics(vote: Vote, verified: Sequence[int], gold: Answer = None, same: Same = None,
                  key: Key = None) -> dict[str, float]:
    """Monitoring numbers of one rollout group (TTRL / T3RL), as a dict of floats, all from vote's
    classes.

    Always: majority_ratio (share of rollouts in the plain-majority class), verified_ratio, flipped
    (1 when the vote's winner is not the plain-majority class; never with omega = 1). With gold
    (pass the same `same` and `key` as to the vote): label_accuracy (the winning class is gold's),
    reward_accuracy (share of rollouts whose reward agrees with the reward gold would give),
    ground_truth_ratio (share of rollouts in gold's class), pass@N (some rollout is), flip_fixed /
    flip_broke (a flip made the label right / wrong)."""
    n = len(vote.assignment)
    if n == 0:
        raise ValueError("the vote has no rollouts; group_metrics needs at least one")
    _check_group(vote.answers, verified, vote.omega)
    by_count = _ranked([c.members for c in vote.classes], lambda i: 1.0)
    majority = next((k for k, c in enumerate(vote.classes)
                     if by_count and c.members == by_count[0]), None)
    flipped = vote.omega != 1 and majority not in (None, 0)
    metrics = {
        "majority_ratio": len(vote.classes[majority].members) / n if majority is not None else 0.0,
        "verified_ratio": sum(verified) / n,
        "flipped": float(flipped),
    }
    if gold is None:
        return metrics
    gold_class = _class_of(vote, gold, same, key)
    true = [1.0 if k is not None and k == gold_class else 0.0 for k in vote.assignment]
    label_right, majority_right = (gold_class is not None and gold_class == 0,
                                   gold_class is not None and gold_class == majority)
    metrics.update({
        "label_accuracy": float(label_right),
        "reward_accuracy": sum(p == t for p, t in zip(vote.rewards(), true)) / n,
        "ground_truth_ratio": sum(true) / n,
        "pass@N": float(any(true)),
        "flip_fixed": float(flipped and label_right and not majority_right),
        "flip_broke": float(flipped and majority_right and not label_right),
    })
    return metrics
