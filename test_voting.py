import doctest
import json
import os
import sys
import threading
import time

import pytest

import verifier
import voting
from verifier import EQUIV_CASES, answer_key, extract_answer, is_equiv, same_answer
from voting import group_metrics, rewards, weighted_vote

INF = float("inf")


# ---------------------------------------------------------------- voting.py

def test_doctests_pass():
    for module in (voting, verifier):
        failed, _ = doctest.testmod(module)
        assert failed == 0


def test_voting_imports_only_the_standard_library():
    source = open(voting.__file__).read()
    imports = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports and imports <= set(sys.stdlib_module_names)


def test_paper_example_flips_with_omega_5_and_not_with_omega_1():
    answers, verified = ["1260"] * 11 + ["1320"] * 5, [0] * 11 + [1] * 5
    assert weighted_vote(answers, verified, 5.0) == ("1320", {"1320": 25.0, "1260": 11.0})
    assert weighted_vote(answers, verified, 1.0) == ("1260", {"1260": 11.0, "1320": 5.0})


def test_hard_filter_counts_only_verified_answers():
    answers, verified = ["7"] * 10 + ["8", "9", "9"], [0] * 10 + [1, 0, 0]
    assert weighted_vote(answers, verified, INF) == ("8", {"8": 1.0, "7": 0.0, "9": 0.0})


def test_hard_filter_without_verified_answers_is_plain_majority():
    assert weighted_vote(["7", "8", "8"], [0, 0, 0], INF) == ("8", {"8": 2.0, "7": 1.0})


def test_tie_on_score_goes_to_more_rollouts():
    # "a": one verified rollout (5); "b": five unverified rollouts (5)
    label, scores = weighted_vote(["a", "b", "b", "b", "b", "b"], [1, 0, 0, 0, 0, 0], 5.0)
    assert label == "b" and scores == {"b": 5.0, "a": 5.0}


def test_full_tie_goes_to_first_appearance():
    assert weighted_vote(["x", "y", "y", "x"], [0, 0, 0, 0], 1.0)[0] == "x"
    assert weighted_vote(["y", "x", "y", "x"], [0, 0, 0, 0], 1.0)[0] == "y"


def test_hard_filter_tie_goes_to_first_appearance():
    assert weighted_vote(["p", "q", "q"], [0, 1, 1], INF)[0] == "q"
    assert weighted_vote(["p", "q", "r"], [1, 0, 1], INF)[0] == "p"


def test_none_never_wins_against_an_answer():
    label, scores = weighted_vote([None, None, None, "4"], [1, 1, 1, 0], 5.0)
    assert label == "4" and scores == {"4": 1.0}


def test_all_none_gives_no_label():
    for omega in (1.0, 5.0, INF):
        assert weighted_vote([None, None], [0, 1], omega) == (None, {})


def test_single_class_group():
    assert weighted_vote(["3", "3", "3"], [1, 0, 1], 5.0) == ("3", {"3": 11.0})


def test_whitespace_variants_vote_together_by_default():
    assert weighted_vote(["1 + i", "1+i", "2"], [0, 0, 0], 1.0) == ("1 + i", {"1 + i": 2.0, "2": 1.0})


def test_class_is_represented_by_its_most_frequent_spelling():
    answers = ["\\frac12", "0.5", "0.5", "1/2", "3", "3"]
    label, scores = weighted_vote(answers, [0] * 6, 1.0, key=answer_key)
    assert label == "0.5" and scores == {"0.5": 4.0, "3": 2.0}


def test_same_merges_spellings_the_key_misses():
    answers = ["\\sqrt{2}/2", "\\frac{1}{\\sqrt2}", "1", "1"]
    assert weighted_vote(answers, [0] * 4, 1.0, key=answer_key)[1] == {"1": 2.0, "\\sqrt{2}/2": 1.0,
                                                                         "\\frac{1}{\\sqrt2}": 1.0}
    label, scores = weighted_vote(answers, [0] * 4, 1.0, key=answer_key, same=same_answer)
    assert label == "\\sqrt{2}/2" and scores == {"\\sqrt{2}/2": 2.0, "1": 2.0}


def test_equivalent_spellings_collapse_into_one_class():
    answers = ["1,000", "1000", "1000.0", "10^3", "999", "\\boxed{1000}"]
    label, scores = weighted_vote(answers, [0, 0, 0, 0, 1, 0], 2.0, key=answer_key, same=same_answer)
    assert label == "1,000" and scores["1,000"] == 5.0 and scores["999"] == 2.0


