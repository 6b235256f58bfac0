"""benchmarks/decode_profile.py's attribution of a decode step's wall time (issue 30 item 1): fake profiler
records in, categories out; pure Python, no model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def dp(benchmark_module):
    return benchmark_module("decode_profile.py")


def test_ops_fall_into_the_category_of_their_work(dp):
    """Inside a step's forward: linear → GEMM, SDPA → attention, building the mask → mask,
    rope/norm/activation → elementwise, the KV slab write and rotate-half concat → memory, views → views;
    inside sample_next every op → sampling (a view too), in the loop around them the uniform draw →
    sampling and the rest → loop bookkeeping. An unknown op in the forward is reported, not guessed."""
    op = dp.OpRecord
    cases = {
        ("aten::linear", "forward"): "gemm",
        ("quantized::linear_dynamic_fp16", "forward"): "gemm",  # fbgemm fp16 weights (dtype float16)
        ("mkldnn::_linear_pointwise", "forward"): "gemm",  # oneDNN-packed bf16 weights (dtype bfloat16)
        ("aten::scaled_dot_product_attention", "forward"): "attention",
        ("rlkit::decode_attention", "forward"): "attention",  # rlkit's compiled kernel (rollout.cpu_kernels)
        ("rlkit::rotary_write", "forward"): "elementwise",  # ... and its fused glue
        ("rlkit::add_rms_norm_cast", "forward"): "elementwise",
        ("aten::arange", "forward"): "mask",  # the causal mask, rebuilt every forward
        ("aten::mul", "forward"): "elementwise",
        ("aten::silu", "forward"): "elementwise",
        ("aten::rsqrt", "forward"): "elementwise",
        ("aten::copy_", "forward"): "memory",
        ("aten::cat", "forward"): "memory",
        ("aten::transpose", "forward"): "views",
        ("aten::log_softmax", "sample"): "sampling",
        ("aten::cumsum", "sample"): "sampling",
        ("aten::squeeze", "sample"): "sampling",
        ("aten::rand", "loop"): "sampling",
        ("aten::index_put_", "loop"): "bookkeeping",
        ("aten::where", "loop"): "bookkeeping",
        ("aten::frobnicate", "forward"): "unclassified",
    }
    got = {key: dp.categorise(op(key[0], (), 1.0, key[1])) for key in cases}
    assert got == cases


def test_gemm_shape_reads_m_n_k_from_the_inputs(dp):
    op = dp.OpRecord
    assert dp.gemm_shape(op("aten::linear", ((16, 1, 576), (1536, 576), ()), 1.0, "forward")) == (
        16,
        1536,
        576,
    )
    assert dp.gemm_shape(op("aten::addmm", ((576,), (8, 1536), (1536, 576)), 1.0, "forward")) == (
        8,
        576,
        1536,
    )
    packed = op("mkldnn::_linear_pointwise", ((8, 1, 576), (1536, 576), (), (), (), ()), 1.0, "forward")
    assert dp.gemm_shape(packed) == (8, 1536, 576)
    assert dp.gemm_shape(op("aten::mul", ((16, 576), (16, 576)), 1.0, "forward")) is None


def test_categories_sum_to_the_wall_and_gemms_get_their_rate(dp):
    """Two steps of a 100 µs·2 phase: linear (16, 1, 64)·(128, 64) twice a step at 4 µs, SDPA 10 µs, a
    sample 6 µs, a mul 2 µs a step: the categories sum to the wall, other is the uncovered rest, and the GEMM
    rate is 2·16·128·64 FLOPs / 4 µs = 65.5 GFLOP/s = 65.5 % of a 100 GFLOP/s probe."""
    op = dp.OpRecord
    step = [
        op("aten::linear", ((16, 1, 64), (128, 64), ()), 4.0, "forward"),
        op("aten::linear", ((16, 1, 64), (128, 64), ()), 4.0, "forward"),
        op("aten::scaled_dot_product_attention", (), 10.0, "forward"),
        op("aten::mul", (), 2.0, "forward"),
        op("aten::log_softmax", (), 6.0, "sample"),
    ]
    result = dp.attribute(step * 2, wall_us=200.0, steps=2, peak_flops=100e9)
    per_step = result["per_step_us"]
    assert per_step["gemm"] == 8.0 and per_step["attention"] == 10.0 and per_step["sampling"] == 6.0
    assert per_step["elementwise"] == 2.0 and per_step["other"] == 100.0 - 26.0
    assert sum(per_step.values()) == pytest.approx(100.0)
    assert sum(result["pct_of_step"].values()) == pytest.approx(100.0)
    (gemm,) = result["gemm_shapes"]
    assert (gemm["M"], gemm["N"], gemm["K"], gemm["calls_per_step"]) == (16, 128, 64, 2)
    assert gemm["gflops"] == pytest.approx(2 * 16 * 128 * 64 / 4e-6 / 1e9)
    assert gemm["pct_of_probe"] == pytest.approx(gemm["gflops"])
    assert result["ops_per_step"] == 5
    assert result["by_op"][0] == {
        "op": "aten::scaled_dot_product_attention",
        "category": "attention",
        "us_per_step": 10.0,
    }


def test_fp16_linears_say_their_shapes_are_not_recorded(dp):
    """fbgemm's fp16 linear records its input's shape only (its weight is a packed object), so its GEMMs are
    not split by shape: the report says so instead of printing a table with no rows."""
    step = [dp.OpRecord("quantized::linear_dynamic_fp16", ((8, 576), ()), 40.0, "forward")]
    result = dp.attribute(step, wall_us=100.0, steps=1, peak_flops=100e9)
    assert result["per_step_us"]["gemm"] == 40.0 and result["gemm_shapes"] == []
    lines = dp._markdown_rows("8x64", result, unprofiled_step_us=90.0)
    assert lines[-1].startswith("GEMMs by shape: none recorded")
    assert not any(line.startswith("| GEMM (M, N, K)") for line in lines)


class _Event:
    """The raw profiler event's interface ops_from_events reads (times in ns)."""

    def __init__(self, name, start, end, shapes=(), thread=1):
        self._name, self._start, self._end, self._shapes, self._thread = name, start, end, shapes, thread

    def name(self):
        return self._name

    def start_ns(self):
        return self._start

    def end_ns(self):
        return self._end

    def shapes(self):
        return list(self._shapes)

    def start_thread_id(self):
        return self._thread


