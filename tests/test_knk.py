"""knk.py: Knights and Knaves, the logic domain (generator, answers, the z3 tool, a training step)."""
import dataclasses
import json
import subprocess
import sys

import pytest

import config
import sampler
import t3rl
import verifier
from config import parse_config
from extensions import knk
from helpers import (
    ROOT,
    ScriptedVerifier,
    rows,
    tiny_argv,
    verify_batch,
)
from sandbox import SandboxPool
from verifier import (
    VERIFIER_SYSTEM,
    ToVerify,
    model_verifier,
    verifier_prompt,
)
from voting import weighted_vote

KNK = [json.loads(line) for line in (ROOT / "data" / "knk.jsonl").read_text().splitlines()]


KNK_4 = next(r for r in KNK if r["level"] == 4)  # Zoey, Ethan, Michael, Samuel: knight, knight, knave, knave


def flip_one(answer, who=0):
    """The same assignment with one person's role flipped: the closest wrong answer."""
    world = knk.parse_assignment(answer)
    name = list(world)[who]
    return knk.canonical(list(world), {**world, name: not world[name]})


def test_knk_set_regenerates_byte_for_byte(tmp_path):
    out = tmp_path / "knk.jsonl"
    done = subprocess.run([sys.executable, "-m", "extensions.knk", "--generate", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == (ROOT / "data" / "knk.jsonl").read_bytes()
    assert knk.generate(5, seed=1) != knk.generate(5, seed=0)  # the seed matters


def test_knk_puzzles_have_one_solution_which_is_the_answer():
    assert len(KNK) == 100 and sorted({r["level"] for r in KNK}) == list(range(2, 9))
    for r in KNK:
        names, statements = r["names"], r["statements"]
        [solution] = knk.solutions(names, names, statements)
        assert knk.canonical(names, dict(zip(names, solution))) == r["answer"]
        assert knk.puzzle_names(r["problem"]) == names and r["level"] == len(names)
        assert all(knk.text(st) in r["problem"] for st in statements)
        assert r["problem"].endswith("So who is a knight and who is a knave?")
        # the guard's premise: no statement fixes anybody on its own, and each names someone else
        assert not any(knk.fixes_someone(n, st) for n, st in zip(names, statements))
        assert all(set(knk.mentioned(st)) - {n} for n, st in zip(names, statements))


def test_knk_generator_enumerates_solutions_correctly():
    statements = [["is", "B", "knave"], ["is", "A", "knave"]]  # A: "B is a knave", B: "A is a knave"
    assert knk.solutions(["A", "B"], ["A", "B"], statements) == [(True, False), (False, True)]
    assert knk.fixes_someone("A", ["and", ["is", "A", "knave"], ["is", "B", "knight"]])  # A must be a knave
    assert not knk.fixes_someone("A", ["or", ["is", "A", "knight"], ["is", "B", "knight"]])


GOLD_4 = "Zoey: knight, Ethan: knight, Michael: knave, Samuel: knave"


@pytest.mark.parametrize("text", [
    "CONCLUSION:\n(1) Zoey is a knight\n(2) Ethan is a knight\n(3) Michael is a knave\n(4) Samuel is a knave",
    "(1) Zoey is a knight (2) Ethan is a knight (3) Michael is a knave (4) Samuel is a knave. The answer is above? "
    "Final answer: (1) Zoey is a knight (2) Ethan is a knight (3) Michael is a knave (4) Samuel is a knave",
    "So $\\boxed{Samuel: knave, Michael: knave, Zoey: knight, Ethan: knight}$",
    "\\boxed{\\text{Zoey is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave}}",
    "\\boxed{\\text{Zoey: Knight}, \\text{Ethan: Knight}, \\text{Michael: Knave}, \\text{Samuel: Knave}}",
    "The answer is: Knights: Zoey, Ethan; Knaves: Michael, Samuel.",
    "Final answer: Zoey and Ethan are knights, Michael and Samuel are knaves.",
    "\\boxed{Zoey is a knight, Ethan is not a knave, Michael is not a knight, Samuel is a knave}",
    "\\boxed{knight, knight, knave, knave}",
    "Suppose Zoey is a knave; then ... contradiction. \\boxed{Zoey - Knight, Ethan - Knight, Michael - Knave, "
    "Samuel - Knave}",
    # the instruction's form copied before the answer, and names in lower case
    "In the form \\boxed{Name: knight, Name: knave, ...}: \\boxed{Zoey: knight, Ethan: knight, Michael: knave, "
    "Samuel: knave}",
    "\\boxed{samuel: knave, zoey: knight, michael: knave, ethan: knight}",
    # a role word later in the clause is no hedge
    "\\boxed{Zoey is a knight, since a knave would lie; Ethan: knight, Michael: knave, Samuel: knave}",
    # markdown headers, a header over the lines below it, negations, R1's answer tag, a verification after
    "Final answer:\n**Knights**: Zoey, Ethan\n**Knaves**: Michael, Samuel\n\nSo there are 2 knights and 2 knaves.",
    "Final answer:\nKnights:\n- Zoey\n- Ethan\nKnaves:\n- Michael\n- Samuel",
    "Final answer: Zoey isn't a knave, Ethan cannot be a knave, Michael is no knight, Samuel is not a knight.",
    "Final answer: Zoey and Ethan are knights. Neither Michael nor Samuel is a knight.",
    "<think>Zoey must be a knave?</think><answer>(1) Zoey is a knight\n(2) Ethan is a knight\n(3) Michael is a "
    "knave\n(4) Samuel is a knave</answer>",
    "CONCLUSION:\n(1) Zoey is a knight\n(2) Ethan is a knight\n(3) Michael is a knave\n(4) Samuel is a knave\n\n"
    "Verification: if Samuel were a knight, Ethan would be a knave, a contradiction.",
    # conclusions as headings, names joined in words
    "## Conclusion\n- Zoey: Knight\n- Ethan: Knight\n- Michael: Knave\n- Samuel: Knave",
    "**Conclusion**:\nZoey: Knight, Ethan: Knight, Michael: Knave, Samuel: Knave",
    "In conclusion Zoey as well as Ethan are knights, and Michael along with Samuel are knaves.",
    "Therefore, the conclusion is that Zoey/Ethan are knights; Michael/Samuel are knaves.",
    "Step 3: Conclusion\nZoey is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave.",
    # prose after the answer that mentions a conclusion is no marker
    "Final answer: Zoey is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave.\n\n"
    "Thus the conclusion is consistent.",
    "Final answer: Zoey is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave. No contradiction "
    "in conclusion.",
])
def test_knk_answer_spellings_read_as_the_canonical_assignment(text):
    assert knk.extract_answer(text, KNK_4["problem"]) == GOLD_4 == KNK_4["answer"]


@pytest.mark.parametrize("text", [
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave}",                          # Samuel is missing
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave, Samuel: knave, Bob: knight}",  # Bob is not there
    "\\boxed{Zoe is a knight, Ethan is a knight, Michael is a knave, Samuel is a knave}",  # misspelt
    "Suppose Zoey is a knight, Ethan is a knight, Michael is a knave and Samuel is a knave.",  # no answer stated
    "\\boxed{knight, knave}",                                                          # two roles for four
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave, Samuel: could be a knight or a knave}",  # hedged
    "\\boxed{Zoey: knight, Ethan: knight, Michael: knave, Samuel: knave, and Mia is also a knave}",  # Mia is not there
    "CONCLUSION:\n(1) Zoey\n(2) Ethan is a knight\n(3) Michael is a knave\n(4) Samuel is a knave",  # Zoey has no role
    "Final answer: Zoey is unknown, Ethan is a knight, Michael is a knave, Samuel is a knave.",
    "Final answer: Zoey: knight/knave, Ethan: knight, Michael: knave, Samuel: knave",                 # hedged
    "Final answer: Zoey is both a knight and a knave; Ethan is a knight; Michael is a knave; Samuel is a knave.",
])
def test_knk_unknown_name_or_missing_person_gives_no_answer(text):
    assert knk.extract_answer(text, KNK_4["problem"]) is None


