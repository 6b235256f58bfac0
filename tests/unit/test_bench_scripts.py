"""Benchmark scripts run end to end on a tiny input, so that one whose rlkit API moved fails here rather than
in the hands of whoever next measures with it (``reward_timeout_overhead.py`` passed a keyword its reward
manager no longer took, unnoticed for several sessions). Nothing is timed or asserted about speed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch


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


def test_quickstart_record_writes_the_runs_steps_and_validation(benchmark_module, monkeypatch, tmp_path):
    """``quickstart_fresh.sh``'s results file: each step's timings and the greedy validation, read from the
    fresh clone's run folder, with the shell script's command (not this Python process's)."""
    import json

    script = benchmark_module("quickstart_record.py")
    run = tmp_path / "clone" / "outputs" / "rlkit" / "quickstart"
    run.mkdir(parents=True)
    val = "val-core/rlkit/arithmetic/score/mean@1"
    rows = [{"step": 0, val: 0.54}]
    rows += [
        {"step": s, "timing_s/step": 20.0 + s, "timing_s/gen": 7.0, "timing_s/update_actor": 13.0}
        for s in (1, 2)
    ]
    rows[-1][val] = 0.86
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "params.json").write_text("{}")
    log = tmp_path / "clone.log"
    log.write_text("noise\ndone: {'val': 0.86}\n")
    saved = {}

    def save(name, record, text, *, machine, command):
        saved.update(name=name, record=record, text=text, command=command)
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(script, "save_results", save)
    monkeypatch.setattr(script, "machine_record", lambda: {})
    argv = ["--clone", str(tmp_path / "clone"), "--log", str(log), "--rc", "0", "--seconds", "505.2"]
    argv += ["--started", "0", "--load-before", "0.5 0.6 0.7", "--load-after", "2 1 1", "--args", "/tmp/x"]
    monkeypatch.setattr(sys, "argv", ["quickstart_record.py", *argv])
    script.main()
    assert (
        saved["name"] == "quickstart-fresh"
        and saved["command"] == "bash benchmarks/quickstart_fresh.sh /tmp/x"
    )
    assert saved["record"]["validation"] == {0: 0.54, 2: 0.86}
    assert [s["timing_s/step"] for s in saved["record"]["steps"]] == [21.0, 22.0]
    assert saved["record"]["done"] == "done: {'val': 0.86}"
    assert "| s/step (`timing_s/step`) | 21.0, 22.0 |" in saved["text"] and "0.54 / 0.86" in saved["text"]


