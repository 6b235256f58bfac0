"""benchmarks/common.py's ``Report``: what a benchmark printed, written as a results file that renders."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def common(benchmark_module):
    return benchmark_module("common.py")


def test_a_table_keeps_its_rows_together_and_paragraphs_stay_apart(common, monkeypatch):
    """A blank line between two Markdown table rows ends the table; any other printed line is a paragraph."""
    written = {}
    monkeypatch.setattr(common, "save_results", lambda name, record, text: written.update(text=text) or name)
    report = common.Report("x")
    for line in ["machine line", "| a | b |", "|---|---|", "| 1 | 2 |", "a note", "| c |", "|---|"]:
        report(line)
    report.save({})
    assert written["text"] == "machine line\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\na note\n\n| c |\n|---|"
