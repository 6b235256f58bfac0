"""The synthetic arithmetic task (``rlkit/arithmetic``): is the model's final number the right one?

The answer a response commits to is, in order of preference: the last ``\\boxed{...}``, the number
after the last "answer is" / "Answer:", else the last number in the text. Scoring the model's
natural answer (with a last-number fall-back) rather than gating on a format is deliberate: a small model
starts with a useful success rate and the reward cannot be won by format alone (see docs/data-and-rewards.md).
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "extract_answer"]

_INT = r"-?\d+(?:\.0+)?"
_BOXED = re.compile(r"\\boxed\{\s*(" + _INT + r")\s*\}")
_ANSWER_IS = re.compile(r"answer(?:\s+is)?[\s:=*\"'`$]*(" + _INT + r")", re.IGNORECASE)
_LAST = re.compile(_INT)


def extract_answer(solution_str: str) -> int | None:
    """The integer a response gives as its answer, or ``None``."""
    for pattern in (_BOXED, _ANSWER_IS, _LAST):
        found = pattern.findall(solution_str)
        if found:
            return int(float(found[-1]))
    return None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str | int,
    extra_info: dict | None = None,
    *,
    correct_score: float = 1.0,
) -> float:
    """``correct_score`` when the extracted integer equals ``ground_truth``, else 0.0."""
    predicted = extract_answer(solution_str)
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        return 0.0
    return correct_score if predicted == expected else 0.0
