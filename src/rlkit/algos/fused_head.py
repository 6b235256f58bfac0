"""Log-prob, entropy and Σπ² of chosen tokens straight from hidden states and the LM head weight.

``head_outputs(hidden, weight, labels)`` is what ``log_probs_from_logits(hidden @ weight.T / T, labels)`` and
``entropy_from_logits`` give, without ever holding the [N, V] logits (or their gradient) whole: the vocabulary
is walked in slices of ``chunk`` columns, each slice's logits [N, v] made by one matmul over all N rows (so
every weight is read once per pass) and folded into running row statistics (online log-sum-exp):
  m   = running max,  s = Σ exp(z − m),  a = Σ exp(z − m) z,  q = Σ exp(2 (z − m)),  z_label picked in its
  slice lse = m + log s,  log_prob = z_label − lse,  entropy = lse − a / s,  Σπ² = q / s²
Backward walks the slices again: it recomputes a slice's logits, turns them into the gradient of the logits
with the saved log-sum-exp and entropy, and adds that slice's share to the hidden states' gradient and writes
the slice's rows of the weight's gradient (each written once). Saved for backward: the hidden rows, the weight
(a parameter: no copy), labels, log-sum-exp and entropy, O(N) floats, and, where the [N, V] float32 logits fit
in ``keep_logits_bytes``, the forward's logit slices themselves: backward then skips the recompute, one of
the head's three [N, H] x [H, V] matmuls (``KEEP_LOGITS_BYTES``, the budget the actor passes). Per slice,
p = softmax(z):
  ∂log_prob/∂z_v = 1[v = label] − p_v,      ∂entropy/∂z_v = −p_v (log p_v + H)
  ∂/∂h = (∂/∂z) W / T,                       ∂/∂W = (∂/∂z)^T h / T

Under autocast (bf16 on CPU or CUDA) the matmuls run in the autocast dtype and everything over the vocabulary
in float32, as ``logits.float()`` after an autocast head does.

Shapes: ``N`` rows (response tokens), ``H`` hidden size, ``V`` vocabulary, ``v`` columns per slice.
"""

from __future__ import annotations

import torch

from rlkit.algos._util import AlgoError

__all__ = ["head_outputs", "default_chunk", "CHUNK_ELEMENTS", "KEEP_LOGITS_BYTES"]

# Elements of one slice's [N, v] float32 logits: 2^22 = 16 MiB (its exp is a second such block).
CHUNK_ELEMENTS = 1 << 22
# The actor's budget for keeping the [N, V] float32 logits from forward to backward (``keep_logits_bytes``):
# 512 MiB holds SmolLM2's 49,152-word logits for 2,730 response tokens. Measured (docs/benchmarks.md): on one
# AVX2 core 0.966x the update at 512 tokens (100 MB kept; session 10); at 2,048 tokens (403 MB) no gain then,
# when the worker faulted that much memory in again at every step, and 0.950x (bf16) / 0.944x (fp32) on Zen 4
# once the workers' allocator keeps freed memory (session 18).
KEEP_LOGITS_BYTES = 512 * 2**20