def test_ort_hybrid_spike_decodes_what_the_graph_step_decodes(benchmark_module, tiny_model_dir):
    """The spike's speed ratio is only a verdict on the hybrid step if it computes the graph's step: its
    logits follow ``OrtDecodeStep``'s to fp16-weight rounding (the tiny Qwen2 has q/k/v biases, so the fused
    q/k/v packing and its bias are checked), step after step over the cache both write."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.rollout.ort_step import OrtDecodeStep

    script = benchmark_module("ort_hybrid_spike.py")
    common = sys.modules["common"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the tiny model's biases start at zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
        graph, hybrid = OrtDecodeStep(model), script.HybridStep(model)
        graph.refresh(model)
        pa, pb = (common.prefilled_arithmetic(tok, model, 8, 4) for _ in range(2))
        la, lb, last = pa.logits, pb.logits, pa.positions[:, -1]
        for step in range(4):
            token, last = la.argmax(-1, keepdim=True), last + 1
            la = graph(pa.cache, token, last, pa.step_mask(step))
            lb = hybrid(pb.cache, token, last, pa.step_mask(step))
            torch.testing.assert_close(lb, la, rtol=0, atol=1e-3)  # fp16 weights: ~1.2e-4 here
            assert (lb - la).abs().max() > 0  # fp16 weights, not the fp32 graph itself


def test_the_harness_reads_the_decode_weights_rebuild_as_a_phase_inside_gen(benchmark_module):
    """``perf/decode_weights_s`` (the rollout's weight rebuild) reaches the harness's per-step phases beside
    ``gen``, and the report's phase table has a column for it."""
    script = benchmark_module("rlkit_grpo.py")
    metrics = {
        "perf/total_num_tokens": 100.0,
        "prompt_length/max": 44.0,
        "timing_s/gen": 5.0,
        "timing_s/update_actor": 9.0,
        "perf/worker_s/gen": 4.9,
        "perf/decode_weights_s": 0.8,
    }
    out = script.phases(metrics, wall=14.5)
    assert out["decode_weights"] == 0.8 and out["gen"] == 5.0 and out["worker_gen"] == 4.9
    assert "decode_weights" in benchmark_module("run.py").PHASES


def test_each_harness_dtype_trains_and_decodes_as_it_says(benchmark_module):
    """Every harness dtype maps to the actor precision and decode its description names: ``bf16auto`` trains
    under bf16 autocast in both toolkits and leaves rlkit's decode to ``auto`` (what a bf16 recipe that says
    nothing about the decode gets); the bounds count its TRL decode in bf16 and rlkit's as it recorded."""
    common, script, run = (benchmark_module(f) for f in ("common.py", "rlkit_grpo.py", "run.py"))
    # (bytes per weight, per KV element) of the decode the bound assumes: TRL's bf16auto row in bf16, rlkit's
    # as its run recorded (here fp32 weights: auto picked float32), bf16 as before
    assert run.decode_bytes("bf16auto", "trl", "") == (2, 2)
    assert run.decode_bytes("bf16auto", "rlkit", "float32") == (4, 4)
    assert run.decode_bytes("bf16auto", "rlkit", "bfloat16") == (2, 4)
    assert run.decode_bytes("bf16", "trl", "") == (2, 2) and run.decode_bytes("fp32auto", "trl", "") == (4, 4)
    assert run.decode_bytes("fp16w", "rlkit", "") == (2, 4)
    assert common.training_probe_dtype("bf16auto") == "bf16" == common.training_probe_dtype("bf16")
    expected = {  # dtype: (actor.mixed_precision, rollout.backend.dtype, rollout.backend.linears)
        "fp32": ("fp32", "float32", "torch"),
        "bf16": ("bf16", "bfloat16", "torch"),
        "fp16w": ("fp32", "float16", "torch"),
        "fp32mlas": ("fp32", "float32", "onnxruntime"),
        "fp32auto": ("fp32", "auto", "auto"),
        "bf16auto": ("bf16", "auto", "auto"),
    }
    assert set(expected) == set(common.HARNESS_DTYPES)
    for dtype, (precision, decode, linears) in expected.items():
        w = common.Workload(model="m", model_name="tiny", dtype=dtype, data="d.parquet")
        recipe = script.recipe_dict(w, "/tmp/out")
        backend = recipe["rollout"]["backend"]
        got = (recipe["actor"]["mixed_precision"], backend["dtype"], backend["linears"])
        assert got == (precision, decode, linears), dtype
    assert common.trains_in_bf16("bf16auto") and not common.trains_in_bf16("fp32auto")


def test_the_harness_refuses_a_dtype_it_does_not_know(benchmark_module):
    """An unknown ``--dtypes`` entry is a usage error naming the valid ones, not a silent fp32 run."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(Path(benchmark_module("run.py").__file__)), "--dtypes", "fp32,bf16autoo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown dtype(s) bf16autoo" in proc.stderr and "bf16auto" in proc.stderr


def test_the_compile_spikes_layer_halves_compute_the_lean_step(benchmark_module, tiny_model_dir):
    """``lean_compile_spike.py`` times its compiled variant against rlkit's lean step: run eager, its layer
    halves (``layered_call``) must give the lean step's own tokens and log-probs, or the spike compares a
    different computation (fp32 decode on the tiny model; no compile here)."""
    import torch

    import rlkit.rollout.decode as decode_module
    from rlkit.batch import Batch
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig, RolloutConfig
    from rlkit.rollout import hf
    from rlkit.rollout.lean_step import lean_step_for

    spike = benchmark_module("lean_compile_spike.py")
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    enc = tok(["2 + 2 =", "what is 17 + 6?"], return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    config = RolloutConfig(n=3, temperature=1.0, ignore_eos=True)
    ro = hf.HFRollout(
        module=model,
        tokenizer=tok,
        max_response_length=12,
        seed=1,
        rollout_config=config,
        params=HFRolloutParams(dtype="float32"),
    )

    def layered(module, scripted=False, fused_glue=False):  # the spike's halves stand in for the Python loop
        lean = lean_step_for(module)
        spike.compile_layers(lean, compile_fn=lambda fn: fn)
        return lambda *args: spike.layered_call(lean, *args)

    outs = []
    original = decode_module.lean_step_for
    try:
        for step_for in (original, layered):
            decode_module.lean_step_for = step_for
            ro.generator.manual_seed(1)
            outs.append(ro.generate(prompts))
    finally:
        decode_module.lean_step_for = original
    eager, halves = outs
    assert torch.equal(eager["responses"], halves["responses"])
    torch.testing.assert_close(eager["rollout_log_probs"], halves["rollout_log_probs"], atol=1e-5, rtol=1e-5)


def test_update_compile_dynamic_times_each_call_at_a_width_not_run_before(benchmark_module, tiny_model_dir):
    """``--dynamic`` is only a verdict on real runs (response lengths change every step) if every timed call
    runs a new token width, the same widths in both variants, and the sum over them is reported (a recompile
    on a new width shows there, not in the best call)."""
    script = benchmark_module("update_compile.py")
    got = script.child(str(tiny_model_dir), "fp32", 2, 20, False, 3, dynamic=True)
    fixed = script.child(str(tiny_model_dir), "fp32", 2, 20, False, 2)
    offsets = script.WIDTH_OFFSETS
    assert got["widths"] == [20 + offsets[0], 20 + offsets[1], 20 + offsets[2]]
    assert len(set(got["widths"] + [20])) == 4  # none repeats the first calls' width or another timed one
    assert len(got["steps_s"]) == 3 and got["sum_s"] == sum(got["steps_s"]) > 0
    assert fixed["widths"] == [20, 20]


def test_update_compile_keeps_a_failed_shape_as_its_error(benchmark_module):
    """A compile that fails on one shape is reported with its error line (not a hint printed after it), and a
    child that succeeds hands back its JSON."""
    script = benchmark_module("update_compile.py")
    stderr = "W warn\\nValueError: boom\\n\\nSet VERBOSE=1 for more\\n"
    failing = f"import sys; sys.stderr.write('{stderr}'); sys.exit(1)"
    assert script._run_child([sys.executable, "-c", failing], {}) == {"error": "ValueError: boom"}
    fine = "print('log line'); print('{\"best_s\": 1.5}')"
    assert script._run_child([sys.executable, "-c", fine], {}) == {"best_s": 1.5}


def test_decode_attention_variants_compute_the_steps_attention(benchmark_module):
    """``decode_attention.py`` compares formulations of the lean step's attention: each must compute what the
    step's ``enable_gqa`` SDPA computes (the grouped query heads map to the KV head the step's would), the
    bf16 cache within bf16 rounding, and the bound count the K and V bytes of every layer."""
    script = benchmark_module("decode_attention.py")
    got = script.measure(rows=3, length=11, reps=1, bandwidth=1e9, layers=2, evict_bytes=4096)
    assert set(got["ms"]) == set(script.VARIANTS) and all(ms > 0 for ms in got["ms"].values())
    diff = got["max_abs_diff"]
    assert diff["sdpa_gqa"] == 0 and diff["sdpa_grouped"] < 1e-5 and diff["matmul"] < 1e-5
    assert 1e-4 < diff["bf16_kv"] < 5e-2  # rounded to bf16, not another head's values
    assert got["bound_ms"] == 2 * 3 * script.KV_HEADS * 11 * script.DIM * 4 * 2 / 1e9 * 1e3


def test_decode_attention_kernel_computes_the_steps_attention(benchmark_module):
    """``decode_attention_kernel.py`` times rlkit's compiled kernel against the step's SDPA on the same
    caches: what it times must compute what SDPA computes, a masked position and a length that is not a
    multiple of the kernel's vector blocks included."""
    script = benchmark_module("decode_attention_kernel.py")
    why = script.unavailable()
    if why:
        pytest.skip(why)
    got = script.measure(rows=3, length=11, reps=1, layers=2, evict_bytes=4096)
    paths = ("sdpa", "kernel", "sdpa16", "kernel16")  # over fp32 K/V, and over the bf16 cache
    assert set(got["ms"]) == {f"{p}_{t}" for p in paths for t in ("cold", "hot")}
    assert all(ms > 0 for ms in got["ms"].values())
    assert got["max_abs_diff"] < 1e-5
    assert got["max_abs_diff_bf16"] < 2e-2  # the same bf16 K/V; bf16 SDPA rounds the query to bf16


