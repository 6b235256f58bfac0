"""rlkit.algos: the algorithms as pure torch functions (this package imports only torch, the
standard library and ``rlkit.errors``; a test checks it).

- ``advantages`` / ``estimators``: advantage estimators (natural signatures / the registry's one).
- ``token_baseline``: the optimal token baseline (OTB, TIR-OTB) and Σπ² from logits.
- ``policy_losses``: per-token policy losses with the registry's signature.
- ``cov_losses``: Clip-Cov and KL-Cov (policy losses too) and their mini-batch token selections.
- ``rollout_correction``: importance weights / masks for off-policy rollouts (TIS, MIS, IcePop, decoupled).
- ``aggregation``: ``agg_loss`` with global token/sequence counts (micro-batch and rank exact).
- ``kl``: KL estimators, controllers, KL-in-reward. ``value``: clipped critic loss.
- ``entropy``: chunked entropy and log-probs from logits. ``dapo``: overlong shaping, group filter.

docs/algorithms.md gives every formula, its paper, and where rlkit differs from veRL.
"""

from __future__ import annotations

from rlkit.algos._util import AlgoError, masked_mean, masked_sum, masked_whiten
from rlkit.algos.advantages import (
    compute_gae,
    compute_gpg_advantage,
    compute_grpo_advantage,
    compute_grpo_passk_advantage,
    compute_opo_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_advantage,
    group_mean_std,
)
from rlkit.algos.aggregation import LOSS_AGG_MODES, agg_loss, global_counts
from rlkit.algos.dapo import (
    DynamicSamplingAccumulator,
    DynamicSamplingError,
    filter_groups,
    first_groups_mask,
    overlong_penalty,
)
from rlkit.algos.entropy import entropy_from_logits, log_probs_from_logits
from rlkit.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
    make_kl_controller,
)
from rlkit.algos.value import compute_value_loss

__all__ = [
    "AlgoError",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "group_mean_std",
    "compute_gae",
    "compute_grpo_advantage",
    "compute_grpo_passk_advantage",
    "compute_rloo_advantage",
    "compute_opo_advantage",
    "compute_gpg_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "LOSS_AGG_MODES",
    "agg_loss",
    "global_counts",
    "KL_KINDS",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
    "compute_value_loss",
    "entropy_from_logits",
    "log_probs_from_logits",
    "overlong_penalty",
    "filter_groups",
    "first_groups_mask",
    "DynamicSamplingAccumulator",
    "DynamicSamplingError",
]
