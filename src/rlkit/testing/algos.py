"""Conformance checks for the function registries: advantage estimators and policy losses (rollout
corrections: ``rlkit.testing.corrections``).

Both call the function exactly as rlkit does (``rlkit.step.advantage.advantage``,
``rlkit.workers.actor.FSDPActor._micro_loss``) on small random batches built here, with the
component's validated parameters as keywords. Shapes: ``B`` samples (``G`` groups of ``n``), ``T``
response tokens.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from rlkit.algos.aggregation import LOSS_AGG_MODES, agg_loss, global_counts
from rlkit.algos.estimators import EstimatorInputs
from rlkit.testing._common import ContractError, resolve_component, who

__all__ = ["check_estimator", "check_policy_loss"]

_ESTIMATOR_CONTRACT = (
    "fn(inputs: EstimatorInputs (token_level_rewards [B, T], response_mask [B, T], group_id [B], "
    "and what the spec declares), **params) -> (advantages [B, T], returns [B, T])  "
    "(rlkit.algos.estimators, rlkit.plugin.specs)"
)
_LOSS_CONTRACT = (
    "fn(log_prob, old_log_prob, advantages, response_mask, **params) -> (per_token_loss [B, T], "
    "metrics: dict[str, float])  (rlkit.plugin.specs)"
)


def _fail(name: str, problem: str, contract: str) -> ContractError:
    return ContractError(f"{name}: {problem}\nContract: {contract}")


# ----- estimators -----------------------------------------------------------------------------------
def _estimator_case(spec: Any, num_groups: int, group_size: int, length: int, seed: int) -> dict[str, Any]:
    """Outcome rewards on the last valid token, as the reward step places them. Group 0 has identical
    members (same score, same length); the last group has 0/1 scores; the others random ones. The
    first row of group 1 has a masked hole, as a tool turn leaves in a multi-turn response."""
    gen = torch.Generator().manual_seed(seed)
    b, t = num_groups * group_size, length
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[:group_size] = max(1, t - 1)
    scores = torch.randn(b, generator=gen)
    scores[:group_size] = 0.5
    binary = torch.arange(group_size) % 2  # at least one 0 and one 1 when group_size >= 2
    scores[-group_size:] = binary.float()
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [B, T]
    if t >= 3 and num_groups > 1:  # a masked hole (a tool turn between two assistant turns)
        lengths[group_size] = t
        mask[group_size] = 1.0
        mask[group_size, 1] = 0.0
    rewards = torch.zeros(b, t)
    rewards[torch.arange(b), lengths - 1] = scores
    index = torch.arange(num_groups).repeat_interleave(group_size)  # [B] dense group ids, as the trainer's
    values = None
    if spec.needs_critic:
        values = torch.randn(b, t, generator=gen)
        values[:group_size] = values[0]  # identical members stay identical
        values = values * mask
    baselines = None
    if spec.needs_greedy_baseline:  # one greedy score per prompt, repeated over its group (the trainer's)
        baselines = torch.randn(num_groups, generator=gen).repeat_interleave(group_size)
    otb = None
    if spec.needs_sum_pi_squared:  # the actor's old log-prob and sum of squared probabilities, 0 where masked
        old = -torch.rand(b, t, generator=gen) * 2
        old[:group_size] = old[0]
        spp = torch.exp(old) ** 2 + torch.rand(b, t, generator=gen) * (1 - torch.exp(old)) ** 2
        otb = {"old_log_prob": old * mask, "sum_pi_squared": spp * mask}
    return {
        "rewards": rewards,
        "mask": mask,
        "index": index,
        "values": values,
        "baselines": baselines,
        "otb": otb,
    }


def _call_estimator(
    est: Any, case: dict[str, Any], rows: torch.Tensor | None = None, index: torch.Tensor | None = None
) -> tuple[Any, Any]:
    def pick(x: torch.Tensor | None) -> torch.Tensor | None:  # the case's own tensors: in-place writes show
        return x if x is None or rows is None else x[rows]

    otb = {k: pick(v) for k, v in case["otb"].items()} if case["otb"] else {}
    inputs = EstimatorInputs(
        token_level_rewards=pick(case["rewards"]),
        response_mask=pick(case["mask"]),
        group_id=pick(case["index"]) if index is None else index,
        values=pick(case["values"]),
        reward_baselines=pick(case["baselines"]),
        **otb,
    )
    out = est.fn(inputs, **est.kwargs)
    if not (
        isinstance(out, (tuple, list)) and len(out) == 2 and all(isinstance(x, torch.Tensor) for x in out)
    ):
        raise _fail(
            who(est),
            f"returned {type(out).__name__}, not a pair of tensors (advantages, returns).",
            _ESTIMATOR_CONTRACT,
        )
    return out


def check_estimator(
    spec_or_name: Any,
    *,
    registries: Any = None,
    num_groups: int = 4,
    group_size: int = 4,
    length: int = 6,
    seed: int = 0,
    **params: Any,
) -> None:
    """Check an advantage estimator against the registry contract; raise ``ContractError`` (an
    ``AssertionError``) naming the first problem.

    ``spec_or_name``: an ``EstimatorSpec`` or a registered name; ``params``: its parameters, validated
    against the spec's params model (``check_estimator("group_quantile", quantile=0.9)``).

    Checked, on ``num_groups`` groups of ``group_size`` samples with outcome rewards:

    - the result is ``(advantages, returns)``, both floating ``[B, T]`` tensors, finite everywhere —
      also for a group whose members all have the same score (zero spread);
    - both are exactly 0 where ``response_mask`` is 0;
    - the inputs are not modified, and a second call gives the same result (a pure function);
    - identical members of one group get identical rows;
    - the estimator is batch-level, so its split invariance is equivariance: permuting whole groups
      (and renaming their ids to other, non-contiguous values) permutes the outputs the same way.
    """
    est = resolve_component("estimators", spec_or_name, params, registries)
    name = who(est)
    case = _estimator_case(est.spec, num_groups, group_size, length, seed)
    before = {k: v.clone() for k, v in case.items() if isinstance(v, torch.Tensor)}
    before |= {f"otb.{k}": v.clone() for k, v in (case["otb"] or {}).items()}
    adv, ret = _call_estimator(est, case)
    for label, x in (("advantages", adv), ("returns", ret)):
        _check_estimator_output(name, label, x, case["mask"], group_size)
    for key, value in before.items():
        if not torch.equal(case[key] if not key.startswith("otb.") else case["otb"][key[4:]], value):
            raise _fail(name, f"it modified its input `{key}` in place; work on a copy.", _ESTIMATOR_CONTRACT)
    adv2, ret2 = _call_estimator(est, case)
    if not (torch.equal(adv, adv2) and torch.equal(ret, ret2)):
        raise _fail(
            name,
            "two calls on the same inputs gave different results; an estimator is a pure function "
            "(no random numbers, no state).",
            _ESTIMATOR_CONTRACT,
        )
    same = adv[:group_size]
    if not torch.allclose(same, same[:1].expand_as(same), rtol=1e-5, atol=1e-6):
        raise _fail(
            name,
            f"the {group_size} identical members of group 0 (same score, same length) got different "
            f"advantages:\n{same}",
            _ESTIMATOR_CONTRACT,
        )
    _check_group_permutation(est, case, adv, ret, num_groups, group_size, seed)


def _check_estimator_output(
    name: str, label: str, x: torch.Tensor, mask: torch.Tensor, group_size: int
) -> None:
    """One of an estimator's outputs (``label``: advantages or returns) as the contract asks: a finite
    floating [B, T] tensor, exactly 0 where ``mask`` is 0."""
    b, t = mask.shape
    outside = mask == 0
    if tuple(x.shape) != (b, t):
        raise _fail(
            name, f"{label} has shape {tuple(x.shape)}; expected [B, T] = {(b, t)}.", _ESTIMATOR_CONTRACT
        )
    if not x.is_floating_point():
        raise _fail(name, f"{label} has dtype {x.dtype}; expected a floating dtype.", _ESTIMATOR_CONTRACT)
    if not torch.isfinite(x).all():
        rows = sorted({int(r) for r in (~torch.isfinite(x)).nonzero()[:, 0]})
        hint = (
            " Rows 0..G-1 form a group whose scores are all equal: divide by (std + epsilon)."
            if any(r < group_size for r in rows)
            else ""
        )
        raise _fail(name, f"{label} has NaN/inf in rows {rows}.{hint}", _ESTIMATOR_CONTRACT)
    if outside.any() and x[outside].abs().max() != 0:
        raise _fail(
            name,
            f"{label} is not 0 where response_mask is 0 (max |value| there: "
            f"{float(x[outside].abs().max()):.4g}); multiply by response_mask.",
            _ESTIMATOR_CONTRACT,
        )


def _check_group_permutation(
    est: Any,
    case: dict[str, Any],
    adv: torch.Tensor,
    ret: torch.Tensor,
    num_groups: int,
    group_size: int,
    seed: int,
) -> None:
    perm = torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed + 1))
    if num_groups > 1 and torch.equal(perm, torch.arange(num_groups)):
        perm = perm.roll(1)
    rows = torch.cat([torch.arange(g * group_size, (g + 1) * group_size) for g in perm.tolist()])  # [B]
    new_ids = case["index"][rows] * 7 + 3  # other, non-contiguous ids for the same groups
    adv_p, ret_p = _call_estimator(est, case, rows=rows, index=new_ids)
    for label, got, want in (("advantages", adv_p, adv[rows]), ("returns", ret_p, ret[rows])):
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            worst = float((got - want).abs().max())
            raise _fail(
                who(est),
                f"permuting whole groups (order {perm.tolist()}) and renaming their ids changed "
                f"the {label} by up to {worst:.4g} instead of permuting them; the result must depend "
                "on the group each row belongs to, not on row positions or id values.",
                _ESTIMATOR_CONTRACT,
            )


# ----- policy losses --------------------------------------------------------------------------------
def _loss_case(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of different lengths (one with a masked hole, as a tool turn makes); log-probs and old
    log-probs are 0 where masked, as the actor and rollout give them."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()  # [B, T]
    if length >= 3:
        mask[0, 1] = 0  # a hole
    log_prob = -(torch.rand(batch, length, generator=gen) * 2 + 0.05)  # [B, T]
    old = log_prob + 0.4 * torch.randn(batch, length, generator=gen)  # ratios around 1, some clipped
    # outcome-style, both signs
    advantages = torch.randn(batch, 1, generator=gen).expand(batch, length).clone()
    zero = mask == 0
    return {
        "log_prob": log_prob.masked_fill(zero, 0.0),
        "old_log_prob": old.masked_fill(zero, 0.0),
        "advantages": advantages.masked_fill(zero, 0.0),
        "response_mask": mask,
    }


def _selection(loss: Any, case: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The loss's ``mini_batch_selection`` over the whole case [B, T], made once (as the actor does per
    mini-batch)."""
    from rlkit.plugin.registry import load_object

    select = loss.spec.mini_batch_selection
    if select is None:
        return None
    return load_object(select)(
        case["log_prob"],
        case["old_log_prob"],
        case["advantages"],
        case["response_mask"].float(),
        generator=torch.Generator().manual_seed(0),
        **loss.kwargs,
    ).bool()