def default_chunk(rows: int) -> int:
    """Vocabulary columns per slice: ``CHUNK_ELEMENTS / N``, at least 256 (a narrower matmul runs below
    peak)."""
    return max(256, CHUNK_ELEMENTS // max(rows, 1))


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    kind = device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def _scaled(h: torch.Tensor, dtype: torch.dtype, inv_temp: float) -> torch.Tensor:
    h = h.to(dtype)
    return h * inv_temp if inv_temp != 1.0 else h


def _in_slice(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose label falls in columns [start, start + width), those labels' column in the slice)."""
    local = labels - start
    rows = ((local >= 0) & (local < width)).nonzero().squeeze(1)
    return rows, local[rows]


class _HeadOutputs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        labels,
        inv_temp: float,
        with_entropy: bool,
        entropy_grad: bool,
        with_spsq: bool,
        chunk: int,
        dtype,
        keep: bool,
    ):
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        top = torch.full((n_rows,), float("-inf"), **f32)  # running max m
        total = torch.zeros(n_rows, **f32)  # s
        dot = torch.zeros(n_rows, **f32) if with_entropy else None  # a
        square = torch.zeros(n_rows, **f32) if with_spsq else None  # q
        picked = torch.zeros(n_rows, **f32)
        h = _scaled(hidden, dtype, inv_temp)  # [N, H]
        kept = []  # each slice's logits, where ``keep``
        work = _SliceBuffers(n_rows, min(chunk, vocab), dtype, hidden.device, logits=not keep)
        for start in range(0, vocab, chunk):
            w = weight[start : start + chunk].to(dtype)  # [v, H]
            z = work.logits(h, w, fresh=keep)  # [N, v] float32
            if keep:
                kept.append(z)
            rows, cols = _in_slice(labels, start, z.shape[1])
            picked[rows] = z[rows, cols]
            new_top = torch.maximum(top, z.amax(dim=-1))
            rescale = torch.exp(top - new_top)  # [N]; exp(-inf) = 0 on the first slice
            e = torch.sub(z, new_top[:, None], out=work.view("exp", z.shape[1])).exp_()  # [N, v]
            total.mul_(rescale).add_(e.sum(dim=-1))
            # row dot products by vecdot, no temporary: einsum's batched [1, v] x [v, 1] GEMMs took 4.9 ms a
            # 2048 x 2048 slice against 2.6 (one Zen 4 core, fp32; session 16, printed only)
            if with_entropy:
                dot.mul_(rescale).add_(torch.linalg.vecdot(e, z))
            if with_spsq:
                square.mul_(rescale * rescale).add_(torch.linalg.vecdot(e, e))
            top = new_top
        lse = top + total.log()
        log_prob = picked - lse
        entropy = lse - dot / total if with_entropy else torch.zeros(0, **f32)
        spsq = square / (total * total) if with_spsq else torch.zeros(0, **f32)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy, *kept)
        ctx.inv_temp, ctx.chunk, ctx.dtype = inv_temp, chunk, dtype
        ctx.entropy_grad = with_entropy and entropy_grad
        ctx.mark_non_differentiable(spsq)
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return log_prob, entropy, spsq

    @staticmethod
    def backward(ctx, g_lp, g_ent, _g_spsq):
        hidden, weight, labels, lse, entropy, *kept = ctx.saved_tensors
        g_ent = g_ent if ctx.entropy_grad else None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (want_h or want_w):
            return (None,) * 10
        dtype, inv_temp, chunk = ctx.dtype, ctx.inv_temp, ctx.chunk
        h = _scaled(hidden, dtype, inv_temp)  # [N, H]
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_h else None
        grad_w = torch.empty_like(weight) if want_w else None
        vocab = weight.shape[0]
        work = _SliceBuffers(hidden.shape[0], min(chunk, vocab), dtype, hidden.device, logits=not kept)
        for index, start in enumerate(range(0, vocab, chunk)):
            w = weight[start : start + chunk].to(dtype)  # [v, H]
            z = kept[index] if kept else work.logits(h, w)  # [N, v]
            # log p; kept logits stay as saved, recomputed ones are overwritten in place
            logp = (
                torch.sub(z, lse[:, None], out=work.view("exp", z.shape[1])) if kept else z.sub_(lse[:, None])
            )
            rows, cols = _in_slice(labels, start, logp.shape[1])
            g = _logit_grad(logp, rows, cols, g_lp, None if g_ent is None else (g_ent, entropy))
            if dtype != torch.float32:
                g = work.low_copy(g)
            if want_h:
                if dtype == torch.float32:
                    grad_h.addmm_(g, w)
                else:
                    grad_h += torch.mm(g, w).float()
            if want_w:
                rows_w = grad_w[start : start + chunk]  # [v, H], contiguous
                if dtype == weight.dtype:
                    torch.mm(g.t(), h, out=rows_w)
                else:
                    rows_w.copy_(torch.mm(g.t(), h))
        if want_h:
            grad_h = (grad_h * inv_temp if inv_temp != 1.0 else grad_h).to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


