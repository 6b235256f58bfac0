"""rlkit.hardware.mlas: whether ONNX Runtime's prepacked fp32 GEMM pays for its packing, and what
``rollout.backend.linears: auto`` becomes (rlkit.hardware.precision.auto_decode_linears)."""

from __future__ import annotations

import math

import pytest

from rlkit.hardware import (
    CpuInfo,
    MatmulProbe,
    MlasProbe,
    auto_decode_linears,
    cached_mlas_probe,
    decide_cpu,
    decide_cuda,
    layer_shapes,
    mlas_decode_pays,
    onnxruntime_unavailable,
    probe_mlas_decode,
    resolve_precision,
)

# F.linear step 10 ms, MLAS step 6 ms: 4 ms saved per token; packing 20 ms pays back after 20 / 4 = 5 tokens;
# the margin of 2 asks for 10
PAYS = MlasProbe(fp32_s=0.010, mlas_s=0.006, pack_s=0.020, rows=16, params=3_538_944)
SLOWER = MlasProbe(fp32_s=0.0001, mlas_s=0.00025, pack_s=0.006, rows=16, params=36_864)
AVX2 = CpuInfo(model="rlkit test cpu (avx2, mlas)", flags=("avx2", "fma"))  # a cache key of its own
SLOW_BF16 = MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,))


def generic() -> None:
    return None


def test_mlas_pays_from_twice_the_break_even():
    assert PAYS.break_even_tokens == pytest.approx(5.0) and PAYS.speedup == pytest.approx(10 / 6)
    assert SLOWER.break_even_tokens == math.inf
    pays, why = mlas_decode_pays(PAYS, 10)
    assert pays is True
    assert "layer (3.5 M parameters) measured 1.67x F.linear at 16 rows, packing 20 ms" in why
    assert why.endswith("pays back after 5 tokens; max_response_length 10 >= 2 x 5 -> onnxruntime")
    assert mlas_decode_pays(PAYS, 9)[0] is False
    assert mlas_decode_pays(PAYS, 9)[1].endswith("max_response_length 9 < 2 x 5 -> torch")
    assert mlas_decode_pays(SLOWER, 10_000)[1].endswith("no saving -> torch")


@pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")
def test_auto_linears_weigh_onnxruntime_only_for_a_float32_cpu_decode(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))  # the cache auto reads (default_cache_path)
    cached_mlas_probe(AVX2, tmp_path / "hardware.json", probe=lambda layer: PAYS)  # the generic layer's
    slow = decide_cpu(AVX2, SLOW_BF16)
    assert auto_decode_linears(slow, "float32", 64, generic) == ("onnxruntime", mlas_decode_pays(PAYS, 64)[1])
    assert auto_decode_linears(slow, "float32", 9, generic) == ("torch", mlas_decode_pays(PAYS, 9)[1])
    assert auto_decode_linears(slow, "float16", 64, generic) == ("torch", "")  # fbgemm's fp16 weights won
    assert auto_decode_linears(slow, "float32", None, generic) == ("torch", "")  # no length
    assert auto_decode_linears(slow, "float32", 64) == ("torch", "")  # no layer: not the hf backend
    assert auto_decode_linears(decide_cuda(False, "T4"), "float32", 64, generic) == ("torch", "")
    # the run's resolution: logged apart from the dtype's reason; an explicit choice is kept
    resolved = resolve_precision(
        "auto", "float32", "cpu", decision=slow, max_new_tokens=64, layer=generic, linears="auto"
    )
    assert resolved.decode_linears == "onnxruntime"
    assert resolved.params()["decode_linears_reason"] == mlas_decode_pays(PAYS, 64)[1]
    assert "decode_reason" not in resolved.params()
    kept = resolve_precision("auto", "auto", "cpu", decision=slow, max_new_tokens=64, linears="torch")
    assert kept.decode_linears == "torch" and "decode_linears_reason" not in kept.params()
    # explicit onnxruntime linears make an auto dtype float32
    explicit = resolve_precision(
        "auto", "auto", "cpu", decision=slow, max_new_tokens=512, linears="onnxruntime"
    )
    assert (explicit.decode_dtype, explicit.decode_linears) == ("float32", "onnxruntime")
    assert explicit.decode_reason == "rollout.backend.linears=onnxruntime decodes with fp32 weights"


def test_auto_linears_are_torch_without_onnxruntime(monkeypatch):
    monkeypatch.setattr("rlkit.hardware.mlas.onnxruntime_unavailable", lambda: "not here")
    assert auto_decode_linears(decide_cpu(AVX2, SLOW_BF16), "float32", 4096, generic) == ("torch", "")


@pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")
def test_the_probe_measures_a_real_layer_and_is_cached(tmp_path):
    tiny = layer_shapes(
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    )
    measured = probe_mlas_decode(tiny, rounds=1)
    assert measured.params == sum(n * k for n, k in tiny) and measured.rows == 16
    assert measured.fp32_s > 0 and measured.mlas_s > 0 and measured.pack_s > 0
    path = tmp_path / "hardware.json"
    calls = []
    assert cached_mlas_probe(AVX2, path, layer=tiny, probe=lambda layer: calls.append(layer) or PAYS) == PAYS
    assert (
        cached_mlas_probe(AVX2, path, layer=tiny, probe=lambda layer: calls.append(layer) or SLOWER) == PAYS
    )
    assert calls == [tiny]  # measured once, then read from the cache


@pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")
@pytest.mark.parametrize(
    ("mlas_step_s", "want"),
    # fp16 weights: (2 x 100 ms + 64 x 6 ms) / 10 ms = 58.4 fp32 steps; MLAS at 6 ms a step: (2 x 20 ms +
    # 64 x 6 ms) / 10 ms = 42.4 -> MLAS; at 9 ms a step: 61.6 -> fp16 stays
    [(0.006, ("float32", "onnxruntime")), (0.009, ("float16", "torch"))],
)
def test_where_fp16_weights_pay_auto_weighs_onnxruntime_against_them(
    tmp_path, monkeypatch, mlas_step_s, want
):
    from rlkit.hardware import Fp16Probe, cached_fp16_probe, mlas_beats_fp16

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    fp16 = Fp16Probe(fp32_s=0.010, fp16_s=0.006, pack_s=0.100, rows=16, params=1)
    mlas = MlasProbe(fp32_s=0.010, mlas_s=mlas_step_s, pack_s=0.020, rows=16, params=1)
    cached_fp16_probe(AVX2, tmp_path / "hardware.json", probe=lambda layer: fp16)
    cached_mlas_probe(AVX2, tmp_path / "hardware.json", probe=lambda layer: mlas)
    slow = decide_cpu(AVX2, SLOW_BF16)
    resolved = resolve_precision(
        "auto", "auto", "cpu", decision=slow, max_new_tokens=64, layer=generic, linears="auto"
    )
    assert (resolved.decode_dtype, resolved.decode_linears) == want
    assert resolved.linears_reason == mlas_beats_fp16(mlas, fp16, 64)[1]
    assert resolved.linears_reason.endswith(
        "float32 on onnxruntime" if want[1] == "onnxruntime" else "float16"
    )
    # linears: torch keeps fbgemm's fp16 weights, whatever MLAS measured
    kept = resolve_precision(
        "auto", "auto", "cpu", decision=slow, max_new_tokens=64, layer=generic, linears="torch"
    )
    assert (kept.decode_dtype, kept.decode_linears) == ("float16", "torch")