def _call_loss(
    loss: Any, case: dict[str, torch.Tensor], log_prob: torch.Tensor, rows: Any = slice(None)
) -> tuple[torch.Tensor, dict]:
    selected = case.get("selected")
    extra = {"selected": selected[rows]} if selected is not None else {}
    out = loss.fn(
        log_prob[rows],
        case["old_log_prob"][rows].clone(),
        case["advantages"][rows].clone(),
        case["response_mask"][rows].clone(),
        **loss.kwargs,
        **extra,
    )
    if not (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and isinstance(out[0], torch.Tensor)
        and isinstance(out[1], dict)
    ):
        raise _fail(
            who(loss),
            f"returned {type(out).__name__}, not (per_token_loss tensor, metrics dict).",
            _LOSS_CONTRACT,
        )
    return out[0], out[1]


def check_policy_loss(
    spec_or_name: Any,
    *,
    registries: Any = None,
    loss_agg_modes: tuple[str, ...] = LOSS_AGG_MODES,
    batch: int = 8,
    length: int = 6,
    seed: int = 0,
    **params: Any,
) -> None:
    """Check a policy loss against the registry contract; raise ``ContractError`` naming the first problem.

    ``spec_or_name``: a ``PolicyLossSpec`` or a registered name; ``params``: its parameters.
    Called as the actor calls it (float32 ``[B, T]`` tensors, an integer ``response_mask``):

    - returns ``(per_token_loss [B, T], metrics)``: a floating tensor, finite everywhere, with a
      gradient to ``log_prob``; metrics a dict of finite Python numbers under un-prefixed names (the
      actor adds ``actor/``);
    - aggregated by ``agg_loss`` in every mode of ``loss_agg_modes``, the gradient is 0 for every
      masked token (nothing leaks from padding or tool tokens) and not 0 for all valid ones;
    - split invariance: the batch cut over two ranks and into micro-batches, each piece's loss
      aggregated with the global token and sequence counts, gives the full batch's loss and gradient
      (so the loss of a row may depend only on that row, and on the spec's ``mini_batch_selection``
      made once over the whole batch and passed to each piece as its rows of ``selected``).
    """
    loss = resolve_component("policy_losses", spec_or_name, params, registries)
    name = who(loss)
    case = _loss_case(batch, length, seed)
    selected = _selection(loss, case)
    if selected is not None:
        if tuple(selected.shape) != tuple(case["response_mask"].shape):
            raise _fail(
                name,
                f"mini_batch_selection returned shape {tuple(selected.shape)}; expected [B, T].",
                _LOSS_CONTRACT,
            )
        case["selected"] = selected
    mask = case["response_mask"]
    lp = case["log_prob"].clone().requires_grad_(True)
    per_token, metrics = _call_loss(loss, case, lp)
    _check_loss_outputs(name, per_token, metrics, mask)
    for mode in loss_agg_modes:
        full = agg_loss(per_token, mask, mode, max_response_len=length)
        (grad,) = torch.autograd.grad(full, lp, retain_graph=True)
        _check_gradient(name, grad, mask, mode)
        _check_split(loss, case, full, grad, mode, length)


