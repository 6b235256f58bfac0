"""A bf16 KV cache for the bf16 decode copy (rlkit.rollout.bf16_kv): its two attentions against a plain loop
and rlkit's fp32 ones, the decode over it — both lean loops the same bit for bit, rows compacted and a group's
prompt read once in bf16, log-probs near the copy's forward — the rule that picks it and this CPU's probe
that gates it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_decode import CASES, ending_tokens, generate
from test_lean_step import _models, other_archs  # noqa: F401  (the fixture)

from rlkit.rollout import decode as decode_module
from rlkit.rollout import lean_step
from rlkit.rollout.bf16_kv import (
    BF16_KV_MAX_RATIO,
    BF16_KV_MIN_POSITIONS,
    KvAttentionProbe,
    cached_kv_attention_probe,
    kv_attention,
    probe_kv_attention,
    shared_prompt_sdpa,
)
from rlkit.rollout.cpu_kernels import kernel_unavailable
from rlkit.rollout.shared_prompt import shared_prompt_attention


def plain_attention(q, keys, values, bias, scale) -> torch.Tensor:
    """Attention row by row and head by head in fp64: ``q [A, H, 1, D]``, ``keys``/``values [A, Hkv, L, D]``,
    additive ``bias [A, L]``; query head ``h`` reads KV head ``h // (H / Hkv)``."""
    a, heads, _, d = q.shape
    per = heads // keys.shape[1]
    out = torch.zeros(a, heads, 1, d, dtype=torch.float64)
    for r in range(a):
        for h in range(heads):
            k, v = keys[r, h // per].double(), values[r, h // per].double()
            scores = k @ q[r, h, 0].double() * scale + bias[r].double()
            out[r, h, 0] = torch.softmax(scores, dim=0) @ v
    return out


def grouped_inputs(g=2, n=3, p=7, t=4, kv=2, heads=6, d=8):
    """Two prompts' rows (the second left-padded) over a cache holding each prompt's K/V in every row."""
    torch.manual_seed(0)
    a = g * n
    prompt_k, prompt_v = torch.randn(g, kv, p, d), torch.randn(g, kv, p, d)
    keys = torch.cat([prompt_k.repeat_interleave(n, 0), torch.randn(a, kv, t, d)], dim=2)
    values = torch.cat([prompt_v.repeat_interleave(n, 0), torch.randn(a, kv, t, d)], dim=2)
    q = torch.randn(a, heads, 1, d)
    bias = torch.zeros(a, p + t)
    bias[n:, :2] = float("-inf")
    return q, keys, values, prompt_k, prompt_v, bias, n, p


def rounded(*tensors):
    return [x.bfloat16().float() for x in tensors]


def test_kv_attention_is_sdpa_over_grouped_query_heads():
    q, keys, values, _, _, bias, _, _ = grouped_inputs()
    attend = (bias == 0)[:, None, None, :]
    want = plain_attention(q, keys, values, bias, 0.3)
    torch.testing.assert_close(kv_attention(q, keys, values, attend, 0.3).double(), want)  # fp32 K/V
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, keys, values, attn_mask=attend, scale=0.3, enable_gqa=True),
        kv_attention(q, keys, values, attend, 0.3),
    )
    out = kv_attention(q, keys.bfloat16(), values.bfloat16(), attend, 0.3)
    assert out.dtype == torch.float32 and out.shape == q.shape
    # bf16 in: the same attention of the rounded operands, its output rounded to bf16 (2**-8 relative)
    torch.testing.assert_close(out.double(), plain_attention(*rounded(q, keys, values), bias, 0.3), **BF16)


BF16 = {"atol": 1e-2, "rtol": 1e-2}


def test_shared_prompt_sdpa_is_the_shared_prompt_attention():
    """Two SDPA calls merged by their log-sum-exps compute rlkit's shared-prompt attention: in fp32 to float
    rounding, over bf16 K/V as the plain loop over the rounded operands does; padding and a group's rows
    mapped as rlkit maps them."""
    q, keys, values, prompt_k, prompt_v, bias, n, p = grouped_inputs()
    biases = (bias[::n, None, None, :p], bias[:, None, None, p:], 0.3)
    want = shared_prompt_attention(q, keys, values, prompt_k, prompt_v, *biases)
    torch.testing.assert_close(want, plain_attention(q, keys, values, bias, 0.3).float())  # fp32's rounding
    torch.testing.assert_close(shared_prompt_sdpa(q, keys, values, prompt_k, prompt_v, *biases), want)
    low = [x.bfloat16() for x in (keys, values, prompt_k, prompt_v)]
    out = shared_prompt_sdpa(q, *low, *biases)
    assert out.dtype == torch.float32 and out.shape == q.shape
    reference = plain_attention(*rounded(q, keys, values), bias, 0.3)
    torch.testing.assert_close(out.double(), reference, **BF16)
    assert float((out - want).abs().max()) > 1e-4  # it did attend in bf16


def _bf16_copy(request, arch: str):
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    tok, model = _models(request, arch)
    return tok, model, Bf16DecodeCopy(model).module