def test_bad_group_is_refused():
    with pytest.raises(ValueError, match="verified has 1"):
        weighted_vote(["1", "2"], [0], 5.0)
    with pytest.raises(ValueError, match="omega must be >= 1"):
        weighted_vote(["1"], [0], 0.5)
    with pytest.raises(ValueError, match="0/1"):
        weighted_vote(["1"], [0.5], 5.0)


def test_rewards_match_label_and_give_none_zero():
    assert rewards(["5", "5.0", None, "6", " 5 "], "5") == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert rewards(["5", "5.0", None, "6"], "5", key=answer_key) == [1.0, 1.0, 0.0, 0.0]
    assert rewards(["5", None], None) == [0.0, 0.0]


def test_metrics_of_a_flip_that_fixes_the_label():
    answers = ["1260"] * 11 + ["1320"] * 4 + [None]
    verified = [0] * 11 + [1] * 4 + [0]
    label, _ = weighted_vote(answers, verified, 5.0)
    m = group_metrics(answers, verified, label, 5.0, gold="1320")
    assert m == {"majority_ratio": 11 / 16, "verified_ratio": 4 / 16, "flipped": 1.0,
                 "label_accuracy": 1.0, "reward_accuracy": 1.0, "ground_truth_ratio": 4 / 16,
                 "pass@N": 1.0, "flip_fixed": 1.0, "flip_broke": 0.0}


def test_metrics_of_a_flip_that_breaks_the_label():
    answers, verified = ["7", "7", "7", "9"], [0, 0, 0, 1]
    label, _ = weighted_vote(answers, verified, 5.0)
    m = group_metrics(answers, verified, label, 5.0, gold="7")
    # pseudo rewards 0,0,0,1 against true 1,1,1,0: none agree
    assert (label, m["flipped"], m["flip_fixed"], m["flip_broke"]) == ("9", 1.0, 0.0, 1.0)
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.0, 0.75, 1.0)


def test_metrics_without_flip_or_gold():
    answers, verified = ["2", "3", "3", "4"], [0, 1, 0, 0]
    label, _ = weighted_vote(answers, verified, 1.0)
    assert group_metrics(answers, verified, label, 1.0) == {"majority_ratio": 0.5, "verified_ratio": 0.25,
                                                            "flipped": 0.0}


def test_metrics_when_nobody_finds_gold():
    answers, verified = ["2", "2", "3", None], [0, 0, 0, 0]
    m = group_metrics(answers, verified, "2", 5.0, gold="4")
    assert (m["label_accuracy"], m["reward_accuracy"], m["ground_truth_ratio"], m["pass@N"]) == (0.0, 0.5, 0.0, 0.0)


# ---------------------------------------------------------------- extract_answer

@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{\\frac{1}{2}} first, then \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt{3}}{2}"),
    ("$\\boxed{\\{1, \\{2\\}\\}}$", "\\{1, \\{2\\}\\}"),
    ("hence \\boxed 5 is it", "5"),
    ("\\fbox{12}", "12"),
    ("Thus, the answer is $\\dfrac{3}{4}$.", "\\dfrac{3}{4}"),
    ("The final answer is 3.5.", "3.5"),
    ("I am not sure.", None),
    ("\\boxed{}", None),
    ("\\boxed{unclosed", None),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


# ---------------------------------------------------------------- answer_key / is_equiv

def test_answer_key_gives_equal_spellings_one_key():
    assert answer_key("0.5") == answer_key("\\frac12") == answer_key("\\dfrac{1}{2}") == answer_key("1/2")
    assert answer_key("1,000") == answer_key("1000") == answer_key("1000.0") == answer_key("$1,\\!000$")
    assert answer_key("(1,2,3)") == answer_key("\\begin{pmatrix} 1 \\\\ 2 \\\\ 3 \\end{pmatrix}")
    assert answer_key("x > 2") == answer_key("(2, \\infty)")
    assert answer_key(None) is None


def test_answer_key_refuses_non_strings():
    with pytest.raises(TypeError, match="answer must be a string"):
        answer_key(["1"])