def _check_loss_outputs(name: str, per_token: torch.Tensor, metrics: dict, mask: torch.Tensor) -> None:
    """A policy loss's ``(per_token_loss, metrics)`` as the contract asks: a finite floating [B, T] tensor
    with a gradient, and finite Python numbers under un-prefixed metric names."""
    if tuple(per_token.shape) != tuple(mask.shape) or not per_token.is_floating_point():
        raise _fail(
            name,
            f"per_token_loss is {per_token.dtype} {tuple(per_token.shape)}; expected a floating [B, T] = "
            f"{tuple(mask.shape)}.",
            _LOSS_CONTRACT,
        )
    if not torch.isfinite(per_token).all():
        raise _fail(
            name,
            "per_token_loss has NaN/inf (also masked positions must be finite: log_prob and "
            "old_log_prob are 0 there).",
            _LOSS_CONTRACT,
        )
    if not per_token.requires_grad:
        raise _fail(
            name,
            "per_token_loss has no gradient with respect to log_prob (was it detached?).",
            _LOSS_CONTRACT,
        )
    for key, value in metrics.items():
        ok = isinstance(key, str) and isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok or value != value or abs(float(value)) == float("inf"):
            raise _fail(
                name,
                f"metric {key!r} = {value!r} is not a finite Python number (return float(...)).",
                _LOSS_CONTRACT,
            )
        if key.startswith("actor/"):
            raise _fail(
                name,
                f"metric {key!r} is prefixed; return un-prefixed names (the actor adds actor/).",
                _LOSS_CONTRACT,
            )


