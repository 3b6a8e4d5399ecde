"""machinery/metrics.py: what a step and an evaluation report (monitors: never rewards)."""
from answers import answer_key, same_answer
from machinery.metrics import group_metrics
from voting import weighted_vote


def test_metrics_of_a_flip_that_fixes_the_label():
    answers = ["1260"] * 11 + ["1320"] * 4 + [None]
    verified = [0] * 11 + [1] * 4 + [0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), answers, verified, 5.0, gold="1320")
    assert m == {"majority_ratio": 11 / 16, "verified_ratio": 4 / 16, "flipped": 1.0,
                 "label_accuracy": 1.0, "reward_accuracy": 1.0, "ground_truth_ratio": 4 / 16,
                 "pass@N": 1.0, "flip_fixed": 1.0, "flip_broke": 0.0}


def test_metrics_of_a_flip_that_breaks_the_label():
    answers, verified = ["7", "7", "7", "9"], [0, 0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0)
    m = group_metrics(vote, answers, verified, 5.0, gold="7")
    # pseudo rewards 0,0,0,1 against true 1,1,1,0: none agree
    assert (vote.label, m["flipped"], m["flip_fixed"], m["flip_broke"]) == ("9", 1.0, 0.0, 1.0)
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.0, 0.75, 1.0)


def test_metrics_without_flip_or_gold():
    answers, verified = ["2", "3", "3", "4"], [0, 1, 0, 0]
    assert group_metrics(weighted_vote(answers, verified, 1.0), answers, verified, 1.0) == {"majority_ratio": 0.5,
                                                                               "verified_ratio": 0.25, "flipped": 0.0}


def test_metrics_when_nobody_finds_gold():
    answers, verified = ["2", "2", "3", None], [0, 0, 0, 0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), answers, verified, 5.0, gold="4")
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.5, 0.0, 0.0)


def test_metrics_find_gold_in_a_class_through_same():
    answers, verified = ["0.5", "0.5", "3"], [0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0, key=answer_key, same=same_answer)
    m = group_metrics(vote, answers, verified, 5.0, gold="\\frac{1}{2}", key=answer_key,
                      same=same_answer)
    assert (vote.label, m["flipped"], m["flip_broke"], m["ground_truth_ratio"]) == ("3", 1.0, 1.0, 2 / 3)
