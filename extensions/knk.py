"""Knights and Knaves: the logic-puzzle domain (the paper's second one): puzzles, answers, and their
verifier.

On an island every inhabitant is a knight (always tells the truth) or a knave (always lies); each
one says something about the others, and the question is who is what. With one Boolean per
inhabitant (True: knight) a statement S said by X is the constraint X <-> S, and a puzzle is the
conjunction of its speakers' constraints. Its answer is the one assignment that satisfies them all.

The generator (seeded, stdlib only) builds puzzles of 2 to 8 inhabitants with exactly one solution;
no statement fixes anybody's role on its own (X <-> S alone), so an encoding of the statements never
contains a bare fact about one person (the rules: docs/knk.md).

Answers are written canonically, in the order the puzzle introduces people: "Zoey: knight, Oliver:
knave". extract_answer(text, problem) reads what a model writes -- "(1) Zoey is a knight (2) Oliver
is a knave", \\boxed{Oliver: knave, Zoey: knight}, "Knights: Zoey; Knaves: Oliver", "Zoey and Ethan
are knights" -- into that form; a claim about somebody not in the puzzle, or a person left out,
gives no answer (None).

The verifier writes the puzzle in SMT-LIB2 (KNK_SYSTEM), z3 solves it in the sandbox (smt_tool), and
v_i = 1 when the solver's assignment is the only one and equals the rollout's (smt_agrees).
KNK puts these together as a verifier.Domain; t3rl.setup takes it for --bench knk, at one call.

    python -m extensions.knk --generate   # writes data/knk.jsonl: 100 puzzles, sizes 2-8,
                                          # byte for byte the same
"""
import argparse
import inspect
import itertools
import json
import os
import random
import re

from answers import closing_braces
from sandbox import default_pool
from verifier import FENCE_ANY, Domain, ToolRun

NAMES = ["Zoey", "Oliver", "Ethan", "Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sophia", "Jack",
         "Harper", "Owen", "Aria", "Logan", "Chloe", "James", "Lily", "Henry", "Grace", "Samuel",
         "Scarlett", "David", "Evelyn", "Jacob", "Abigail", "Aiden", "Daniel", "Victoria", "Joseph",
         "Aurora", "Michael", "Penelope", "Sebastian", "Riley", "Matthew", "Hannah", "William",
         "Luke", "Amelia"]
VERBS = ["says", "claims", "tells you", "states", "remarks"]
INTRO = ("A very special island is inhabited only by knights and knaves. Knights always tell the "
         "truth, and knaves always lie.")
QUESTION = "So who is a knight and who is a knave?"
SMT_OPS = {"if": "=>", "iff": "="}  # SMT-LIB2 spells the others (not, and, or) as we do
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNK_PATH = os.path.join(REPO, "data", "knk.jsonl")

# --------------------------------------------------------------------------------------------------
# Statements: ["is", name, "knight"|"knave"], ["not", claim], ["and"|"or", s, s(, s)],
# ["if"|"iff", s, s]


def truth(statement, world):
    """The truth value of a statement in a world (name -> True for a knight)."""
    op, *args = statement
    if op == "is":
        return world[args[0]] == (args[1] == "knight")
    values = [truth(arg, world) for arg in args]
    if op == "not":
        return not values[0]
    if op == "and":
        return all(values)
    if op == "or":
        return any(values)
    if op == "if":
        return not values[0] or values[1]
    return values[0] == values[1]  # iff


def text(statement):
    """The statement in English, as the puzzle prints it."""
    op, *args = statement
    if op == "is":
        return f"{args[0]} is a {args[1]}"
    if op == "not":
        name, role = args[0][1:]
        return f"{name} is not a {role}"
    if op in ("and", "or"):
        parts = [text(arg) for arg in args]
        return (f" {op} ".join(parts) if len(parts) == 2
                else ", ".join(parts[:-1]) + f", {op} {parts[-1]}")
    if op == "if":
        return f"if {text(args[0])} then {text(args[1])}"
    return f"{text(args[0])} if and only if {text(args[1])}"