def _check_gradient(name: str, grad: torch.Tensor, mask: torch.Tensor, mode: str) -> None:
    if not torch.isfinite(grad).all():
        raise _fail(name, f"the gradient of the {mode} loss has NaN/inf.", _LOSS_CONTRACT)
    leak = grad[mask == 0].abs().max() if (mask == 0).any() else torch.tensor(0.0)
    if leak > 1e-8:
        rows = sorted({int(r) for r in ((grad.abs() > 1e-8) & (mask == 0)).nonzero()[:, 0]})
        raise _fail(
            name,
            f"masked tokens get a gradient (up to {float(leak):.3g}, rows {rows}) under {mode}: some "
            "row-level quantity (a sequence mean, a normaliser) is computed over masked positions; "
            "weight it by response_mask.",
            _LOSS_CONTRACT,
        )
    if grad[mask == 1].abs().max() == 0:
        raise _fail(name, f"the {mode} loss has zero gradient for every valid token.", _LOSS_CONTRACT)


def _check_split(
    loss: Any, case: dict[str, torch.Tensor], full: torch.Tensor, grad: torch.Tensor, mode: str, length: int
) -> None:
    mask = case["response_mask"]
    b = mask.shape[0]
    ranks = [list(range(r, b, 2)) for r in range(2)]  # two ranks, interleaved rows
    counts = [global_counts(mask[rows]) for rows in ranks]
    g_tokens, g_seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)  # all-reduce SUM
    lp = case["log_prob"].clone().requires_grad_(True)  # one leaf: gradients of all pieces add up (SUM)
    total = torch.zeros(())
    for rows in ranks:
        for start in range(0, len(rows), 3):  # micro-batches of up to 3 rows
            piece = rows[start : start + 3]
            per_token, _ = _call_loss(loss, case, lp, piece)
            share = agg_loss(
                per_token,
                mask[piece],
                mode,
                global_tokens=g_tokens,
                global_seqs=g_seqs,
                max_response_len=length,
            )
            share.backward()
            total = total + share.detach()
    if not torch.allclose(total, full.detach(), rtol=1e-4, atol=1e-6) or not torch.allclose(
        lp.grad, grad, rtol=1e-4, atol=1e-6
    ):
        raise _fail(
            who(loss),
            f"under {mode}, micro-batches and ranks aggregated with the global counts give loss "
            f"{float(total):.6g} (gradient off by {float((lp.grad - grad).abs().max()):.3g}) but the "
            f"full batch gives {float(full.detach()):.6g}: a row's loss must not depend on the other rows "
            "of its micro-batch (no batch-level normalisation inside the loss).",
            _LOSS_CONTRACT,
        )


# ----- rollout corrections --------------------------------------------------------------------------