def test_knk_wrong_answers_spelled_as_headers_or_negations_read_as_what_they_say():
    """A wrong answer must not read as the gold: the roles in bold headers, "neither ... nor", and a sentence of
    role words without names on a two-person puzzle (once read as a list in the puzzle's order)."""
    wrong = "Final answer:\n**Knights**: Michael, Samuel\n**Knaves**: Zoey, Ethan\n\nSo there are 2 knights and 2 knaves."
    assert knk.extract_answer(wrong, KNK_4["problem"]) == "Zoey: knave, Ethan: knave, Michael: knight, Samuel: knight"
    neither = "Final answer: Zoey and Ethan are knights. Neither Michael nor Samuel is a knave."
    assert not knk.is_equiv(knk.extract_answer(neither, KNK_4["problem"]), GOLD_4)
    two = next(r for r in KNK if len(r["names"]) == 2)
    assert knk.extract_answer("Final answer: I could not tell who is a knight and who is a knave.", two["problem"]) is None


def test_knk_equal_assignments_vote_together_and_grade_equal():
    other_order = "Samuel: knave, Michael: knave, Ethan: knight, Zoey: knight"
    assert knk.answer_key(other_order) == knk.answer_key(GOLD_4) and knk.same_answer(other_order, GOLD_4)
    assert knk.is_equiv(other_order, GOLD_4) and not knk.is_equiv(flip_one(GOLD_4, 2), GOLD_4)
    assert not knk.is_equiv(None, GOLD_4)
    label = weighted_vote([GOLD_4, other_order, flip_one(GOLD_4)], [0, 0, 0], omega=1.0,
                          key=knk.answer_key, same=knk.same_answer).label
    assert knk.same_answer(label, GOLD_4)