def mentioned(statement):
    """The names a statement talks about, in order."""
    if statement[0] == "is":
        return [statement[1]]
    return [name for arg in statement[1:] for name in mentioned(arg)]


def solutions(names, speakers, statements):
    """Every world (tuple of bools, in `names` order) where each speaker is a knight exactly when he
    says the truth."""
    found = []
    for values in itertools.product((True, False), repeat=len(names)):
        world = dict(zip(names, values))
        if all(world[s] == truth(st, world) for s, st in zip(speakers, statements)):
            found.append(values)
    return found


def fixes_someone(speaker, statement):
    """True when speaker <-> statement alone leaves one of its people only one role (an encoding of
    it would hold a fact about one person, which the solver-side guard refuses)."""
    people = list(dict.fromkeys([speaker, *mentioned(statement)]))
    worlds = solutions(people, [speaker], [statement])
    return any(len({w[i] for w in worlds}) < 2 for i in range(len(people)))


def random_statement(rng, speaker, names):
    """One claim about someone else, or 2-3 claims about different people (the speaker may be one)
    joined."""
    op = rng.choice(["is", "is", "and", "or", "if", "iff"])
    if op == "is":
        people = [rng.choice([n for n in names if n != speaker])]
    else:  # distinct people, so at least one of them is not the speaker
        people = rng.sample(names, 3 if op in ("and", "or") and len(names) >= 3
                            and rng.random() < 0.3 else 2)
    claims = []
    for name in people:
        claim = ["is", name, rng.choice(["knight", "knave"])]
        claims.append(["not", claim] if rng.random() < 0.25 else claim)
    return claims[0] if op == "is" else [op, *claims]


def consistent_statement(rng, speaker, names, world):
    """A random statement that is true when the speaker is a knight in `world`, false when a knave,
    and that fixes nobody on its own."""
    while True:
        statement = random_statement(rng, speaker, names)
        if truth(statement, world) == world[speaker] and not fixes_someone(speaker, statement):
            return statement


def make_puzzle(rng, n):
    """A puzzle of n inhabitants with exactly one solution: {names, statements, world}."""
    names = rng.sample(NAMES, n)
    world = {name: rng.random() < 0.5 for name in names}
    statements = [consistent_statement(rng, name, names, world) for name in names]
    count = len(solutions(names, names, statements))
    # the hidden world always solves it; redraw one statement unless that adds solutions
    while count > 1:
        i = rng.randrange(n)
        candidate = (statements[:i] + [consistent_statement(rng, names[i], names, world)]
                     + statements[i + 1:])
        new_count = len(solutions(names, names, candidate))
        if new_count <= count:
            statements, count = candidate, new_count
    return {"names": names, "statements": statements, "world": world}


def puzzle_text(names, statements, verbs):
    people = (" and ".join(names) if len(names) == 2
              else ", ".join(names[:-1]) + f", and {names[-1]}")
    said = " ".join(f"{name} {verb} that {text(st)}."
                    for name, verb, st in zip(names, verbs, statements))
    return f"{INTRO} You meet {len(names)} inhabitants: {people}. {said} {QUESTION}"


def generate(count=100, seed=0, sizes=range(2, 9)):
    """`count` puzzle records {id, problem, answer, level (= number of people), names, statements};
    puzzle k has sizes[k % len(sizes)] people."""
    rng = random.Random(seed)
    sizes = list(sizes)
    records = []
    for k in range(count):
        puzzle = make_puzzle(rng, sizes[k % len(sizes)])
        names, statements = puzzle["names"], puzzle["statements"]
        verbs = [rng.choice(VERBS) for _ in names]
        records.append({"id": f"knk-{k:03d}", "problem": puzzle_text(names, statements, verbs),
                        "answer": canonical(names, puzzle["world"]), "level": len(names),
                        "names": names, "statements": statements})
    return records