@pytest.fixture
def slab_dtypes(monkeypatch) -> list[torch.dtype]:
    """The dtype of every slab buffer the decode allocates (a wrapper on the real ``SlabLayer``)."""
    seen: list[torch.dtype] = []
    real = decode_module.SlabLayer.lazy_initialization

    def recording(self, key_states, value_states):
        real(self, key_states, value_states)
        seen.append(self.key_slab.dtype)

    monkeypatch.setattr(decode_module.SlabLayer, "lazy_initialization", recording)
    return seen


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_both_lean_loops_decode_the_same_over_bf16_kv(request, arch, slab_dtypes, monkeypatch):
    """3 prompts × 4 rows ending at different steps over a bf16 cache: the TorchScript loop (with torch's
    operators between its GEMMs, as the Python loop) and the Python loop decode the same tokens and log-probs
    bit for bit, a group's prompt read once (in bf16) on both, the steps past it through the same attention
    (the compiled kernel over bf16 K/V where it loads, else bf16 SDPA)."""
    tok, _, packed = _bf16_copy(request, arch)
    shared_calls: list[int] = []
    real = lean_step.shared_prompt_sdpa
    monkeypatch.setattr(lean_step, "shared_prompt_sdpa", lambda *a: shared_calls.append(1) or real(*a))
    kw = {"n": 4, **CASES["sampled"]}
    eos = ending_tokens(tok, packed, **kw)
    (scripted, _), (loop, _) = (
        generate(
            tok,
            packed,
            fast=True,
            lean=True,
            scripted=on,
            fused_glue=False,
            bf16_kv_from=0,
            bf16_kv_probe=False,
            eos=eos,
            **kw,
        )
        for on in (True, False)
    )
    assert torch.equal(scripted["responses"], loop["responses"])
    assert torch.equal(scripted["rollout_log_probs"], loop["rollout_log_probs"])
    lengths = loop["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended apart: the bf16 slabs were compacted
    assert shared_calls  # the Python loop read the prompts once, over bf16 K/V
    assert set(slab_dtypes) == {torch.bfloat16}
    for out in (scripted, loop):
        assert out.meta["metrics"]["rollout/bf16_kv_cache"] == 1.0
    assert scripted.meta["metrics"]["rollout/scripted_layers"] == 1.0


def recomputed_log_probs(model, out) -> torch.Tensor:
    """Log-probs of the sampled tokens (temperature 1) from one plain forward of ``model`` over prompt +
    response: fp32 K/V, no cache."""
    ids, mask, pos = (out[k] for k in ("input_ids", "attention_mask", "position_ids"))
    width = out["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, -width - 1 : -1], -1).gather(-1, ids[:, -width:, None]).squeeze(-1)
    return lp * out["response_mask"]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_bf16_kv_log_probs_stay_near_the_copys_forward(request, arch, slab_dtypes):
    """The bf16 cache's rollout log-probs, against the bf16 copy's own forward over the same tokens (fp32
    K/V): moved by the K/V rounding (more than the fp32 cache's are) and by little (on these tiny random
    models, whose activations are larger than a trained model's: mean 0.015, max 0.07)."""
    tok, _, packed = _bf16_copy(request, arch)
    moved = {}
    for start in (0, None):
        out, _ = generate(
            tok, packed, fast=True, lean=True, bf16_kv_from=start, bf16_kv_probe=False, n=4, temperature=1.0
        )
        assert out.meta["metrics"]["rollout/bf16_kv_cache"] == float(start == 0)
        moved[start] = (out["rollout_log_probs"] - recomputed_log_probs(packed, out)).abs()
    layers = len(packed.model.layers)
    assert slab_dtypes == [torch.bfloat16] * layers + [torch.float32] * layers
    assert moved[None].mean() < moved[0].mean() < 0.05
    assert float(moved[0].max()) < 0.2


@pytest.fixture
def attention_probe(tmp_path, monkeypatch):
    """``probe(pays, heads, kv_heads, dim, kernel_pays=pays)``: this CPU's cached attention probes for the
    tiny models' heads, as a machine where bf16 K/V do (or do not) pay under SDPA (``pays``) and under the
    compiled kernel (``kernel_pays``) would have measured them (a hardware cache of this test's own:
    ``RLKIT_CACHE``)."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))

    def probe(pays: bool, heads: int, kv_heads: int, dim: int, kernel_pays: bool | None = None) -> None:
        for kernel, bf16_pays in ((False, pays), (True, pays if kernel_pays is None else kernel_pays)):
            measured = KvAttentionProbe(fp32_s=1.0, bf16_s=0.5 if bf16_pays else 1.5)
            cached_kv_attention_probe(heads, kv_heads, dim, probe=lambda *_, m=measured: m, kernel=kernel)

    return probe


@pytest.mark.parametrize("pays", [True, False])
def test_the_rule_takes_bf16_kv_for_long_decodes_of_the_bf16_copy_where_the_probe_says(
    request, slab_dtypes, attention_probe, pays
):
    """Default plan: fp32 K/V for a short decode; bf16 once prompt width + max_new_tokens / 2 reaches
    ``BF16_KV_MIN_POSITIONS``, where this CPU's attention probe found bf16 K/V faster; never for fp32 or fp16
    weights (their linears read fp32 activations) or the model's own forward."""
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    tok, model, packed = _bf16_copy(request, "qwen2")
    step = lean_step.lean_step_for(packed)
    attention_probe(pays, step.heads, step.kv_heads, step.dim)
    short, _ = generate(tok, packed, fast=True, lean=True, n=2, do_sample=False)
    long, _ = generate(
        tok, packed, fast=True, lean=True, n=2, do_sample=False, max_new_tokens=2 * BF16_KV_MIN_POSITIONS
    )
    assert short.meta["metrics"]["rollout/bf16_kv_cache"] == 0.0
    assert long.meta["metrics"]["rollout/bf16_kv_cache"] == float(pays)
    for other in (model, Fp16DecodeCopy(model).module):
        out, _ = generate(tok, other, fast=True, lean=True, n=2, do_sample=False, bf16_kv_from=0)
        assert out.meta["metrics"]["rollout/lean_step"] == 1.0
        assert out.meta["metrics"]["rollout/bf16_kv_cache"] == 0.0
    off, _ = generate(tok, packed, fast=True, lean=False, n=2, do_sample=False, bf16_kv_from=0)
    assert off.meta["metrics"]["rollout/bf16_kv_cache"] == 0.0  # the model's forward reads fp32 K/V
    assert slab_dtypes.count(torch.bfloat16) == (len(packed.model.layers) if pays else 0)  # the long decode's


@pytest.mark.skipif(
    kernel_unavailable() is not None, reason=f"no decode kernels here: {kernel_unavailable()}"
)
@pytest.mark.parametrize("kernel", [True, False])
def test_the_rule_asks_the_probe_of_the_attention_that_reads_the_cache(
    request, slab_dtypes, attention_probe, kernel
):
    """A long decode of the bf16 copy on a CPU where bf16 K/V pay under the compiled kernel but not under
    SDPA: bf16 K/V (read by the kernel) where the kernel attends, fp32 K/V where it is turned off."""
    tok, _, packed = _bf16_copy(request, "qwen2")
    step = lean_step.lean_step_for(packed)
    attention_probe(False, step.heads, step.kv_heads, step.dim, kernel_pays=True)
    kw = {"max_new_tokens": 2 * BF16_KV_MIN_POSITIONS, "attention_kernel_probe": False}
    long, _ = generate(tok, packed, fast=True, lean=True, n=1, do_sample=False, attention_kernel=kernel, **kw)
    assert long.meta["metrics"]["rollout/attention_kernel"] == float(kernel)
    assert long.meta["metrics"]["rollout/bf16_kv_cache"] == float(kernel)


def test_the_attention_probe_times_both_caches_once_per_machine(tmp_path):
    """The real probe: both attentions timed; cached, so a second read measures nothing and decides alike."""
    measured: list[KvAttentionProbe] = []

    def probe(*heads):
        measured.append(probe_kv_attention(*heads))
        return measured[-1]

    cache = tmp_path / "hardware.json"
    first = cached_kv_attention_probe(9, 3, 64, cache, probe=probe)
    again = cached_kv_attention_probe(9, 3, 64, cache, probe=probe)
    assert len(measured) == 1 and again == first == measured[0]
    assert first.fp32_s > 0 and first.bf16_s > 0
    assert first.pays == (first.bf16_s <= BF16_KV_MAX_RATIO * first.fp32_s)
    assert "bf16-kv-attention-cold-9-3-64" in cache.read_text()


@pytest.mark.skipif(
    kernel_unavailable() is not None, reason=f"no decode kernels here: {kernel_unavailable()}"
)
def test_the_kernels_probe_times_it_over_both_caches_under_its_own_key(tmp_path, monkeypatch):
    """``kernel=True``: the compiled kernel over fp32 and over bf16 K/V, cached beside (not instead of) the
    SDPA probe."""
    from rlkit.rollout import attention_kernel

    read: list[torch.dtype] = []
    real = attention_kernel.decode_attention
    monkeypatch.setattr(
        attention_kernel, "decode_attention", lambda q, k, *a: read.append(k.dtype) or real(q, k, *a)
    )
    cache = tmp_path / "hardware.json"
    sdpa = cached_kv_attention_probe(4, 2, 16, cache)
    kernel = cached_kv_attention_probe(4, 2, 16, cache, kernel=True)
    assert kernel.fp32_s > 0 and kernel.bf16_s > 0 and kernel != sdpa
    assert set(read) == {torch.float32, torch.bfloat16}  # the kernel read both caches
    text = cache.read_text()
    assert "bf16-kv-attention-cold-4-2-16" in text and "bf16-kv-attention-kernel-4-2-16" in text


def test_the_kernels_probe_says_why_it_cannot_run(monkeypatch):
    from rlkit.rollout import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "kernel_unavailable", lambda: "no g++ on PATH to compile them")
    with pytest.raises(RuntimeError, match="cannot probe the kernel over bf16 K/V: no g"):
        probe_kv_attention(4, 2, 16, kernel=True)
