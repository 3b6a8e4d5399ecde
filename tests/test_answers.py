"""answers.py: extracting and comparing answers."""
import json
import os
import threading
import time

import pytest

from answers import answer_key, extract_answer, is_equiv, same_answer
from bench.answers import EQUIV_CASES, bench_equiv
from voting import answer_classes


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
    # Minerva's format: the sentence's math span, not the rest of the sentence
    ("so $x=5$.\nFinal Answer: The final answer is $100$. I hope it is correct.", "100"),
    ("Final Answer: The final answer is 7/2. I hope it is correct.", "7/2"),
    ("$= \\boxed{24}.$\nFinal Answer: The final answer is $24$. I hope it is correct.", "24"),
    # a later "final answer is" overrides a mid-solution box; a box inside the sentence is the answer
    ("after six months \\boxed{200} dollars ... so the final answer is 10,455.", "10,455"),
    ("The final answer is $\\boxed{7}$.", "7"),
    ("\\boxed{6}. Let me check: the answer is right.", "6"),  # only a *final* answer sentence beats a box
    # boxes separated only by connectors are one answer; prose in between keeps only the last
    ("The roots are \\boxed{-2} and \\boxed{1}.", "-2, 1"),
    ("$\\boxed{(2, 2)} \\quad \\text{and} \\quad \\boxed{(6, 2)}$", "(2, 2), (6, 2)"),
    ("first \\boxed{5}, wait, that is wrong: \\boxed{6}", "6"),
    # a short response: its last math span; a long unmarked solution: none
    ("Answer \\( (9+1) \\)", "(9+1)"),
    ("We find that $x \\lt 3$.", "x \\lt 3"),
    ("$1$ and $2$ and $3$", "1, 2, 3"),
    ("Answer $ \n 9 \n $", None),  # $...$ does not span lines
    ("Let $t$ be the time. " * 20 + "Then $t = 3$.", None),
    # markdown around a final answer; words after a box leave the box; one sentence, several spans
    ("So $\\boxed{25}$.\n\n**Final Answer:** 25", "25"),
    ("...\n\nFinal Answer: **25**", "25"),
    ("...\n\n**Final Answer:**\n$$25$$", "25"),
    ("So $\\boxed{4}$. The final answer is in the box above.", "4"),
    ("The answer is $x = 3$ or $x=5$.", "x = 3, x=5"),
    ("The answer is $5$. Then $6$.", "5"),
    ("The answer is $5$, and $5^2 = 25$ confirms it.", "5"),  # the sentence goes on past its spans
    ("The final answer is $x=3$ or $x=-3$, as required.", "x=3, x=-3"),
    ("\\boxed{5}\n\nThe final answer is above.", "5"),        # words pointing back leave the box
    ("First \\boxed{A}. Wait. The final answer is C.", "C"),  # a letter after a box still replaces it
    ("The final answer is __7__.", "7"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


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
    ("(p,q)=(3,2)", "(3,2)"), ("AB=4, CD=5", "CD=5, AB=4"), ("a=4,\\,-8,\\,-10", "-10,-8,4"),       # labels
    ("f(x)=1", "1"), ("p=-1 \\text{ and } p=\\dfrac{15}{8}", "p=-1, p=\\frac{15}{8}"),
    ("-x > -1", "x < 1"), ("x \\neq 3", "x != 3"), ("x = 5+5+1 = 11", "11"),             # relations
    ("28 pct", "28\\%"), ("28 percent", "28\\%"), ("9\\%", "9"),                              # percent words
    ("0.0833333333333333", "\\frac{1}{12}"),                                               # a printed double
    ("1+\\mathrm{i}", "1+i"), ("\\mathrm{e}^{-1}", "\\frac1e"), ("\\text{e}^2", "e^2"),          # upright e, i
    ("x=-1 \\text{ or } x=2", "-1, 2"), ("x=1 \\lor x=2", "2,1"), ("1 or 2", "1,2"),             # roots with or
    ("{1,3}", "1,3"), ("{1,000}", "1000"), ("{10 \\choose 3}", "120"),                      # a bare group
    ("\\text{Yes or No}", "Yes or No"), ("(1,2) or (3,4)", "(1,2), (3,4)"),                  # or, not a list
    ("\\pi or -\\pi", "\\pm\\pi"), ("x_1 = 1 or x_2 = 2", "1, 2"), ("x = \\sqrt[3]{2} or x = 1", "1, \\sqrt[3]{2}"),
    ("{30}^\\circ", "30"),
    ("(-\\infty,1) \\text{ or } (2,\\infty)", "(-\\infty,1)\\cup(2,\\infty)"),
]


