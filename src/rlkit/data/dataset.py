"""Parquet prompts in veRL's schema → tokenized prompts → left-padded ``Batch``.

``RLDataset`` reads one or many parquet files with pyarrow, checks every row, renders each prompt
with the tokenizer's chat template (generation prompt added) and applies the prompt-length policy:

- ``error`` (default): a row longer than ``max_prompt_length`` tokens raises ``DataError`` naming
  file and row; malformed rows raise too.
- ``filter``: too-long and malformed rows are skipped; ``dataset.stats`` counts them (logged).
- ``truncate_left`` / ``truncate_right``: too-long prompts keep their last / first
  ``max_prompt_length`` tokens (counted in ``stats["truncated"]``); malformed rows still raise.

Everything is checked when the dataset is built, so a run fails before any model is loaded.

``collate(samples)`` builds the batch: tensors ``input_ids``, ``attention_mask``, ``position_ids``
(``[B, P]``, left-padded, ``P`` = longest prompt in the batch) and per-sample fields
``data_source``, ``reward_model``, ``extra_info``, ``ability``, ``raw_prompt`` (the messages),
``row`` (``"<file #>:<row>"``: the parquet file's number among ``data.*_files`` and the row's number in it,
stable across resumes). A sample's group id (``uid``, ``group_id``) is made by the generation phase.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rlkit.batch import Batch
from rlkit.errors import DataError

__all__ = ["PROMPT_LENGTH_POLICIES", "RLDataset", "collate_prompts"]

log = logging.getLogger(__name__)

PROMPT_LENGTH_POLICIES = ("error", "filter", "truncate_left", "truncate_right")
REQUIRED_COLUMNS = ("data_source", "reward_model")
_TOKENIZE_CHUNK = 1024


def _read_table(path: Path, prompt_key: str) -> pa.Table:
    if not path.is_file():
        raise DataError(f"{path}: data file not found. Check data.train_files / data.val_files.")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot be read as parquet ({type(exc).__name__}: {exc}).") from exc
    missing = [c for c in (prompt_key, *REQUIRED_COLUMNS) if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; it has {table.column_names}. rlkit reads veRL's schema: "
            f"data_source, {prompt_key} (list of {{role, content}}), reward_model {{style, ground_truth}}, "
            "extra_info. Convert the file with `rlkit data ...` or set data.prompt_key."
        )
    prompt_type = table.schema.field(prompt_key).type
    if not (pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type)):
        raise DataError(
            f"{path}: column '{prompt_key}' has type {prompt_type}; expected a list of chat messages "
            "(list<struct<role: string, content: string>>)."
        )
    if table.num_rows == 0:
        raise DataError(f"{path}: the file has no rows.")
    return table


def _rows(table: pa.Table, path: Path) -> list[dict[str, Any]]:
    """Python rows; a row that is not valid UTF-8 raises ``DataError`` naming it."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        pass
    rows = []
    for i in range(table.num_rows):
        try:
            rows.extend(table.slice(i, 1).to_pylist())
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}, row {i}: a text field is not valid UTF-8 ({exc.reason}).") from exc
    return rows


def _problem(row: dict[str, Any], prompt_key: str) -> str | None:
    """What is wrong with a row, or None."""
    messages = row.get(prompt_key)
    if not isinstance(messages, list) or not messages:
        return f"'{prompt_key}' is missing or empty"
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"'{prompt_key}'[{j}] has no string 'role'"
        if not isinstance(message.get("content"), str):
            kind = type(message.get("content")).__name__
            return f"'{prompt_key}'[{j}].content is {kind}, not a string"
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        return "'data_source' is missing or not a string"
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        return "'reward_model.ground_truth' is missing"
    if row.get("extra_info") is not None and not isinstance(row["extra_info"], dict):
        return f"'extra_info' is a {type(row['extra_info']).__name__}, not a mapping"
    return None


