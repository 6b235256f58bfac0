"""Step metrics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlkit.batch import Batch
from rlkit.step.metrics import Timer, data_metrics, throughput_metrics, timing_metrics, validation_metrics


def make_batch() -> Batch:
    # two samples, prompt width 3 (left-padded), response width 4
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    scores = torch.tensor([[0.0, 1.0, 0, 0], [0, 0, 0, 0.5]])
    return Batch(
        {
            "attention_mask": attention,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - 0.1 * response_mask,
            "advantages": torch.tensor([[1.0, 1.0, 9.0, 9.0], [-1.0, -1.0, -1.0, -2.0]]),
        }
    )


def test_data_metrics_by_hand():
    m = data_metrics(make_batch(), max_prompt_length=3, max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx(0.75)  # scores 1.0 and 0.5
    assert m["critic/rewards/mean"] == pytest.approx((0.8 + 0.1) / 2)  # 1.0-0.2, 0.5-0.4
    assert m["critic/advantages/max"] == 1.0  # the 9.0s sit under the mask and are ignored
    assert m["critic/advantages/min"] == -2.0
    assert m["response_length/mean"] == 3.0 and m["response_length/clip_ratio"] == 0.5  # lengths 2 and 4
    assert m["prompt_length/min"] == 2.0 and m["prompt_length/clip_ratio"] == 0.5  # lengths 2 and 3


def test_timing_per_token():
    batch = make_batch()  # 6 response tokens, 11 tokens in all
    m = timing_metrics({"gen": 0.6, "update_actor": 1.1, "step": 2.0}, batch)
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(100.0)
    assert "timing_per_token_ms/step" not in m and m["timing_s/step"] == 2.0
    t = throughput_metrics(batch, step_time=2.0, num_ranks=2)
    assert t["perf/total_num_tokens"] == 11 and t["perf/throughput"] == pytest.approx(2.75)


def test_validation_mean_and_best_at_n():
    sources = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
    uids = np.array(["p0", "p0", "p1", "p1", "q0", "q0"], dtype=object)
    scores = [1.0, 0.0, 0.0, 0.0, 0.5, 1.0]
    m = validation_metrics(sources, uids, scores, n=2, extra={"acc": [True, False, False, False, True, True]})
    assert m["val-core/a/score/mean@2"] == 0.25 and m["val-core/a/score/best@2"] == 0.5  # best: p0→1, p1→0
    assert m["val-core/b/score/best@2"] == 1.0 and m["val-core/b/acc/mean@2"] == 1.0


def test_timer_accumulates():
    timer = Timer()
    for _ in range(2):
        with timer("x"):
            pass
    assert set(timer.times) == {"x"} and timer.times["x"] >= 0


# ----- perf/mfu/actor: executed FLOPs over a stated peak (rlkit.model.flops) -------------------------
_ATTENTION_OPS = ("bmm", "_scaled_dot_product")


def _grouped_batch(tok, module):
    """2 prompts of different lengths x 3 sampled responses of varying length (a GRPO-style micro-batch)."""
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout

    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("What is 2 + 3?", "What is 12 + 30? Answer with the number.")
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    eos = int(tok.convert_tokens_to_ids("7"))
    return HFRollout(
        module=module,
        tokenizer=tok,
        rollout_config=RolloutConfig(n=3),
        max_response_length=10,
        eos_token_ids=[eos],
        seed=2,
    ).generate(Batch(dict(enc)))


def _counted(module, batch, layout, monkeypatch, *, fused=True):
    """(tally, linear FLOPs, attention FLOPs) of one forward + backward in ``layout``, the latter two as
    ``torch.utils.flop_counter.FlopCounterMode`` counts the ops that ran (with in-place ``addmm_``, which the
    fused head's backward runs for the hidden states' gradient and FlopCounterMode has no formula for)."""
    from torch.utils.flop_counter import FlopCounterMode

    from rlkit.model import forward
    from rlkit.model.flops import FlopTally, model_dims

    monkeypatch.setattr(forward, "layout_of", lambda *a, **k: layout)
    plan = forward.ForwardPlan(fused_head=fused, share_prefix=layout == "shared")
    tally = FlopTally(model_dims(module))

    def addmm_(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:  # [m, k] @ [k, n] added in
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_}) as counter:
        lp, ent = forward.forward_response(
            module,
            batch,
            temperature=1.0,
            with_entropy=True,
            entropy_grad=True,
            device=torch.device("cpu"),
            tally=tally,
            plan=plan,
        )
        (lp.sum() + 0.1 * ent.sum()).backward()
    ops = counter.get_flop_counts()["Global"]
    attention = sum(v for k, v in ops.items() if any(a in str(k) for a in _ATTENTION_OPS))
    return tally, sum(ops.values()) - attention, attention


def _split(tally):
    """The tally's FLOPs as (linear maps, attention) from its one recorded layout's rows."""
    from rlkit.model.flops import Rows, update_flops

    rows = tally.rows[0]
    attention = update_flops(tally.dims, Rows(0, 0, rows.pairs))
    return tally.flops - attention, attention


_QV, _MLP = ["q_proj", "v_proj"], ["gate_proj", "up_proj"]


@pytest.mark.parametrize(
    "layout,fused,lora",
    [
        ("padded", True, None),
        ("shared", True, None),
        ("packed", True, None),
        ("padded", False, None),
        ("shared", False, None),
        ("padded", True, _QV),
        ("packed", True, _QV),
        ("padded", True, _MLP),
    ],
)
def test_counted_flops_match_the_ops_that_ran(tiny_model_dir, monkeypatch, layout, fused, lora):
    """perf/flops/actor's count of one micro-batch's update, per layout, against FlopCounterMode on the tiny
    model (eager attention): the linear maps within 3% and never above what ran; attention never above what
    ran and at least half of it (the count takes the causal pairs; eager attention computes the masked ones
    too)."""
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import LoraConfig, ModelConfig

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    torch.manual_seed(0)
    module = load_model(cfg, tokenizer=tok)
    batch = _grouped_batch(tok, module)
    module.set_attn_implementation("eager")  # matmuls FlopCounterMode counts (it has no rule for CPU SDPA)
    if lora:
        from rlkit.model.lora import apply_lora

        module, _ = apply_lora(module, LoraConfig(rank=4, alpha=8, target_modules=lora))
    tally, linear, attention = _counted(module, batch, layout, monkeypatch, fused=fused)
    assert list(tally.layouts) == [layout]
    counted_linear, counted_attention = _split(tally)
    assert counted_linear <= linear * 1.0001 and counted_linear >= 0.97 * linear, (counted_linear, linear)
    assert 0.5 * attention <= counted_attention <= attention * 1.0001, (counted_attention, attention)


def test_mfu_of_a_plain_update_stays_below_one(tiny_model_dir, monkeypatch):
    """The counted FLOPs of a timed forward + backward over this machine's peak for one thread (as the run
    states it: the table, or the best-of probe where the table's reported clock is below what the cores reach)
    <= 1."""
    import time

    from rlkit.hardware import matmul_flops
    from rlkit.model.flops import stated_peak
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    module = load_model(cfg, tokenizer=tok)
    batch = _grouped_batch(tok, module)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        probe = max(
            matmul_flops(torch.float32, size=1024, threads=1, budget_s=0.0, max_reps=3) for _ in range(3)
        )
        peak = stated_peak("cpu", "fp32", 1, probe=probe)
        start = time.perf_counter()
        tally, _, _ = _counted(module, batch, "padded", monkeypatch)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(previous)
    assert peak is not None and peak.flops >= probe
    assert 0 < tally.flops / seconds / peak.flops <= 1.0


def test_stated_peaks():
    """GPU peaks from the table by device name; CPU peaks from flags x clock; the probe only where it is
    larger."""
    from rlkit.model.flops import cpu_clock_hz, cpu_flops_per_cycle, gpu_peak

    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").flops == 989.4e12
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").flops == 756.5e12
    assert gpu_peak("NVIDIA H200", "fp32").flops == pytest.approx(66.9e12)
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32", tf32=True).flops == pytest.approx(156e12)
    assert gpu_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert cpu_flops_per_cycle("AuthenticAMD", {"avx2", "fma"}, "fp32")[0] == 32
    assert cpu_flops_per_cycle("AuthenticAMD", {"avx2", "fma", "avx512f"}, "fp32")[0] == 32  # Zen 4
    assert cpu_flops_per_cycle("GenuineIntel", {"avx2", "fma", "avx512f", "amx_bf16"}, "bf16")[0] == 1024
    assert cpu_flops_per_cycle("GenuineIntel", {"avx2", "fma", "avx512f"}, "fp32")[0] == 64
    assert cpu_flops_per_cycle("AuthenticAMD", {"avx2", "fma"}, "bf16")[0] == 32  # no native bf16: fp32 units
    _stated_cpu_peak_or_probe()
    text = "model name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\ncpu MHz\t\t: 2199.998\ncpu MHz\t\t: 3100.0\n"
    assert cpu_clock_hz(text) == 3.1e9 and cpu_clock_hz(text, "3900000") == 3.9e9


def _stated_cpu_peak_or_probe(tmp=None):
    import tempfile
    from pathlib import Path

    from rlkit.model.flops import stated_peak

    with tempfile.TemporaryDirectory() as d:
        info = Path(d) / "cpuinfo"
        info.write_text(
            "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 2500.000\n"
            "flags\t\t: fpu avx avx2 fma\n"
        )
        table = stated_peak("cpu", "fp32", 2, cpuinfo=info, probe=100e9)  # 2 x 32 x 2.5 GHz = 160 GFLOP/s
        assert table.flops == 160e9 and table.source.startswith("table: 2 cores x AVX2+FMA")
        probed = stated_peak("cpu", "fp32", 2, cpuinfo=info, probe=170e9)
        assert probed.flops == 170e9 and probed.source.startswith("probe: best of 3")


def test_actor_update_reports_its_executed_flops_and_the_driver_divides_by_the_stated_peak(
    tiny_model_dir, gloo_world1, monkeypatch
):
    """FSDPActor.update's perf/flops/actor (ppo_epochs x mini-batches x micro-batches, every layout) is at
    most what FlopCounterMode sees the update run (eager attention) and within 10% of it; perf/mfu/actor
    divides it by the update time and the peak of all ranks."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from torch.utils.flop_counter import FlopCounterMode

    from rlkit.model.flops import Peak
    from rlkit.runtime.build import Runtime

    sys.path.insert(0, str(Path(__file__).parent / "workers"))
    try:
        from test_actor import make_actor, prepared
    finally:
        sys.path.pop(0)
    actor = make_actor(tiny_model_dir, ppo_epochs=2, ppo_micro_batch_size_per_rank=3)
    actor.module.set_attn_implementation("eager")
    batch = prepared(actor)
    with FlopCounterMode(display=False) as counter:
        metrics = actor.update(batch)
    executed = metrics["perf/flops/actor"]
    assert 0.9 * counter.get_total_flops() <= executed <= counter.get_total_flops()
    rt = SimpleNamespace(peak=Peak(1e9, "table: test"), actor=SimpleNamespace(world_size=2))
    mfu = Runtime.perf_metrics(rt, batch, {"update_actor": 4.0}, metrics)
    assert mfu == {"perf/mfu/actor": pytest.approx(executed / 4.0 / 2e9)}
    assert (
        Runtime.perf_metrics(
            SimpleNamespace(peak=None, actor=rt.actor), batch, {"update_actor": 4.0}, metrics
        )
        == {}
    )


