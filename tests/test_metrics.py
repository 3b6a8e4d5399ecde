"""machinery/metrics.py: what a step and an evaluation report (monitors: never rewards)."""
from answers import answer_key, same_answer
from machinery.metrics import eval_metrics, group_metrics
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


def test_an_extensions_counts_are_summed_over_the_questions_and_shown():
    """Learner.monitors: each question's counts (numbers, {status: count}) add up in the step's row,
    its line and the run's summary, under the extension's name."""
    from machinery.metrics import _training_lines, format_step, step_metrics
    question = {"label_accuracy": 1.0, "majority_label_accuracy": 1.0, "reward_accuracy": 1.0,
                "majority_ratio": 1.0, "ground_truth_ratio": 1.0, "verified_ratio": 0.0,
                "flipped": 0.0, "flip_fixed": 0.0, "flip_broke": 0.0, "pass@N": 1.0, "statuses": [],
                "correct": 2, "judged_verified": 0, "verified_correct": 0, "correct_judged": 0,
                "inherited_verified": 0, "inherited_verified_correct": 0, "no_answer": 0,
                "response_tokens": [3, 4], "verifier_tokens": 0}
    per_question = [question | {"agent": {"tool_calls": 2, "tool_statuses": {"ok": 2}}},
                    question | {"agent": {"tool_calls": 1, "tool_statuses": {"error": 1, "timeout": 0}}}]
    row = step_metrics(0, per_question, {}, [{"sample": 1.0}], ["agent"])
    # a status no call reached keeps its 0
    assert row["extensions"] == {"agent": {"tool_calls": 3,
                                           "tool_statuses": {"ok": 2, "error": 1, "timeout": 0}}}
    assert "| agent tool_calls 3 tool_statuses {'ok': 2, 'error': 1, 'timeout': 0} |" in format_step(row, 1)
    assert "agent tool_calls" in "\n".join(_training_lines([row, row]))
    assert any(line.split()[-1] == "6" for line in _training_lines([row, row])
               if line.startswith("agent tool_calls"))
    assert "extensions" not in step_metrics(0, per_question, {}, [{"sample": 1.0}])


def test_an_evaluation_of_numbered_and_named_levels_reports_each():
    """A user's file may number some levels and name others: by_level holds each, numbers first."""
    row = lambda qid, level, right: {"id": qid, "level": level, "greedy@1": right, "runs": [right]}  # noqa: E731
    result = eval_metrics([row("a", 2, 1.0), row("b", "olympiad", 0.0), row("c", 1, 1.0), row("d", None, 0.0)], 1)
    assert list(result["by_level"]) == [1, 2, "olympiad"]
    assert result["by_level"]["olympiad"]["avg@1"] == 0.0 and result["avg@1"] == 0.5



def test_a_verdict_a_class_passed_on_counts_once_in_the_steps_statuses():
    """--verify-budget 1: one program ran and four rollouts took its verdict. The step's status
    counts say what the programs did (1 verified), the inherited verdicts are counted apart."""
    from machinery.metrics import question_monitors, step_metrics
    from sampler import Completion
    from t3rl import Judged
    from verifier import MATH, Verification
    answers = ["5"] * 5
    verdicts = [Verification(1, "verified", "5", tokens=9)] + [
        Verification(1, "verified", "5", inferred=True) for _ in range(4)]
    judged = Judged(weighted_vote(answers, [1] * 5, 5.0), [1] * 5, [0, 1])
    group = [Completion([1], [2, 3], "x", "eos") for _ in answers]
    stats = question_monitors({"id": "q", "answer": "5"}, group, answers, verdicts, judged, MATH, 5.0)
    row = step_metrics(0, [stats], {}, [{"sample": 1.0}])
    assert row["status"] == {"verified": 1}
    assert (row["verified_rollouts"], row["inherited_verified_rollouts"]) == (1, 4)
