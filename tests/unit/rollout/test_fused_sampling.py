"""The compiled next-token draw (``rlkit::sample_rows``, kernels/sampling.cpp) against torch's path in
``rlkit.rollout.sampling.sample_next`` and against fp64: greedy picks, draws over the whole vocabulary (fp32
and bf16 logits, temperatures, a vocabulary with a partial last block), the log-probs; its refusals; and
whole decodes with it on and off (``DecodePlan.fused_sampling``), the bf16 decode copy's bf16 logits
included."""

from __future__ import annotations

import pytest
import torch
from test_decode import CASES, ending_tokens, generate

from rlkit.rollout import sampling
from rlkit.rollout.cpu_kernels import kernel_unavailable

needs_kernels = pytest.mark.skipif(
    kernel_unavailable() is not None, reason=f"no decode kernels here: {kernel_unavailable()}"
)
NEAR_BOUNDARY = 1e-6  # of the row's mass: where float rounding may move a draw across a token boundary
LOG_PROB_TOLERANCE = 2e-5  # torch's log of an fp32 probability against the kernel's fp64 log_softmax


def torch_draw(logits, u, temperature, greedy=False):
    return sampling.sample_next(
        logits, temperature=temperature, top_p=1.0, top_k=0, do_sample=not greedy, generator=None, uniform=u
    )


def check_draws(rows: int = 16, vocab: int = 49152, trials: int = 6) -> int:
    """Draws by the kernel and by torch's path for the same uniforms: the same token wherever the draw is
    not within ``NEAR_BOUNDARY`` of a token boundary of the fp64 CDF between the two, at most 1 % differing;
    log-probs fp64's ``log_softmax`` at the token. Returns the draws checked."""
    torch.manual_seed(3)
    checked = differ = 0
    for dtype in (torch.float32, torch.bfloat16):
        for temperature in (1.0, 0.7, 1.3):
            for _ in range(trials):
                logits = (3 * torch.randn(rows, vocab)).to(dtype)
                logits[0, 17] = 40.0  # a peaked row
                u = torch.rand(rows, 1, dtype=torch.float64)
                u[1] = 0.0  # the first token with mass
                u[2] = 1.0 - 2**-53  # the end of the last block
                want, want_lp = torch_draw(logits, u, temperature)
                got, got_lp = torch.ops.rlkit.sample_rows(logits, u, temperature, sampling._BLOCK)
                assert got.dtype == torch.int64 and got_lp.dtype == torch.float32
                scaled = logits.double() / temperature
                exact = torch.log_softmax(scaled, -1)
                torch.testing.assert_close(
                    got_lp, exact.gather(1, got[:, None])[:, 0].float(), rtol=0, atol=2e-6
                )
                same = got == want
                torch.testing.assert_close(got_lp[same], want_lp[same], rtol=0, atol=LOG_PROB_TOLERANCE)
                cdf = exact.exp().cumsum(-1)
                for r in (~same).nonzero().flatten().tolist():
                    lo = min(int(got[r]), int(want[r]))
                    assert (cdf[r, lo : max(int(got[r]), int(want[r]))] - u[r]).abs().min() < NEAR_BOUNDARY
                    differ += 1
                # the peaked row's token; u = 0 the first token; u → 1 a token of the last block (which one
                # is float rounding: the running sum may cross the block's fp32 sum before its last token)
                assert int(got[0]) == 17 and int(got[1]) == 0
                assert (vocab - 1) // sampling._BLOCK * sampling._BLOCK <= int(got[2]) < vocab
                checked += rows
    assert differ <= max(1, checked // 100), differ
    return checked


def check_greedy(rows: int = 8, vocab: int = 1031) -> int:
    """Greedy: torch's argmax (the first of tied maxima), the log-prob fp64's ``log_softmax`` at temperature 1
    whatever temperature is passed to sample_next."""
    torch.manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * torch.randn(rows, vocab)).to(dtype)
        logits[1, 5] = logits[1, 900] = 50.0  # tied maxima
        logits[2, vocab - 1] = 50.0  # in the partial last block
        want, want_lp = torch_draw(logits, None, 0.7, greedy=True)
        got, got_lp = torch.ops.rlkit.sample_rows(logits, None, 1.0, sampling._BLOCK)
        assert torch.equal(got, want) and int(got[1]) == 5 and int(got[2]) == vocab - 1
        exact = torch.log_softmax(logits.double(), -1).gather(1, got[:, None])[:, 0]
        torch.testing.assert_close(got_lp, exact.float(), rtol=0, atol=2e-6)
        torch.testing.assert_close(got_lp, want_lp, rtol=0, atol=LOG_PROB_TOLERANCE)
    return 2


def check_all() -> int:
    """Every check above; returns how many cases ran (the AVX2 build's subprocess prints it)."""
    return check_draws() + check_draws(rows=4, vocab=1000 + 7, trials=3) + check_greedy()


@needs_kernels
def test_the_kernels_draws_are_torchs_to_float_rounding():
    assert check_draws() == 2 * 3 * 6 * 16


@needs_kernels
def test_a_vocabulary_with_a_partial_last_block():
    assert check_draws(rows=4, vocab=1000 + 7, trials=3) == 2 * 3 * 3 * 4


