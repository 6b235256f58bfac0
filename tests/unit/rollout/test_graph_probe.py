"""rlkit.rollout.graph_probe: the probe of the whole decode step (F.linear, fbgemm fp16 weights, one ONNX
Runtime graph, oneDNN-packed bf16 weights where the CPU has native bf16) for a model the graph takes, the
choice it makes for ``linears: auto``, and how the run's precision resolution uses it in place of the
per-linear probes."""

from __future__ import annotations

import math

import pytest

from rlkit.hardware import CpuInfo, MatmulProbe, decide_cpu, onnxruntime_unavailable, resolve_precision
from rlkit.rollout.graph_probe import GraphProbe, cached_graph_probe, graph_choice, probe_graph_step

pytestmark = pytest.mark.skipif(onnxruntime_unavailable() is not None, reason="onnxruntime not installed")

# per layer: F.linear 10 ms a step; fp16 weights 6 ms, repacked in 100 ms; the graph 7 ms, rebuilt in 20 ms
PROBE = GraphProbe(fp32_s=0.010, fp16_s=0.006, graph_s=0.007, fp16_pack_s=0.100, graph_pack_s=0.020, params=1)
AVX2 = CpuInfo(model="rlkit test cpu (avx2, graph)", flags=("avx2", "fma"))
AMX = CpuInfo(model="rlkit test cpu (amx, graph)", flags=("avx512f", "avx512_bf16", "amx_bf16", "amx_tile"))
SLOW_BF16 = MatmulProbe(fp32_flops=80e9, bf16_flops=1e9, ratios=(0.0125,))
# the same, and bf16 weights at 4 ms a step, repacked in 50 ms (a CPU with native bf16)
WITH_BF16 = GraphProbe(**{**PROBE.__dict__, "bf16_s": 0.004, "bf16_pack_s": 0.050})


@pytest.mark.parametrize(
    ("tokens", "reduced", "want"),
    [
        # 1 token: F.linear 10 ms; fp16 2 x 100 + 6 = 206; graph 2 x 20 + 7 = 47 -> F.linear
        (1, True, ("float32", "torch")),
        # 64 tokens: F.linear 640; fp16 200 + 384 = 584; graph 40 + 448 = 488 -> the graph
        (64, True, ("float32", "onnxruntime")),
        # 1000 tokens: F.linear 10000; fp16 200 + 6000 = 6200; graph 40 + 7000 = 7040 -> fp16 weights
        (1000, True, ("float16", "torch")),
        # fp16 weights not allowed (an explicit float32 decode): the graph
        (1000, False, ("float32", "onnxruntime")),
    ],
)
def test_the_cheapest_of_the_three_decodes_wins(tokens, reduced, want):
    dtype, linears, why = graph_choice(PROBE, tokens, margin=2.0, reduced=reduced)
    assert (dtype, linears) == want
    assert ("float16 weights" in why) is reduced
    assert "bfloat16" not in why  # not measured (inf): not weighed
    assert why.startswith(f"for {tokens} tokens the decode step of one decoder layer")


@pytest.mark.parametrize(
    ("tokens", "reduced", "want"),
    [
        # 1 token: F.linear 10 ms; bf16 2 x 50 + 4 = 104 -> F.linear
        (1, True, ("float32", "torch")),
        # 64 tokens: F.linear 640; fp16 584; graph 488; bf16 100 + 256 = 356 -> bf16 weights
        (64, True, ("bfloat16", "torch")),
        # reduced precision not allowed (an explicit float32 decode): the graph
        (64, False, ("float32", "onnxruntime")),
    ],
)
def test_bf16_weights_win_where_measured_and_cheapest(tokens, reduced, want):
    dtype, linears, why = graph_choice(WITH_BF16, tokens, margin=2.0, reduced=reduced)
    assert (dtype, linears) == want
    assert ("bfloat16 weights" in why) is reduced


def test_the_bf16_costs_in_the_reason_are_hand_worked_fp32_steps():
    why = graph_choice(WITH_BF16, 64, margin=2.0, reduced=True)[2]
    assert "packing fp16 100 ms, graph 20 ms, bf16 50 ms)" in why
    assert why.endswith(
        "costs in fp32 steps: float32 with F.linear 64.0, float16 weights 58.4, "
        "float32 as one onnxruntime graph 48.8, bfloat16 weights 35.6 -> bfloat16 weights"
    )


