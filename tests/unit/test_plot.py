"""rlkit plot reads a run's metrics back and writes a PNG."""

from __future__ import annotations

import json

import pytest

from rlkit.cli.plot import plot_runs, read_history
from rlkit.errors import RlkitError


def write_run(path, offset):
    path.mkdir()
    with (path / "metrics.jsonl").open("w") as f:
        for step in range(1, 4):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time": 0,
                        "critic/score/mean": offset + step / 10,
                        "val-core/x/score/mean@1": offset,
                    }
                )
                + "\n"
            )
    return path


def test_plot_two_runs(tmp_path):
    a, b = write_run(tmp_path / "a", 0.0), write_run(tmp_path / "b", 0.5)
    assert [s for s, _ in read_history(a)["critic/score/mean"]] == [1, 2, 3]
    assert read_history(a)["critic/score/mean"][1] == (2, 0.2)
    out = plot_runs([a, b], tmp_path / "curves.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_plot_without_metrics_says_what_to_give(tmp_path):
    with pytest.raises(RlkitError, match="trainer.output_dir"):
        read_history(tmp_path)
