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


def test_ort_nbits_spike_packs_the_weights_onnxruntime_dequantises(benchmark_module):
    """The spike's speed table is only about the kernels its error column describes if ONNX Runtime reads
    the packed blob as the weights ``quantise`` dequantised (nibble order, zero point, scale layout)."""
    import numpy as np

    script = benchmark_module("ort_nbits_spike.py")
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((96, 64)) * 0.02).astype(np.float32)]
    x = rng.standard_normal((5, 64)).astype(np.float32)
    for bits in (8, 4):
        _, _, dequant = script.quantise(weights[0], bits, 32)
        (got,) = script.session(weights, f"nbits{bits}-acc0", 32).run(None, {"x64": x})
        np.testing.assert_allclose(got, x @ dequant.T, rtol=1e-4, atol=1e-5)
        assert np.abs(dequant - weights[0]).max() > 0  # quantised, not the weights themselves
