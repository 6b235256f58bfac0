"""Conformance checks for rollout corrections (``rollout_corrections``), called as rlkit calls them
(``fn(old_log_prob, rollout_log_probs, response_mask, **params)``) on the small random batches
``rlkit.testing.algos`` builds. Shapes: ``B`` samples, ``T`` response tokens.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from rlkit.testing._common import resolve_component, who
from rlkit.testing.algos import _fail, _loss_case

__all__ = ["check_rollout_correction"]

_CORRECTION_CONTRACT = (
    "fn(old_log_prob, rollout_log_probs, response_mask, **params) -> (weights or 0/1 mask [B, T], "
    "metrics: dict[str, float])  (rlkit.plugin.specs.RolloutCorrectionSpec)"
)


def check_rollout_correction(
    spec_or_name: Any,
    *,
    registries: Any = None,
    batch: int = 8,
    length: int = 6,
    seed: int = 0,
    **params: Any,
) -> None:
    """Check a rollout correction against its contract; raise ``ContractError`` naming the first problem.

    - returns ``(tensor [B, T], metrics)``: finite, non-negative, 0 on padding, no gradient; a ``"mask"``
      correction returns only 0/1; metrics finite Python numbers, un-prefixed (the trainer adds
      ``rollout_corr/``);
    - on-policy (rollout log-probs equal to the old ones) nothing is dropped or reweighted: weight 1 on
      every valid token;
    - row-local: any row split gives the same rows (the trainer computes it over the whole batch);
    - a spec declaring ``bypass`` has a bool ``bypass`` params field, and with ``bypass=True`` its output is
      exactly 1 on every valid token (pi_old := pi_rollout).
    """
    corr = resolve_component("rollout_corrections", spec_or_name, params, registries)
    name = who(corr)
    if corr.spec.output not in ("weights", "mask"):
        raise _fail(
            name,
            f"spec.output is {corr.spec.output!r}; it must be 'weights' or 'mask'.",
            _CORRECTION_CONTRACT,
        )
    _check_bypass(name, corr, batch, length, seed)
    case = _loss_case(batch, length, seed)
    old, rollout, mask = case["log_prob"], case["old_log_prob"], case["response_mask"]
    out, metrics = corr.fn(old.clone(), rollout.clone(), mask.clone(), **corr.kwargs)
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != tuple(mask.shape)
        or not out.is_floating_point()
    ):
        raise _fail(
            name,
            f"returned {type(out).__name__} {tuple(getattr(out, 'shape', ()))}; expected a floating [B, T].",
            _CORRECTION_CONTRACT,
        )
    _check_correction_values(name, corr, out, metrics, mask)
    same, _ = corr.fn(old.clone(), old.clone(), mask.clone(), **corr.kwargs)
    if not torch.allclose(same, mask.to(same.dtype)):
        raise _fail(
            name,
            "on-policy (rollout log-probs == old log-probs) the output must be 1 on every valid token.",
            _CORRECTION_CONTRACT,
        )
    rows = torch.arange(batch).flip(0)
    piece, _ = corr.fn(old[rows[:3]], rollout[rows[:3]], mask[rows[:3]], **corr.kwargs)
    if not torch.allclose(piece, out[rows[:3]], rtol=1e-5, atol=1e-7):
        raise _fail(
            name,
            "a row's output depends on the other rows of the call; it must be row-local.",
            _CORRECTION_CONTRACT,
        )


def _check_bypass(name: str, corr: Any, batch: int, length: int, seed: int) -> None:
    """A spec declaring ``bypass``: a bool ``bypass`` field defaulting to False, and with ``bypass=True``
    (other parameters at their defaults) exactly 1 on every valid token, whatever the old log-probs."""
    field = type(corr.params).model_fields.get("bypass") if corr.params is not None else None
    if corr.spec.bypass and (field is None or field.annotation is not bool or field.default is not False):
        raise _fail(
            name,
            "spec.bypass is True, so its params model needs `bypass: bool = Field(False, ...)` (the trainer "
            "reads it) and its function a `bypass` keyword (pi_old := pi_rollout).",
            _CORRECTION_CONTRACT,
        )
    # bypass (other parameters at their defaults): old_log_prob ignored, every valid weight 1
    if corr.spec.bypass:
        case = _loss_case(batch, length, seed)
        out, _ = corr.fn(
            case["log_prob"],
            case["old_log_prob"],
            case["response_mask"],
            **type(corr.params)(bypass=True).model_dump(),
        )
        if not torch.equal(out, case["response_mask"].to(out.dtype)):
            raise _fail(
                name,
                "with bypass=True the output must be exactly 1 on every valid token, 0 on padding.",
                _CORRECTION_CONTRACT,
            )


def _check_correction_values(
    name: str, corr: Any, out: torch.Tensor, metrics: dict, mask: torch.Tensor
) -> None:
    """The output finite, >= 0, gradient-free, 0 on padding (0/1 for a ``mask`` correction); the metrics
    un-prefixed finite numbers."""
    if not torch.isfinite(out).all() or (out < 0).any() or out.requires_grad:
        raise _fail(name, "the output must be finite, >= 0 and carry no gradient.", _CORRECTION_CONTRACT)
    if (out[mask == 0] != 0).any():
        raise _fail(name, "the output is not 0 on padding (multiply by response_mask).", _CORRECTION_CONTRACT)
    if corr.spec.output == "mask" and not set(out.unique().tolist()) <= {0.0, 1.0}:
        raise _fail(name, "a 'mask' correction must return only 0 and 1.", _CORRECTION_CONTRACT)
    for key, value in metrics.items():
        if not isinstance(value, numbers.Real) or value != value or key.startswith("rollout_corr/"):
            raise _fail(
                name, f"metric {key!r} = {value!r}: return un-prefixed finite floats.", _CORRECTION_CONTRACT
            )