def test_sampling_kernel_times_both_draws_of_the_same_logits(benchmark_module):
    """``sampling_kernel.py`` times torch's draw and the compiled one, cold and hot, over the same logits and
    uniforms, and counts the draws where their tokens differ (none at a small vocabulary's spacing)."""
    from rlkit.rollout.cpu_kernels import kernel_unavailable

    if kernel_unavailable() is not None:
        pytest.skip(kernel_unavailable())
    script = benchmark_module("sampling_kernel.py")
    for dtype in (torch.float32, torch.bfloat16):
        got = script.measure(rows=3, dtype=dtype, reps=4, vocab=300, evict_bytes=4096)
        assert set(got["ms"]) == {f"{p}_{t}" for p in ("torch", "kernel") for t in ("cold", "hot")}
        assert all(ms > 0 for ms in got["ms"].values())
        assert got["draws"] == 12 and got["differ"] == 0


def test_ab_compile_compiles_each_layers_mlp_and_norms_and_keeps_the_numbers(
    benchmark_module, tiny_model_dir
):
    """``ab.py --change compile``'s B must run the compiled parts (not silently eager: a renamed submodule
    would leave nothing compiled) and compute what eager computes, forward and backward."""
    import torch
    import torch._dynamo
    from transformers import AutoModelForCausalLM

    script = benchmark_module("ab.py")
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    compiled = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    torch._dynamo.reset()
    script.compile_mlp_and_norms(compiled)
    ids = torch.randint(0, eager.config.vocab_size, (2, 9))
    losses = []
    for model in (eager, compiled):
        loss = model(input_ids=ids).logits.float().pow(2).mean()
        loss.backward()
        losses.append(loss)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    assert frames >= 2  # the MLP's and the RMSNorm's forward, at least
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prompt_attention_times_every_path_it_names(benchmark_module):
    """``shared_prompt_attention.py`` times rlkit's attentions (SDPA, the shared path, the bf16 cache's two
    SDPA calls and grouped SDPA): each must run at its shape and compute SDPA's output, fp32 to float
    rounding, bf16 K/V to bf16's (the paths themselves: tests/unit/rollout/test_bf16_kv.py)."""
    script = benchmark_module("shared_prompt_attention.py")
    row = script.measure(2, 3, 9, 4, reps=1)
    assert row["saved"] == (6 - 2) * 9 / (6 * 13)
    assert row["max_abs_diff"] < 1e-5 and row["two_sdpa_max_abs_diff"] < 1e-5
    assert 1e-4 < row["two_sdpa_bf16_max_abs_diff"] < 5e-2
    assert all(
        row[k] > 0 for k in ("sdpa_us", "shared_us", "two_sdpa_us", "two_sdpa_bf16_us", "sdpa_bf16_us")
    )


