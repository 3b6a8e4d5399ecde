"""extensions/budget.py: verifying some rollouts of a class (--verify-budget, --lazy-verify)."""
import itertools
import math
import random

from extensions import budget
from extensions.budget import undecided_classes
from helpers import PROBLEM, ROLLOUT, ScriptedVerifier, verify_batch
from verifier import MATH, Verification
from voting import weighted_vote


def block(code):
    return f"Here is the program.\n```python\n{code}\n```\nIt prints the result."


def every_outcome(verified):
    """Each way the unverified rollouts (None) could turn out: complete 0/1 lists."""
    unknown = [i for i, v in enumerate(verified) if v is None]
    for bits in itertools.product((0, 1), repeat=len(unknown)):
        filled = list(verified)
        for i, bit in zip(unknown, bits):
            filled[i] = bit
        yield filled


OMEGAS = (1.0, 2.0, 5.0, math.inf)


def test_the_vote_is_undecided_exactly_when_unverified_rollouts_can_change_its_label():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        answers = [None if rng.random() < 0.15 else rng.choice("abc") for _ in range(n)]
        verified = [rng.choice((0, 1, None)) for _ in range(n)]
        for omega in OMEGAS:
            labels = {weighted_vote(answers, v, omega).label for v in every_outcome(verified)}
            assert (undecided_classes(answers, verified, omega) == []) == (len(labels) == 1), (answers, verified, omega)


def test_verifying_the_undecided_classes_in_two_rounds_gives_the_label_and_rewards_of_verifying_all():
    rng = random.Random(1)
    asked = everyone = 0
    for _ in range(300):
        n = rng.randint(1, 8)
        answers = [None if rng.random() < 0.15 else rng.choice("abcd") for _ in range(n)]
        truth = [rng.randint(0, 1) for _ in range(n)]
        for omega in OMEGAS:
            known = [None] * n
            for first_round in (True, False):  # the likeliest winner first, then every class that can beat it
                undecided = undecided_classes(answers, known, omega)
                for members in undecided[:1] if first_round else undecided:
                    for i in members:
                        known[i] = truth[i]
            assert undecided_classes(answers, known, omega) == []
            lazy = weighted_vote(answers, [0 if v is None else v for v in known], omega)
            full = weighted_vote(answers, truth, omega)
            assert (lazy.label, lazy.rewards()) == (full.label, full.rewards())
            asked += sum(v is not None for v in known)
            everyone += sum(a is not None for a in answers)
    assert asked < 0.8 * everyone


def test_plain_majority_needs_no_verdict():
    assert undecided_classes(["1", "2", "2"], [None] * 3, omega=1.0) == []


def test_budget_verifies_only_k_per_answer_class(verify_pool):
    answers = ["\\frac12", "0.5", "1/2", "2", "2", "2"]  # two classes: 1/2 (three spellings) and 2
    verifier = ScriptedVerifier(*[block("print(1 / 2)")] * 2 + [block("print(1 + 1)")] * 2)
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, MATH, verify_pool, budget=2)
    assert len(verifier.batches[0]) == 4
    assert [r.inferred for r in results] == [False, False, True, False, False, True]
    # its monitor counts its own inherited verdicts, not another extension's (the memory's)
    remembered = Verification(1, "verified", "2", inferred=True, details={"remembered": True})
    assert budget.monitor(None, answers, results + [remembered]) == {"inherited": 2, "skipped": 0}


def test_budget_shares_the_majority_outcome_of_the_class(verify_pool):
    answers = ["55"] * 5
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"), block("print(54 + len('x'))"),
                                block("print(1 / 0)"))
    results = verify_batch([PROBLEM] * 5, [ROLLOUT] * 5, answers, verifier, MATH, verify_pool, budget=3)
    assert [r.v for r in results] == [1, 1, 0, 1, 1]
    assert [r.status for r in results[3:]] == ["verified", "verified"]


def test_budget_tie_inherits_unverified(verify_pool):
    verifier = ScriptedVerifier(block("print(54 + len('x'))"), block("print(54)"))
    results = verify_batch([PROBLEM] * 3, [ROLLOUT] * 3, ["55"] * 3, verifier, MATH, verify_pool, budget=2)
    assert results[2].v == 0 and results[2].inferred


