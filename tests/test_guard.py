"""guard.py: the hard-coding guard on programs that copy the candidate answer in."""
from machinery.guard import hardcoded
from helpers import GUARD_PROBLEM


def test_a_small_answer_used_as_a_constant_is_no_copy():
    problem = "Sam has four socks and pairs them. How many pairs?"
    assert not hardcoded("s = 'abcd'\nprint(len(s) // 2)", problem, "2")
    assert not hardcoded("pairs = [('a', 'b'), ('c', 'd')]\nprint(len(pairs[1]))", problem, "2")
    assert hardcoded("print(2 + 0)", problem, "2")


def test_a_value_the_problem_supplies_or_another_answer_is_no_copy():
    assert not hardcoded("print(1320 // 1)", "What is 1320 divided by 1?", "1320")
    assert not hardcoded("print(1320)", GUARD_PROBLEM, "1321")
    assert hardcoded("from fractions import Fraction\nprint(Fraction(3, 4))", "Find the ratio p/q.", "\\frac34")
    assert not hardcoded("from fractions import Fraction\nprint(Fraction(3, 4))", "3 of every 4 cats ...", "\\frac34")


def test_a_word_the_problem_offers_is_no_copy():
    problem = "She spins 2250 degrees to her right. Which direction (north, south, east or west) is she facing?"
    chosen = "turns = 2250 // 90 % 4\nd = 'east' if turns == 1 else 'north'\nprint(d)"
    assert not hardcoded(chosen, problem, "\\text{east}")
    # the same word copied in without a choice is a copy
    assert hardcoded("d = 'east'\nprint(d)", "She spins 2250 degrees to her right. Which way is she facing?",
                     "\\text{east}")
    assert hardcoded("print('Evelyn')", "Which student ran fastest?", "\\text{Evelyn}")


def test_a_bare_constant_computes_nothing_even_when_the_problem_gives_it():
    """Both verified a wrong answer on human MATH solutions (2026-12-06): the literal is in the
    problem, but the program prints it without computing anything."""
    problem = "What is the smallest integer x for which f(x) = sqrt(x - 1) / (x - 2) is defined?"
    assert hardcoded("x_value = 2\nprint(x_value)", problem, "2")
    assert hardcoded("import sympy\nresult = sympy.Integer(1)\nprint(result)", problem, "1")
    assert hardcoded("print(1320)", "What is 1320 divided by 1?", "1320")
    assert hardcoded("print('east')", "Is she facing north, south, east or west?", "\\text{east}")
    # a value control flow chooses, or one computed, is not a bare constant
    assert not hardcoded("x = 1\nif 2 > 3:\n    x = 2\nprint(x)", problem, "1")
    assert not hardcoded("x = 3 - 1\nprint(x)", problem, "2")
    assert not hardcoded("x_value = 2\nprint(x_value)", problem, "3")


def test_a_value_computed_control_flow_picks_is_no_copy_whichever_branch_prints():
    """Each branch's print can be the last: the verdict may not depend on which one comes last in the
    source, and a literal that a computed test picks is a choice, not a copy."""
    problem = "How many real roots does x^2 + 2x + 5 = 0 have?"
    branches = ("import sympy\nx = sympy.symbols('x')\ndisc = 2**2 - 4*5\n"
                "if disc > 0:\n    print(2)\nelif disc == 0:\n    print(1)\nelse:\n    print(0)")
    for answer in ("0", "1", "2"):
        assert not hardcoded(branches, problem, answer)
    words = "n = 7\nif n % 2:\n    print('odd')\nelse:\n    print('even')"
    for answer in ("\\text{odd}", "\\text{even}"):
        assert not hardcoded(words, "Is 7 odd or even?", answer)
    # a copy printed in any branch that can end the program is still a copy; a constant test picks nothing
    copied = "x = 1320\ndisc = 5\nif disc > 0:\n    print(x)\nelse:\n    print(0)"
    assert hardcoded(copied, "Find the number of ways.", "1320")
    assert hardcoded("if True:\n    print(1320)", "Find the number of ways.", "1320")
    assert hardcoded("def main():\n    print(1320)\n\nmain()", "Find the number of ways.", "1320")


def test_counters_accumulators_and_search_bounds_are_no_copy_of_a_small_answer():
    """0, 1 and 2 come naturally as a counter's start, a loop's bound or round's digits: a program that
    computes 0, 1 or 2 that way is no copy (each was refused, so a right answer of 0 or 1 lost its v)."""
    assert not hardcoded("result = 1\nfor _ in range(100):\n    result = (result * 2) % 3\nprint(result)",
                         "What is the remainder when 2^100 is divided by 3?", "1")
    assert not hardcoded("count = 0\nfor x in range(-100, 100):\n    if x * x + 5 == 3:\n        count += 1\n"
                         "print(count)", "How many integers x satisfy x^2 + 5 = 3?", "0")
    assert not hardcoded("from sympy import primerange, isprime\n"
                         "print(sum(1 for p in primerange(2, 1000) if isprime(p**2 + 2)))",
                         "How many primes p make p^2 + 2 prime?", "1")
    assert not hardcoded("for n in range(1, 100):\n    if n * n == n:\n        print(n)\n        break",
                         "What is the least positive n with n^2 = n?", "1")
    assert not hardcoded("x = 2.004\nprint(round(x, 2))", "Round two and four thousandths to hundredths.", "2")
    assert not hardcoded("a = -7\nb = 3\nprint(min(a, b))", "Let a = -7 and b = 3. Compute min(a, b).", "-7")
    # the same shapes with the answer itself copied in are copies
    for code in ("x = 0\nfor _ in range(1):\n    x += 1320\nprint(x)", "x = 0\nwhile x < 1:\n    x += 1320\nprint(x)",
                 "print(len(range(1320)))", "print(sum(1 for _ in range(1320)))",
                 "print([1320 for _ in [0] if True][0])"):
        assert hardcoded(code, "Find the number of ways.", "1320"), code


def test_negative_answers_main_blocks_and_f_strings_are_copies_too():
    problem = "Find the value."
    for code, answer in [("print(-5)", "-5"), ("x = -5\nprint(x)", "-5"), ("print(-0.75)", "-\\frac34"),
                         ("from fractions import Fraction\nprint(Fraction(-3, 7))", "-\\frac{3}{7}"),
                         ("if __name__ == '__main__':\n    ans = 55\n    print(ans)", "55")]:
        assert hardcoded(code, problem, answer), code
    assert hardcoded("print(f'{55}')", "There are 55 cats.", "55")  # a bare constant, though the problem gives it


def test_an_infinite_literal_or_a_chain_too_deep_to_walk_is_decided_without_error():
    """1e999 is inf, no answer's value: the minimum it starts is computed; a chain nested past the walk's
    recursion is not checked, so it is not verified."""
    start_at_inf = "m = 1e999\nfor v in [5, 7, 9]:\n    m = min(m, v)\nprint(m)"
    assert not hardcoded(start_at_inf, "Find the smallest of 5, 7 and 9.", "5")
    assert hardcoded("x = " + "+".join(["1"] * 3000) + "\nprint(x)", "Add 1 to itself.", "3000")