@pytest.fixture(scope="module")
def knk_pool():
    with SandboxPool(timeout=5.0) as p:
        yield p


def smt_block(script):
    return f"Encoding each statement:\n```smt2\n{script}\n```"


def reference_smt(record, drop=None):
    """The puzzle's encoding; drop=i leaves out the i-th statement (then the solution is not unique)."""
    lines = knk.smt_script(record["names"], record["statements"]).splitlines()
    dropped = None if drop is None else f"(assert (= {record['names'][drop]} "
    return "\n".join(line for line in lines if dropped is None or not line.startswith(dropped))


def asserted_smt(answer):
    world = knk.parse_assignment(answer)
    declared = "".join(f"(declare-const {n} Bool)\n" for n in world)
    return declared + "(assert (and " + " ".join(n if v else f"(not {n})" for n, v in world.items()) + "))\n(check-sat)"


def verify_knk(completions, answers, pool, record=KNK_4):
    scripted = ScriptedVerifier(*completions)
    results = verify_batch([record["problem"]] * len(answers), ["\\boxed{...}"] * len(answers), answers, scripted,
                           knk.KNK, pool)
    assert all(p.system == knk.KNK_SYSTEM and record["problem"] in p.user for p in scripted.batches[0])
    return results


def test_knk_tool_verifies_a_right_script_and_mismatches_a_wrong_assignment(knk_pool):
    right, wrong = KNK_4["answer"], flip_one(KNK_4["answer"], 1)
    results = verify_knk([smt_block(reference_smt(KNK_4))] * 2, [right, wrong], knk_pool)
    assert [(r.v, r.status) for r in results] == [(1, "verified"), (0, "mismatch")], [r.output for r in results]
    assert knk.same_answer(results[1].result, right)  # the solver found the right one, not the rollout's


def test_knk_quoted_symbols_are_the_plain_names_and_hold_no_answer_text(knk_pool):
    """|Zoey| is the symbol Zoey (not a second, free constant); a symbol quoting an assignment, |Zoey: knave|, is no
    person and cannot write itself into the solver's result."""
    right, wrong = KNK_4["answer"], flip_one(KNK_4["answer"], 0)
    quoted = reference_smt(KNK_4).replace("(declare-const Zoey Bool)", "(declare-const |Zoey| Bool)")
    injected = reference_smt(KNK_4) + "\n(declare-const |Zoey: knave| Bool)\n(assert (= |Zoey: knave| Zoey))"
    results = verify_knk([smt_block(quoted), smt_block(injected)], [right, wrong], knk_pool)
    assert [(r.v, r.status) for r in results] == [(1, "verified"), (0, "mismatch")], [r.output for r in results]


def test_knk_script_asserting_the_candidate_is_caught(knk_pool):
    answer = KNK_4["answer"]
    cheat = asserted_smt(answer)
    also_statements = reference_smt(KNK_4) + "\n(assert (not Michael))"  # one fact on top of the encoding
    results = verify_knk([smt_block(cheat), smt_block(also_statements)], [answer, answer], knk_pool)
    assert [(r.v, r.status) for r in results] == [(0, "hardcoded"), (0, "hardcoded")]
    assert results[1].result == "asserts Michael"


def test_knk_closing_parentheses_that_close_nothing_are_dropped_before_the_solver(knk_pool):
    """A small verifier's typical slip, `(assert (= Zoey (not Oliver))))`, made z3 refuse the whole script;
    the closers at depth 0 go (a comment's parentheses stay), and the encoding is solved as written."""
    right, wrong = KNK_4["answer"], flip_one(KNK_4["answer"], 1)
    sloppy = "; who says what (each line closes once too often)\n" + reference_smt(KNK_4).replace(")))\n", "))))\n")
    assert sloppy.count(")") > reference_smt(KNK_4).count(")") + 1
    results = verify_knk([smt_block(sloppy)] * 2, [right, wrong], knk_pool)
    assert [(r.v, r.status) for r in results] == [(1, "verified"), (0, "mismatch")], [r.output for r in results]
    assert knk.extract_smt(smt_block(sloppy)).startswith("; who says what (each line closes once too often)")