def smt_script(names, statements):
    """The reference SMT-LIB2 encoding of a puzzle: one Bool per person, (= speaker statement) per
    speaker."""
    def smt(st):
        op, *args = st
        if op == "is":
            return args[0] if args[1] == "knight" else f"(not {args[0]})"
        return f"({SMT_OPS.get(op, op)} {' '.join(smt(a) for a in args)})"
    lines = [f"(declare-const {n} Bool)" for n in names]
    lines += [f"(assert (= {n} {smt(st)}))" for n, st in zip(names, statements)]
    return "\n".join(lines + ["(check-sat)", "(get-model)"])


# --------------------------------------------------------------------------------------------------
# Answers

_PEOPLE = re.compile(r"inhabitants:\s*([^.]*)\.")
_PAIR = re.compile(r"([A-Za-z][\w'-]*)\s*:\s*(knight|knave)", re.IGNORECASE)
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
# "CONCLUSION:", a "## Conclusion" heading, "**Conclusion**:", "In conclusion" opening a sentence,
# "the conclusion is that"; not "the conclusion is consistent", "our conclusion"
_MARKER = re.compile(r"conclusion\b[*_#]*[ \t]*[:,]|^[^\n]{0,8}conclusion\b[*_#]*[ \t]*$"
                     r"|(?:^|[.!]\s+)in\s+conclusion\b|the conclusion is that"
                     r"|final answer|the answer is|answer\s*:", re.IGNORECASE | re.MULTILINE)
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|emph)\s*\{([^{}]*)\}")
# a role word; "not", "n't", "cannot (be)", "never", "no" before it flip it; a colon, equals sign,
# "are" or "is" after it (past markdown: "**Knights**:") makes it a header
_ROLE = (r"(?P<not>(?:\b(?i:not|cannot|never|no)|(?i:n't))\s+(?:(?i:be)\s+)?(?:an?\s+|the\s+)?)?"
         r"\b(?P<role>(?i:knight|knave))(?i:s)?\b(?P<header>[*_]*\s*(?::|=|\bare\b|\bis\b))?")
# what names several people at once: "Zoey, Ethan and Oliver", "neither Mia nor Liam"
_JOINER = re.compile(r"[\s*_,]*(?:and(?:\s+also)?|&|/|nor|plus|as\s+well\s+as|along\s+with)?"
                     r"[\s*_,]*", re.IGNORECASE)
# one person given both roles: "a knight or a knave", "knight/knave", "both a knight and a knave"
_HEDGE = re.compile(r"\s*,?\s*(?:or|and|/)\s*(?:\w+\s+){0,2}?(?:an?\s+|the\s+)?", re.IGNORECASE)
_ROLE_LIST = re.compile(r"[\s\d().,;:*_-]*(?:(?:knights?|knaves?|and)\b[\s\d().,;:*_-]*)*",
                        re.IGNORECASE)
_NOT_NAMES = {"It", "He", "She", "This", "That", "Who", "Each", "Everyone", "One", "Nobody",
              "Somebody", "Someone", "Person", "Inhabitant", "Answer", "Conclusion", "Therefore",
              "Thus", "So", "Hence", "Then", "Solution", "Role", "Result", "Final", "Status",
              "Identity", "Type", "Note", "Case", "Step"}


def canonical(names, world):
    """`Zoey: knight, Oliver: knave`, in the order of `names`."""
    return ", ".join(f"{name}: {'knight' if world[name] else 'knave'}" for name in names)


def puzzle_names(problem):
    """The inhabitants, in the order the puzzle introduces them ("You meet 3 inhabitants: A, B, and
    C.")."""
    m = _PEOPLE.search(problem or "")
    if not m:
        return []
    return [n.strip() for n in re.split(r",\s*(?:and\s+)?|\s+and\s+", m.group(1)) if n.strip()]


def parse_assignment(answer):
    """name -> True (knight) / False (knave) from `Name: knight, ...` (the canonical form); {} when
    none."""
    return {name: role.lower() == "knight" for name, role in _PAIR.findall(answer or "")}


