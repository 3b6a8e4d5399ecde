"""Verification-weighted majority voting: the pseudo-label and rewards of test-time RL.

Test-time RL has no ground truth. For each question the policy samples N rollouts with final answers
a_1..a_N; the group votes on a pseudo-label and each rollout is rewarded for agreeing with it (TTRL).
T3RL adds a tool verifier that marks each rollout v_i in {0, 1}, and lets verified rollouts vote louder:

    w_i  = (1 - v_i) * 1 + v_i * omega                       (omega >= 1)
    y*   = argmax_a  sum_i w_i * 1[a_i ~ a]                  (the pseudo-label)
    r_i  = 1[a_i ~ y*]                                       (the binary reward)

where a ~ b means "the same answer". omega = 1 is plain majority voting (TTRL); omega = inf is hard
filtering: only verified answers count, and with none verified the vote falls back to plain majority.

Answer classes. Two answers vote together when key(a) == key(b) (default key: the answer with all
whitespace removed) or when same(a, b) holds; `key` buckets the rollouts cheaply, `same` (optional,
may be slow, e.g. a symbolic equivalence check) then merges buckets. A class is represented by its
most frequent spelling (ties: the one seen first). A missing answer (None) belongs to no class, so it
never wins unless every answer is missing, in which case the label is None.

Ties are broken deterministically: higher weighted score, then more rollouts, then the class whose
first rollout comes earliest in `answers`.

The paper's worked example: 11 unverified rollouts say 1260, 5 verified rollouts say 1320.

>>> answers = ["1260"] * 11 + ["1320"] * 5
>>> verified = [0] * 11 + [1] * 5
>>> weighted_vote(answers, verified, omega=5.0)
('1320', {'1320': 25.0, '1260': 11.0})
>>> weighted_vote(answers, verified, omega=1.0)[0]
'1260'
>>> rewards(answers, "1320")[-6:]
[0.0, 1.0, 1.0, 1.0, 1.0, 1.0]

Standard library only, so this file can be copied into another project as is.
"""

import math


def _default_key(answer):
    return "".join(answer.split())


def answer_classes(answers, same=None, key=None):
    """Group answer indices into vote classes: buckets by key, buckets merged by `same`.

    Returns a list of index lists, in order of each class's first appearance.
    """
    key = key or _default_key
    buckets = {}
    for i, a in enumerate(answers):
        if a is not None:
            buckets.setdefault(key(a), []).append(i)
    classes = []  # each: (spelling that founded it, [indices])
    for members in buckets.values():
        spelling = answers[members[0]]
        for founder, indices in classes:
            if same is not None and same(spelling, founder):
                indices.extend(members)
                break
        else:
            classes.append((spelling, list(members)))
    return [sorted(indices) for _, indices in classes]


def _representative(answers, indices):
    counts = {}
    for i in indices:
        counts[answers[i]] = counts.get(answers[i], 0) + 1
    return max(counts, key=lambda spelling: counts[spelling])  # max keeps the first of equals


def _check_group(answers, verified, omega):
    if len(answers) != len(verified):
        raise ValueError(f"answers has {len(answers)} entries but verified has {len(verified)}; pass one flag per answer")
    for v in verified:
        if v not in (0, 1):
            raise ValueError(f"verified must hold 0/1 or booleans, got {v!r}")
    if not omega >= 1:
        raise ValueError(f"omega must be >= 1 (1 = plain majority, float('inf') = hard filter), got {omega!r}")


def weighted_vote(answers, verified, omega=5.0, same=None, key=None):
    """Vote on a pseudo-label. Returns (label, scores).

    answers: list of answer strings or None; verified: list of 0/1 (or bools), one per answer.
    label: the winning class's representative spelling, or None when every answer is None.
    scores: {representative: weighted score}, best first (the tie rule decides the order).
    With omega = inf a score is the number of verified rollouts in the class (plain counts when no
    answer is verified).
    """
    _check_group(answers, verified, omega)
    classes = answer_classes(answers, same, key)
    hard_filter = math.isinf(omega) and any(verified[i] for members in classes for i in members)

    def weight(i):
        if hard_filter:
            return float(verified[i])
        return omega if verified[i] else 1.0

    ranked = []
    for members in classes:
        score = sum(weight(i) for i in members)
        ranked.append((-score, -len(members), members[0], _representative(answers, members), score))
    ranked.sort()
    scores = {rep: score for *_, rep, score in ranked}
    label = ranked[0][3] if ranked else None
    return label, scores


def _same_class(a, b, same, key):
    if a is None or b is None:
        return False
    key = key or _default_key
    return key(a) == key(b) or (same is not None and same(a, b))


def rewards(answers, label, same=None, key=None):
    """Binary rewards r_i = 1[answer_i same as label]; a None answer (or a None label) gets 0."""
    return [1.0 if _same_class(a, label, same, key) else 0.0 for a in answers]


def group_metrics(answers, verified, label, omega, gold=None, same=None, key=None):
    """Monitoring numbers of one rollout group (TTRL / T3RL), as a dict of floats.

    label: the pseudo-label that weighted_vote(answers, verified, omega, ...) returned.
    Always: majority_ratio (share of rollouts in the plain-majority class), verified_ratio,
    flipped (1 when the label differs from the plain-majority label; never with omega = 1).
    With gold: label_accuracy (label is gold), reward_accuracy (share of rollouts whose reward
    agrees with the reward gold would give), ground_truth_ratio (share of rollouts that are gold),
    pass@N (any rollout is gold), flip_fixed / flip_broke (a flip made the label right / wrong).
    """
    _check_group(answers, verified, omega)
    n = len(answers)
    if n == 0:
        raise ValueError("answers is empty; group_metrics needs at least one rollout")
    majority, plain_scores = weighted_vote(answers, verified, 1.0, same=same, key=key)
    flipped = omega != 1 and not (label is None and majority is None) and not _same_class(label, majority, same, key)
    metrics = {
        "majority_ratio": (plain_scores[majority] / n) if majority is not None else 0.0,
        "verified_ratio": sum(verified) / n,
        "flipped": float(flipped),
    }
    if gold is None:
        return metrics
    label_right = _same_class(label, gold, same, key)
    majority_right = _same_class(majority, gold, same, key)
    pseudo = rewards(answers, label, same=same, key=key)
    true = rewards(answers, gold, same=same, key=key)
    metrics.update({
        "label_accuracy": float(label_right),
        "reward_accuracy": sum(p == t for p, t in zip(pseudo, true)) / n,
        "ground_truth_ratio": sum(true) / n,
        "pass@N": float(any(true)),
        "flip_fixed": float(flipped and label_right and not majority_right),
        "flip_broke": float(flipped and majority_right and not label_right),
    })
    return metrics