def test_bf16_kv_drift_measures_both_caches_against_the_fp32_model(benchmark_module, tiny_model_dir):
    """``bf16_kv_drift.py`` samples with the bf16 copy over fp32 and over bf16 K/V and compares each
    rollout's log-probs with the fp32 model's on its tokens: both measured, non-zero (the copy's bf16 weights)
    and small."""
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.bf16_weights import bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    script = benchmark_module("bf16_kv_drift.py")
    cfg = ModelConfig(path=str(tiny_model_dir))
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).float().eval()
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False) for q in ("1+1?", "2+5?")
    ]
    row = script.drift(model, tok, texts, samples=2, tokens=6)
    assert row["tokens"] == 6 and row["prompt_width"] > 0
    for kv in ("fp32_kv", "bf16_kv"):
        assert 0 < row[kv]["logp_mean"] <= row[kv]["logp_max"] < 0.5
        assert 0 < row[kv]["prob_mean"] <= row[kv]["prob_max"]


def test_ab_toggles_each_decode_plan_change_it_names(benchmark_module):
    """``ab.py --change X``: A turns X's DecodePlan switch off, B is the default (on); every other switch
    stays at its default in both."""
    from dataclasses import asdict

    from rlkit.rollout.decode import DecodePlan

    script = benchmark_module("ab.py")
    default = asdict(DecodePlan())
    for change, field in [
        ("glue", "fused_glue"),
        ("sampling", "fused_sampling"),
        ("scripted", "scripted_layers"),
        ("lean", "lean_step"),
        ("prefill", "share_prefill"),
        ("sharedattn", "share_prompt_attention"),
    ]:
        a, b = (asdict(script.plans(change, on)[1]) for on in (False, True))
        assert b == default, change
        assert a == default | {field: False}, change


