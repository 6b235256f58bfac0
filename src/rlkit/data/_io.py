"""Reading JSON Lines inputs and writing veRL-schema parquet files, with errors that name file and line."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlkit.errors import DataError

__all__ = ["read_jsonl", "write_rows", "make_row", "join_instruction"]


def read_jsonl(path: str | Path, required: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Rows of a JSON Lines file; a bad line raises ``DataError`` naming the file and line number."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: input file not found. Pass the folder that holds it with --input.")
    required = tuple(required)
    rows: list[dict[str, Any]] = []
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{path}, line {line_no}: not valid UTF-8 ({exc.reason} at byte {exc.start})."
                ) from exc
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{path}, line {line_no}: not valid JSON ({exc.msg}, column {exc.colno})."
                ) from exc
            if not isinstance(row, dict):
                raise DataError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}.")
            missing = [k for k in required if not isinstance(row.get(k), str) or not row[k].strip()]
            if missing:
                raise DataError(f"{path}, line {line_no}: missing or empty string field(s) {missing}.")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: the file has no rows.")
    return rows


def make_row(
    data_source: str,
    content: str,
    ground_truth: str,
    extra_info: dict[str, Any],
    ability: str = "math",
) -> dict[str, Any]:
    """One row of veRL's schema: a single user turn and a rule-based reward."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": extra_info,
    }


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to one parquet file (parent folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def join_instruction(question: str, instruction: str) -> str:
    """The user turn: the question, then the instruction (if any) after one space."""
    question = question.strip()
    return f"{question} {instruction.strip()}" if instruction and instruction.strip() else question