def answer_region(text, names):
    """Where a rollout states its answer: its \\boxed{...} contents (joined; those that name one of
    the puzzle's `names`, when some do: a copy of the instruction's \\boxed{Name: knight, ...} is
    no answer), else its last <answer>...</answer>, else what follows its last "conclusion" /
    "final answer" / "the answer is" / "answer:" up to the paragraph in which every person has been
    named (a verification after the answer is no answer), else None."""
    matches = list(_BOX.finditer(text))
    closing = closing_braces(text, matches[0].start()) if matches else {}
    boxes = [text[m.end():closing[m.end() - 1]] for m in matches if m.end() - 1 in closing]
    boxes = [b for b in boxes if b]
    naming = [b for b in boxes if any(re.search(rf"\b{re.escape(n)}\b", b, re.IGNORECASE)
                                      for n in names)]
    boxes = naming or boxes or re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)[-1:]
    if boxes:  # else the <answer> tag R1-style rollouts close (Logic-RL's K&K format)
        return "\n".join(boxes)
    markers = list(_MARKER.finditer(text))
    if not markers:
        return None
    region = ""
    for paragraph in re.split(r"(\n[ \t]*\n)", text[markers[-1].end():]):
        region += paragraph
        if all(re.search(rf"\b{re.escape(n)}\b", region, re.IGNORECASE) for n in names):
            break
    return region


def read_roles(region, names):
    """name -> bool from an answer region; None when it names somebody unknown. Name-first claims
    ("Zoey is a knight", "Zoey and Ethan are knights", "Zoey: knight") and headers ("Knights: Zoey,
    Ethan") are read, names in any case; a header lasts until the end of its sentence, line or
    clause (one that ends its line, over the lines below it up to a blank one); names wait for a
    role within their clause and only when joined as a list ("Zoey is unknown, Ethan is a knight"
    gives Zoey none); "not", "isn't", "cannot be", "is no" and "neither ... nor" negate; a later
    claim about a person wins, and a person given both roles in one clause ("could be a knight or a
    knave", "knight/knave") has none. A bare list of roles is read in the puzzle's order only when
    the region holds nothing else."""
    region = _LATEX_TEXT.sub(r"\1", region).replace("\\\\", "\n").replace("$", " ")
    claimed = re.findall(r"\b([A-Z][a-z]+)\s*(?:(?:is|was)\s+(?:also\s+|not\s+)*(?:an?|the)\s+"
                         r"|[:=-]\s*)(?i:knight|knave)", region)
    known = {name.lower(): name for name in names}
    if any(name.lower() not in known and name not in _NOT_NAMES for name in claimed):
        return None
    spelled = "|".join(rf"\b{re.escape(n)}\b" for n in names)
    # names in lower case only when the region spells none as the puzzle does: "will" is a word
    any_case = re.IGNORECASE if not re.search(spelled, region) else 0
    token = re.compile("(?P<name>" + spelled + ")|" + _ROLE + r"|(?P<stop>[.;\n])", any_case)
    roles, pending, header, order, last, last_end = {}, [], None, [], [], 0
    block, clause, named_end = False, 0, 0
    for m in token.finditer(region):
        if m.group("name"):
            name = known[m.group("name").lower()]
            if header is not None:
                roles[name] = header
            elif pending and _JOINER.fullmatch(region[named_end:m.start()]):
                pending.append(name)
            else:
                pending = [name]
            named_end = m.end()
        elif m.group("role"):
            knight = (m.group("role").lower() == "knight") != bool(m.group("not"))
            order.append(knight)
            if m.group("header") and not pending:
                header = knight
                block = not region[m.end():].split("\n", 1)[0].strip(" \t*_")  # ends its line
            elif pending:
                neither = re.search(r"\bneither\b", region[clause:m.start()], re.IGNORECASE)
                roles.update({name: knight != bool(neither) for name in pending})
                pending, header, last, last_end = [], None, pending, m.end()
            else:
                header = None
                hedged = _HEDGE.fullmatch(region[last_end:m.start()])
                if hedged and any(roles[name] != knight for name in last):  # "a knight or a knave"
                    roles.update({name: None for name in last})
        else:
            blank = not region[m.end():].split("\n", 1)[0].strip()
            if not (block and header is not None and m.group("stop") == "\n" and not blank):
                header, block = None, False
            last, pending, clause = [], [], m.end()
    # a bare list of roles, in the puzzle's order
    if not roles and not pending and len(order) == len(names) and _ROLE_LIST.fullmatch(region):
        roles = dict(zip(names, order))
    return roles


