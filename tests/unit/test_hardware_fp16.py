"""rlkit.hardware.fp16: whether fp16 decode weights pay for their packing, and what ``rollout.backend.dtype:
auto`` becomes for a decode of a given length (rlkit.hardware.precision.auto_decode_dtype)."""

from __future__ import annotations

import json
import math

import pytest

from rlkit.hardware import (
    CpuInfo,
    Fp16Probe,
    MatmulProbe,
    auto_decode_dtype,
    cached_fp16_probe,
    decide_cpu,
    decide_cuda,
    fp16_decode_pays,
    fp16_weights_unavailable,
    layer_shapes,
    probe_fp16_decode,
    resolve_precision,
)
from rlkit.hardware.fp16 import PROBE_LAYER

# fp32 step 10 ms, fp16 step 6 ms: 4 ms saved per token; packing 100 ms pays back after 100 / 4 = 25 tokens;
# the margin of 2 asks for 50
PROBE = Fp16Probe(fp32_s=0.010, fp16_s=0.006, pack_s=0.100, rows=16, params=11_272_192)


def test_break_even_is_the_packing_over_the_saving_per_token():
    assert PROBE.break_even_tokens == pytest.approx(25.0)
    assert PROBE.speedup == pytest.approx(10 / 6)
    slower = Fp16Probe(fp32_s=0.006, fp16_s=0.010, pack_s=0.100)
    assert slower.break_even_tokens == math.inf


def test_fp16_pays_from_twice_the_break_even():
    assert fp16_decode_pays(PROBE, 49)[0] is False
    pays, why = fp16_decode_pays(PROBE, 50)
    assert pays is True
    assert "layer (11.3 M parameters) measured 1.67x fp32 at 16 rows, packing 100 ms" in why
    assert "pays back after 25 tokens" in why and "50 >= 2 x 25 -> float16" in why
    assert fp16_decode_pays(PROBE, 49)[1].endswith("49 < 2 x 25 -> float32")
    slower = Fp16Probe(fp32_s=0.006, fp16_s=0.010, pack_s=0.100, rows=16, params=1)
    assert fp16_decode_pays(slower, 10_000)[0] is False
    assert fp16_decode_pays(slower, 10_000)[1].endswith("no saving -> float32")


SLOWER = Fp16Probe(fp32_s=0.001, fp16_s=0.003, pack_s=0.001, rows=16, params=81_920)


def generic() -> None:
    """The layer of a model whose config gives none: auto probes the generic layer (PROBE_LAYER)."""
    return None


AVX2 = CpuInfo(model="rlkit test cpu (avx2)", flags=("avx2", "fma"))  # a cache key of its own
SLOW_BF16 = MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,))
FAST_BF16 = MatmulProbe(fp32_flops=80e9, bf16_flops=400e9, ratios=(5.0,))


def _cache_with(path, probe: Fp16Probe) -> None:
    """Put ``probe`` in a hardware cache at ``path`` for ``AVX2``, as a measurement would."""
    cached_fp16_probe(AVX2, path, probe=lambda layer: probe)


@pytest.mark.skipif(fp16_weights_unavailable() is not None, reason="no fbgemm in this torch build")
def test_auto_is_float16_only_where_bf16_is_slow_and_the_decode_is_long(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))  # the cache auto reads (default_cache_path)
    _cache_with(tmp_path / "hardware.json", PROBE)
    slow = decide_cpu(AVX2, SLOW_BF16)
    assert slow.decode_dtype == "float32"
    assert auto_decode_dtype(slow, 64, generic) == ("float16", fp16_decode_pays(PROBE, 64)[1])
    assert auto_decode_dtype(slow, 16, generic) == ("float32", fp16_decode_pays(PROBE, 16)[1])
    assert auto_decode_dtype(slow, None, generic) == ("float32", "")  # no length: the machine's decision
    assert auto_decode_dtype(slow, 64) == ("float32", "")  # no layer: a backend without fp16 weights
    fast = decide_cpu(CpuInfo(model="rlkit test cpu (amx)", flags=("amx_bf16",)), FAST_BF16)
    assert auto_decode_dtype(fast, 4096, generic) == ("bfloat16", "")  # bf16 wins where it is fast
    assert auto_decode_dtype(decide_cuda(False, "T4"), 4096, generic) == ("float32", "")  # CUDA: no fbgemm
    # the run's resolution: the length is data.max_response_length; the reason is logged and printed
    resolved = resolve_precision("auto", "auto", "cpu", decision=slow, max_new_tokens=512, layer=generic)
    assert resolved.decode_dtype == "float16"
    assert resolved.params()["decode_reason"] == fp16_decode_pays(PROBE, 512)[1]
    assert resolve_precision("auto", "float32", "cpu", decision=slow, max_new_tokens=512).decode_dtype == (
        "float32"
    )  # an explicit value is kept
    assert "decode_reason" not in resolve_precision("auto", "float32", "cpu", decision=slow).params()


