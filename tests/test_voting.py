"""voting.py: the verification-weighted vote, its classes, rewards, laziness and monitors."""
import doctest
import itertools
import math
import os
import random
import shutil
import subprocess
import sys

import pytest

import verifier
import voting
from answers import answer_key, same_answer
from voting import answer_classes, group_metrics, undecided_classes, weighted_vote

INF = float("inf")


def test_doctests_pass():
    for module in (voting, verifier):
        failed, _ = doctest.testmod(module)
        assert failed == 0


def test_voting_imports_only_the_standard_library():
    source = open(voting.__file__).read()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports and imports <= set(sys.stdlib_module_names)


def vote_of(answers, verified, omega, **classes):
    vote = weighted_vote(answers, verified, omega, **classes)
    return vote.label, vote.scores


def test_voting_runs_as_a_lone_file(tmp_path):
    shutil.copy(voting.__file__, tmp_path / "voting.py")
    done = subprocess.run([sys.executable, "-m", "doctest", "-v", "voting.py"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0 and "passed and 0 failed" in done.stdout, done.stdout + done.stderr


def test_paper_example_flips_with_omega_5_and_not_with_omega_1():
    answers, verified = ["1260"] * 11 + ["1320"] * 5, [0] * 11 + [1] * 5
    assert vote_of(answers, verified, 5.0) == ("1320", {"1320": 25.0, "1260": 11.0})
    assert vote_of(answers, verified, 1.0) == ("1260", {"1260": 11.0, "1320": 5.0})


def test_hard_filter_counts_only_verified_answers():
    answers, verified = ["7"] * 10 + ["8", "9", "9"], [0] * 10 + [1, 0, 0]
    assert vote_of(answers, verified, INF) == ("8", {"8": 1.0, "7": 0.0, "9": 0.0})


def test_hard_filter_without_verified_answers_is_plain_majority():
    assert vote_of(["7", "8", "8"], [0, 0, 0], INF) == ("8", {"8": 2.0, "7": 1.0})


def test_tie_on_score_goes_to_more_rollouts():
    # "a": one verified rollout (5); "b": five unverified rollouts (5)
    label, scores = vote_of(["a", "b", "b", "b", "b", "b"], [1, 0, 0, 0, 0, 0], 5.0)
    assert label == "b" and scores == {"b": 5.0, "a": 5.0}


def test_full_tie_goes_to_first_appearance():
    assert weighted_vote(["x", "y", "y", "x"], [0, 0, 0, 0], 1.0).label == "x"
    assert weighted_vote(["y", "x", "y", "x"], [0, 0, 0, 0], 1.0).label == "y"


def test_hard_filter_tie_goes_to_first_appearance():
    assert weighted_vote(["p", "q", "q"], [0, 1, 1], INF).label == "q"
    assert weighted_vote(["p", "q", "r"], [1, 0, 1], INF).label == "p"


def test_none_never_wins_against_an_answer():
    vote = weighted_vote([None, None, None, "4"], [1, 1, 1, 0], 5.0)
    assert (vote.label, vote.scores, vote.assignment, vote.rewards()) == ("4", {"4": 1.0}, [None, None, None, 0],
                                                                          [0.0, 0.0, 0.0, 1.0])


def test_all_none_gives_no_label():
    for omega in (1.0, 5.0, INF):
        vote = weighted_vote([None, None], [0, 1], omega)
        assert (vote.label, vote.scores, vote.rewards()) == (None, {}, [0.0, 0.0])


def test_single_class_group():
    assert vote_of(["3", "3", "3"], [1, 0, 1], 5.0) == ("3", {"3": 11.0})


def test_whitespace_variants_vote_together_by_default():
    assert vote_of(["1 + i", "1+i", "2"], [0, 0, 0], 1.0) == ("1 + i", {"1 + i": 2.0, "2": 1.0})


def test_class_is_represented_by_its_most_frequent_spelling():
    answers = ["\\frac12", "0.5", "0.5", "1/2", "3", "3"]
    assert vote_of(answers, [0] * 6, 1.0, key=answer_key) == ("0.5", {"0.5": 4.0, "3": 2.0})


def test_same_merges_spellings_the_key_misses():
    answers = ["\\sqrt{2}/2", "\\frac{1}{\\sqrt2}", "1", "1"]
    assert vote_of(answers, [0] * 4, 1.0, key=answer_key)[1] == {"1": 2.0, "\\sqrt{2}/2": 1.0, "\\frac{1}{\\sqrt2}": 1.0}
    assert vote_of(answers, [0] * 4, 1.0, key=answer_key, same=same_answer) == ("\\sqrt{2}/2", {"\\sqrt{2}/2": 2.0, "1": 2.0})


def test_equivalent_spellings_collapse_into_one_class():
    answers = ["1,000", "1000", "1000.0", "10^3", "999", "\\boxed{1000}"]
    label, scores = vote_of(answers, [0, 0, 0, 0, 1, 0], 2.0, key=answer_key, same=same_answer)
    assert label == "1,000" and scores["1,000"] == 5.0 and scores["999"] == 2.0


def test_same_answers_in_any_order_elect_the_same_class_and_reward_only_it():
    # 9% is 9 percent, not 0.09: the winner is 0.09 whichever rollout comes first, and the 9 / 9% rollouts lose
    answers = ["9", "9\\%", "0.09", "0.09", "0.09"]
    for order in itertools.permutations(range(len(answers))):
        shuffled = [answers[i] for i in order]
        vote = weighted_vote(shuffled, [0] * len(shuffled), 5.0, key=answer_key, same=same_answer)
        assert vote.label == "0.09" and list(vote.scores.values()) == [3.0, 2.0]
        assert vote.rewards() == [1.0 if a == "0.09" else 0.0 for a in shuffled]


def test_classes_are_connected_components_whatever_the_order():
    # a `same` that is not transitive (neighbours): classes must still not depend on the rollouts' order
    def neighbours(a, b):
        return abs(int(a) - int(b)) == 1
    for answers in itertools.permutations(["1", "2", "3", "7"]):
        classes = answer_classes(list(answers), same=neighbours)
        assert sorted(sorted(answers[i] for i in c) for c in classes) == [["1", "2", "3"], ["7"]]


def test_assignment_matches_classes_and_rewards():
    answers = ["5", "6", None, "5", "6", "6"]
    vote = weighted_vote(answers, [1, 0, 0, 1, 0, 0], 5.0)
    assert [c.members for c in vote.classes] == [[0, 3], [1, 4, 5]]
    assert vote.assignment == [0, 1, None, 0, 1, 1] and vote.rewards() == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]


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


def test_bad_group_is_refused():
    with pytest.raises(ValueError, match="verified has 1"):
        weighted_vote(["1", "2"], [0], 5.0)
    with pytest.raises(ValueError, match="omega must be >= 1"):
        weighted_vote(["1"], [0], 0.5)
    with pytest.raises(ValueError, match=r"shares in \[0, 1\], got 1.5"):
        weighted_vote(["1"], [1.5], 5.0)


def test_a_share_of_programs_weighs_between_one_and_omega():
    """--verifier-agreement share: v_i is the share of a rollout's programs that reproduced a_i and
    w_i = 1 + (omega - 1) * v_i: two thirds at omega 4 weigh 3 votes, so one such rollout outvotes two
    unverified ones, a third of a program (weight 2) ties them and loses on size."""
    assert weighted_vote(["7", "9", "9"], [2 / 3, 0, 0], 4.0).scores == {"7": 3.0, "9": 2.0}
    assert weighted_vote(["7", "9", "9"], [1 / 3, 0, 0], 4.0).label == "9"
    assert weighted_vote(["7", "9"], [0.5, 0.25], math.inf).scores == {"7": 0.5, "9": 0.25}
    # lazy verification's bounds hold for shares: 7's verified share decides against one open rollout
    assert undecided_classes(["7", "7", "9"], [2 / 3, 2 / 3, None], 4.0) == []
    assert undecided_classes(["7", "7", "9", "9"], [1 / 3, 1 / 3, None, None], 4.0) == [[2, 3]]


def test_rewards_follow_the_class_assignment():
    assert weighted_vote(["5", "5.0", None, "6", " 5 ", "5"], [0] * 6, 1.0).rewards() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert weighted_vote(["5", "5.0", None, "6"], [0] * 4, 1.0, key=answer_key).rewards() == [1.0, 1.0, 0.0, 0.0]


def test_metrics_of_a_flip_that_fixes_the_label():
    answers = ["1260"] * 11 + ["1320"] * 4 + [None]
    verified = [0] * 11 + [1] * 4 + [0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), verified, gold="1320")
    assert m == {"majority_ratio": 11 / 16, "verified_ratio": 4 / 16, "flipped": 1.0,
                 "label_accuracy": 1.0, "reward_accuracy": 1.0, "ground_truth_ratio": 4 / 16,
                 "pass@N": 1.0, "flip_fixed": 1.0, "flip_broke": 0.0}