@pytest.mark.parametrize(("cpu", "measured"), [(AVX2, False), (AMX, True)])
def test_bf16_weights_are_measured_only_where_the_cpu_has_native_bf16(monkeypatch, cpu, measured):
    import rlkit.hardware as hardware
    from rlkit.rollout.bf16_weights import bf16_weights_unavailable
    from rlkit.rollout.graph_probe import bf16_measurable

    monkeypatch.setattr(hardware, "cpu_info", lambda: cpu)
    assert bf16_measurable() is (measured and bf16_weights_unavailable() is None)


def test_the_costs_in_the_reason_are_hand_worked_fp32_steps():
    why = graph_choice(PROBE, 64, margin=2.0, reduced=True)[2]
    assert why.endswith(
        "costs in fp32 steps: float32 with F.linear 64.0, float16 weights 58.4, "
        "float32 as one onnxruntime graph 48.8 -> float32 as one onnxruntime graph"
    )


def test_a_layer_too_small_to_time_keeps_f_linear():
    """A tiny model on a busy machine: its 3-layer step read no slower than its 1-layer one, so every share
    is 0 (the full suite's smoke runs cached such a reading and divided by it)."""
    untimed = GraphProbe(
        fp32_s=0.0, fp16_s=0.0, graph_s=0.0, fp16_pack_s=0.0, graph_pack_s=0.0, params=36_864
    )
    dtype, linears, why = graph_choice(untimed, 16, margin=2.0, reduced=True)
    assert (dtype, linears) == ("float32", "torch")
    assert why == (
        "one decoder layer (0.0 M parameters) is too small for its share of a decode step to be timed "
        "(F.linear 0.000 ms) -> float32 with F.linear"
    )


def test_a_tie_goes_to_the_simpler_path():
    tie = GraphProbe(fp32_s=0.010, fp16_s=0.010, graph_s=0.010, fp16_pack_s=0.0, graph_pack_s=0.0)
    assert graph_choice(tie, 64, margin=2.0, reduced=True)[:2] == ("float32", "torch")


def test_the_probe_times_the_three_paths_on_the_runs_architecture(tiny_model_dir):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    from rlkit.rollout.bf16_weights import bf16_weights_unavailable

    bf16 = bf16_weights_unavailable() is None  # measured here whatever the CPU (native bf16 or emulated)
    probe = probe_graph_step(config.to_dict(), bf16=bf16)
    assert torch.equal(torch.random.get_rng_state(), before)  # the run's random state is left alone
    assert probe is not None and probe.rows == 16
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    q, k = heads * dim, kv * dim
    assert probe.params == hidden * (q + 2 * k) + q * hidden + 3 * hidden * inter  # one layer's linears
    from rlkit.hardware import fp16_weights_unavailable

    timed = ("fp32_s", "graph_s", "graph_pack_s") + (
        () if fp16_weights_unavailable() else ("fp16_s", "fp16_pack_s")
    )
    timed += ("bf16_s", "bf16_pack_s") if bf16 else ()
    for name in timed:
        value = getattr(probe, name)
        assert math.isfinite(value) and value >= 0.0, (name, value)
    # two more decoder layers take longer to step (the tiny model's session builds are mostly fixed cost:
    # their share may read 0)
    assert probe.fp32_s > 0.0 and probe.graph_s > 0.0


@pytest.mark.parametrize(
    "change",
    [{"hidden_act": "gelu"}, {"model_type": "gpt2"}, {"model_type": "mistral", "sliding_window": 16}],
    ids=["not SiLU", "not a Llama family", "a sliding window"],
)
def test_an_architecture_the_graph_does_not_take_has_no_probe_and_is_not_built_again(
    tiny_model_dir, tmp_path, change
):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir).to_dict() | change
    cache = tmp_path / "hardware.json"
    assert cached_graph_probe(config, AVX2, cache) is None  # the real probe: it builds and declines

    def must_not_run(config):
        raise AssertionError("measured again")

    assert cached_graph_probe(config, AVX2, cache, probe=must_not_run) is None  # the cached answer


