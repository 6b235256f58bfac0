"""GSM8K: compare the final number of a solution with the reference answer.

Two extraction modes:

- ``strict`` (default): the answer is the number after the last ``####`` marker, the format GSM8K's
  reference solutions use and the default instruction asks for.
- ``flexible``: the last number anywhere in the text.

Numbers are compared as exact decimals after removing thousands commas, a leading ``$`` and a
trailing period, so ``$1,000.`` equals ``1000`` and ``-3.50`` equals ``-3.5``.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

__all__ = ["compute_score", "extract_answer", "parse_number", "METHODS"]

METHODS = ("strict", "flexible")

# A number as people write it: optional sign, optional $, digits with optional thousands
# commas, optional decimal part ("-$1,234.50", "$5", ".5", "12.").
_NUMBER = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\$?\.\d+")


def parse_number(text: str) -> Decimal | None:
    """``"$1,234.50."`` → ``Decimal("1234.50")``; ``None`` when it is not a number."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").replace(" ", "")
    if not cleaned or cleaned in {"-", "."}:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer text a solution commits to, or ``None`` when it gives none."""
    if method not in METHODS:
        raise ValueError(f"unknown gsm8k extraction method '{method}'; valid: {', '.join(METHODS)}.")
    if method == "strict":
        found = [m for m in _STRICT.findall(solution_str) if parse_number(m) is not None]
        return found[-1] if found else None
    found = _ANY_NUMBER.findall(solution_str)
    return found[-1] if found else None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    *,
    method: str | None = None,
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted number equals ``ground_truth``, ``format_score`` if a number was
    extracted but is wrong, 0.0 if none was found.

    The method comes from the ``method`` argument, else ``extra_info["method"]``, else ``strict``.
    """
    if method is None:
        method = (extra_info or {}).get("method", "strict") if isinstance(extra_info, dict) else "strict"
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    predicted, expected = parse_number(answer), parse_number(str(ground_truth))
    if predicted is None or expected is None:
        return 0.0
    return score if predicted == expected else format_score