def test_the_probe_is_measured_once_and_then_read_from_the_cache(tmp_path):
    path = tmp_path / "hardware.json"
    calls = []

    def measure(layer) -> Fp16Probe:
        calls.append(layer)
        return PROBE

    assert cached_fp16_probe(AVX2, path, probe=measure) == PROBE
    assert cached_fp16_probe(AVX2, path, probe=measure) == PROBE
    assert calls == [PROBE_LAYER]
    small = ((64, 64), (32, 64), (32, 64), (64, 64), (256, 64), (256, 64), (64, 256))
    assert cached_fp16_probe(AVX2, path, layer=small, probe=measure) == PROBE  # another layer: its own entry
    assert calls == [PROBE_LAYER, small]
    entries = json.loads(path.read_text())["entries"]
    keys = [key for key in entries if "-fp16-decode-" in key]
    assert len(keys) == 2 and any(
        key.endswith("-64x64,32x64,32x64,64x64,256x64,256x64,64x256") for key in keys
    )
    assert entries[keys[0]]["cpu_model"] == AVX2.model and entries[keys[0]]["pack_s"] == 0.100
    # a malformed entry is measured again, not trusted, and replaced: the next call reads it
    path.write_text(json.dumps({"version": 1, "entries": {key: {"fp32_s": "x"} for key in keys}}))
    assert cached_fp16_probe(AVX2, path, probe=measure) == PROBE and len(calls) == 3
    assert cached_fp16_probe(AVX2, path, probe=measure) == PROBE and len(calls) == 3


@pytest.mark.skipif(fp16_weights_unavailable() is not None, reason="no fbgemm in this torch build")
def test_the_probe_times_real_fbgemm_linears():
    probe = probe_fp16_decode(rounds=1, rows=4, reps=1)
    assert probe.params == sum(n * k for n, k in PROBE_LAYER) == 11_272_192
    assert probe.rows == 4 and probe.fp32_s > 0 and probe.fp16_s > 0 and probe.pack_s > 0
    assert math.isfinite(probe.speedup)


def test_layer_shapes_from_a_config():
    # SmolLM2-135M: hidden 576, 9 heads of 64, 3 KV heads, MLP 1536
    smollm2 = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    assert layer_shapes(smollm2) == (
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    )
    # an explicit head_dim (Qwen3, Gemma) sets the attention width; no num_key_value_heads: multi-head
    assert layer_shapes({**smollm2, "head_dim": 128, "num_key_value_heads": None})[:4] == (
        (1152, 576),
        (1152, 576),
        (1152, 576),
        (576, 1152),
    )
    assert layer_shapes({"hidden_size": 576}) is None  # not a decoder config it can read


@pytest.mark.skipif(fp16_weights_unavailable() is not None, reason="no fbgemm in this torch build")
def test_auto_probes_the_models_own_layer(tmp_path, monkeypatch):
    """A layer the probe measured slower in fp16 (a tiny model's) stays float32 however long the decode;
    auto asks for the layer only where the answer matters."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    tiny = ((64, 64), (32, 64), (32, 64), (64, 64), (256, 64), (256, 64), (64, 256))
    cached_fp16_probe(AVX2, tmp_path / "hardware.json", layer=tiny, probe=lambda layer: SLOWER)
    _cache_with(tmp_path / "hardware.json", PROBE)  # the generic layer: pays
    slow = decide_cpu(AVX2, SLOW_BF16)
    assert auto_decode_dtype(slow, 4096, lambda: tiny)[0] == "float32"
    assert auto_decode_dtype(slow, 4096, lambda: None)[0] == "float16"  # unknown shapes: the generic layer
    asked = []
    fast = decide_cpu(CpuInfo(model="rlkit test cpu (amx)", flags=("amx_bf16",)), FAST_BF16)
    assert auto_decode_dtype(fast, 4096, lambda: asked.append(1))[0] == "bfloat16" and asked == []
