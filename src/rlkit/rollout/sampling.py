"""Next-token sampling for the HF rollout: greedy, temperature, top-k and top-p, with the sampled token's
log-prob under the untruncated temperature-scaled distribution (what rollout correction compares).

Shapes: ``B`` rows, ``V`` vocabulary, ``k`` top-k candidates.
"""

from __future__ import annotations

import torch

__all__ = ["sample_next"]


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    top_k: int,
    do_sample: bool,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits [B, V]``; returns ``(tokens [B], log_prob [B])``.

    The log-prob is that of ``log_softmax(logits / temperature)`` (greedy: temperature 1), before
    top-k / top-p truncation (``rlkit.rollout.base``). ``uniform [B, 1]`` (float64): the rows' random draws
    when the caller made them (``rlkit.rollout.decode`` draws for the full batch); else drawn here.
    Nothing of size ``[B, V]`` is copied unless truncation needs it; top-k works on its ``k`` candidates.
    """
    logits = logits.float()
    greedy = not do_sample or temperature == 0
    scaled = logits if greedy or temperature == 1 else logits / temperature  # [B, V]
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        tokens = logp.argmax(dim=-1)
    else:
        tokens = (
            _sample_top_k(scaled, top_k, top_p, generator, uniform) if 0 < top_k < scaled.shape[-1] else None
        )
        if tokens is None:
            tokens = _inverse_cdf_sample(_truncated_probs(scaled, top_k, top_p), generator, uniform)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


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
