"""benchmarks/common.py's ``Report``: what a benchmark printed, written as a results file that renders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("_bench_common", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["_bench_common"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_a_table_keeps_its_rows_together_and_paragraphs_stay_apart(common, monkeypatch):
    """A blank line between two Markdown table rows ends the table; any other printed line is a paragraph."""
    written = {}
    monkeypatch.setattr(common, "save_results", lambda name, record, text: written.update(text=text) or name)
    report = common.Report("x")
    for line in ["machine line", "| a | b |", "|---|---|", "| 1 | 2 |", "a note", "| c |", "|---|"]:
        report(line)
    report.save({})
    assert written["text"] == "machine line\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\na note\n\n| c |\n|---|"