def test_the_gpu_peak_follows_the_device_name_and_precision(monkeypatch):
    """stated_peak on CUDA reads torch.cuda.get_device_name and the TF32 switch (no GPU here: both
    patched)."""
    from rlkit.model.flops import stated_peak

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert stated_peak("cuda", "bf16", 1).flops == pytest.approx(989.4e12)
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 allowed
        assert stated_peak("cuda:0", "fp32", 1).flops == pytest.approx(494.7e12)
        torch.set_float32_matmul_precision("highest")
        assert stated_peak("cuda", "fp32", 1).source.startswith("table: H100 fp32 dense 66.9")
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    assert stated_peak("cuda", "bf16", 1) is None  # unlisted: no perf/mfu/actor


# ----- the harness's bounds (benchmarks/common.py)
# -----------------------------------------------------------------
SMOLLM2 = {
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
}


def test_decode_bound_is_the_larger_of_bytes_and_flops_per_step_with_the_prefill(benchmark_module):
    """One AVX2 core (80 GFLOP/s, 16 GB/s), SmolLM2 fp32: 16 rows are compute-bound (the issue's ridge ≈ 10
    rows), 1 row bandwidth-bound; fp16 weights halve the bytes and move the ridge down; the bound is never
    below either term alone, and the prefill is part of it."""
    common = benchmark_module("common.py")
    shape = common.shape_from_config(SMOLLM2, 134_515_008)
    peak, bandwidth = 80e9, 16e9
    wide = common.decode_roofline(shape, 16, 44, 32, 4, bandwidth, peak, prompts=4)
    narrow = common.decode_roofline(shape, 1, 44, 32, 4, bandwidth, peak)
    assert wide["compute_bound_steps"] == wide["decode_steps"] == 31 and narrow["compute_bound_steps"] == 0
    half = common.decode_roofline(shape, 8, 44, 32, 2, bandwidth, peak, prompts=2)
    full = common.decode_roofline(shape, 8, 44, 32, 4, bandwidth, peak, prompts=2)
    # ridge: 5 rows fp16, 10 fp32
    assert half["compute_bound_steps"] == 31 and full["compute_bound_steps"] == 0
    bandwidth_only = common.decode_roofline(shape, 16, 44, 32, 4, bandwidth)
    step_flops = 2 * (shape.linear + shape.head) * 16
    assert wide["gen_bound_s"] >= bandwidth_only["gen_bound_s"]
    assert wide["gen_bound_s"] >= wide["prefill_bound_s"] + 31 * step_flops / peak > 31 * step_flops / peak
    # each distinct prompt through the layers
    assert wide["prefill_bound_s"] >= 2 * shape.linear * 4 * 44 / peak


def test_update_bound_counts_executed_flops_per_layout(benchmark_module):
    """The harness's executed FLOPs are rlkit.model.flops' count: a shared prompt pass runs fewer body
    positions than padded rows, 'best' picks the cheapest, and model FLOPs (6 · N · tokens) are a different
    number."""
    common = benchmark_module("common.py")
    shape = common.shape_from_config(SMOLLM2, 134_515_008)
    kw = {"prompts": 4, "completions": 16, "prompt_width": 44, "tokens": 32}
    padded, _ = common.executed_update_flops(shape, layout="padded", **kw)
    shared, _ = common.executed_update_flops(shape, layout="shared", **kw)
    best, chosen = common.executed_update_flops(shape, **kw)
    assert shared < padded and best == min(
        shared, padded, common.executed_update_flops(shape, layout="packed", **kw)[0]
    )
    assert chosen in ("shared", "packed") and best < common.update_flops(134_515_008, 16 * (44 + 32))
