"""Benchmark scripts run end to end on a tiny input, so that one whose rlkit API moved fails here rather than
in the hands of whoever next measures with it (``reward_timeout_overhead.py`` passed a keyword its reward
manager no longer took, unnoticed for several sessions). Nothing is timed or asserted about speed."""

from __future__ import annotations

import sys


def test_reward_timeout_overhead_scores_through_every_manager(benchmark_module, monkeypatch, tmp_path):
    script = benchmark_module("reward_timeout_overhead.py")
    common = sys.modules["common"]  # the script's own import of benchmarks/common.py
    saved = {}

    def save(name, record, text):
        saved.update(name=name, text=text)
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(common, "save_results", save)
    monkeypatch.setattr(sys, "argv", ["reward_timeout_overhead.py", "--batch", "4", "--repeats", "2"])
    script.main()  # asserts every manager's scores equal the inline ones
    assert saved["name"] == "reward-timeout-overhead"
    for manager in ("inline", "naive", "parallel", "batch"):
        assert f"  {manager} (" in saved["text"], saved["text"]