class RLDataset(torch.utils.data.Dataset):
    """Tokenized prompts from parquet files; ``stats`` says how many rows were read, kept, filtered,
    truncated."""

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 1024,
        prompt_length_policy: str = "error",
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        if prompt_length_policy not in PROMPT_LENGTH_POLICIES:
            raise DataError(
                f"data.prompt_length_policy: '{prompt_length_policy}' is not valid; "
                f"choose one of {', '.join(PROMPT_LENGTH_POLICIES)}."
            )
        if max_prompt_length < 1:
            raise DataError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}.")
        self.files = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
        if not self.files:
            raise DataError("no data files given (data.train_files / data.val_files is empty).")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.policy = prompt_length_policy
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.pad_token_id = self._pad_token_id(tokenizer)
        self.stats = {
            "rows_read": 0,
            "rows_kept": 0,
            "filtered_too_long": 0,
            "filtered_malformed": 0,
            "truncated": 0,
        }
        self.samples: list[dict[str, Any]] = []
        for file_number, path in enumerate(self.files):
            self._load(file_number, path)
        if not self.samples:
            raise DataError(f"no rows left in {[str(f) for f in self.files]} after filtering: {self.stats}.")
        if self.stats["filtered_too_long"] or self.stats["filtered_malformed"] or self.stats["truncated"]:
            log.warning("dataset %s: %s", [str(f) for f in self.files], self.stats)

    @staticmethod
    def _pad_token_id(tokenizer: Any) -> int:
        for attr in ("pad_token_id", "eos_token_id"):
            value = getattr(tokenizer, attr, None)
            if isinstance(value, int):
                return value
        raise DataError("the tokenizer has neither a pad token nor an eos token; set tokenizer.pad_token.")

    def _load(self, file_number: int, path: Path) -> None:
        rows = _rows(_read_table(path, self.prompt_key), path)
        self.stats["rows_read"] += len(rows)
        valid: list[tuple[int, dict[str, Any]]] = []
        for row_number, row in enumerate(rows):
            problem = _problem(row, self.prompt_key)
            if problem is None:
                valid.append((row_number, row))
            elif self.policy == "filter":
                self.stats["filtered_malformed"] += 1
                if self.stats["filtered_malformed"] == 1:
                    log.warning("skipping malformed row %s, row %d: %s", path, row_number, problem)
            else:
                raise DataError(
                    f"{path}, row {row_number}: {problem}. Fix the row, or set "
                    "data.prompt_length_policy=filter to skip bad rows."
                )
        for start in range(0, len(valid), _TOKENIZE_CHUNK):
            chunk = valid[start : start + _TOKENIZE_CHUNK]
            for (row_number, row), ids in zip(chunk, self._tokenize(path, chunk)):
                self._add(file_number, path, row_number, row, ids)

    def _tokenize(self, path: Path, chunk: list[tuple[int, dict[str, Any]]]) -> list[list[int]]:
        texts = []
        for row_number, row in chunk:
            try:
                texts.append(
                    self.tokenizer.apply_chat_template(
                        row[self.prompt_key],
                        add_generation_prompt=True,
                        tokenize=False,
                        **self.chat_template_kwargs,
                    )
                )
            except Exception as exc:
                raise DataError(
                    f"{path}, row {row_number}: the chat template failed ({type(exc).__name__}: {exc}). "
                    "Check that the tokenizer has a chat_template."
                ) from exc
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def _add(
        self, file_number: int, path: Path, row_number: int, row: dict[str, Any], ids: list[int]
    ) -> None:
        limit = self.max_prompt_length
        if len(ids) > limit:
            if self.policy == "error":
                raise DataError(
                    f"{path}, row {row_number}: the prompt is {len(ids)} tokens, longer than "
                    f"data.max_prompt_length={limit}. Raise data.max_prompt_length, or set "
                    "data.prompt_length_policy to filter, truncate_left or truncate_right."
                )
            if self.policy == "filter":
                self.stats["filtered_too_long"] += 1
                return
            ids = ids[-limit:] if self.policy == "truncate_left" else ids[:limit]
            self.stats["truncated"] += 1
        self.samples.append(
            {
                "input_ids": list(ids),
                "data_source": row["data_source"],
                "reward_model": row["reward_model"],
                "extra_info": row.get("extra_info") or {},
                "ability": row.get("ability") or "",
                "raw_prompt": row[self.prompt_key],
                "row": f"{file_number}:{row_number}",
                **({"agent_name": row["agent_name"]} if row.get("agent_name") else {}),
            }
        )
        self.stats["rows_kept"] += 1

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.samples[i]

    def collate(self, samples: Sequence[dict[str, Any]]) -> Batch:
        return collate_prompts(samples, self.pad_token_id)

    def max_length(self) -> int:
        """The longest tokenized prompt (after truncation)."""
        return max(len(s["input_ids"]) for s in self.samples)


NON_TENSOR_FIELDS = (
    "data_source",
    "reward_model",
    "extra_info",
    "ability",
    "raw_prompt",
    "row",
    "agent_name",
)


def collate_prompts(samples: Sequence[dict[str, Any]], pad_token_id: int) -> Batch:
    """Left-pad prompts into ``input_ids``/``attention_mask``/``position_ids`` ``[B, P]`` plus raw fields."""
    if not samples:
        raise DataError("cannot collate an empty list of samples.")
    width = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)  # [B, P]
    for i, sample in enumerate(samples):
        ids = sample["input_ids"]
        if ids:
            input_ids[i, width - len(ids) :] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P]
    non_tensors = {
        key: [s.get(key) for s in samples] for key in NON_TENSOR_FIELDS if any(key in s for s in samples)
    }
    return Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids},
        non_tensors,
    )