def extract_answer(text, problem):
    """The canonical assignment a rollout gives for the puzzle, or None (no answer region, a person
    missing or given both roles, or somebody named who is not in the puzzle)."""
    names = puzzle_names(problem)
    region = answer_region(text or "", names) if names else None
    roles = read_roles(region, names) if region is not None else None
    if not roles or any(roles.get(name) is None for name in names):
        return None
    return canonical(names, roles)


def answer_key(answer):
    """The vote-class key: the assignment with its people in alphabetical order (any spelling order
    agrees)."""
    world = parse_assignment(answer)
    return canonical(sorted(world), world) if world else answer.strip()


def same_answer(a, b):
    """Two answers are the same when they give every person the same role."""
    return (a is not None and b is not None and bool(parse_assignment(a))
            and parse_assignment(a) == parse_assignment(b))


def is_equiv(pred, gold):
    return same_answer(pred, gold)


# --------------------------------------------------------------------------------------------------
# Knights and Knaves: the verifier writes SMT-LIB2, z3 solves it in the sandbox.
#
# SMT-LIB2 rather than z3's Python API: the script is data, not a program. It cannot print an
# answer; the tool, not the script, calls the solver, reads the model and checks that it is the only
# one (block it, solve again: unsat). So the one way to "hard-code" is to assert facts, and that is
# decided on the solver's side: a top-level conjunct that on its own fixes one person's role.
# knk.py's generator keeps only statements that fix nobody on their own, so an encoding of the
# statements never does.

KNK_SYSTEM = """You are an expert in logic and a careful user of the Z3 SMT solver. You check a \
candidate solution to a Knights and Knaves puzzle by encoding the puzzle in SMT-LIB2, so that the \
solver finds who is a knight and who is a knave.

Rules:
1. Do NOT assume the candidate's reasoning is correct. Encode the puzzle from its statement; use \
the reasoning only as a hint for how to read the statements.
2. Declare one Bool constant per inhabitant, named exactly as in the puzzle, true meaning knight: \
(declare-const Zoey Bool).
3. For every statement assert that the speaker is a knight exactly when the statement is true: \
Zoey says that Oliver is a knave and Ethan is a knight -> (assert (= Zoey (and (not Oliver) \
Ethan))). "if P then Q" is (=> P Q); "P if and only if Q" is (= P Q); "or" is (or P Q). A claim \
about a person is that person's constant: "Oliver is a knight" and "Oliver is not a knave" are \
Oliver; "Oliver is a knave" and "Oliver is not a knight" are (not Oliver).
4. Never assert who is a knight or a knave as a fact (no (assert Zoey), no (assert (not Oliver))): \
the solver must derive it from the statements.
5. Answer with exactly one code block, fenced as smt2 like the example, that ends with (check-sat) \
and (get-model), and nothing after it.

Example. Puzzle: You meet 3 inhabitants: Zoey, Oliver, and Ethan. Zoey says that Ethan is a knight \
or Oliver is a knave. Oliver claims that Ethan is a knight or Zoey is a knave. Ethan states that \
Oliver is a knight and Zoey is a knave.
```smt2
(declare-const Zoey Bool)
(declare-const Oliver Bool)
(declare-const Ethan Bool)
; Zoey says that Ethan is a knight or Oliver is a knave
(assert (= Zoey (or Ethan (not Oliver))))
; Oliver claims that Ethan is a knight or Zoey is a knave
(assert (= Oliver (or Ethan (not Zoey))))
; Ethan states that Oliver is a knight and Zoey is a knave
(assert (= Ethan (and Oliver (not Zoey))))
(check-sat)
(get-model)
```"""