def test_the_probe_is_measured_once_per_architecture_and_cpu(tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir).to_dict()
    calls = []

    def probe(config):
        calls.append(config["hidden_size"])
        return PROBE

    cache = tmp_path / "hardware.json"
    assert cached_graph_probe(config, AVX2, cache, probe=probe) == PROBE
    assert cached_graph_probe(config, AVX2, cache, probe=probe) == PROBE
    assert len(calls) == 1
    wider = config | {"hidden_size": 2 * config["hidden_size"]}
    assert cached_graph_probe(wider, AVX2, cache, probe=probe) == PROBE and len(calls) == 2


def test_the_run_resolution_takes_the_whole_step_probe_where_it_is_given():
    slow = decide_cpu(AVX2, SLOW_BF16)
    asked = []

    def graph(tokens, reduced):
        asked.append((tokens, reduced))
        return graph_choice(PROBE, tokens, margin=2.0, reduced=reduced)

    def resolve(decode_dtype, linears, decision=slow):
        return resolve_precision(
            "auto", decode_dtype, "cpu", decision=decision, max_new_tokens=64, linears=linears, graph=graph
        )

    got = resolve("auto", "auto")
    assert (got.decode_dtype, got.decode_linears) == ("float32", "onnxruntime")
    assert got.linears_reason == graph_choice(PROBE, 64, margin=2.0, reduced=True)[2]
    assert got.decode_reason == "chosen with the linears (the probe of the whole decode step)"
    assert resolve("float32", "auto").decode_linears == "onnxruntime" and asked[-1] == (64, False)
    # an explicit choice of linears, or a dtype that is not float32, is not the probe's to change
    asked.clear()
    assert resolve("auto", "torch").decode_linears == "torch"
    assert resolve("bfloat16", "auto").decode_dtype == "bfloat16"
    assert asked == []
    # a CPU with fast bf16 trains in bf16, and the probe of the whole step still decides the decode: the
    # graph where it is cheapest (a small model's layer), bf16 weights where they are
    fast = decide_cpu(AMX, MatmulProbe(fp32_flops=80e9, bf16_flops=400e9, ratios=(5.0,)))
    assert (fast.mixed_precision, fast.decode_dtype) == ("bf16", "bfloat16")
    got = resolve("auto", "auto", fast)
    assert (got.mixed_precision, got.decode_dtype, got.decode_linears) == ("bf16", "float32", "onnxruntime")
    assert asked == [(64, True)]

    def graph(tokens, reduced):  # noqa: F811 - the same probe, bf16 weights measured cheapest
        return graph_choice(WITH_BF16, tokens, margin=2.0, reduced=reduced)

    got = resolve("auto", "auto", fast)
    assert (got.mixed_precision, got.decode_dtype, got.decode_linears) == ("bf16", "bfloat16", "torch")
    assert got.linears_reason.endswith("-> bfloat16 weights")


def test_on_a_native_bf16_cpu_that_trains_in_fp32_the_probe_may_choose_bf16_weights():
    """avx512_bf16 whose matmul probe reads 1.3x fp32, below the band where auto trains in bf16 (Zen 4 reads
    about 2x and trains in bf16); the whole-step probe weighs bf16 weights with the rest, and an
    fp32-training run decodes with them where cheapest."""
    slow_bf16 = CpuInfo(
        model="rlkit test cpu (avx512_bf16, graph)", flags=("avx2", "fma", "avx512f", "avx512_bf16")
    )
    decision = decide_cpu(slow_bf16, MatmulProbe(fp32_flops=100e9, bf16_flops=130e9, ratios=(1.3,)))
    assert (decision.mixed_precision, decision.decode_dtype) == ("fp32", "float32")

    def graph(tokens, reduced):
        return graph_choice(WITH_BF16, tokens, margin=2.0, reduced=reduced)

    got = resolve_precision(
        "auto", "auto", "cpu", decision=decision, max_new_tokens=64, linears="auto", graph=graph
    )
    assert (got.mixed_precision, got.decode_dtype, got.decode_linears) == ("fp32", "bfloat16", "torch")
    assert got.linears_reason.endswith("-> bfloat16 weights") and not got.warnings
    explicit = resolve_precision(
        "auto", "float32", "cpu", decision=decision, max_new_tokens=64, linears="auto", graph=graph
    )
    assert (explicit.decode_dtype, explicit.decode_linears) == ("float32", "onnxruntime")