def test_only_the_decode_phases_outermost_ops_count_each_with_its_scope(dp):
    """The prefill's ops (its forward and the shared cache copy before the first sample), an op's children
    (addmm under linear) and another thread's ops are not counted; each counted op keeps its scope."""
    ev = _Event
    events = [
        ev(dp.GENERATE, 0, 100_000),
        ev(dp.FORWARD, 1_000, 18_000),  # the prefill
        ev("aten::linear", 2_000, 10_000, [[8, 10, 4], [6, 4], []]),
        ev("aten::index", 18_500, 19_500),  # the shared prefill's cache copy: prefill
        ev(dp.SAMPLE, 20_000, 25_000),
        ev("aten::log_softmax", 21_000, 24_000),
        ev("aten::index_put_", 26_000, 27_000),  # recording the token: the loop
        ev(dp.FORWARD, 30_000, 60_000),
        ev("aten::linear", 31_000, 41_000, [[8, 1, 4], [6, 4], []]),
        ev("aten::addmm", 32_000, 40_000),  # inside linear: not outermost
        ev("aten::mul", 42_000, 43_000),
        ev("rlkit::rotary_write", 44_000, 46_000),  # rlkit's compiled operator, called from the scripted loop
        ev("aten::empty", 44_500, 45_000),  # inside it: not outermost
        ev("aten::mul", 62_000, 63_000, thread=2),  # another thread
    ]
    ops, phases = dp.ops_from_events(events)
    assert [(o.name, o.scope, o.duration_us) for o in ops] == [
        ("aten::log_softmax", "sample", 3.0),
        ("aten::index_put_", "loop", 1.0),
        ("aten::linear", "forward", 10.0),
        ("aten::mul", "forward", 1.0),
        ("rlkit::rotary_write", "forward", 2.0),
    ]
    assert ops[2].shapes == ((8, 1, 4), (6, 4), ())
    assert phases == {"generate": (0.0, 100.0), "prefill": (0.0, 20.0), "decode": (20.0, 100.0)}
