"""The hard-coding guard: does a verifier program print the candidate answer copied in, rather than
compute it?

Small verifiers copy the trace's final answer into the program (the paper's Figure 11); such a
program "verifies" anything. The failure is a data flow: the candidate's value enters the program as
a literal that the problem does not supply, and reaches the printed result. So the guard is a small
taint analysis on the AST. Sources: a literal equal to the candidate answer (1320, 1320.0, '1320',
f'{1320}') or spelling it as a fraction (Fraction(3, 4) for 3/4), that the problem text does not
contain. The taint follows data: calls (int(), Fraction(), sympy.Integer(), ...), subscripts, names
through every assignment to them (tuple unpacking position by position, loops, augmented assignment,
walrus), and the program's own functions through their returns. Arithmetic carries it only where it
keeps the value (1320 * 1, 1320 + 0; not len(s) // 2 for the answer 2), and control flow does not
carry it (`if x == 1320: print(x)` is a check, not a copy); a literal in a branch that computed
control flow picks (`print(2) if disc > 0 else print(0)`) is a choice, not a copy, and so is a
count: `count += 1` in a loop, a computed filter's element (sum(1 for p in ... if isprime(p))),
range's start, round's digits, and the 0 or 1 that a name updated from itself starts at. A Python
program whose printed result matches the candidate is refused when a print(...) that can come last
shows a tainted value, or the answer as a bare constant (a literal through names bound once and
conversions: `x = 2; print(x)`), which computes nothing even when the problem gives the number.
Recomputations from the problem's numbers stay clean: print(11 * 120) when the problem gives 11 and
120, print(math.comb(12, 3)).

hardcoded(code, problem, answer) is what verify_batch asks (through the math Domain) of every
program whose printed result matches the rollout's answer.
"""
import ast
import math
import re
from fractions import Fraction

from answers import answer_key


def hardcoded(code, problem, answer):
    """True when a print that can come last in the program shows the candidate `answer` copied in as
    a literal that the `problem` text does not supply, or as a bare constant (the module's docstring
    says how). A program that does not parse is not hard-coded: it cannot run either, and the tool
    reports the error; one nested too deep to check counts as hard-coded (not verified)."""
    if answer is None:
        return False
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    except RecursionError:  # nested past what the parser follows ('1+1+...' 3000 times): unchecked,
        return True         # so not verified
    try:
        taint = _Taint(tree, problem, answer)
        return any(taint.carries(arg) or taint.constant(arg)
                   for call in final_prints(tree) for arg in call.args)
    except RecursionError:  # and past what the walk follows (1000 times)
        return True


def _is_print(node):
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "print" and bool(node.args))


def final_prints(tree) -> list:
    """The print calls that can be the last one a run executes: the last of each branch that can
    end the program, through if/else, loops, try, with, match and calls of the program's own
    functions (else the last print in the source, for prints inside expressions)."""
    functions = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}

    def block(body, calling) -> tuple[list, bool]:
        """(candidates, whether the block surely prints) of a statement list, from its end."""
        found = []
        for statement in reversed(body):
            candidates, sure = one(statement, calling)
            found += candidates
            if sure:
                return found, True
        return found, False

    def one(node, calling) -> tuple[list, bool]:
        if isinstance(node, ast.Expr) and _is_print(node.value):
            return [node.value], True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) in functions \
                and node.value.func.id not in calling:
            name = node.value.func.id
            return block(functions[name].body, calling | {name})
        if isinstance(node, ast.If):
            (a, sure_a), (b, sure_b) = block(node.body, calling), block(node.orelse, calling)
            return a + b, sure_a and sure_b
        if isinstance(node, (ast.For, ast.While, ast.With, ast.Try, ast.Match)):
            parts = [getattr(node, name, []) for name in ("body", "orelse", "finalbody")]
            parts += [h.body for h in getattr(node, "handlers", [])]
            parts += [case.body for case in getattr(node, "cases", [])]
            found = [call for part in parts for call in block(part, calling)[0]]
            return found, isinstance(node, ast.With) and block(node.body, calling)[1]
        return [], False

    found = block(tree.body, frozenset())[0]
    return found or [node for node in ast.walk(tree) if _is_print(node)][-1:]


