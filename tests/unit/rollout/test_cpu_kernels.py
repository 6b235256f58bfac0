"""rlkit's compiled decode operators (rlkit.rollout.cpu_kernels): how their one library is compiled, cached
and refused (its AVX2 build run in a process of its own); the glue operators (kernels/decode_glue.cpp)
against the torch operators they replace; and the layer loop that calls them (rlkit.rollout.scripted_step.
fused_layer_loop) against the torch operators' loop through whole decodes — fp32 on four model families, the
bf16 decode copy's packed GEMMs, a group's prompt read once, the attention kernel, a bf16 KV cache — and the
rule that picks it."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models import perturbed_model
from test_attention_kernel import SHAPES, vector_width
from test_decode import CASES, ending_tokens, generate
from test_fused_sampling import check_all as check_sampling  # noqa: F401  (AVX2_CHECK imports it)
from test_lean_step import ARCHS, _models, other_archs  # noqa: F401  (the fixture)

from rlkit.rollout import cpu_kernels as ck
from rlkit.rollout import scripted_step

needs_kernels = pytest.mark.skipif(
    ck.kernel_unavailable() is not None, reason=f"no decode kernels here: {ck.kernel_unavailable()}"
)
BF16_ULP = 2**-7  # a bf16 rounding of the same fp32 sum computed in another order may land one ulp apart


def check_norms(bf16: bool, rows: int = 5, width: int = 584) -> None:
    """``rms_norm_cast`` and ``add_rms_norm_cast`` (the sum exact; biased bf16 and fp32 GEMM outputs) against
    ``F.rms_norm`` and a cast; ``width`` not a multiple of the vector width (the tail loop)."""
    torch.manual_seed(0)
    x, weight = 3 * torch.randn(rows, width), torch.randn(width)
    dtype = torch.bfloat16 if bf16 else torch.float32
    tolerance = {"rtol": BF16_ULP, "atol": 1e-6} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    got = torch.ops.rlkit.rms_norm_cast(x, weight, 1e-5, bf16)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, [width], weight, 1e-5).to(dtype), **tolerance)
    for y_dtype in (torch.bfloat16, torch.float32):
        y, bias = torch.randn(rows, width).to(y_dtype), torch.randn(width)
        for b in (bias, None):
            total, normed = torch.ops.rlkit.add_rms_norm_cast(x, y, b, weight, 1e-5, bf16)
            want = x + (y.float() if b is None else y.float() + b)
            assert torch.equal(total, want)
            torch.testing.assert_close(normed, F.rms_norm(want, [width], weight, 1e-5).to(dtype), **tolerance)


def check_silu_mul(bf16: bool, rows: int = 4, intermediate: int = 1544) -> None:
    """``silu_mul_cast`` against SiLU(gate) · up in fp32 (large |gate| included: the exp's clamp)."""
    torch.manual_seed(1)
    for y_dtype in (torch.bfloat16, torch.float32):
        gate_up = (8 * torch.randn(rows, 2 * intermediate)).to(y_dtype)
        gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0]).to(y_dtype)
        bias = torch.randn(2 * intermediate)
        for b in (bias, None):
            g = gate_up.float() if b is None else gate_up.float() + b
            want = F.silu(g[:, :intermediate]) * g[:, intermediate:]
            got = torch.ops.rlkit.silu_mul_cast(gate_up, b, bf16)
            assert got.shape == (rows, intermediate)
            if bf16:
                torch.testing.assert_close(got, want.bfloat16(), rtol=BF16_ULP, atol=1e-6)
            else:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def check_rotary(slab_dtype: torch.dtype, head_norms: bool, transposed: bool, block: int) -> None:
    """``rotary_write`` against the lean step's torch ops: bias added, Qwen3's head norms, q and k rotated
    (``x·cos + roll(x, D/2)·sin``), k and v written at ``start`` only (the earlier positions kept, NaN after
    it stays NaN); the transposed keys (the attention kernel's, in the slabs' dtype) untouched unless
    ``start`` ends a block of ``block`` positions (the library's vector width), then that whole block of
    keys."""
    torch.manual_seed(2)
    rows, heads, kv_heads, dim, capacity = 3, 6, 2, 32, 2 * block + 1
    width = (heads + 2 * kv_heads) * dim
    angle = 6 * torch.rand(rows, 1, dim // 2)
    cos = torch.cat([angle.cos(), angle.cos()], -1)
    sin = torch.cat([-angle.sin(), angle.sin()], -1)  # rotate_half's signs folded in, as the lean step's
    q_norm, k_norm = (torch.randn(dim), torch.randn(dim)) if head_norms else (None, None)
    for y_dtype, start in ((torch.bfloat16, 5), (torch.float32, block - 1), (torch.bfloat16, 2 * block - 1)):
        y, bias = torch.randn(rows, width).to(y_dtype), torch.randn(width)
        keys = torch.full((rows, kv_heads, capacity, dim), float("nan"), dtype=slab_dtype)
        keys[:, :, :start] = torch.randn(rows, kv_heads, start, dim).to(slab_dtype)  # the earlier steps'
        earlier = keys[:, :, :start].clone()
        values = torch.full_like(keys, float("nan"))
        keys_t = torch.full((rows, kv_heads, dim, 2 * block + 16), float("nan"), dtype=slab_dtype)
        q = torch.ops.rlkit.rotary_write(
            y, bias, cos, sin, q_norm, k_norm, 1e-6, keys, values, keys_t if transposed else None, start,
            heads, kv_heads,
        )  # fmt: skip
        heads_of = (y.float() + bias).reshape(rows, heads + 2 * kv_heads, dim)
        qk, v = heads_of[:, : heads + kv_heads], heads_of[:, heads + kv_heads :]
        if head_norms:
            qk = torch.cat(
                [
                    F.rms_norm(qk[:, :heads], [dim], q_norm, 1e-6),
                    F.rms_norm(qk[:, heads:], [dim], k_norm, 1e-6),
                ],
                1,
            )
        qk = torch.addcmul(qk * cos, qk.roll(dim // 2, dims=-1), sin)
        assert q.shape == (rows, heads, 1, dim) and q.dtype == torch.float32
        torch.testing.assert_close(q, qk[:, :heads, None], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(keys[:, :, start], qk[:, heads:].to(slab_dtype), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(values[:, :, start], v.to(slab_dtype), rtol=0, atol=0)
        assert torch.equal(keys[:, :, :start], earlier)
        assert keys[:, :, start + 1 :].isnan().all() and values[:, :, start + 1 :].isnan().all()
        written = torch.zeros(keys_t.shape[-1], dtype=torch.bool)
        if transposed and (start + 1) % block == 0:
            first = start + 1 - block
            assert torch.equal(
                keys_t[..., first : start + 1], keys[:, :, first : start + 1].transpose(-1, -2)
            )
            written[first : start + 1] = True
        assert keys_t[..., ~written].isnan().all()


def check_all(block: int) -> int:
    """Every check above, each case, for the library of vector width ``block``; returns how many ran (the
    AVX2 build's subprocess prints it)."""
    cases = 0
    for bf16 in (True, False):
        check_norms(bf16)
        check_silu_mul(bf16)
        cases += 2
    for slab_dtype in (torch.float32, torch.bfloat16):
        for head_norms in (False, True):
            for transposed in (False, True):
                check_rotary(slab_dtype, head_norms, transposed, block)
                cases += 1
    return cases


@needs_kernels
@pytest.mark.parametrize("bf16", [True, False])
def test_the_norm_operators_are_torchs_norm_add_and_cast(bf16):
    check_norms(bf16)


@needs_kernels
@pytest.mark.parametrize("bf16", [True, False])
def test_silu_mul_is_torchs_silu_times_up(bf16):
    check_silu_mul(bf16)


@needs_kernels
@pytest.mark.parametrize("slab_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_norms", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_rotary_write_rotates_and_writes_what_the_lean_step_does(slab_dtype, head_norms, transposed):
    check_rotary(slab_dtype, head_norms, transposed, vector_width())


@needs_kernels
def test_the_glue_operators_refuse_what_they_cannot_read():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="x must be fp32 or bf16"):
        torch.ops.rlkit.rms_norm_cast(x.double(), torch.ones(8), 1e-5, True)
    with pytest.raises(RuntimeError, match="fp32 x"):  # the residual stream stays fp32
        torch.ops.rlkit.rms_norm_cast(x.bfloat16(), torch.ones(8), 1e-5, True)
    with pytest.raises(RuntimeError, match="even width"):
        torch.ops.rlkit.silu_mul_cast(torch.randn(2, 7), None, False)
    slab = torch.zeros(2, 1, 4, 8)
    with pytest.raises(RuntimeError, match=r"\(H \+ 2 Hkv\) D"):
        torch.ops.rlkit.rotary_write(
            torch.randn(2, 30), None, torch.ones(2, 1, 8), torch.ones(2, 1, 8), None, None, 1e-6,
            slab, slab.clone(), None, 0, 2, 1,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="room at start"):
        torch.ops.rlkit.rotary_write(
            torch.randn(2, 32), None, torch.ones(2, 1, 8), torch.ones(2, 1, 8), None, None, 1e-6,
            slab, slab.clone(), None, 4, 2, 1,
        )  # fmt: skip


AVX2_CHECK = """
import sys, torch, torch.nn.functional as F
from pathlib import Path
from rlkit.rollout import cpu_kernels
# this process's library is the AVX2 build: the test modules' kernel_unavailable() loads it, not this CPU's
# (an operator keeps the last implementation loaded; check_rotary's 8-wide blocks fail on a 16-wide one)
cpu_kernels.kernel_library = lambda *args, **kwargs: (Path(sys.argv[1]), None)
assert cpu_kernels.kernel_unavailable() is None
sys.path.insert(0, sys.argv[2])
from test_attention_kernel import SHAPES, check_blocked_keys, kernel_inputs
from test_cpu_kernels import check_all, check_sampling
for shape in SHAPES:
    q, keys, keys_t, values, mask = kernel_inputs(*shape)
    length, scale = shape[-1], shape[3] ** -0.5
    attend = mask[:, None, None]
    for dtype in (torch.float32, torch.bfloat16):  # fp32 K/V, and the bf16 cache's widened as loaded
        kt, vs = keys_t.to(dtype), values.to(dtype)
        got = torch.ops.rlkit.decode_attention(q, kt, vs, attend, length, scale)
        k, v = keys[:, :, :length].to(dtype).float(), vs[:, :, :length].float()
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, scale=scale, enable_gqa=True)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for dtype in (torch.float32, torch.bfloat16):  # the last positions from the key slab, 8-wide blocks
        check_blocked_keys(shape, dtype, 8)
print("ok", len(SHAPES), check_all(8), check_sampling())
"""


@needs_kernels
def test_the_avx2_build_computes_the_same(tmp_path):
    """The 8-wide build (an AVX2 CPU's), compiled here and run in a process of its own (an operator has one
    implementation per process): the same attention (over fp32 and bf16 K/V), glue and draws."""
    path, why = ck.kernel_library(tmp_path, cpu_flags={"avx2", "fma"})
    assert why is None and path.name.startswith("decode_kernels-8-")
    done = subprocess.run(
        [sys.executable, "-c", AVX2_CHECK, str(path), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == f"ok {len(SHAPES)} 12 {2 * 3 * 6 * 16 + 2 * 3 * 3 * 4 + 2}"


def test_the_build_follows_the_cpus_flags_and_says_why_not(tmp_path, monkeypatch):
    assert ck.build_flags({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})[1] == 16
    assert ck.build_flags({"avx2", "fma", "avx512f"})[1] == 8  # AVX-512 without BW/DQ/VL: the AVX2 build
    assert ck.build_flags({"avx2"}) is None
    path, why = ck.kernel_library(tmp_path, cpu_flags={"sse4_2"})
    assert path is None and why == "this CPU has no AVX2 and FMA"
    monkeypatch.setattr(ck, "_compiler", lambda: None)
    path, why = ck.kernel_library(tmp_path, cpu_flags={"avx2", "fma"})
    assert path is None and "no g++" in why


@pytest.mark.skipif(ck._compiler() is None, reason="no g++ here")
def test_a_failed_compile_is_a_reason_not_a_crash_and_a_good_one_is_cached(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(ck, "SOURCES", (*ck.SOURCES, broken))
    path, why = ck.kernel_library(tmp_path / "a", cpu_flags={"avx2", "fma"})
    assert path is None and why.startswith(
        "compiling decode_attention.cpp, decode_glue.cpp, sampling.cpp, broken.cpp failed"
    )
    assert list((tmp_path / "a").iterdir()) == []  # no half-written library left behind
    monkeypatch.undo()
    first, _ = ck.kernel_library(tmp_path / "b", cpu_flags={"avx2", "fma"})
    stamp = first.stat().st_mtime_ns
    real = subprocess.run

    def no_compile(command, *args, **kwargs):
        assert "-shared" not in command, "compiled again"
        return real(command, *args, **kwargs)

    monkeypatch.setattr(ck.subprocess, "run", no_compile)
    again, _ = ck.kernel_library(tmp_path / "b", cpu_flags={"avx2", "fma"})
    assert again == first and again.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    ("why", "warned"),
    [("no g++ on PATH to compile them", True), ("compiling decode_glue.cpp failed (x)", True)]
    + [("this CPU has no AVX2 and FMA", False), ("the kernels are for x86-64 Linux (this is Darwin)", False)],
)
def test_why_not_is_a_warning_only_where_the_kernels_could_have_run(monkeypatch, why, warned):
    """A machine that could run the kernels but cannot build them says so once, as a warning; a CPU or system
    they are not for only logs it. Either way the reason is returned and the step runs torch's operators."""
    monkeypatch.setattr(ck, "kernel_library", lambda: (None, why))
    ck.kernel_unavailable.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ck.kernel_unavailable() == why
        said = [w for w in caught if "decode kernels" in str(w.message)]
        assert len(said) == (1 if warned else 0)
    finally:
        monkeypatch.undo()
        ck.kernel_unavailable.cache_clear()
        ck.kernel_unavailable()  # this process's real answer again (a loaded library loads once)


def assert_close_decodes(fused, plain, tolerance: float = 1e-5) -> None:
    assert torch.equal(fused["responses"], plain["responses"])
    assert torch.equal(fused["response_mask"], plain["response_mask"])
    torch.testing.assert_close(
        fused["rollout_log_probs"], plain["rollout_log_probs"], atol=tolerance, rtol=tolerance
    )
    assert fused.meta["metrics"]["rollout/fused_glue"] == 1.0
    assert plain.meta["metrics"]["rollout/fused_glue"] == 0.0
    for out in (fused, plain):
        assert out.meta["metrics"]["rollout/scripted_layers"] == 1.0


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_the_fused_loop_decodes_what_torchs_operators_decode(request, arch):
    """fp32 weights (Qwen2's q/k/v biases, Qwen3's head norms, grouped KV heads), rows ending apart: the same
    tokens, log-probs to float rounding."""
    tok, model = _models(request, arch)
    kw = {"n": 2, **CASES["sampled"]}
    eos = ending_tokens(tok, model, **kw)
    fused, plain = (
        generate(tok, model, fast=True, lean=True, fused_glue=on, eos=eos, **kw)[0] for on in (True, False)
    )
    assert_close_decodes(fused, plain)
    lengths = plain["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # rows ended apart: the slabs the operators wrote were compacted


@needs_kernels
@pytest.mark.parametrize("weights", ["fp32", "bf16-copy", "fp16-copy"])
def test_the_fused_loop_adds_every_linears_bias(tmp_path, weights):
    """A Llama with ``attention_bias`` and ``mlp_bias`` (a bias on o_proj, gate/up and down too; the bf16
    copy's GEMMs leave each to the operator that reads their output, the fp16 copy's fbgemm GEMMs add their
    own): the same tokens, log-probs to float rounding (the bf16 copy's rounding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlkit.hardware import fp16_weights_unavailable
    from rlkit.model.tiny import build_tiny_model
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable
    from rlkit.rollout.fp16_weights import Fp16DecodeCopy

    unavailable = {"bf16-copy": bf16_weights_unavailable, "fp16-copy": fp16_weights_unavailable}
    if weights in unavailable and unavailable[weights]():
        pytest.skip(unavailable[weights]())
    path = build_tiny_model(tmp_path / "llama", arch="llama", seed=2)
    config = AutoConfig.from_pretrained(path)
    config.attention_bias, config.mlp_bias = True, True
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok, model = perturbed_model(path, seed=2)
    assert model.model.layers[0].mlp.down_proj.bias.abs().sum() > 0
    assert model.model.layers[0].self_attn.o_proj.bias.abs().sum() > 0
    copies = {"bf16-copy": Bf16DecodeCopy, "fp16-copy": Fp16DecodeCopy}
    model = copies[weights](model).module if weights in copies else model
    kw = {"n": 2, **CASES["sampled"], "attention_kernel_probe": False}
    fused, plain = (
        generate(tok, model, fast=True, lean=True, fused_glue=on, **kw)[0] for on in (True, False)
    )
    assert_close_decodes(fused, plain, tolerance=2e-3 if weights == "bf16-copy" else 1e-5)


@pytest.fixture
def packed_model(request):
    """``packed(arch)``: the bf16 decode copy of a tiny model (its fused oneDNN GEMMs), or a skip."""
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())

    def packed(arch: str):
        tok, model = _models(request, arch)
        return tok, Bf16DecodeCopy(model).module

    return packed


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize(
    "cache",
    ["kernel", "sdpa", "bf16_kv", "bf16_kv_sdpa"],
    ids=["attention-kernel", "sdpa", "bf16-kv-cache-kernel", "bf16-kv-cache-sdpa"],
)
def test_the_fused_loop_through_the_bf16_copy_groups_and_every_cache(packed_model, arch, cache):
    """The bf16 copy's packed GEMMs hand their bf16 outputs (and biases) to the operators as they are;
    attending through SDPA over fp32 or a bf16 KV cache (the operator writes its K/V, transposed keys too,
    rounded to bf16) over 3 prompts × 4 rows (a group's prompt read once), or through the kernel over fp32 or
    bf16 K/V over 3 prompts × 1 row (a step that reads a shared prompt attends on its own, so groups would
    hide the kernel): the same tokens, log-probs within the bf16 copy's rounding."""
    tok, packed = packed_model(arch)
    kw = {
        "n": 1 if cache in ("kernel", "bf16_kv") else 4,
        **CASES["temperature_top_k_top_p"],
        "attention_kernel_probe": False,
    }
    kw |= {
        "kernel": {"bf16_kv_from": None},
        "sdpa": {"bf16_kv_from": None, "attention_kernel": False},
        "bf16_kv": {"bf16_kv_from": 0, "bf16_kv_probe": False},
        "bf16_kv_sdpa": {"bf16_kv_from": 0, "bf16_kv_probe": False, "attention_kernel": False},
    }[cache]
    fused, plain = (
        generate(tok, packed, fast=True, lean=True, fused_glue=on, **kw)[0] for on in (True, False)
    )
    assert_close_decodes(fused, plain, tolerance=2e-3)
    metrics = fused.meta["metrics"]
    assert metrics["rollout/attention_kernel"] == float(cache in ("kernel", "bf16_kv"))
    assert metrics["rollout/bf16_kv_cache"] == float(cache.startswith("bf16_kv"))


@needs_kernels
def test_the_kernel_hands_the_packed_output_projection_bf16_without_a_cast(packed_model):
    """In the fused loop over the bf16 copy the attention kernel writes the output projection's bf16 input
    itself (``bf16_out``): a decode through the kernel casts an ``[A, H·D]`` tensor twice a step (the last
    layer's bf16 down projection widened for the residual, the head's input rounded) where SDPA's casts once
    more per layer (its fp32 output rounded for the projection), and both decode the same tokens."""
    from torch.profiler import ProfilerActivity, profile

    tok, packed = packed_model("qwen2")
    config = packed.config
    width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    kw = {"n": 1, **CASES["greedy"], "attention_kernel_probe": False, "bf16_kv_from": None}

    def casts(kernel: bool) -> tuple[int, object]:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = generate(tok, packed, fast=True, lean=True, attention_kernel=kernel, **kw)[0]
        shaped = [e for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes]
        count = sum(1 for e in shaped if len(e.input_shapes[0]) == 2 and e.input_shapes[0][1] == width)
        return count, out

    with_kernel, by_kernel = casts(True)
    with_sdpa, by_sdpa = casts(False)
    assert by_kernel.meta["metrics"]["rollout/attention_kernel"] == 1.0
    assert by_sdpa.meta["metrics"]["rollout/attention_kernel"] == 0.0
    steps = (with_sdpa - with_kernel) // config.num_hidden_layers
    assert steps > 0 and with_sdpa - with_kernel == steps * config.num_hidden_layers
    assert with_kernel == 2 * steps  # none for the attention's output
    assert torch.equal(by_kernel["responses"], by_sdpa["responses"])


@needs_kernels
def test_the_rule_takes_the_fused_loop_wherever_the_operators_load(tok_and_model, monkeypatch):
    """Default plan: the fused loop under the scripted layers; torch's operators with ``fused_glue=False``,
    the Python loop (``scripted_layers=False``) or where the library did not load (the reason said once by
    ``cpu_kernels``)."""
    from rlkit.rollout import decode as decode_module

    tok, model = tok_and_model
    kw = {"fast": True, "lean": True, "n": 2, "do_sample": False}
    on, _ = generate(tok, model, **kw)
    assert on.meta["metrics"]["rollout/fused_glue"] == 1.0
    for off_kw in ({"fused_glue": False}, {"scripted": False}):
        off, _ = generate(tok, model, **kw, **off_kw)
        assert off.meta["metrics"]["rollout/fused_glue"] == 0.0
        assert torch.equal(off["responses"], on["responses"])
    monkeypatch.setattr(decode_module, "kernel_unavailable", lambda: "no g++ on PATH to compile them")
    unloaded, _ = generate(tok, model, **kw, attention_kernel=False)
    assert unloaded.meta["metrics"]["rollout/fused_glue"] == 0.0
    assert unloaded.meta["metrics"]["rollout/scripted_layers"] == 1.0


@needs_kernels
def test_a_fused_loop_that_cannot_be_scripted_leaves_the_unfused_one(tok_and_model, monkeypatch):
    tok, model = tok_and_model
    real = torch.jit.script

    def only_the_plain_loop(fn):
        if fn is scripted_step.fused_layer_loop:
            raise OSError("could not get source code")
        return real(fn)

    monkeypatch.setattr(torch.jit, "script", only_the_plain_loop)
    scripted_step.scripted_layer_loop.cache_clear()
    try:
        with pytest.warns(UserWarning, match="could not be compiled by TorchScript"):
            out, _ = generate(tok, model, fast=True, lean=True, n=2, do_sample=False)
    finally:
        scripted_step.scripted_layer_loop.cache_clear()
    assert out.meta["metrics"]["rollout/scripted_layers"] == 1.0
    assert out.meta["metrics"]["rollout/fused_glue"] == 0.0


def test_an_installed_rlkit_ships_every_file_the_build_reads():
    """The wheel's package data (pyproject.toml) covers the kernels' sources and the header they include, and
    the build hashes every file the sources include: a file left out would fail to compile, or a stale
    library would be loaded, only on an install from a wheel."""
    import ast
    import fnmatch
    import re

    root = Path(ck.__file__).resolve().parents[1]  # src/rlkit
    pyproject = (root.parents[1] / "pyproject.toml").read_text()  # (tomllib: Python 3.11+)
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1]
    globs = ast.literal_eval(re.search(r"^rlkit = (\[.*\])$", package_data, re.M).group(1))
    read = (*ck.SOURCES, *ck.HEADERS)
    for path in read:
        assert any(fnmatch.fnmatch(str(path.relative_to(root)), g) for g in globs), path
    included = {
        name for path in read for name in re.findall(r'#include "([^"]+)"', path.read_text())
    }  # the kernels' own headers (quoted includes)
    assert included == {h.name for h in ck.HEADERS}