def test_knk_non_unique_unsat_and_broken_scripts_do_not_verify(knk_pool):
    answer = KNK_4["answer"]
    broken = reference_smt(KNK_4).replace("(assert", "(assert (", 1)
    unsat = reference_smt(KNK_4) + "\n(assert (= Zoey (not Zoey)))"
    completions = [smt_block(reference_smt(KNK_4, drop=0)), smt_block(unsat), smt_block(broken), "no script here"]
    results = verify_knk(completions, [answer] * 4, knk_pool)
    assert [r.status for r in results] == ["mismatch", "mismatch", "exec_error", "no_code"]
    assert [r.result for r in results[:2]] == ["not unique", "unsat"] and sum(r.v for r in results) == 0


def test_knk_reference_encodings_of_the_set_verify_in_one_sandbox_batch(knk_pool):
    records = [r for size in range(2, 9) for r in [r for r in KNK if r["level"] == size][:3]]
    runs = knk.smt_tool([reference_smt(r) for r in records], knk_pool)
    assert all(run.status == "ok" and knk.smt_agrees(run.result, r["answer"]) for run, r in zip(runs, records))


def test_knk_verifier_chat_gets_the_knk_system_prompt(tiny_model, tokenizer, monkeypatch):
    import sampler
    seen = []
    real = sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, *a, **kw: seen.extend(prompts) or
                        real(model, tok, prompts, *a, **kw))
    prompt = verifier_prompt(ToVerify(KNK_4["problem"], "\\boxed{Zoey: knight}", None, "q0", None), knk.KNK)
    model_verifier(tiny_model, tokenizer, max_new_tokens=1, seed=0)([prompt])
    assert knk.KNK_SYSTEM in seen[0] and VERIFIER_SYSTEM not in seen[0] and KNK_4["problem"] in seen[0]


def test_knk_training_step_votes_with_solver_verified_rollouts(tiny_dir, tmp_path, monkeypatch):
    """--bench knk end to end on the tiny model: the rollouts' answers are scripted (the tiny model writes none),
    the verifier writes each puzzle's encoding; z3 verifies exactly the rollouts that give the gold assignment."""
    by_problem = {r["problem"]: r for r in KNK}

    def scripted_answer(text, problem):
        gold = by_problem[problem]["answer"]
        return gold if len(text) % 2 else flip_one(gold)

    def encoding_verifier(prompts):
        return [smt_block(reference_smt(next(r for p, r in by_problem.items() if p in prompt.user))) for prompt in prompts]

    policy_prompts, real_generate = [], sampler.generate
    monkeypatch.setattr(sampler, "generate", lambda model, tok, prompts, *a, **kw: (
        policy_prompts.extend(prompts) or real_generate(model, tok, prompts, *a, **kw)))
    monkeypatch.setattr(knk, "KNK", dataclasses.replace(knk.KNK, extract=scripted_answer))
    monkeypatch.setattr(t3rl, "build_verifier", lambda cfg, device, **kw: encoding_verifier)
    monkeypatch.delenv("T3RL_DATA_DIR", raising=False)  # data/knk.jsonl, the committed set
    run = t3rl.train(parse_config(tiny_argv(tiny_dir, tmp_path, bench="knk", limit=2, max_steps=1, eval_samples=0)))
    # the policy is asked for the assignment's form (else a small model boxes one word), in training and eval
    assert policy_prompts and all(knk.KNK_INSTRUCTION in p and verifier.MATH.instruction not in p for p in policy_prompts)
    rollouts = rows(run, "rollouts.jsonl")
    assert len(rollouts) == 2 * 4 and {r["id"] for r in rollouts} == {"knk-000", "knk-001"}
    golds = {r["id"]: r["answer"] for r in KNK}
    assert all((r["status"] == "verified") == (r["answer"] == golds[r["id"]]) for r in rollouts)
    assert {r["status"] for r in rollouts} == {"verified", "mismatch"}
    # omega 5: a verified gold answer wins the vote even where it is the minority
    assert all(r["label"] == golds[r["id"]] for r in rollouts if any(
        o["status"] == "verified" for o in rollouts if o["id"] == r["id"]))
    metrics = rows(run, "metrics.jsonl")
    assert [m["kind"] for m in metrics] == ["eval", "train", "eval"]
    assert set(metrics[0]["by_level"]) == {"2", "3"} and metrics[1]["verifier_precision"] == 1.0
