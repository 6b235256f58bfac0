"""Helpers for the data tests: veRL-schema rows and parquet files (a unique module name, so no clash
with other test folders' helpers)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def make_row(content, truth="2", source="rlkit/arithmetic", index=0):
    return {
        "data_source": source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": index},
    }


def write_parquet(path: Path, rows=None, table: pa.Table | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table if table is not None else pa.Table.from_pylist(rows), path)
    return path
