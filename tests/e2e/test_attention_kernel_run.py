"""The compiled decode attention kernel through ``rlkit run``: a recipe decoding in fp32 on a CPU whose kernel
probe (read from the run's hardware cache, ``RLKIT_CACHE``, filled here as such a machine would have measured
it) found the kernel faster attends through it in the Ray worker's lean step
(``rlkit.rollout.attention_kernel``), trains on what it samples (a non-zero gradient) with rollout log-probs
that agree with the fp32 actor's to float rounding; on a CPU whose probe found it no faster the same recipe
attends with SDPA. Both runs' scripted layers call the compiled glue operators (norms, SiLU·up, rotary and
K/V writes: ``rlkit.rollout.scripted_step.fused_layer_loop``) and draw their tokens with the compiled
``rlkit::sample_rows``. Real parts throughout: the compiled kernels
(this machine's, copied into each run's cache), the Ray worker, the TorchScript loop, the update."""

from __future__ import annotations

import math
import shutil

import pytest
from rlkit_harness import two_graded_steps

from rlkit.rollout import attention_kernel as ak
from rlkit.rollout import cpu_kernels

pytestmark = pytest.mark.skipif(
    cpu_kernels.kernel_unavailable() is not None,
    reason=f"no compiled decode kernels here: {cpu_kernels.kernel_unavailable()}",
)


def hardware_cache(model, root, pays: bool):
    """A hardware cache at ``root`` holding this CPU's kernel probe for ``model`` 's heads as a machine where
    the kernel is (or is not) faster would have measured it, and this machine's compiled kernel."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    measured = ak.KernelAttentionProbe(sdpa_s=1.0, kernel_s=0.5 if pays else 0.95)
    ak.cached_kernel_probe(heads, kv_heads, dim, root / "hardware.json", probe=lambda *_: measured)
    library, _ = cpu_kernels.kernel_library()
    (root / "kernels").mkdir()
    shutil.copy(library, root / "kernels" / library.name)
    return root


def run_two_steps(model, data, out, cache):
    # 64 tokens: past the first ~20 steps of a group of 4 the rows' own positions outweigh the shared prompt
    # (rlkit.rollout.shared_prompt.worth_sharing), and those steps attend through the kernel
    # linears: torch, the lean step (auto may time the one-graph ONNX Runtime step faster for the tiny model)
    backend = {"name": "hf", "dtype": "float32", "linears": "torch"}
    overrides = {"rollout.backend": backend, "data.max_response_length": 64}
    return two_graded_steps(model, data, out, cache, overrides)


def test_a_run_attends_through_the_kernel_where_its_probe_says(tiny_assets, tmp_path):
    model, data = tiny_assets
    pays = hardware_cache(model, tmp_path / "pays", True)
    slower = hardware_cache(model, tmp_path / "slower", False)
    steps = run_two_steps(model, data, tmp_path / "out-kernel", pays)
    for step in steps:
        assert step["rollout/attention_kernel"] == 1.0
        assert step["rollout/scripted_layers"] == 1.0  # the TorchScript loop called the operator
        assert step["rollout/fused_glue"] == 1.0  # ... and the compiled glue operators (scripted_step)
        assert step["rollout/fused_sampling"] == 1.0  # ... and the compiled draw (rollout.sampling)
        assert math.isfinite(step["actor/pg_loss"])
        # fp32 rollout through the kernel against the fp32 actor's recompute: float rounding only
        assert step["training/rollout_probs_diff_valid"] == 1.0
        assert step["training/rollout_probs_diff_max"] < 1e-3
    # it trained on what it sampled: a step whose group's scores differ has a non-zero gradient
    graded = [s for s in steps if s["critic/score/min"] < s["critic/score/max"]]
    assert graded and all(s["actor/grad_norm"] > 0 for s in graded)
    for step in run_two_steps(model, data, tmp_path / "out-sdpa", slower):
        assert step["rollout/attention_kernel"] == 0.0
        assert step["rollout/lean_step"] == 1.0
        assert step["rollout/fused_glue"] == 1.0  # the glue operators load whatever the attention probe said
        assert step["rollout/fused_sampling"] == 1.0
    assert not list((tmp_path / "pays" / "kernels").glob(".*.tmp"))  # the copied kernel was used, not rebuilt