@needs_kernels
def test_the_kernels_greedy_pick_is_torchs_argmax():
    assert check_greedy() == 2


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The rows of each ``rlkit::sample_rows`` call from here on."""
    calls: list[int] = []
    real = torch.ops.rlkit.sample_rows

    def counted(logits, *args):
        calls.append(logits.shape[0])
        return real(logits, *args)

    monkeypatch.setattr(torch.ops.rlkit, "sample_rows", counted, raising=False)
    return calls


@needs_kernels
def test_sample_next_takes_the_kernel_only_for_what_it_draws(kernel_calls):
    """``fused=True``: greedy and untruncated draws by the kernel (a strided logits view made contiguous);
    top-k and top-p by torch's path, whatever ``fused`` says."""
    calls = kernel_calls
    logits = torch.randn(8, 3000)[:, ::2]  # [8, 1500], last dim strided
    g = torch.Generator().manual_seed(0)
    for kw in ({"do_sample": False}, {"temperature": 0.0}, {"temperature": 0.8}):
        args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "do_sample": True, **kw}
        assert sampling.kernel_draws(**args)
        sampling.sample_next(logits, generator=g, fused=True, **args)
    assert len(calls) == 3
    for kw in ({"top_k": 5}, {"top_p": 0.9}):
        args = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "do_sample": True, **kw}
        assert not sampling.kernel_draws(**args)
        tokens, _ = sampling.sample_next(logits, generator=g, fused=True, **args)
        assert tokens.shape == (8,)
    assert len(calls) == 3


@needs_kernels
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_kernel_draws_what_the_generator_would_have_drawn(temperature):
    """Without the caller's uniforms, ``sample_next``'s kernel draw consumes the generator as torch's path
    does: the same tokens and log-probs at the temperature asked for, the generator left in the same state."""
    logits = 2 * torch.randn(32, 5000)
    args = {"temperature": temperature, "top_p": 1.0, "top_k": 0, "do_sample": True}
    outs, states = [], []
    for fused in (True, False):
        g = torch.Generator().manual_seed(11)
        outs.append(sampling.sample_next(logits, generator=g, fused=fused, **args))
        states.append(g.get_state())
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(states[0], states[1])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=LOG_PROB_TOLERANCE)


@needs_kernels
def test_the_kernel_refuses_what_it_cannot_read():
    logits = torch.randn(2, 64)
    u = torch.rand(2, 1, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="fp32 or bf16 logits"):
        torch.ops.rlkit.sample_rows(logits.double(), u, 1.0, 256)
    with pytest.raises(RuntimeError, match=r"logits \[B, V\]"):
        torch.ops.rlkit.sample_rows(logits[0], u, 1.0, 256)
    with pytest.raises(RuntimeError, match=r"uniform \[B, 1\] fp64"):
        torch.ops.rlkit.sample_rows(logits, u.float(), 1.0, 256)
    with pytest.raises(RuntimeError, match="temperature > 0"):
        torch.ops.rlkit.sample_rows(logits, u, 0.0, 256)


def assert_close_decodes(fused, plain) -> None:
    assert torch.equal(fused["responses"], plain["responses"])
    assert torch.equal(fused["response_mask"], plain["response_mask"])
    torch.testing.assert_close(
        fused["rollout_log_probs"], plain["rollout_log_probs"], atol=LOG_PROB_TOLERANCE, rtol=0
    )
    assert fused.meta["metrics"]["rollout/fused_sampling"] == 1.0
    assert plain.meta["metrics"]["rollout/fused_sampling"] == 0.0


@needs_kernels
@pytest.mark.parametrize("case", ["greedy", "sampled"])
@pytest.mark.parametrize("fast", [True, False], ids=["slab", "plain"])
def test_decodes_draw_the_same_tokens_with_the_kernel(tok_and_model, kernel_calls, case, fast):
    """Both loops, rows ending apart: every token drawn by the kernel, the same tokens as torch's path under
    one seed, log-probs within the tolerance."""
    tok, model = tok_and_model
    kw = {"n": 4, **CASES[case]}
    eos = ending_tokens(tok, model, **kw)
    kernel_calls.clear()
    fused = generate(tok, model, fast=fast, lean=fast, eos=eos, fused_sampling=True, **kw)[0]
    drawn = list(kernel_calls)
    plain = generate(tok, model, fast=fast, lean=fast, eos=eos, fused_sampling=False, **kw)[0]
    assert len(kernel_calls) == len(drawn)  # none with the plan's switch off
    assert len(drawn) == fused["response_mask"].sum(0).gt(0).sum()  # one call per step
    assert_close_decodes(fused, plain)
    lengths = plain["response_mask"].sum(1)
    assert lengths.min() < lengths.max()


@needs_kernels
def test_the_bf16_copys_head_hands_the_kernel_bf16_logits(tok_and_model, monkeypatch):
    """The bf16 decode copy: the lean step returns its head's bf16 GEMM output, which the kernel reads as it
    is and torch's path widens: the same tokens; a top-k decode of the copy draws through torch's path."""
    from rlkit.rollout import decode as decode_module
    from rlkit.rollout.bf16_weights import Bf16DecodeCopy, bf16_weights_unavailable

    if bf16_weights_unavailable() is not None:
        pytest.skip(bf16_weights_unavailable())
    tok, model = tok_and_model
    packed = Bf16DecodeCopy(model).module
    seen: list[torch.dtype] = []
    real = decode_module.sample_next

    def recording(logits, **kw):
        seen.append(logits.dtype)
        return real(logits, **kw)

    monkeypatch.setattr(decode_module, "sample_next", recording)
    kw = {"n": 4, **CASES["sampled"]}
    fused, plain = (
        generate(tok, packed, fast=True, lean=True, fused_sampling=on, **kw)[0] for on in (True, False)
    )
    assert_close_decodes(fused, plain)
    assert seen[len(seen) // 2] == torch.float32  # the second decode's prefill
    # each decode: the prefill's logits (the model's forward) fp32, then every step's bf16
    assert seen[0] == torch.float32 and seen.count(torch.float32) == 2 and len(seen) > 4
    top_k, _ = generate(tok, packed, fast=True, lean=True, n=2, **CASES["top_k"])
    assert top_k.meta["metrics"]["rollout/fused_sampling"] == 0.0