def test_every_timed_repack_packs_every_linear(tiny_model_dir, monkeypatch):
    """The repack the probe times is a real one: the copy's construction packs once, and each round's timed
    refresh packs every linear again (a first refresh right after the construction packs nothing, so timing it
    would read a repack as free)."""
    import torch
    from transformers import AutoConfig

    from rlkit.rollout.bf16_weights import Bf16FusedLinear, Bf16Linear, bf16_weights_unavailable
    from rlkit.rollout.fp16_weights import Fp16FusedLinear, Fp16Linear
    from rlkit.rollout.graph_probe import _probe_model, _time_paths
    from rlkit.rollout.ort_step import ort_step_for

    if bf16_weights_unavailable():
        pytest.skip(bf16_weights_unavailable())
    model = _probe_model(AutoConfig.from_pretrained(tiny_model_dir).to_dict(), 1)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    packs = {Bf16Linear: 0, Fp16Linear: 0}
    counts_as = {Bf16Linear: Bf16Linear, Fp16Linear: Fp16Linear, Bf16FusedLinear: Bf16Linear}
    counts_as[Fp16FusedLinear] = Fp16Linear
    for cls in counts_as:
        original = cls.pack

        def counted(self, linear, name="", cls=cls, original=original):  # a fused group: its linears
            packs[counts_as[cls]] += len(linear) if isinstance(linear, list) else 1
            original(self, linear, name)

        monkeypatch.setattr(cls, "pack", counted)
    with torch.no_grad():
        best = _time_paths(model, ort_step_for(model), rounds=2, rows=4, context=8, bf16=True)
    assert packs[Bf16Linear] == 3 * linears  # the construction, then one repack in each of 2 rounds
    from rlkit.hardware import fp16_weights_unavailable

    if fp16_weights_unavailable() is None:
        assert packs[Fp16Linear] == 3 * linears
    assert math.isfinite(best["bf16_pack_s"]) and best["bf16_pack_s"] > 0


def test_the_probe_times_the_lean_step_as_the_decode_runs_it(tiny_model_dir, monkeypatch):
    """The F.linear and fp16 paths are timed as ``rollout.decode`` runs them where the compiled operators
    load: the scripted layers with the fused glue, attending with the kernel over a cache that keeps its keys
    transposed (the kernel's probe taking it); the graph over a plain cache."""
    import torch
    from transformers import AutoConfig

    from rlkit.hardware import fp16_weights_unavailable
    from rlkit.rollout import attention_kernel, graph_probe
    from rlkit.rollout.attention_kernel import attends_with_kernel
    from rlkit.rollout.cpu_kernels import kernel_unavailable
    from rlkit.rollout.lean_step import LeanStep
    from rlkit.rollout.ort_step import ort_step_for

    if kernel_unavailable():
        pytest.skip(f"no decode kernels here: {kernel_unavailable()}")
    monkeypatch.setattr(attention_kernel, "kernel_pays", lambda *heads: True)
    timed = []
    real = graph_probe._time_steps

    def spy(step, cache, *args):
        timed.append((step, cache))
        return real(step, cache, *args)

    monkeypatch.setattr(graph_probe, "_time_steps", spy)
    model = graph_probe._probe_model(AutoConfig.from_pretrained(tiny_model_dir).to_dict(), 1)
    with torch.no_grad():
        graph_probe._time_paths(model, ort_step_for(model), rounds=1, rows=4, context=8, bf16=False)
    lean = [(step, cache) for step, cache in timed if isinstance(step, LeanStep)]
    assert len(lean) == (1 if fp16_weights_unavailable() else 2)  # F.linear, fp16 weights
    for step, cache in lean:
        assert step.scripted is not None and step.scripted.fused and step.fused_steps > 0
        assert attends_with_kernel(cache) and step.kernel_steps > 0
    assert [attends_with_kernel(cache) for step, cache in timed if not isinstance(step, LeanStep)] == [False]
