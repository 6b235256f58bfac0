"""A veRL-style compute_score: 1.0 when the response contains the ground-truth keyword."""

from __future__ import annotations


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
) -> dict:
    """Keyword match, case-insensitive; returns a dict with ``score`` plus an extra metric."""
    found = str(ground_truth).lower() in solution_str.lower()
    return {"score": 1.0 if found else 0.0, "response_chars": float(len(solution_str))}