def test_metrics_of_a_flip_that_breaks_the_label():
    answers, verified = ["7", "7", "7", "9"], [0, 0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0)
    m = group_metrics(vote, verified, gold="7")
    # pseudo rewards 0,0,0,1 against true 1,1,1,0: none agree
    assert (vote.label, m["flipped"], m["flip_fixed"], m["flip_broke"]) == ("9", 1.0, 0.0, 1.0)
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.0, 0.75, 1.0)


def test_metrics_without_flip_or_gold():
    answers, verified = ["2", "3", "3", "4"], [0, 1, 0, 0]
    assert group_metrics(weighted_vote(answers, verified, 1.0), verified) == {"majority_ratio": 0.5,
                                                                               "verified_ratio": 0.25, "flipped": 0.0}


def test_metrics_when_nobody_finds_gold():
    answers, verified = ["2", "2", "3", None], [0, 0, 0, 0]
    m = group_metrics(weighted_vote(answers, verified, 5.0), verified, gold="4")
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.5, 0.0, 0.0)


def test_metrics_find_gold_in_a_class_through_same():
    answers, verified = ["0.5", "0.5", "3"], [0, 0, 1]
    vote = weighted_vote(answers, verified, 5.0, key=answer_key, same=same_answer)
    m = group_metrics(vote, verified, gold="\\frac{1}{2}", key=answer_key, same=same_answer)
    assert (vote.label, m["flipped"], m["flip_broke"], m["ground_truth_ratio"]) == ("3", 1.0, 1.0, 2 / 3)
