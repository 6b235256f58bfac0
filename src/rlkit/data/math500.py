"""MATH-500 (PRM800K's held-out MATH subset) → ``test.parquet`` in veRL's schema.

MATH-500 is an evaluation set with a single split, so only ``test.parquet`` is written (use it as
``data.val_files``). The ground truth is the ``answer`` field (the last ``\\boxed{}`` of the
reference solution); ``extra_info`` keeps problem, solution, subject, level and unique_id.
"""

from __future__ import annotations

from pathlib import Path

from rlkit.data._io import join_instruction, make_row, read_jsonl, write_rows

__all__ = ["DATA_SOURCE", "DEFAULT_INSTRUCTION", "preprocess_math500"]

DATA_SOURCE = "HuggingFaceH4/MATH-500"
DEFAULT_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def preprocess_math500(
    input_dir: str | Path,
    output_dir: str | Path,
    instruction: str = DEFAULT_INSTRUCTION,
) -> dict[str, Path]:
    """Read ``test.jsonl`` from ``input_dir``; write ``test.parquet``. Returns ``{"test": path}``."""
    source = Path(input_dir) / "test.jsonl"
    rows = []
    for index, raw in enumerate(read_jsonl(source, required=("problem", "solution", "answer"))):
        extra = {
            "split": "test",
            "index": index,
            "question": raw["problem"],
            "solution": raw["solution"],
            "subject": str(raw.get("subject", "")),
            "level": int(raw.get("level", 0) or 0),
            "unique_id": str(raw.get("unique_id", "")),
        }
        rows.append(
            make_row(DATA_SOURCE, join_instruction(raw["problem"], instruction), raw["answer"], extra)
        )
    return {"test": write_rows(rows, Path(output_dir) / "test.parquet")}
