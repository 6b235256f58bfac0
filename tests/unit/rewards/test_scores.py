"""Built-in score functions: every reference answer scores 1.0, hand-picked hard cases, false positives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlkit.data.gsm8k import final_answer
from rlkit.rewards.scores import gsm8k, math, synthetic

# rows cut from the real files (README there)
DATA = Path(__file__).resolve().parents[2] / "fixtures" / "datasets"
GSM8K = DATA / "gsm8k"
MATH500 = DATA / "math500" / "test.jsonl"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ----- GSM8K ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["strict", "flexible"])
def test_every_gsm8k_reference_solution_scores_one(method):
    rows = _jsonl(GSM8K / "train.jsonl") + _jsonl(GSM8K / "test.jsonl")
    assert len(rows) == 11 + 8
    misses = [
        r["answer"][-60:]
        for r in rows
        if gsm8k.compute_score("openai/gsm8k", r["answer"], final_answer(r["answer"]), method=method) != 1.0
    ]
    assert misses == []


@pytest.mark.parametrize(
    ("solution", "truth", "method", "expected"),
    [
        ("so the total is 18.\n#### 18", "18", "strict", 1.0),
        ("#### 1,000", "1000", "strict", 1.0),  # thousands comma
        ("#### $1,234.", "1234", "strict", 1.0),  # dollar sign and trailing period
        ("#### -7", "-7", "strict", 1.0),  # negative
        ("#### 3.50", "3.5", "strict", 1.0),  # equal as numbers
        ("#### 7", "-7", "strict", 0.0),  # sign matters
        ("#### 17", "18", "strict", 0.0),  # wrong
        ("the answer is 18", "18", "strict", 0.0),  # strict needs ####
        ("#### 12 then corrected #### 18", "18", "strict", 1.0),  # the last marker wins
        ("#### eighteen", "18", "strict", 0.0),
        ("The answer is $1,000.", "1000", "flexible", 1.0),
        ("I got 5 apples and then 3 more, so 8.", "8", "flexible", 1.0),
        ("It costs -$4.", "-4", "flexible", 1.0),
        ("It is 8. Check: 8 - 5 = 3", "8", "flexible", 0.0),  # last number is 3
        ("no numbers here", "8", "flexible", 0.0),
        ("", "8", "strict", 0.0),
    ],
)
def test_gsm8k_hard_cases(solution, truth, method, expected):
    assert gsm8k.compute_score("openai/gsm8k", solution, truth, method=method) == expected


def test_gsm8k_method_from_extra_info_and_format_score():
    assert gsm8k.compute_score("gsm8k", "it is 4", "4", {"method": "flexible"}) == 1.0
    assert gsm8k.compute_score("gsm8k", "it is 4", "4", {"method": "strict"}) == 0.0
    assert gsm8k.compute_score("gsm8k", "#### 5", "4", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="flexible"):
        gsm8k.extract_answer("#### 1", method="loose")


# ----- MATH ----------------------------------------------------------------------------------
@pytest.mark.parametrize("use_math_verify", [False, True])
def test_math500_reference_solutions_score_one(use_math_verify):
    if use_math_verify:
        pytest.importorskip("math_verify")
    rows = _jsonl(MATH500)
    assert len(rows) == 8
    misses = [
        (r["unique_id"], math.last_boxed(r["solution"]), r["answer"])
        for r in rows
        if math.compute_score("math", r["solution"], r["answer"], use_math_verify=use_math_verify) != 1.0
    ]
    print(f"MATH-500 self-score misses ({len(misses)}/{len(rows)}): {misses}")
    assert 1 - len(misses) / len(rows) >= 0.99, misses


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{5}.", "5"),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("first \\boxed{4}, finally \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # last one, escaped braces
        ("\\fbox{7}", "7"),
        ("$\\boxed 9$", "9"),
        ("\\boxed{unclosed", None),
        ("no box at all", None),
    ],
)
def test_last_boxed(text, boxed):
    assert math.last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("solution", "truth", "expected"),
    [
        ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # numeric equality
        ("\\boxed{-\\frac{2}{4}}", "-0.5", 1.0),
        ("\\boxed{3/4}", "\\frac{3}{4}", 1.0),
        ("\\boxed{.5}", "0.5", 1.0),
        ("\\boxed{10\\text{ inches}}", "10", 1.0),  # unit text dropped
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\$18.90}", "18.90", 1.0),
        ("\\boxed{2,\\!000}", "2000", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "(3,\\frac{\\pi}{2})", 1.0),
        ("\\boxed{\\text{(C)}}", "(C)", 1.0),
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt2", 1.0),
        ("\\fbox{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
        # false positives must stay 0
        ("\\boxed{5}", "6", 0.0),
        ("\\boxed{1,2}", "12", 0.0),  # a list is not a number with a comma
        ("\\boxed{2m}", "2", 0.0),  # a variable is not a unit
        ("\\boxed{x^2+1}", "x^2+2", 0.0),
        ("\\boxed{-3}", "3", 0.0),
        ("the answer is 5", "5", 0.0),  # no box, no score
        ("\\boxed{\\frac{1}{3}}", "0.33", 0.0),
    ],
)
def test_math_hard_cases_pure_python(solution, truth, expected):
    assert math.compute_score("math", solution, truth, use_math_verify=False) == expected


def test_math_verify_extends_equivalence():
    pytest.importorskip("math_verify")
    # Symbolically equal, textually different: the rules say no, math-verify says yes.
    assert (
        math.compute_score(
            "math", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", use_math_verify=False
        )
        == 0.0
    )
    assert math.compute_score("math", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}") == 1.0
    assert math.compute_score("math", "\\boxed{7}", "8") == 0.0


# ----- synthetic -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3 + 5 = 8", 1.0),
        ("The answer is 8.", 1.0),
        ("Answer: 8", 1.0),
        ("**Answer:** 8", 1.0),
        ("The answer is 8. Check: 8 - 5 = 3", 1.0),  # an explicit answer beats the last number
        ("\\boxed{8} (since 3 + 5)", 1.0),
        ("8.0", 1.0),
        ("3 + 5 = 9", 0.0),
        ("eight", 0.0),
        ("", 0.0),
    ],
)
def test_arithmetic_score(response, expected):
    assert synthetic.compute_score("rlkit/arithmetic", response, "8") == expected


def test_arithmetic_bad_ground_truth_scores_zero():
    assert synthetic.compute_score("rlkit/arithmetic", "8", "eight") == 0.0


def test_arithmetic_answer_in_quotes():
    assert synthetic.compute_score("rlkit/arithmetic", 'The answer is "5", since 2 + 3.', "5") == 1.0
