"""GSM8K (openai/grade-school-math) → ``train.parquet`` / ``test.parquet`` in veRL's schema.

The ground truth is the number on the ``#### n`` line of the reference solution, thousands commas
removed ("1,000" → "1000"). ``extra_info`` keeps the question and the full reference solution.
"""

from __future__ import annotations

import re
from pathlib import Path

from rlkit.data._io import join_instruction, make_row, read_jsonl, write_rows
from rlkit.errors import DataError

__all__ = ["DATA_SOURCE", "DEFAULT_INSTRUCTION", "preprocess_gsm8k", "final_answer"]

DATA_SOURCE = "openai/gsm8k"
DEFAULT_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
SPLITS = ("train", "test")
_FINAL = re.compile(r"####\s*(.+?)\s*$")


def final_answer(solution: str) -> str | None:
    """``"...\\n#### 1,000"`` → ``"1000"``; None when the solution has no ``####`` line."""
    match = _FINAL.search(solution.strip())
    return match.group(1).replace(",", "").replace("$", "").strip() if match else None


def preprocess_gsm8k(
    input_dir: str | Path,
    output_dir: str | Path,
    instruction: str = DEFAULT_INSTRUCTION,
) -> dict[str, Path]:
    """Read ``train.jsonl`` and ``test.jsonl`` from ``input_dir``; write ``<split>.parquet`` files.

    Returns ``{split: path}``. Raises ``DataError`` naming file and line for a malformed row.
    """
    written = {}
    for split in SPLITS:
        source = Path(input_dir) / f"{split}.jsonl"
        rows = []
        for index, raw in enumerate(read_jsonl(source, required=("question", "answer"))):
            answer = final_answer(raw["answer"])
            if answer is None:
                raise DataError(f"{source}, line {index + 1}: the answer has no '#### <number>' final line.")
            extra = {"split": split, "index": index, "question": raw["question"], "answer": raw["answer"]}
            rows.append(make_row(DATA_SOURCE, join_instruction(raw["question"], instruction), answer, extra))
        written[split] = write_rows(rows, Path(output_dir) / f"{split}.parquet")
    return written
