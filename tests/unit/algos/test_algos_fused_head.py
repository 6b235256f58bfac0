"""The fused LM-head outputs (no [N, V] logits held) equal log-softmax / entropy / Σπ² of the full logits,
values and gradients of the hidden states and the head weight, in vocabulary slices or whole, with temperature
and autocast."""

from __future__ import annotations

import pytest
import torch

from rlkit.algos import AlgoError
from rlkit.algos.fused_head import CHUNK_ELEMENTS, KEEP_LOGITS_BYTES, default_chunk, head_outputs
from rlkit.algos.token_baseline import sum_pi_squared_from_logits


def reference(hidden, weight, labels, temperature):
    """Full [N, V] logits, then the textbook formulas (float64 inputs: the exact answer)."""
    logits = hidden @ weight.t() / temperature  # [N, V]
    logp = torch.log_softmax(logits, -1)
    log_prob = logp.gather(-1, labels[:, None])[:, 0]
    entropy = -(logp.exp() * logp).sum(-1)
    return log_prob, entropy, sum_pi_squared_from_logits(logits.detach())


def inputs(n=13, h=8, v=37, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g, dtype=dtype) * 2).requires_grad_(True)
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("keep_logits_bytes", [0, 2**20])  # backward recomputes the logits / keeps them
def test_values_and_gradients_match_the_full_logits(chunk, temperature, entropy_grad, keep_logits_bytes):
    hidden, weight, labels = inputs()
    got = head_outputs(
        hidden,
        weight,
        labels,
        temperature=temperature,
        with_entropy=True,
        entropy_grad=entropy_grad,
        with_sum_pi_squared=True,
        chunk=chunk,
        keep_logits_bytes=keep_logits_bytes,
    )
    want_lp, want_h, want_s = reference(hidden, weight, labels, temperature)
    assert got["log_prob"].dtype == torch.float32 and got["log_prob"].shape == (13,)
    # the float32 vocabulary math over float64 inputs: agreement to float32 precision
    torch.testing.assert_close(got["log_prob"].double(), want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["entropy"].double(), want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["sum_pi_squared"], want_s.float(), rtol=1e-5, atol=1e-6)
    assert not got["sum_pi_squared"].requires_grad
    assert got["entropy"].requires_grad == entropy_grad
    # a loss with distinct weights per row, so every row's gradient matters
    coef = torch.linspace(-1, 2, 13, dtype=torch.float64)
    loss_got = (coef * got["log_prob"].double()).sum() + (
        0.3 * got["entropy"].double().sum() if entropy_grad else 0
    )
    loss_want = (coef * want_lp).sum() + (0.3 * want_h.sum() if entropy_grad else 0)
    g_got = torch.autograd.grad(loss_got, (hidden, weight))
    g_want = torch.autograd.grad(loss_want, (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == torch.float64  # gradients come back in the inputs' dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _backward_matmul_flops(keep_logits_bytes: int, chunk: int) -> tuple[float, tuple[torch.Tensor, ...]]:
    """(FLOPs of backward's matmuls, the gradients of hidden and weight) for the default float64 inputs."""
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight, labels = inputs()
    got = head_outputs(
        hidden,
        weight,
        labels,
        with_entropy=True,
        entropy_grad=True,
        chunk=chunk,
        keep_logits_bytes=keep_logits_bytes,
    )
    loss = (torch.linspace(-1, 2, 13, dtype=torch.float64) * got["log_prob"]).sum() + got["entropy"].sum()
    with FlopCounterMode(display=False) as counter:
        grads = torch.autograd.grad(loss, (hidden, weight))
    return counter.get_total_flops(), grads


@pytest.mark.parametrize("chunk", [5, 64])
def test_kept_logits_skip_backwards_recompute_and_give_the_same_gradients(chunk):
    """Within the budget backward runs two [N, H] x [H, V] matmuls (the hidden states' and the weight's
    gradients) instead of three; one byte short of the [N, V] float32 logits it recomputes them."""
    n, h, v = 13, 8, 37
    matmul = 2 * n * h * v
    needed = n * v * 4
    recomputed, want = _backward_matmul_flops(0, chunk)
    kept, got = _backward_matmul_flops(needed, chunk)
    short, _ = _backward_matmul_flops(needed - 1, chunk)
    assert (recomputed, kept, short) == (3 * matmul, 2 * matmul, 3 * matmul)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_actors_budget_keeps_the_logits_of_2048_smollm2_response_tokens():
    """The budget the actor passes holds SmolLM2's [2048, 49152] float32 logits (smollm2-256's micro-batch of
    8 × 256 response tokens, 403 MB): keeping them made that update 0.95x as long on Zen 4 with the workers'
    allocator (docs/benchmarks.md, "The head's logits kept at 2,048 tokens")."""
    assert 2048 * 49152 * 4 <= KEEP_LOGITS_BYTES


def test_frozen_weight_gets_no_gradient_and_log_prob_alone_needs_no_entropy():
    hidden, weight, labels = inputs(dtype=torch.float32)
    weight = weight.detach()  # a frozen (e.g. LoRA-base) head
    got = head_outputs(hidden, weight, labels)
    assert set(got) == {"log_prob"}
    (g,) = torch.autograd.grad(got["log_prob"].sum(), hidden)
    want_lp = reference(hidden, weight, labels, 1.0)[0]
    (g_want,) = torch.autograd.grad(want_lp.sum(), hidden)
    torch.testing.assert_close(g, g_want, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_runs_the_matmuls_in_bf16():
    hidden, weight, labels = inputs(n=20, h=16, v=50, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_outputs(hidden, weight, labels, with_entropy=True, entropy_grad=True)
        logits = (hidden @ weight.t()).float()  # autocast: a bf16 matmul, as the model's own head
    assert logits.dtype == torch.float32
    exact = head_outputs(hidden, weight, labels, with_entropy=True)
    # bf16 logits, not fp32 ones: close to the bf16 reference, and visibly different from the exact values
    torch.testing.assert_close(
        got["log_prob"], torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0], rtol=1e-4, atol=1e-4
    )
    assert not torch.allclose(got["log_prob"], exact["log_prob"], rtol=0, atol=1e-5)
    g_hidden, g_weight = torch.autograd.grad(got["log_prob"].sum() + got["entropy"].sum(), (hidden, weight))
    assert g_hidden.dtype == g_weight.dtype == torch.float32 and torch.isfinite(g_weight).all()


@pytest.mark.parametrize(
    "chunk", [7, 64]
)  # 50 = 7 * 7 + 1: the last slice is one column, in the buffers' front
@pytest.mark.parametrize("keep_logits_bytes", [0, 2**20])
@pytest.mark.parametrize("bf16", [False, True])
def test_slices_in_reused_buffers_match_autograd_through_the_full_logits(chunk, keep_logits_bytes, bf16):
    """The float32 and bf16-autocast paths (slice logits, their exp and, under autocast, the bf16 matmul
    output and gradient all in buffers reused from slice to slice) give autograd's values and gradients
    through the full logits computed the same way."""
    hidden, weight, labels = inputs(n=20, h=16, v=50, dtype=torch.float32)
    coef = torch.linspace(-1, 2, 20)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        got = head_outputs(
            hidden,
            weight,
            labels,
            with_entropy=True,
            entropy_grad=True,
            chunk=chunk,
            keep_logits_bytes=keep_logits_bytes,
        )
        logits = (hidden @ weight.t()).float()  # [N, V], float32 from the autocast dtype's matmul
    logp = torch.log_softmax(logits, -1)
    want_lp = logp.gather(-1, labels[:, None])[:, 0]
    want_h = -(logp.exp() * logp).sum(-1)
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["log_prob"], want_lp, **tol)
    torch.testing.assert_close(got["entropy"], want_h, **tol)
    g_got = torch.autograd.grad((coef * got["log_prob"]).sum() + got["entropy"].sum(), (hidden, weight))
    g_want = torch.autograd.grad((coef * want_lp).sum() + want_h.sum(), (hidden, weight))
    for a, b in zip(g_got, g_want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, **tol)


def test_bad_inputs_say_what_is_wrong():
    hidden, weight, labels = inputs()
    with pytest.raises(AlgoError, match="labels must have shape"):
        head_outputs(hidden, weight, labels[:-1])
    with pytest.raises(AlgoError, match=r"weight \[V, H\]"):
        head_outputs(hidden, weight.t(), labels)
    with pytest.raises(AlgoError, match="temperature"):
        head_outputs(hidden, weight, labels, temperature=0.0)
    assert default_chunk(10**9) == 256  # at least 256 vocabulary columns per matmul
    assert default_chunk(512) * 512 == CHUNK_ELEMENTS  # else one [N, v] block of CHUNK_ELEMENTS logits
