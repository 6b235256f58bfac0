"""Next-token sampling for the HF rollout: greedy, temperature, top-k and top-p, with the sampled token's
log-prob under the untruncated temperature-scaled distribution (what rollout correction compares).

Shapes: ``B`` rows, ``V`` vocabulary, ``k`` top-k candidates, ``C`` CDF blocks of ``_BLOCK`` tokens.
"""

from __future__ import annotations

import torch

__all__ = ["kernel_draws", "sample_next"]

_BLOCK = 256  # tokens per block of the two-level inverse CDF (``_sample_full_vocabulary``)
_TINY = 1e-30  # below this a float32 probability has lost precision: its log-prob comes from log_softmax


def kernel_draws(temperature: float, top_p: float, top_k: int, do_sample: bool) -> bool:
    """Whether ``sample_next(..., fused=True)`` draws with the compiled ``rlkit::sample_rows`` under these
    settings: a greedy pick, or a draw over the whole vocabulary (no top-p, no top-k)."""
    return not do_sample or temperature == 0 or (top_p >= 1.0 and top_k <= 0)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    do_sample: bool,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits [B, V]``; returns ``(tokens [B], log_prob [B])``.

    The log-prob is that of ``log_softmax(logits / temperature)`` (greedy: temperature 1), before
    top-k / top-p truncation (``rlkit.rollout.base``), taken as the log of the sampled token's softmax
    probability (``_log_prob``). ``uniform [B, 1]`` (float64): the rows' random draws when the caller made
    them (``rlkit.rollout.decode`` draws for the full batch); else drawn here. One fused softmax over the
    vocabulary; nothing else of size ``[B, V]`` is written unless truncation needs it: top-k works on its
    ``k`` candidates, and an untruncated draw reads the softmax once more for its block sums
    (``_sample_full_vocabulary``).

    ``fused``: where :func:`kernel_draws` holds, the compiled ``rlkit::sample_rows``
    (``rlkit.rollout.cpu_kernels``; the caller checked it loaded, CPU logits) does all of it in two reads of
    each row, over the logits as they are (fp32, or bf16 from the bf16 decode copy's head): the same greedy
    tokens; for a draw, the same two-level inverse CDF over unnormalised terms, so a token differs from this
    path's only where the draw lies within float rounding (~1e-7 of the mass) of a token boundary, and the
    log-prob is ``log_softmax`` computed in fp64 (within ~1e-5 of this path's ``log`` of an fp32
    probability).
    """
    greedy = not do_sample or temperature == 0
    if fused and kernel_draws(temperature, top_p, top_k, do_sample):
        if not greedy and uniform is None:
            uniform = torch.rand(logits.shape[0], 1, generator=generator, dtype=torch.float64)
        return torch.ops.rlkit.sample_rows(
            logits if logits.stride(-1) == 1 else logits.contiguous(),
            None if greedy else uniform,
            1.0 if greedy else float(temperature),
            _BLOCK,
        )
    logits = logits.float()
    scaled = logits if greedy or temperature == 1 else logits / temperature  # [B, V]
    probs = torch.softmax(scaled, dim=-1)  # [B, V]
    if greedy:
        tokens = scaled.argmax(dim=-1)
    elif top_p >= 1.0 and not 0 < top_k < scaled.shape[-1]:
        tokens = _sample_full_vocabulary(probs, generator, uniform)
    else:
        tokens = (
            _sample_top_k(scaled, top_k, top_p, generator, uniform) if 0 < top_k < scaled.shape[-1] else None
        )
        if tokens is None:
            tokens = _inverse_cdf_sample(_truncated_probs(scaled, top_k, top_p), generator, uniform)
    return tokens, _log_prob(scaled, probs, tokens)


def _log_prob(scaled: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log_softmax(scaled)`` at ``tokens [B]``, as ``log`` of the token's softmax probability ``probs [B,
    V]``: as precise as float32 log_softmax (both within ~1e-5 of float64 at a 49k vocabulary; the float32
    normaliser bounds both), or, for a row whose token's probability is below ``_TINY`` (float32 keeps too
    few digits there; a draw lands on such a token with probability < 1e-30), log_softmax over that row."""
    p = probs.gather(-1, tokens[:, None]).squeeze(-1)  # [B]
    log_p = torch.log(p)
    tiny = p < _TINY
    if bool(tiny.any()):
        rows = tiny.nonzero().flatten()
        log_p[rows] = torch.log_softmax(scaled[rows], dim=-1).gather(-1, tokens[rows, None]).squeeze(-1)
    return log_p


def _sample_full_vocabulary(
    probs: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None
) -> torch.Tensor:
    """One draw per row of ``probs [B, V]`` → ``[B]``: the token ``_inverse_cdf_sample`` picks for the same
    uniform draw, without its float64 cumulative sum over the whole vocabulary (a sequential scan, the
    largest op of the sampling step: docs/benchmarks.md, "Where the decode step goes"). Two levels: the sums
    of blocks of ``_BLOCK`` tokens ``[B, C]`` (float32, one vectorised pass) and their float64 cumulative sum
    find the block the draw falls in; the float64 cumulative sum inside that block finds the token. The
    block sums carry float32 rounding (~1e-7 of a block's mass), so a token can differ from the one-level
    scan's only for a draw that close to a token boundary."""
    b, v = probs.shape
    whole = v // _BLOCK * _BLOCK
    sums = [probs[:, :whole].reshape(b, -1, _BLOCK).sum(-1)]
    if whole < v:
        sums.append(probs[:, whole:].sum(-1, keepdim=True))
    block_cdf = torch.cumsum(torch.cat(sums, dim=1), dim=-1, dtype=torch.float64)  # [B, C]
    u = (
        uniform
        if uniform is not None
        else torch.rand(b, 1, generator=generator, dtype=torch.float64, device=probs.device)
    )
    target = u * block_cdf[:, -1:]  # [B, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [B, 1]
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [B, 1]
    index = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # [B, _BLOCK]
    inside = probs.gather(1, index.clamp(max=v - 1)).double().masked_fill_(index >= v, 0.0)
    cdf = before + torch.cumsum(inside, dim=-1)  # [B, _BLOCK]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=_BLOCK - 1)  # [B, 1]
    return (block * _BLOCK + pick).clamp_(max=v - 1).squeeze(-1)


def _truncated_probs(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``softmax`` of ``scaled [B, V]`` after top-k (ties with the k-th kept) and top-p, over the whole
    vocabulary: the reference form (a sort of ``[B, V]`` for top-p)."""
    filtered = scaled
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        filtered = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p  # mass before this token already >= p
        sorted_logits[drop] = float("-inf")
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


def _sample_top_k(
    scaled: torch.Tensor,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None,
) -> torch.Tensor | None:
    """Top-k (then top-p) sampling on the ``k`` candidates ``[B, k]`` in vocabulary order, the order the
    full-vocabulary inverse CDF walks: the same draw picks the same token. None where a row has ties with
    its k-th logit (the reference keeps them all): the caller takes the full path."""
    values, index = torch.topk(scaled, top_k, dim=-1)  # [B, k], descending
    if bool(((scaled >= values[:, -1:]).sum(-1) > top_k).any()):
        return None
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        values = values.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    index, order = index.sort(dim=-1)  # vocabulary order
    pick = _inverse_cdf_sample(torch.softmax(values.gather(-1, order), dim=-1), generator, uniform)  # [B]
    return index.gather(-1, pick[:, None]).squeeze(-1)


def _inverse_cdf_sample(
    probs: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row of ``probs [B, V]`` → ``[B]``: the first token whose cumulative probability exceeds
    a uniform draw (``uniform [B, 1]`` float64, or drawn here). One random number per row, where
    ``torch.multinomial`` draws one per vocabulary entry (the timing: docs/benchmarks.md, History, change
    6); float64 keeps the tail's mass exact enough."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # [B, V]
    u = (
        uniform
        if uniform is not None
        else torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    )
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)