KNK_USER = """Puzzle:
{problem}

Candidate solution (it may be wrong):
{rollout}

Write the SMT-LIB2 script that encodes the puzzle."""

_FENCE_SMT = re.compile(r"```[ \t]*(?:smt2?|smt-?lib2?|lisp|scheme|z3)\b[^\n]*\n(.*?)(?:```|\Z)",
                        re.DOTALL | re.IGNORECASE)


def extract_smt(text):
    """The first ```smt2 (smt, smtlib, lisp, z3) block of a verifier completion, else its first
    fenced block, without the closing parentheses that close nothing."""
    for fence in (_FENCE_SMT, FENCE_ANY):
        m = fence.search(text)
        if m and m.group(1).strip():
            return drop_unmatched_parens(m.group(1))
    return None


def drop_unmatched_parens(script):
    """The script without each `)` that closes nothing. Small verifiers miscount the parentheses at
    the end of an assert (`(assert (= Zoey (not Oliver))))`), and z3 then refuses the whole script;
    a closer at depth 0 is outside every expression, so dropping it changes no command (comments and
    |quoted| symbols are skipped)."""
    kept, depth, i = [], 0, 0
    while i < len(script):
        c = script[i]
        skip_to = {";": "\n", "|": "|", '"': '"'}.get(c)
        if skip_to:
            end = script.find(skip_to, i + 1)
            end = len(script) if end < 0 else end + 1
            kept.append(script[i:end])
            i = end
            continue
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            depth = 0
        else:
            kept.append(c)
        i += 1
    return "".join(kept)


def smt_solve(script):
    """Runs in the sandbox (this function's source is sent there): z3's verdict on an SMT-LIB2
    script.

    The script's own commands (check-sat, get-model) are ignored; its assertions are split at
    top-level `and`s into conjuncts. Returns {"verdict": "asserts facts", "facts": [names]} when a
    conjunct on its own forces some person's value; else {"verdict": "unsat" | "unknown"}; else the
    model over every Bool constant (declared or used), with "unique" when blocking it leaves the
    assertions unsatisfiable, "not unique" otherwise."""
    import re

    import z3
    conjuncts, todo = [], list(z3.parse_smt2_string(script))
    while todo:
        a = todo.pop(0)
        if z3.is_and(a):
            todo[:0] = a.children()
        else:
            conjuncts.append(a)

    def people(exprs):  # Bool constants the script declared, by name
        found, seen, todo = {}, set(), list(exprs)
        while todo:
            e = todo.pop()
            if e.get_id() not in seen:
                seen.add(e.get_id())
                if z3.is_const(e) and e.decl().kind() == z3.Z3_OP_UNINTERPRETED and z3.is_bool(e):
                    found[str(e)] = e
                todo += e.children()
        return found

    def satisfiable(*exprs):
        solver = z3.Solver()
        solver.add(*exprs)
        return solver.check() == z3.sat

    facts = sorted({name for c in conjuncts for name, x in people([c]).items()
                    if satisfiable(c, x) != satisfiable(c, z3.Not(x))})
    if facts:
        return {"verdict": "asserts facts", "facts": facts}
    solver = z3.Solver()
    solver.add(*conjuncts)
    verdict = solver.check()
    if verdict != z3.sat:
        return {"verdict": str(verdict)}
    declared = re.findall(r"\(declare-(?:const\s+([^\s()]+)|fun\s+([^\s()]+)\s*\(\s*\))"
                          r"\s+Bool\s*\)", script)
    # unconstrained ones too; |Zoey| is the symbol Zoey
    everyone = {**{(a or b).strip("|"): z3.Bool((a or b).strip("|")) for a, b in declared},
                **people(conjuncts)}
    model = {name: z3.is_true(solver.model().eval(x, model_completion=True))
             for name, x in everyone.items()}
    solver.add(z3.Or([x != z3.BoolVal(model[name]) for name, x in everyone.items()]))
    return {"verdict": "unique" if solver.check() == z3.unsat else "not unique", "model": model}