def chosen_nodes(tree) -> set:
    """ids of the nodes in a branch that computed control flow picks (an if, a conditional
    expression or a match whose test reads a name or a call): a value there is a choice, not a
    copy."""
    chosen = set()

    def mark(nodes):
        for node in nodes:
            chosen.update(id(child) for child in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.While)):  # `count += 1` repeated: a count, not a copy
            mark([n for n in ast.walk(node)
                  if isinstance(n, ast.AugAssign) and _is_zero_or_one(n.value)])
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)) and \
                any(_computed(test) for c in node.generators for test in c.ifs):
            mark([node.elt])  # sum(1 for p in ... if isprime(p)): a count
        test = (node.test if isinstance(node, (ast.If, ast.IfExp))
                else node.subject if isinstance(node, ast.Match) else None)
        if test is None or not _computed(test):
            continue
        if isinstance(node, ast.IfExp):
            mark([node.body, node.orelse])
        elif isinstance(node, ast.If):
            mark(node.body + node.orelse)
        else:
            mark([s for case in node.cases for s in case.body])
    return chosen


_PROBLEM_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_MAIN_TEST = re.compile(r"""__name__ == (['"])__main__\1""")


def _computed(test) -> bool:
    """Whether a test reads something the program computes (a name, a call, an attribute); `if
    __name__ == '__main__':` reads a name but picks nothing: the program runs its body."""
    return not _MAIN_TEST.fullmatch(ast.unparse(test)) and \
        any(isinstance(n, (ast.Name, ast.Call, ast.Attribute)) for n in ast.walk(test))


_EXACT_CALLS = {"Fraction", "Rational"}
# calls that keep a single argument's value: print(int(2)) prints the constant 2
_CONVERSIONS = {"int", "float", "str", "abs", "round", "Fraction", "Integer", "Rational", "Float",
                "S", "sympify", "nsimplify", "simplify"}


def _callee(call):
    """The called name: Fraction for Fraction(...) and for fractions.Fraction(...)."""
    return getattr(call.func, "id", getattr(call.func, "attr", None))


def _value(text):
    """The exact value of a plain number answer or literal, else None."""
    try:
        return Fraction(answer_key(str(text)))
    except (ValueError, ZeroDivisionError, TypeError):
        return None


