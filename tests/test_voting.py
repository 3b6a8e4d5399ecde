"""voting.py: the verification-weighted vote, its classes and rewards."""
import doctest
import itertools
import os
import shutil
import subprocess
import sys

import pytest

import voting
from answers import answer_key, same_answer
from voting import answer_classes, weighted_vote

INF = float("inf")


def test_doctests_pass():
    failed, tested = doctest.testmod(voting)
    assert tested > 0 and failed == 0


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


def test_bad_group_is_refused():
    with pytest.raises(ValueError, match="2 answers need as many verdicts"):
        weighted_vote(["1", "2"], [0], 5.0)
    with pytest.raises(ValueError, match="omega must be >= 1"):
        weighted_vote(["1"], [0], 0.5)
    with pytest.raises(ValueError, match=r"each 0 or\s*1; got \[0.5\]"):
        weighted_vote(["1"], [0.5], 5.0)


def test_rewards_follow_the_class_assignment():
    assert weighted_vote(["5", "5.0", None, "6", " 5 ", "5"], [0] * 6, 1.0).rewards() == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert weighted_vote(["5", "5.0", None, "6"], [0] * 4, 1.0, key=answer_key).rewards() == [1.0, 1.0, 0.0, 0.0]




@pytest.mark.parametrize("omega, verified, unverified", [(1.4, 10, 14), (1.3, 10, 13), (1.1, 20, 22), (1.1, 50, 55),
                                                         (2.2, 25, 55)])
def test_an_omega_that_makes_a_tie_ties_and_the_tie_goes_to_more_rollouts(omega, verified, unverified):
    """10 verified at omega 1.4 weigh exactly what 14 unverified do; float sums (14.000000000000002) would decide
    the tie by rounding instead of by the rule."""
    vote = weighted_vote(["A"] * verified + ["B"] * unverified, [1] * verified + [0] * unverified, omega=omega)
    assert vote.label == "B" and vote.scores["A"] == vote.scores["B"] == unverified


@pytest.mark.parametrize("omega", [5.0, float("inf")])
def test_numpy_verdicts_vote_as_ints_do(omega):
    import numpy
    answers, verified = ["a", "b", "b"], [1, 0, 0] if omega == 5.0 else [0, 1, 1]
    assert weighted_vote(answers, list(numpy.array(verified, dtype=bool)), omega).scores == \
        weighted_vote(answers, verified, omega).scores