def test_budget_keeps_problems_apart(verify_pool):
    other = "What is 5 times 11?"
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"), block("print(5 * 11)"))
    results = verify_batch([PROBLEM, PROBLEM, other], [ROLLOUT] * 3, ["55"] * 3, verifier, MATH, verify_pool, budget=1)
    assert [r.inferred for r in results] == [False, True, False]


def test_lazy_verification_stops_once_the_majority_is_verified(verify_pool, monkeypatch):
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)
    answers = ["55", "55", "55", "55", "54", "56"]  # 55 verified scores 20, the others 5 at most
    verifier = ScriptedVerifier(block("print(sum(range(1, 11)))"))
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, MATH, verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [1]
    assert [r.status for r in results] == ["verified"] * 4 + ["skipped"] * 2 and [r.v for r in results] == [1] * 4 + [0, 0]


def test_lazy_verification_asks_the_classes_that_can_still_win_in_a_second_call(verify_pool, monkeypatch):
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)  # a second call pays even for one prompt spared
    answers = ["55", "55", "55", "55", "54", "56"]  # 55 fails (4): 54 or 56 verified (5) would beat it
    verifier = ScriptedVerifier(*[block("print(6 * 9)")] * 3)
    results = verify_batch([PROBLEM] * 6, [ROLLOUT] * 6, answers, verifier, MATH, verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [1, 2]
    assert [r.status for r in results] == ["mismatch"] * 4 + ["verified", "mismatch"]
    assert weighted_vote(answers, [r.v for r in results], 5.0).label == "54"


def test_lazy_verification_asks_every_class_that_can_win_at_once_when_a_second_call_spares_little(verify_pool):
    answers = ["55", "55", "55", "55", "54", "56", "57"]  # 55 and the three that could beat it: 3 prompts spared
    verifier = ScriptedVerifier(*[block("print(6 * 9)")] * 4)
    results = verify_batch([PROBLEM] * 7, [ROLLOUT] * 7, answers, verifier, MATH, verify_pool, budget=1, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [4]
    assert [r.status for r in results] == ["mismatch"] * 4 + ["verified", "mismatch", "mismatch"]


def test_lazy_verification_of_several_problems_makes_two_verifier_calls(verify_pool, monkeypatch):
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)
    other = "What is 5 times 11?"
    problems = [PROBLEM] * 4 + [other] * 4
    answers = ["55", "55", "54", "53"] * 2  # per problem: 55 fails, so 54 and 53 can still win
    verifier = ScriptedVerifier(*[block("print(0)")] * 8)
    results = verify_batch(problems, [ROLLOUT] * 8, answers, verifier, MATH, verify_pool, omega=5.0)
    assert [len(batch) for batch in verifier.batches] == [4, 4]
    assert all(r.status == "mismatch" for r in results)


def test_two_questions_with_the_same_text_vote_apart_when_keyed_apart(verify_pool, monkeypatch):
    """A benchmark may hold one text twice (two ids): keyed by question, each vote's laziness is its own, as
    if each were verified alone. By text the six rollouts would vote as one group, where a verified 55 (15)
    leaves the second question's 54 and 53 nothing to win, and they would be skipped."""
    monkeypatch.setattr(budget, "LAZY_SECOND_CALL", 0)  # the likeliest winners first, then what can beat them
    a, b = ["55", "55", "55", "54"], ["54", "53"]
    program = block("print(sum(range(1, 11)))")

    def statuses(answers, groups=None):
        return [r.status for r in verify_batch([PROBLEM] * len(answers), [ROLLOUT] * len(answers), answers,
                                               ScriptedVerifier(*[program] * 6), MATH, verify_pool, omega=5.0,
                                               groups=groups)]
    keyed = statuses(a + b, groups=["a"] * 4 + ["b"] * 2)
    assert keyed == statuses(a) + statuses(b) and keyed[4:] == ["mismatch", "mismatch"]
    assert statuses(a + b)[4:] == ["skipped", "skipped"]