class _Taint:
    """Does an expression of the program carry the candidate answer, copied from outside the
    problem?"""

    def __init__(self, tree, problem, answer):
        self.numbers = {Fraction(n) for n in
                        _PROBLEM_NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3})", "", problem))}
        self.numbers |= {-n for n in self.numbers}  # "a = -7": the sign is text before the number
        self.problem = problem
        self.answer_key, self.answer_value = answer_key(answer), _value(answer)
        self.bindings, self.returns, self.chosen = {}, {}, chosen_nodes(tree)
        self.updated = set()  # names an assignment computes from themselves (x += 1, x = x * 2)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.returns[node.name] = [r.value for r in ast.walk(node)
                                           if isinstance(r, ast.Return) and r.value]
            for target, value in _assignments(node):
                self.bindings.setdefault(target, []).append(value)
                if isinstance(node, ast.AugAssign) or any(
                        isinstance(n, ast.Name) and n.id == target for n in ast.walk(value)):
                    self.updated.add(target)

    def _is_answer(self, constant):
        if isinstance(constant.value, str):
            return answer_key(constant.value) == self.answer_key
        if isinstance(constant.value, float) and not math.isfinite(constant.value):
            return False  # 1e999 is inf: no answer's value
        if isinstance(constant.value, (int, float)) and not isinstance(constant.value, bool):
            return self.answer_value is not None and \
                abs(Fraction(constant.value) - self.answer_value) <= \
                abs(self.answer_value) * Fraction(1, 10 ** 9)
        return False

    def _is_answer_fraction(self, node):
        """Fraction(3, 4) / sympy.Rational(3, 4) spelling the answer 3/4 with numbers the problem
        lacks."""
        if not (isinstance(node, ast.Call) and len(node.args) == 2
                and self.answer_value is not None and id(node) not in self.chosen
                and _callee(node) in _EXACT_CALLS):
            return False
        parts = [c.value for c in map(_literal, node.args) if c and type(c.value) is int]
        return parts == [self.answer_value.numerator, self.answer_value.denominator] and \
            not {Fraction(p) for p in parts} <= self.numbers

    def _supplied(self, constant):
        """Does the problem give this literal: one of its numbers, or a word of its text ('east'
        when it asks "north, south, east or west?", a name it mentions)?"""
        value = _value(constant.value)
        if value is not None or not isinstance(constant.value, str):
            return value in self.numbers
        word = re.escape(constant.value.strip())
        return bool(word) and \
            re.search(rf"(?<!\w){word}(?!\w)", self.problem, re.IGNORECASE) is not None

    def constant(self, node, seen=frozenset()):
        """Is the node the answer as a bare constant: a literal worth it, through names bound once
        (a second binding is control flow choosing a value) and value-keeping conversions?"""
        literal = _literal(node)
        if literal is not None:
            return self._is_answer(literal) and id(node) not in self.chosen
        if isinstance(node, ast.JoinedStr) and len(node.values) == 1 and \
                isinstance(node.values[0], ast.FormattedValue) and not node.values[0].format_spec:
            return self.constant(node.values[0].value, seen)  # f'{55}'
        if isinstance(node, ast.Name) and node.id not in seen:
            bound = self.bindings.get(node.id, [])
            return len(bound) == 1 and self.constant(bound[0], seen | {node.id})
        if isinstance(node, ast.Call) and len(node.args) == 1 and not node.keywords:
            return _callee(node) in _CONVERSIONS and self.constant(node.args[0], seen)
        return False

    def carries(self, node, seen=frozenset()):
        literal = _literal(node)
        if literal is not None and (isinstance(node, ast.Constant) or self._is_answer(literal)):
            return (self._is_answer(literal) and not self._supplied(literal)
                    and id(node) not in self.chosen)
        if self._is_answer_fraction(node):
            return True
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in seen:
            # a name updated from itself starts at 0 or 1 (count = 0; count += 1): no copy
            return any(self.carries(v, seen | {node.id}) for v in self.bindings.get(node.id, [])
                       if not (node.id in self.updated and _is_zero_or_one(v)))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in self.returns and node.func.id not in seen:
            if any(self.carries(v, seen | {node.func.id}) for v in self.returns[node.func.id]):
                return True
        if isinstance(node, ast.Call) and _callee(node) == "len":  # a sequence's length is new,
            return bool(node.args) and isinstance(node.args[0], ast.Call) and \
                _callee(node.args[0]) == "range" and \
                self.carries(node.args[0], seen)  # len(range(1320)) is range's bound
        if isinstance(node, ast.Call) and _callee(node) == "range" and len(node.args) > 1:
            return any(self.carries(a, seen) for a in node.args[1:])  # range(1, n) starts at 1
        if isinstance(node, ast.Call) and _callee(node) in _CONVERSIONS and node.args:
            return self.carries(node.args[0], seen)  # round(x, 2): the digits are no value
        # 1320 * 1 and 1320 + 0 keep the value; len(s) // 2 makes a new one
        if isinstance(node, ast.BinOp):
            return (self.carries(node.left, seen) and _identity(node.op, node.right)) or \
                (self.carries(node.right, seen) and _identity(node.op, node.left, right_side=False))
        if isinstance(node, (ast.Subscript, ast.Attribute)):  # x[0] is x's value, not the index's
            return self.carries(node.value, seen)
        return any(self.carries(child, seen) for child in ast.iter_child_nodes(node)
                   if not isinstance(child, (ast.expr_context, ast.FunctionDef, ast.Lambda)))


def _literal(node):
    """The constant a node spells: a literal, or a negative number (-5 parses as -(5))."""
    if isinstance(node, ast.Constant):
        return node
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return ast.Constant(-node.operand.value)
    return None


def _is_zero_or_one(node):
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and \
        node.value in (0, 1)


def _identity(op, other, right_side=True):
    """Is `other` the literal that leaves the tainted operand's value unchanged under `op`
    (x * 1, x + 0, ...)?"""
    if not (isinstance(other, ast.Constant) and type(other.value) in (int, float)):
        return False
    if isinstance(op, ast.Mult) or (right_side
                                    and isinstance(op, (ast.Div, ast.FloorDiv, ast.Pow))):
        return other.value == 1
    return (isinstance(op, ast.Add) or (right_side and isinstance(op, ast.Sub))) \
        and other.value == 0


def _assignments(node):
    """(name, value expression) for each name `node` binds; unpacking a literal tuple goes position
    by position."""
    if isinstance(node, ast.Assign):
        pairs = [(t, node.value) for t in node.targets]
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
        pairs = [(node.target, node.value)]
    elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        pairs = [(node.target, node.iter)]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        pairs = [(node.optional_vars, node.context_expr)]
    else:
        return []
    out = []
    while pairs:
        target, value = pairs.pop()
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)) \
                and len(target.elts) == len(value.elts):
            pairs += list(zip(target.elts, value.elts))
        else:
            out += [(n.id, value) for n in ast.walk(target) if isinstance(n, ast.Name)]
    return out
