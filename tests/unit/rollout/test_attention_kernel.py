"""The compiled decode attention kernel (rlkit.rollout.attention_kernel): the operator against a plain loop
and SDPA (its AVX2 build and how it is compiled: test_cpu_kernels.py), the slab's transposed keys, the decode
through it — both lean loops the same bit for bit, rows compacted, against the SDPA decode to float
rounding — and the rule and probe that pick it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_bf16_kv import plain_attention
from test_decode import CASES, ending_tokens, generate
from test_lean_step import _models, other_archs  # noqa: F401  (the fixture)

from rlkit.rollout import attention_kernel as ak
from rlkit.rollout import cpu_kernels as ck
from rlkit.rollout import lean_step
from rlkit.rollout.decode import SlabLayer

needs_kernel = pytest.mark.skipif(
    ck.kernel_unavailable() is not None, reason=f"no decode kernels here: {ck.kernel_unavailable()}"
)

SHAPES = [  # rows, query heads, KV heads, head size, filled positions
    (3, 9, 3, 64, 11),  # SmolLM2's heads, a length short of one vector block
    (2, 4, 2, 16, 5),  # the tiny test models'
    (4, 8, 1, 128, 40),  # 8 query heads on one KV head
    (5, 12, 4, 32, 33),
    (1, 2, 2, 64, 70),  # one query head per KV head
]


def kernel_inputs(rows, heads, kv_heads, dim, length, seed=0):
    """Queries as a view of a wider projection (the step's), a slab twice the length with its keys also
    transposed, and a mask with a left-padded row."""
    torch.manual_seed(seed)
    capacity = 2 * length + 3
    projected = torch.randn(rows, heads + kv_heads, dim)
    q = projected[:, :heads, None]  # [A, H, 1, D], not contiguous
    keys, values = torch.randn(rows, kv_heads, capacity, dim), torch.randn(rows, kv_heads, capacity, dim)
    keys_t = torch.full((rows, kv_heads, dim, ak.padded_capacity(capacity)), float("nan"))
    keys_t[..., :length] = keys[:, :, :length].transpose(-1, -2)  # NaN past the filled positions
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[0, : min(3, length - 1)] = False
    return q, keys, keys_t, values, mask


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_is_attention_over_grouped_query_heads(shape):
    """Against a float64 loop row by row and head by head and against the step's SDPA: to float rounding,
    padding masked, nothing read past the filled positions (NaN there), query head h on KV head
    h / (H / Hkv)."""
    rows, heads, kv_heads, dim, length = shape
    q, keys, keys_t, values, mask = kernel_inputs(*shape)
    scale = dim**-0.5
    got = ak.decode_attention(q, keys_t, values, mask[:, None, None, :], length, scale)
    assert got.shape == (rows, heads, 1, dim) and got.dtype == torch.float32
    bias = torch.zeros(rows, length).masked_fill_(~mask, float("-inf"))
    k, v = keys[:, :, :length], values[:, :, :length]
    torch.testing.assert_close(got.double(), plain_attention(q, k, v, bias, scale), atol=2e-6, rtol=1e-5)
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True
    )
    torch.testing.assert_close(got, sdpa, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_over_bf16_kv_the_kernel_is_attention_over_the_bf16_values(shape):
    """bf16 keys and values (the bf16 KV cache's slabs, NaN past the filled positions): the float64 loop
    over the same bf16 values, widened — the kernel's arithmetic stays fp32."""
    rows, heads, kv_heads, dim, length = shape
    q, keys, keys_t, values, mask = kernel_inputs(*shape)
    keys16, keys16_t, values16 = keys.bfloat16(), keys_t.bfloat16(), values.bfloat16()
    scale = dim**-0.5
    got = ak.decode_attention(q, keys16_t, values16, mask[:, None, None, :], length, scale)
    assert got.dtype == torch.float32
    bias = torch.zeros(rows, length).masked_fill_(~mask, float("-inf"))
    k, v = keys16[:, :, :length].float(), values16[:, :, :length].float()
    torch.testing.assert_close(got.double(), plain_attention(q, k, v, bias, scale), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        ak.decode_attention(q, keys16_t, values, mask[:, None, None, :], length, scale)


def vector_width() -> int:
    """The positions per vector of this process's library (its RLKIT_VEC: 16 with AVX-512, 8 with AVX2)."""
    from rlkit.hardware import cpu_flags

    return ck.build_flags(cpu_flags())[1]


def check_blocked_keys(shape, dtype: torch.dtype, width: int) -> None:
    """Given the untransposed key slab, the kernel reads the transposed keys only for the whole blocks of
    ``width`` positions below the length (NaN in them after that) and the rest from the slab: the same
    attention as over the whole transposed keys."""
    rows, heads, kv_heads, dim, length = shape
    q, keys, keys_t, values, mask = kernel_inputs(*shape)
    keys, keys_t, values = keys.to(dtype), keys_t.to(dtype), values.to(dtype)
    attend, scale = mask[:, None, None, :], dim**-0.5
    whole = ak.decode_attention(q, keys_t, values, attend, length, scale)
    check_bf16_out(q, keys_t, values, attend, length, scale, None)
    keys_t[..., length // width * width :] = float("nan")
    got = torch.ops.rlkit.decode_attention(q, keys_t, values, attend, length, scale, keys)
    torch.testing.assert_close(got, whole, atol=2e-6, rtol=1e-5)
    check_bf16_out(q, keys_t, values, attend, length, scale, keys)


def check_bf16_out(q, keys_t, values, attend, length: int, scale: float, keys) -> None:
    """``bf16_out``: the kernel's fp32 output rounded to bf16 by the kernel, bit for bit as torch's cast
    rounds it (the packed output projection's input in ``scripted_step.fused_layer_loop``)."""
    fp32 = torch.ops.rlkit.decode_attention(q, keys_t, values, attend, length, scale, keys)
    rounded = torch.ops.rlkit.decode_attention(q, keys_t, values, attend, length, scale, keys, True)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == fp32.shape
    assert torch.equal(rounded.view(torch.int16), fp32.bfloat16().view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_given_the_key_slab_the_kernel_reads_the_last_positions_from_it(shape, dtype):
    check_blocked_keys(shape, dtype, vector_width())
    q, keys, keys_t, values, mask = kernel_inputs(*shape)
    with pytest.raises(RuntimeError, match=r"keys \[A, Hkv, C, D\] in keys_t's dtype"):
        torch.ops.rlkit.decode_attention(
            q, keys_t, values, mask[:, None, None], shape[-1], 0.1, keys.bfloat16()
        )


@needs_kernel
def test_the_kernel_refuses_what_it_was_not_built_for():
    q, _, keys_t, values, mask = kernel_inputs(2, 9, 3, 64, 20)
    with pytest.raises(RuntimeError, match="room for the length"):  # shorter than the length, any width
        ak.decode_attention(q, keys_t[..., :19], values, mask[:, None, None], 20, 0.1)
    q, _, keys_t, values, mask = kernel_inputs(2, 20, 2, 64, 20)  # 10 query heads per KV head
    with pytest.raises(RuntimeError, match="no kernel for 10 query heads"):
        ak.decode_attention(q, keys_t, values, mask[:, None, None], 20, 0.1)


def test_the_slab_keeps_its_keys_transposed_through_steps_and_compaction():
    layer = SlabLayer(capacity=9, transposed_keys=True)
    torch.manual_seed(0)
    layer.update(torch.randn(4, 2, 5, 8), torch.randn(4, 2, 5, 8))  # a prefill of 5 positions
    layer.update(torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8))  # a step
    assert layer.key_slab_t.shape == (4, 2, 8, ak.padded_capacity(9))
    torch.testing.assert_close(layer.key_slab_t[..., :6], layer.keys.transpose(-1, -2), rtol=0, atol=0)
    layer.batch_select_indices(torch.tensor([3, 1]))
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    torch.testing.assert_close(layer.key_slab_t[..., :7], layer.keys.transpose(-1, -2), rtol=0, atol=0)
    assert SlabLayer(capacity=9).key_slab_t is None


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """One entry per Python-loop call of the kernel (a wrapper on the real one)."""
    calls: list[int] = []
    real = lean_step.decode_attention
    monkeypatch.setattr(lean_step, "decode_attention", lambda *a: calls.append(1) or real(*a))
    return calls


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_both_lean_loops_decode_the_same_with_the_kernel_and_sdpa_agrees(request, arch, kernel_calls):
    """3 prompts × 4 rows ending at different steps: the TorchScript and Python loops decode the same tokens
    and log-probs bit for bit through the kernel (the slabs compacted as rows end); the SDPA decode samples
    the same tokens, its log-probs equal to float rounding."""
    tok, model = _models(request, arch)
    kw = {"n": 4, **CASES["sampled"]}
    eos = ending_tokens(tok, model, **kw)
    common = {"fast": True, "lean": True, "eos": eos, "attention_kernel_probe": False, **kw}
    common["fused_glue"] = False  # the same torch operators in both loops (test_cpu_kernels.py: fused)
    (scripted, _), (loop, _), (sdpa, _) = (
        generate(tok, model, scripted=scripted, attention_kernel=kernel, **common)
        for scripted, kernel in ((True, True), (False, True), (True, False))
    )
    assert torch.equal(scripted["responses"], loop["responses"])
    assert torch.equal(scripted["rollout_log_probs"], loop["rollout_log_probs"])
    lengths = loop["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended apart: the slabs, transposed keys too, compacted
    assert kernel_calls  # the Python loop attended through the kernel
    for out, ran in ((scripted, 1.0), (loop, 1.0), (sdpa, 0.0)):
        assert out.meta["metrics"]["rollout/attention_kernel"] == ran
    assert scripted.meta["metrics"]["rollout/scripted_layers"] == 1.0
    assert torch.equal(scripted["responses"], sdpa["responses"])
    torch.testing.assert_close(scripted["rollout_log_probs"], sdpa["rollout_log_probs"], atol=1e-5, rtol=1e-5)


@pytest.fixture
def kernel_probe(tmp_path, monkeypatch):
    """``probe(pays)``: this CPU's cached kernel probe for the tiny models' heads, as a machine where the
    kernel is (or is not) faster would have measured it (a hardware cache of this test's own)."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))

    def probe(pays: bool, heads: int, kv_heads: int, dim: int) -> None:
        measured = ak.KernelAttentionProbe(sdpa_s=1.0, kernel_s=0.5 if pays else 0.95)
        ak.cached_kernel_probe(heads, kv_heads, dim, probe=lambda *_: measured)

    return probe


@needs_kernel
@pytest.mark.parametrize("pays", [True, False])
def test_the_rule_takes_the_kernel_where_the_probe_says(request, kernel_probe, pays):
    """Default plan: the kernel where this CPU's probe found it faster; never over a bf16 cache, through the
    model's own forward or with ``attention_kernel=False``."""
    tok, model = _models(request, "qwen2")
    step = lean_step.lean_step_for(model)
    kernel_probe(pays, step.heads, step.kv_heads, step.dim)
    out, _ = generate(tok, model, fast=True, lean=True, n=2, do_sample=False)
    assert out.meta["metrics"]["rollout/attention_kernel"] == float(pays)
    for kw in ({"lean": False}, {"lean": True, "attention_kernel": False}):
        off, _ = generate(tok, model, fast=True, n=2, do_sample=False, attention_kernel_probe=False, **kw)
        assert off.meta["metrics"]["rollout/attention_kernel"] == 0.0
        assert torch.equal(off["responses"], out["responses"])


@needs_kernel
def test_the_kernel_reads_a_bf16_kv_cache(request, monkeypatch):
    """The bf16 copy attends through the kernel over fp32 K/V and over bf16 K/V (its slabs keep their keys
    transposed in bf16 too), and with ``attention_kernel=False`` over bf16 K/V through the bf16 cache's SDPA
    (no transposed keys). (The two bf16 paths differ by more than float rounding — SDPA computes in bf16 —
    and the tiny model's tokens follow such differences; the operator's numerics are checked above.)"""
    from rlkit.rollout import decode as decode_module
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    transposed: list[bool] = []
    real = decode_module.SlabLayer.lazy_initialization

    def recording(self, key_states, value_states):
        real(self, key_states, value_states)
        transposed.append(None if self.key_slab_t is None else self.key_slab_t.dtype)

    monkeypatch.setattr(decode_module.SlabLayer, "lazy_initialization", recording)

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    tok, model = _models(request, "qwen2")
    packed = Bf16DecodeCopy(model).module
    kw = {"fast": True, "lean": True, "n": 2, "do_sample": False, "attention_kernel_probe": False}
    fp32_kv, _ = generate(tok, packed, bf16_kv_from=None, **kw)
    bf16_kv, _ = generate(tok, packed, bf16_kv_from=0, bf16_kv_probe=False, **kw)
    bf16_sdpa, _ = generate(tok, packed, bf16_kv_from=0, bf16_kv_probe=False, attention_kernel=False, **kw)
    assert fp32_kv.meta["metrics"]["rollout/attention_kernel"] == 1.0  # the bf16 copy attends over fp32 K/V
    for out, kernel in ((bf16_kv, 1.0), (bf16_sdpa, 0.0)):
        assert out.meta["metrics"]["rollout/bf16_kv_cache"] == 1.0
        assert out.meta["metrics"]["rollout/attention_kernel"] == kernel
    layers = len(packed.model.layers)
    assert transposed == [torch.float32] * layers + [torch.bfloat16] * layers + [None] * layers
    for out in (fp32_kv, bf16_kv, bf16_sdpa):
        logp = out["rollout_log_probs"][out["response_mask"].bool()]
        assert torch.isfinite(logp).all() and (logp <= 0).all()


@needs_kernel
def test_the_probe_times_sdpa_and_the_kernel_once_per_machine(tmp_path):
    measured: list[ak.KernelAttentionProbe] = []

    def probe(*heads):
        measured.append(ak.probe_kernel(*heads))
        return measured[-1]

    cache = tmp_path / "hardware.json"
    first = ak.cached_kernel_probe(9, 3, 64, cache, probe=probe)
    again = ak.cached_kernel_probe(9, 3, 64, cache, probe=probe)
    assert len(measured) == 1 and again == first == measured[0]
    assert first.sdpa_s > 0 and first.kernel_s > 0
    assert first.pays == (first.kernel_s <= ak.KERNEL_MAX_RATIO * first.sdpa_s)
    assert "decode-attention-kernel-9-3-64" in cache.read_text()


@needs_kernel
def test_steps_that_read_a_shared_prompt_do_not_count_as_the_kernels(request, kernel_calls):
    """A group's rows reading their shared prompt attend on that path, not the kernel's: with every step
    shared (4 rows a prompt, 3 new tokens, no row ending early) the decode reports no kernel."""
    tok, model = _models(request, "qwen2")
    kw = {"fast": True, "lean": True, "scripted": False, "attention_kernel_probe": False, "eos": []}
    shared, _ = generate(tok, model, n=4, do_sample=False, max_new_tokens=3, **kw)
    assert shared.meta["metrics"]["rollout/attention_kernel"] == 0.0 and not kernel_calls
    alone, _ = generate(tok, model, n=1, do_sample=False, max_new_tokens=3, **kw)  # no group: the kernel
    assert alone.meta["metrics"]["rollout/attention_kernel"] == 1.0 and kernel_calls