def smt_program(script):
    """The Python program the sandbox runs for one script: smt_solve's source, then one JSON line of
    verdict."""
    return (f"{inspect.getsource(smt_solve)}\nimport json\n"
            f"print(json.dumps(smt_solve({script!r})))\n")


def smt_tool(scripts, sandbox=None):
    """Solve every script in the sandbox (one run_many call). The result t_i is the unique
    assignment in canonical form; "unsat", "unknown" or "not unique" otherwise (a mismatch); a
    script that asserts facts is refused ("hardcoded")."""
    runs = ((sandbox or default_pool()).run_many([smt_program(s) for s in scripts])
            if scripts else [])
    tool_runs = []
    for run in runs:
        output = run.stdout + (("\n" if run.stdout and run.stderr else "") + run.stderr)
        lines = run.stdout.strip().splitlines()
        if run.status != "ok" or not lines:
            tool_runs.append(ToolRun("timeout" if run.status == "timeout" else "error", None,
                                     output, run.duration))
            continue
        found = json.loads(lines[-1])
        if found["verdict"] == "asserts facts":
            status, result = "hardcoded", "asserts " + ", ".join(found["facts"])
        else:
            # a quoted symbol may hold any text (|Zoey: knave|): only plain names are people
            model = {name: role for name, role in (found.get("model") or {}).items()
                     if re.fullmatch(r"[A-Za-z][\w'-]*", name)}
            status = "ok"
            result = (canonical(list(model), model) if found["verdict"] == "unique"
                      else found["verdict"])
        tool_runs.append(ToolRun(status, result, output, run.duration))
    return tool_runs


def smt_agrees(result, answer):
    """The solver's unique assignment gives every person of the rollout's answer the same role
    (names compared case-insensitively; constants the script added beyond the people do not
    matter)."""
    solved = {name.lower(): role for name, role in parse_assignment(result).items()}
    claimed = parse_assignment(answer)
    return bool(claimed) and all(solved.get(name.lower()) == role for name, role in claimed.items())


# without the form, a small policy boxes one word ("\\boxed{knaves}") and no assignment is read
KNK_INSTRUCTION = ("Please reason step by step, and put your final answer within \\boxed{}, naming "
                   "every inhabitant with a role, in the form "
                   "\\boxed{Name: knight, Name: knave, ...}.")
# z3's script refuses a bare fact itself (status "hardcoded"): no guard after it
KNK = Domain("knk", KNK_INSTRUCTION, extract_answer, same_answer, answer_key, is_equiv, KNK_SYSTEM,
             KNK_USER, extract_smt, smt_tool, lambda run, answer: smt_agrees(run.result, answer))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", action="store_true",
                        help="write the puzzle set (default data/knk.jsonl)")
    parser.add_argument("--count", type=int, default=100, help="number of puzzles (default 100)")
    parser.add_argument("--seed", type=int, default=0, help="generator seed (default 0)")
    parser.add_argument("--out", default=KNK_PATH, help="output file (default data/knk.jsonl)")
    args = parser.parse_args()
    if not args.generate:
        parser.print_help()
        return
    if args.count < 1:
        parser.error(f"--count {args.count}: pass at least 1 puzzle")
    records = generate(args.count, args.seed)
    with open(args.out, "w", encoding="utf-8", newline="\n") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    print(f"wrote {len(records)} puzzles ({min(r['level'] for r in records)}-"
          f"{max(r['level'] for r in records)} people) to {args.out}")


if __name__ == "__main__":
    main()
