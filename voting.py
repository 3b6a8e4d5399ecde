"""The verified vote of T3RL: the pseudo-label and the rewards of one question's rollouts.

N rollouts answer a_1..a_N; the verifier marks each v_i in {0, 1}. Rollout i votes with weight w_i,
the answer class with the largest total weight is the pseudo-label, and a rollout is rewarded for
agreeing with it:

    w_i   = (1 - v_i) + v_i * omega            omega = 1: TTRL's majority vote
    label = argmax_c  sum_i w_i 1[class(a_i) = c]
    r_i   = 1[class(a_i) = label]

omega = inf is hard filtering (with none verified, the plain majority). A missing answer (None) is
in no class and never rewarded. Classes group answers by key(a) (default: without whitespace) and
join where same(a, b) holds, an equivalence. Weights add exactly (omega 1.4 is 7/5), and ties go to
more rollouts, then to the earlier first rollout. Standard library only: copy this file anywhere.

The paper's example: 11 unverified rollouts say 1260, 5 verified ones say 1320.

>>> answers, verified = ["1260"] * 11 + ["1320"] * 5, [0] * 11 + [1] * 5
>>> vote = weighted_vote(answers, verified, omega=5)
>>> vote.label, vote.scores
('1320', {'1320': 25.0, '1260': 11.0})
>>> vote.rewards()[-6:]
[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
>>> weighted_vote(answers, verified, omega=1).label
'1260'
"""
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class VoteClass:
    """An answer class: its most frequent spelling, its rollouts (indices, ascending), its score."""
    answer: str
    members: list
    score: float


@dataclass(frozen=True)
class Vote:
    """The classes best first (classes[0] won) and each rollout's class index (None: no answer)."""
    classes: list
    assignment: list

    @property
    def label(self):
        """The pseudo-label; None when every answer is missing."""
        return self.classes[0].answer if self.classes else None

    @property
    def scores(self) -> dict:  # {representative: score}, best first
        return {c.answer: c.score for c in self.classes}

    def rewards(self) -> list:
        """r_i = 1 when rollout i's class won, else 0."""
        return [1.0 if k == 0 else 0.0 for k in self.assignment]


def weighted_vote(answers, verified, omega=5.0, same=None, key=None) -> Vote:
    """The vote of rollouts with answers (str or None) and verdicts v_i in {0, 1}."""
    if len(answers) != len(verified) or any(v not in (0, 1) for v in verified):
        raise ValueError(f"weighted_vote: {len(answers)} answers need as many verdicts, each 0 or"
                         f" 1; got {list(verified)!r}")
    if not omega >= 1:
        raise ValueError(f"omega must be >= 1 (1: majority, inf: hard filtering), got {omega!r}")
    weights = vote_weights(verified, omega)
    classes = rank_classes(answer_classes(answers, same, key), weights)
    ranked = [VoteClass(representative(answers, members), members,
                        float(sum(weights[i] for i in members))) for members in classes]
    assignment = [next((k for k, m in enumerate(classes) if i in m), None)
                  for i in range(len(answers))]
    return Vote(ranked, assignment)


def vote_weights(verified, omega) -> list:
    """w_i = (1 - v_i) + v_i * omega as Fractions; at omega = inf, v_i (all 1 when no v_i is 1)."""
    if omega == float("inf"):  # int(v): numpy's bools too
        return [Fraction(int(v) if any(verified) else 1) for v in verified]
    return [(1 - int(v)) + int(v) * Fraction(repr(float(omega))) for v in verified]


def rank_classes(classes, weights) -> list:
    """Classes best first: larger total weight, then more rollouts, then earlier first rollout."""
    return sorted(classes, key=lambda members: (-sum(weights[i] for i in members), -len(members),
                                                members[0]))


def answer_classes(answers, same=None, key=None) -> list:
    """Rollout indices grouped into answer classes, in order of first appearance: bucketed by key,
    buckets joined where `same` holds (connected components, whatever the order of `answers`).

    >>> answer_classes(["2", "3", " 2", None])
    [[0, 2], [1]]
    """
    key = key or (lambda answer: "".join(answer.split()))
    buckets = {}
    for i, answer in enumerate(answers):
        if answer is not None:
            buckets.setdefault(key(answer), []).append(i)
    groups = list(buckets.values())
    parent = list(range(len(groups)))  # union-find over the buckets

    def root(g):
        while parent[g] != g:
            g = parent[g]
        return g

    for g in range(len(groups)) if same else ():
        for h in range(g + 1, len(groups)):
            if root(g) != root(h) and same(answers[groups[g][0]], answers[groups[h][0]]):
                parent[max(root(g), root(h))] = min(root(g), root(h))
    classes = {}
    for g, members in enumerate(groups):
        classes.setdefault(root(g), []).extend(members)
    return [sorted(members) for members in classes.values()]


def representative(answers, members) -> str:
    """The most frequent spelling among a class's rollouts (the first of equals)."""
    return max(dict.fromkeys(s := [answers[i] for i in members]), key=s.count)
