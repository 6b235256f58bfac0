"""Log-prob, entropy and Σπ² of chosen tokens straight from hidden states and the LM head weight.

``head_outputs(hidden, weight, labels)`` is what ``log_probs_from_logits(hidden @ weight.T / T, labels)`` and
``entropy_from_logits`` give, without ever holding the [N, V] logits (or their gradient) whole: each chunk of
``chunk_rows`` rows computes its logits (one matmul), shifts them by their row maximum in place, and reads off
the log-sum-exp, the label's log-prob, the entropy and Σπ² before the chunk is dropped. Backward recomputes a
chunk's logits and turns them, in place, into the gradient of the logits, then into the gradients of the hidden
states and of the head weight (two matmuls). Saved for backward: the hidden rows, the weight (a parameter: no
copy), labels, log-sum-exp and entropy, O(N) floats.

Per chunk, with z = h W^T / T, p = softmax(z), lse = logsumexp(z), H = entropy:
  log_prob  = z[label] − lse
  entropy   = lse − Σ_v p_v z_v
  Σπ²       = Σ_v p_v²                                       (no gradient)
  ∂log_prob/∂z_v = 1[v = label] − p_v
  ∂entropy/∂z_v  = −p_v (log p_v + H)
  ∂/∂h = (∂/∂z) W / T,   ∂/∂W = (∂/∂z)^T h / T

Under autocast (bf16 on CPU or CUDA) both matmuls run in the autocast dtype and everything over the
vocabulary in float32, as ``logits.float()`` after an autocast head does.

Shapes: ``N`` rows (response tokens), ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError

__all__ = ["head_outputs", "default_chunk_rows"]

# Elements of one chunk's [n, V] float32 logits: 2^22 = 16 MiB (its softmax is a second such block).
CHUNK_ELEMENTS = 1 << 22


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS / V``, at least 64 (a matmul of fewer rows runs well below peak)."""
    return max(64, CHUNK_ELEMENTS // max(vocab, 1))


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    kind = device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _scaled(h: torch.Tensor, dtype: torch.dtype, inv_temp: float) -> torch.Tensor:
    h = h.to(dtype)
    return h * inv_temp if inv_temp != 1.0 else h


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, H] @ [V, H]^T -> [n, V] float32 (``h`` already scaled by 1 / T and cast)."""
    return torch.mm(h, weight.t()).float()


class _HeadOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, inv_temp: float, with_entropy: bool, entropy_grad: bool,
                with_spsq: bool, chunk_rows: int, dtype):
        n_rows = hidden.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        log_prob, lse_all = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
        entropy = torch.empty(n_rows, **f32) if with_entropy else torch.zeros(0, **f32)
        spsq = torch.empty(n_rows, **f32) if with_spsq else torch.zeros(0, **f32)
        w = weight.to(dtype)
        for s in range(0, n_rows, chunk_rows):
            rows = slice(s, s + chunk_rows)
            z = _chunk_logits(_scaled(hidden[rows], dtype, inv_temp), w)  # [n, V]
            top = z.amax(dim=-1, keepdim=True)  # [n, 1]
            z.sub_(top)
            picked = z.gather(1, labels[rows, None]).squeeze(1)  # [n]
            if with_entropy or with_spsq:
                p = z.exp()  # [n, V], unnormalised
                total = p.sum(dim=-1)  # [n]
                p.div_(total[:, None])
                lse = total.log()
                if with_entropy:  # lse − Σ p z, on the shifted z (shift-invariant)
                    entropy[rows] = lse - torch.einsum("nv,nv->n", p, z)
                if with_spsq:
                    spsq[rows] = torch.einsum("nv,nv->n", p, p)
                del p
            else:
                lse = z.exp_().sum(dim=-1).log()
            log_prob[rows] = picked - lse
            lse_all[rows] = lse + top.squeeze(1)
        ctx.save_for_backward(hidden, weight, labels, lse_all, entropy)
        ctx.inv_temp, ctx.chunk_rows, ctx.dtype = inv_temp, chunk_rows, dtype
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.mark_non_differentiable(spsq)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_prob, entropy, spsq

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spsq):
        hidden, weight, labels, lse_all, entropy = ctx.saved_tensors
        g_ent = g_ent if ctx.entropy_grad else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_lp is None and g_ent is None or not (want_h or want_w):
            return (None,) * 9
        dtype, inv_temp = ctx.dtype, ctx.inv_temp
        w = weight.to(dtype)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, hidden.shape[0], ctx.chunk_rows):
            rows = slice(s, s + ctx.chunk_rows)
            h = _scaled(hidden[rows], dtype, inv_temp)  # [n, H]
            z = _chunk_logits(h, w).sub_(lse_all[rows, None])  # log p, [n, V]
            g = _logit_grad(z, labels[rows], None if g_lp is None else g_lp[rows],
                            None if g_ent is None else (g_ent[rows], entropy[rows]))  # [n, V] float32
            g = g.to(dtype)
            if want_h:
                grad_h[rows] = (torch.mm(g, w) * inv_temp).to(hidden.dtype)
            if want_w:
                if dtype == torch.float32:
                    grad_w.addmm_(g.t(), h)
                else:
                    grad_w += torch.mm(g.t(), h).float()
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _logit_grad(logp: torch.Tensor, labels: torch.Tensor, g_lp: torch.Tensor | None,
                ent: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """∂loss/∂z [n, V] from log p [n, V] (overwritten), in place where possible.

    ∂/∂z_v = g_lp (1[v = label] − p_v) − g_ent p_v (log p_v + H)
           = −p_v (g_lp + g_ent (log p_v + H)) + g_lp 1[v = label]
    """
    g_lp_col = g_lp[:, None] if g_lp is not None else None
    if ent is None:  # no entropy gradient: −g_lp p, plus g_lp at the label
        grad = logp.exp_().mul_(-g_lp_col)
    else:
        g_ent, h = ent
        p = logp.exp()
        grad = logp.add_(h[:, None]).mul_(g_ent[:, None])
        if g_lp_col is not None:
            grad.add_(g_lp_col)
        grad.mul_(p).neg_()
    if g_lp is not None:
        grad.scatter_add_(1, labels[:, None], g_lp_col)
    return grad


def head_outputs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                 with_entropy: bool = False, entropy_grad: bool = False, with_sum_pi_squared: bool = False,
                 chunk_rows: int | None = None) -> dict[str, torch.Tensor]:
    """``log_prob`` [N] (and ``entropy``, ``sum_pi_squared`` [N]) of ``labels`` under ``softmax(hidden @ weight.T /
    temperature)``, float32, chunked over rows (module docstring).

    hidden [N, H] (any float dtype; gradients flow to it), weight [V, H] (the LM head, e.g. a tied embedding;
    gradients flow to it when it requires grad), labels [N] (long). ``entropy_grad``: the entropy carries a
    gradient (else it is returned detached); ``sum_pi_squared`` never does. Autocast, when active on the
    tensors' device, sets the matmuls' dtype.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise AlgoError(f"head_outputs: hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} "
                        f"and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise AlgoError(f"head_outputs: labels must have shape ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if temperature <= 0:
        raise AlgoError(f"head_outputs: temperature must be > 0, got {temperature}")
    rows = chunk_rows or default_chunk_rows(weight.shape[0])
    if rows <= 0:
        raise AlgoError(f"head_outputs: chunk_rows must be > 0, got {rows}")
    dtype = _autocast_dtype(hidden.device) or weight.dtype
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent, spsq = _HeadOutputs.apply(hidden, weight, labels.long(), 1.0 / temperature, with_entropy,
                                           entropy_grad, with_sum_pi_squared, rows, dtype)
    out = {"log_prob": lp}
    if with_entropy:
        out["entropy"] = ent if entropy_grad else ent.detach()
    if with_sum_pi_squared:
        out["sum_pi_squared"] = spsq
    return out