EQUIV = [  # (pred, gold) pairs that are equal, one or more per category of the issue
    ("0.\\overline{3}", "\\frac13"), ("0.1\\overline{6}", "\\frac{1}{6}"),             # repeating decimals
    ("x \\le 3", "(-\\infty, 3]"), ("-2 \\le x < 7", "[-2,7)"),                         # inequalities
    ("x<2 \\text{ or } x>3", "(-\\infty,2)\\cup(3,\\infty)"),
    ("10\u2009080", "10,\\!080"), ("10\\,080", "10080"),                                 # thousands
    ("90°", "90^\\circ"), ("90", "90^{\\circ}"),                                         # degrees
    ("(-2,-14,-7)", "\\begin{pmatrix} -2 \\\\ -14 \\\\ -7 \\end{pmatrix}"),               # vectors
    ("6 - 5 i", "6-5i"), ("-5i + 6", "6 - 5i"),                                          # complex
    ("\\textbf{(C)} 12", "\\text{(C)}"), ("C", "(C)"),                                    # choices
    ("142", "142.0"), ("25", "025"),                                                      # AMC / AIME
    ("\\frac{\\sqrt3}{3}", "\\frac{1}{\\sqrt3}"), ("1 \\pm \\sqrt{19}", "1-\\sqrt{19}, 1+\\sqrt{19}"),
]
NOT_EQUIV = [  # near misses
    ("141", "142.0"), ("-3", "3"), ("\\frac{3}{14}", "\\frac{14}{3}"),                   # off by one, sign, reciprocal
    ("0.333", "\\frac13"), ("0.3333333", "\\frac13"), ("1.4142", "\\sqrt2"),             # rounded decimals
    ("(3,4)", "(3,4]"), ("x < 3", "(-\\infty, 3]"),                                       # open vs closed
    ("(-29,15)", "(15,-29)"), ("(-1/3, 5/3, 2/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
    ("1", "1,-2"), ("1,-2,3", "1,-2"), ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),              # missing / extra root
    ("6+5i", "6-5i"), ("(B)", "\\text{(C)}"), ("89^\\circ", "90^\\circ"), ("10,081", "10,\\!080"),
    ("0.\\overline{3}", "0.3"),
]


@pytest.mark.parametrize("pred, gold", EQUIV)
def test_is_equiv_accepts_equal_spellings(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred, gold", NOT_EQUIV)
def test_is_equiv_rejects_near_misses(pred, gold):
    assert not is_equiv(pred, gold)


def test_is_equiv_none_is_never_equal():
    assert not is_equiv(None, "1") and not is_equiv("1", None) and not is_equiv(None, None)


def test_is_equiv_on_the_labelled_set_has_no_false_positive():
    with open(EQUIV_CASES) as f:
        cases = [json.loads(line) for line in f]
    assert len(cases) >= 300
    false_pos = [c for c in cases if not c["equal"] and is_equiv(c["pred"], c["gold"])]
    right = sum(is_equiv(c["pred"], c["gold"]) == c["equal"] for c in cases)
    assert false_pos == []
    assert right / len(cases) >= 0.985


def test_hanging_comparison_returns_within_its_limit():
    start = time.monotonic()
    assert not is_equiv("2^{2^{2^{2^{2^{2}}}}}", "7", timeout=1.0)  # a huge integer power, in C
    assert time.monotonic() - start < 1.0 + 0.5
    assert is_equiv("\\sqrt{8}", "2\\sqrt2")  # the helper process is replaced


def test_is_equiv_works_outside_the_main_thread():
    results = []
    thread = threading.Thread(target=lambda: results.append(is_equiv("\\cos^2 x + \\sin^2 x", "1")))
    thread.start()
    thread.join()
    assert results == [True]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_is_equiv_works_in_a_forked_child():
    is_equiv("\\sqrt{12}", "2\\sqrt{3}")  # make sure the parent has a helper process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = is_equiv("\\sqrt{27}", "3\\sqrt{3}") and not is_equiv("\\sqrt{27}", "3\\sqrt{2}")
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert is_equiv("\\sqrt{50}", "5\\sqrt{2}")  # the parent's helper still answers


def test_same_answer_is_symmetric():
    assert same_answer("2x+y=0", "y=-2x") == same_answer("y=-2x", "2x+y=0")
    assert same_answer("\\frac{1}{\\sqrt2}", "\\frac{\\sqrt2}{2}") and not same_answer("1", None)