NOT_EQUIV = [  # near misses
    ("141", "142.0"), ("-3", "3"), ("\\frac{3}{14}", "\\frac{14}{3}"),                   # off by one, sign, reciprocal
    ("0.333", "\\frac13"), ("0.3333333", "\\frac13"), ("1.4142", "\\sqrt2"),             # rounded decimals
    ("(3,4)", "(3,4]"), ("x < 3", "(-\\infty, 3]"),                                       # open vs closed
    ("(-29,15)", "(15,-29)"), ("(-1/3, 5/3, 2/3)", "\\begin{pmatrix} -1/3 \\\\ 2/3 \\\\ 5/3 \\end{pmatrix}"),
    ("1", "1,-2"), ("1,-2,3", "1,-2"), ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}"),              # missing / extra root
    ("6+5i", "6-5i"), ("(B)", "\\text{(C)}"), ("89^\\circ", "90^\\circ"), ("10,081", "10,\\!080"),
    ("0.\\overline{3}", "0.3"),
    ("32, 349", "32349"), ("", ""), ("\\boxed{}", ""),                                       # false positives
    ("(p,q)=(3,2)", "(2,3)"), ("AB=4, CD=5", "AB=5, CD=4"), ("f(x)=1", "2"),
    ("-x > -1", "x > 1"), ("28 pct", "2.8\\%"), ("9\\%", "0.09"),
    ("1+\\mathrm{e}", "1-\\mathrm{e}"), ("3+4\\mathrm{i}", "7"), ("2\\mathrm{i}", "2"),         # upright e, i
    ("x=-1 \\text{ or } x=2", "2"), ("x=1 \\quad\\text{or}\\quad x=2", "2"),                   # not the last root
    ("(3,1)", "{1,3}"), ("0,111", "111"),                                     # a tuple is no list; 0,111 no number
    ("x=1 or y=2", "(1,2)"), ("x=1 or y=2", "2"), ("p \\lor q", "p, q"),       # or between names, in logic
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


def test_the_answer_benchmark_scores_each_checker(tmp_path, capsys):
    """python -m bench.answers, on two labelled pairs: every checker's row, is_equiv's sympy share."""
    cases = [{"pred": "\\frac{1}{2}", "gold": "0.5", "equal": True, "category": "fraction"},
             {"pred": "3", "gold": "4", "equal": False, "category": "integer"}]
    path = tmp_path / "cases.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))
    bench_equiv(str(path))
    out = capsys.readouterr().out
    assert f"2 labelled cases (1 equal, 1 not equal) from {path}" in out
    assert [line.split()[0] for line in out.splitlines()[2:5]] == ["string", "math-verify", "is_equiv"]
    assert "is_equiv sent" in out and "fraction" in out


def test_a_tuple_never_equals_a_set_so_a_wrong_order_joins_no_vote_class():
    """math-verify compares a tuple or interval with a set unordered: (2,1) would equal 1,2, which equals
    (1,2), and the vote's classes (connected by same_answer) would reward the wrong order."""
    assert not is_equiv("(2,1)", "1,2") and not is_equiv("(1,2)", "\\{1,2\\}") and not is_equiv("x\\in(1,2)", "1,2")
    assert is_equiv("(1, 2)", "\\left(1,2\\right)") and is_equiv("2, 1", "\\{1,2\\}")
    assert answer_classes(["(1,2)", "(2,1)", "1, 2"], same=same_answer, key=answer_key) == [[0], [1], [2]]


def test_a_blank_answer_is_no_answer_so_blanks_form_no_vote_class():
    """Boxes holding only spacing or markup say nothing: they must not join into a class that wins
    the vote over a stated answer (and they count as no answer in the monitors)."""
    blanks = [extract_answer(t) for t in ("\\boxed{\\text{}}", "\\boxed{\\,}", "The answer is .")]
    assert blanks == [None, None, None]
    answers = blanks + [extract_answer("\\boxed{3}")] * 2
    assert answer_classes(answers, same=same_answer, key=answer_key) == [[3, 4]]
    assert extract_answer("So \\boxed{5}. Final answer: $\\,$") == "5"  # a blank conclusion leaves the box


@pytest.mark.parametrize("text, gold", [("x+0." + "1" * 4301, "x"),  # int() refuses 4300 digits
                                        ("1" + " " * 20000 + "2", "12"),
                                        ("The final answer is 1" + " " * 40000 + "2", "12")])
def test_a_degenerate_rollout_is_read_without_error_and_equals_nothing_else(text, gold):
    """A rollout of 10,000s of spaces or braces: its answer (none, or one longer than any real answer)
    equals only itself, and no rule raises on it."""
    answer = extract_answer(text) or text
    assert not is_equiv(answer, gold) and answer_key(answer) == answer_key(answer)


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
