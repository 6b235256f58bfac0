"""A bf16 KV cache through ``rlkit run``: a recipe that decodes with the bf16 copy (``rollout.backend.dtype:
bfloat16``) on prompts long enough that its steps attend over at least ``BF16_KV_MIN_POSITIONS`` positions on
average keeps its K/V in bf16 (``rlkit.rollout.bf16_kv``), trains on what it samples (a non-zero gradient) and
logs how far the rollout's log-probs are from the fp32 actor's; the same recipe keeps fp32 K/V on short
prompts, and on a CPU whose attention probe (read from the run's hardware cache, ``RLKIT_CACHE``, filled
here as such a machine would have measured it: SDPA's, and where the compiled kernel attends, the kernel's
over each cache) found bf16 K/V no faster. Real parts throughout: the Ray worker, the oneDNN-packed copy, the
TorchScript loop, the compiled kernels where they build here (copied into each run's cache; the draw from the
copy's bf16 logits among them), the update."""

from __future__ import annotations

import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rlkit_harness import two_graded_steps

from rlkit.rollout import attention_kernel, cpu_kernels
from rlkit.rollout.bf16_kv import BF16_KV_MIN_POSITIONS, KvAttentionProbe, cached_kv_attention_probe
from rlkit.rollout.bf16_weights import bf16_weights_unavailable

pytestmark = pytest.mark.skipif(bf16_weights_unavailable() is not None, reason="no oneDNN bf16 packing here")

NOTE = "Read this note first. " * 20  # ~300 tokens of the tiny model's tokenizer


def long_prompt_data(data, root):
    """``data``'s arithmetic parquet files with ``NOTE`` before every question."""
    root.mkdir()
    for name in ("train.parquet", "test.parquet"):
        rows = pq.read_table(data / name).to_pylist()
        for row in rows:
            row["prompt"] = [{**m, "content": NOTE + m["content"]} for m in row["prompt"]]
        pq.write_table(pa.Table.from_pylist(rows), root / name)
    return root


def attention_probe(model, cache, pays: bool) -> None:
    """The hardware cache ``cache`` holding this CPU's attention probes for ``model`` 's heads as a machine
    where bf16 K/V do (or do not) attend faster would have measured them, with SDPA and with the compiled
    kernel (found faster than SDPA, and copied in where it builds here)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    measured = KvAttentionProbe(fp32_s=1.0, bf16_s=0.5 if pays else 1.5)
    for kernel in (False, True):
        cached_kv_attention_probe(
            heads, kv_heads, dim, cache / "hardware.json", probe=lambda *_: measured, kernel=kernel
        )
    kernel_faster = attention_kernel.KernelAttentionProbe(sdpa_s=1.0, kernel_s=0.5)
    attention_kernel.cached_kernel_probe(
        heads, kv_heads, dim, cache / "hardware.json", probe=lambda *_: kernel_faster
    )
    if cpu_kernels.kernel_unavailable() is None:
        library, _ = cpu_kernels.kernel_library()
        (cache / "kernels").mkdir()
        shutil.copy(library, cache / "kernels" / library.name)


def run_two_steps(model, data, out, cache):
    overrides = {"rollout.backend": {"name": "hf", "dtype": "bfloat16"}, "data.max_prompt_length": 512}
    return two_graded_steps(model, data, out, cache, overrides)


def test_long_prompts_decode_over_a_bf16_kv_cache(tiny_assets, tmp_path):
    model, data = tiny_assets
    pays, slower = tmp_path / "pays", tmp_path / "slower"
    attention_probe(model, pays, True)
    attention_probe(model, slower, False)
    long = long_prompt_data(data, tmp_path / "long")
    for step in run_two_steps(model, long, tmp_path / "out-long", pays):
        assert step["rollout/bf16_kv_cache"] == 1.0
        assert step["rollout/scripted_layers"] == 1.0  # the TorchScript loop over bf16 slabs
        # the copy's head hands its bf16 logits to the compiled draw where the kernels build here
        assert step["rollout/fused_sampling"] == float(cpu_kernels.kernel_unavailable() is None)
        assert step["prompt_length/mean"] + 12 / 2 >= BF16_KV_MIN_POSITIONS
        assert step["actor/grad_norm"] > 0 and math.isfinite(step["actor/pg_loss"])
        assert step["critic/score/min"] < step["critic/score/max"]
        # the bf16 copy over bf16 K/V is not the fp32 actor: measured, small and non-zero
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert 0 < step["training/rollout_probs_diff_max"] < 0.1
    # the same long prompts on a CPU whose probe found bf16 attention no faster; short prompts where it did
    for steps in (
        run_two_steps(model, long, tmp_path / "out-long-slower", slower),
        run_two_steps(model, data, tmp_path / "out-short", pays),
    ):
        assert [s["rollout/bf16_kv_cache"] for s in steps] == [0.0, 0.0]
        assert all(s["rollout/lean_step"] == 1.0 for s in steps)