class _SliceBuffers:
    """One vocabulary slice's [N, v] working memory, allocated once per pass and reused by every slice.

    A fresh [N, v] tensor per slice (16 MiB at ``CHUNK_ELEMENTS``) is memory the C allocator often hands back
    to the kernel when it is freed, so every slice's matmul and elementwise passes fault its pages in again
    (docs/benchmarks.md, "Zen 4 after the graph, the workers' allocator, the head's slices in reused
    buffers"). A narrower last slice uses the front of each buffer as a contiguous [N, v'] view.
    """

    def __init__(self, rows: int, width: int, dtype: torch.dtype, device: torch.device, *, logits: bool):
        f32 = dict(dtype=torch.float32, device=device)
        self.rows = rows
        self.buffers = {"exp": torch.empty(rows * width, **f32)}
        if logits:
            self.buffers["logits"] = torch.empty(rows * width, **f32)
        if dtype != torch.float32:  # the matmuls' own dtype: their output, the gradient they read
            self.buffers["low"] = torch.empty(rows * width, dtype=dtype, device=device)

    def view(self, name: str, width: int) -> torch.Tensor:
        return self.buffers[name][: self.rows * width].view(self.rows, width)

    def logits(self, h: torch.Tensor, w: torch.Tensor, *, fresh: bool = False) -> torch.Tensor:
        """``h @ w.T`` as float32 [N, v]: in the logits buffer, or in a new tensor where ``fresh`` (kept)."""
        width = w.shape[0]
        out = torch.empty(self.rows, width, dtype=torch.float32, device=h.device) if fresh else None
        out = self.view("logits", width) if out is None else out
        if h.dtype == torch.float32:
            return torch.mm(h, w.t(), out=out)
        return out.copy_(torch.mm(h, w.t(), out=self.view("low", width)))

    def low_copy(self, g: torch.Tensor) -> torch.Tensor:
        """``g`` [N, v] in the matmuls' dtype, in the low buffer."""
        return self.view("low", g.shape[1]).copy_(g)


def _logit_grad(
    logp: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    g_lp: torch.Tensor | None,
    ent: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """∂loss/∂z [N, v] of one vocabulary slice from its log p [N, v] (overwritten); ``rows``/``cols``: the
    labels that fall in the slice.

    ∂/∂z_v = g_lp (1[v = label] − p_v) − g_ent p_v (log p_v + H)
           = −p_v (g_lp + g_ent (log p_v + H)) + g_lp 1[v = label]
    """
    if ent is None:  # no entropy gradient: −g_lp p, plus g_lp at the label
        grad = logp.exp_().mul_(-g_lp[:, None])
    else:
        g_ent, h = ent
        p = logp.exp()
        grad = logp.add_(h[:, None]).mul_(g_ent[:, None])
        if g_lp is not None:
            grad.add_(g_lp[:, None])
        grad.mul_(p).neg_()
    if g_lp is not None and len(rows):
        grad.index_put_((rows, cols), g_lp[rows], accumulate=True)
    return grad


def head_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    with_sum_pi_squared: bool = False,
    chunk: int | None = None,
    keep_logits_bytes: int = 0,
) -> dict[str, torch.Tensor]:
    """``log_prob`` [N] (and ``entropy``, ``sum_pi_squared`` [N]) of ``labels`` under ``softmax(hidden @
    weight.T / temperature)``, float32, in vocabulary slices of ``chunk`` columns (default ``default_chunk``;
    module docstring).

    hidden [N, H] (any float dtype; gradients flow to it), weight [V, H] (the LM head, e.g. a tied embedding;
    gradients flow to it when it requires grad), labels [N] (long). ``entropy_grad``: the entropy carries a
    gradient (else it is returned detached); ``sum_pi_squared`` never does. Autocast, when active on the
    tensors' device, sets the matmuls' dtype. ``keep_logits_bytes``: where the [N, V] float32 logits fit in
    this many bytes and a gradient will flow, they are kept from forward to backward instead of recomputed
    (the same numbers; the actor passes ``KEEP_LOGITS_BYTES``).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise AlgoError(
            f"head_outputs: hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise AlgoError(
            f"head_outputs: labels must have shape ({hidden.shape[0]},), got {tuple(labels.shape)}"
        )
    if temperature <= 0:
        raise AlgoError(f"head_outputs: temperature must be > 0, got {temperature}")
    columns = chunk or default_chunk(hidden.shape[0])
    if columns <= 0:
        raise AlgoError(f"head_outputs: chunk must be > 0, got {columns}")
    dtype = _autocast_dtype(hidden.device) or weight.dtype
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = grad and hidden.shape[0] * weight.shape[0] * 4 <= keep_logits_bytes
    with torch.autocast(hidden.device.type, enabled=False):
        lp, ent, spsq = _HeadOutputs.apply(
            hidden,
            weight,
            labels.long(),
            1.0 / temperature,
            with_entropy,
            entropy_grad,
            with_sum_pi_squared,
            columns,
            dtype,
            keep,
        )
    out = {"log_prob": lp}
    if with_entropy:
        out["entropy"] = ent if entropy_grad else ent.detach()
    if with_sum_pi_squared:
        out["sum_pi_squared"] = spsq.detach()
    return out