def test_bf16_repack_stages_the_weights_rlkit_packs(benchmark_module, tiny_model_dir):
    """``bf16_repack.py``'s B packs the same bf16 weights as rlkit's own packing (the copies' logits
    bit-identical, a fused group's rows in its members' order) and drops its staging buffer after a
    refresh."""
    from rlkit.model.load import load_model
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    script = benchmark_module("bf16_repack.py")
    model = load_model(ModelConfig(path=str(tiny_model_dir))).eval()
    rlkits = Bf16DecodeCopy(model)
    with script.staged_packing():
        staged = Bf16DecodeCopy(model)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)  # moved weights: both copies repack
        staged.refresh(model)
    assert not script._STAGING
    rlkits.refresh(model)
    ids = torch.tensor([[3, 17, 29, 5, 11]])
    with torch.no_grad():
        assert torch.equal(rlkits.module(input_ids=ids).logits, staged.module(input_ids=ids).logits)


@pytest.mark.parametrize("shape", [(40, 24), (35, 600)], ids=["one-block", "two-row-blocks-padded-columns"])
def test_fp16_fastpack_builds_fbgemms_own_layout(benchmark_module, tmp_path, shape):
    """``fp16_fastpack.py``'s verdict stands only if its packing is fbgemm's: the buffer it builds, multiplied
    by fbgemm's own kernel, gives torch's ``linear_dynamic_fp16`` outputs bit for bit — one block row, and two
    (K = 600: a 512-row block and an 88-row one) with N padded to a whole column block."""
    import shutil

    from rlkit.hardware import cpu_flags, fp16_weights_unavailable

    if fp16_weights_unavailable() or shutil.which("g++") is None:
        pytest.skip(fp16_weights_unavailable() or "no g++ to compile the spike's operator")
    script = benchmark_module("fp16_fastpack.py")
    script.build_operator(tmp_path)
    bcol = script.column_block(set(cpu_flags()))
    n, k = shape
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    packed = script.fast_pack(weight, bcol)
    for rows in (1, 8, 17):
        x = torch.randn(rows, k)
        want = torch.ops.quantized.linear_dynamic_fp16(
            x, torch.ops.quantized.linear_prepack_fp16(weight, None)
        )
        assert torch.equal(torch.ops.rlkit_fp16_spike.fp16_gemm(x, packed, k, n, bcol), want)
