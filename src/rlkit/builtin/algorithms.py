"""Registers rlkit's built-in estimators, policy losses and rollout corrections through the public hooks.

The functions live in ``rlkit.algos`` (torch). Each spec's ``fn`` is a ``LazyFunction``: a real
callable that imports its target on first call, so `rlkit plugins` and `rlkit validate` never
import torch. ``inspect.signature(spec.fn)`` resolves it and gives the target's signature.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rlkit.builtin.algo_params import (
    ClipCovParams,
    DecoupledParams,
    GeoMeanParams,
    IcePopParams,
    KLCovParams,
    LuspoParams,
    OptimalTokenBaselineParams,
    SeqMISParams,
    SeqTISParams,
    TirOptimalTokenBaselineParams,
    TokenMISParams,
    TokenTISParams,
    VespoParams,
)
from rlkit.builtin.params import (
    ClipParams,
    DiscountParams,
    DrGrpoParams,
    GaeParams,
    GroupNormParams,
    PPOClipParams,
    SapoParams,
)
from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import EstimatorSpec, PolicyLossSpec, RolloutCorrectionSpec

__all__ = [
    "LazyFunction",
    "rlkit_register_estimators",
    "rlkit_register_policy_losses",
    "rlkit_register_rollout_corrections",
]


class LazyFunction:
    """A callable standing for ``"package.module:function"``, imported on first use."""

    def __init__(self, target: str):
        self.target = target
        self._fn: Any = None

    def resolve(self) -> Any:
        if self._fn is None:
            module_name, _, attr = self.target.partition(":")
            self._fn = getattr(importlib.import_module(module_name), attr)
        return self._fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.resolve())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LazyFunction) and other.target == self.target

    def __hash__(self) -> int:
        return hash(self.target)

    def __repr__(self) -> str:
        return f"<lazy {self.target}>"


def _est(name: str) -> LazyFunction:
    return LazyFunction(f"rlkit.algos.estimators:{name}")


def _loss(name: str, module: str = "policy_losses") -> LazyFunction:
    return LazyFunction(f"rlkit.algos.{module}:{name}")


def _grpo_family() -> list[EstimatorSpec]:
    """GRPO's advantage under three names: what differs is declared as recipe defaults."""
    return [
        EstimatorSpec(
            name="grpo",
            fn=_est("grpo"),
            params=GroupNormParams,
            needs_groups=True,
            description="GRPO: (score - group mean) / (group std + epsilon)",
            paper="Shao et al. 2024, DeepSeekMath (arXiv:2402.03300)",
        ),
        EstimatorSpec(
            name="dapo",
            fn=_est("grpo"),
            params=GroupNormParams,
            needs_groups=True,
            description="DAPO: GRPO advantage + clip-higher, token-mean, dynamic sampling, overlong shaping",
            recipe_defaults={
                "actor.policy_loss.clip_ratio_low": 0.2,
                "actor.policy_loss.clip_ratio_high": 0.28,
                "actor.loss_agg_mode": "token-mean",
                "algorithm.filter_groups.enable": True,
                "reward.overlong_buffer.enable": True,
            },
            paper="Yu et al. 2025 (arXiv:2503.14476)",
        ),
        EstimatorSpec(
            name="dr_grpo",
            fn=_est("grpo"),
            params=DrGrpoParams,
            needs_groups=True,
            description="Dr.GRPO: score - group mean (no std), constant-normalised token sum",
            recipe_defaults={"actor.loss_agg_mode": "seq-mean-token-sum-norm"},
            paper="Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv:2503.20783)",
        ),
    ]


def _other_group_baselines() -> list[EstimatorSpec]:
    return [
        EstimatorSpec(
            name="rloo",
            fn=_est("rloo"),
            needs_groups=True,
            description="RLOO: score minus the mean of the other samples of its group",
            paper="Ahmadian et al. 2024 (arXiv:2402.14740)",
        ),
        EstimatorSpec(
            name="opo",
            fn=_est("opo"),
            needs_groups=True,
            description="OPO: score minus the length-weighted group mean",
            paper="Hao et al. 2025, On-Policy RL with Optimal Reward Baseline (arXiv:2505.23585)",
        ),
        EstimatorSpec(
            name="gpg",
            fn=_est("gpg"),
            needs_groups=True,
            description="GPG: (score - group mean) * B / #non-zero scores; pairs with the gpg loss",
            recipe_defaults={"actor.policy_loss": "gpg"},
            paper="Chu et al. 2025, GPG (arXiv:2504.02546)",
        ),
        EstimatorSpec(
            name="grpo_passk",
            fn=_est("grpo_passk"),
            params=GroupNormParams,
            needs_groups=True,
            description="Pass@k: only each group's best sample gets max - second max",
            paper="Chen et al. 2025, Pass@k Training (arXiv:2503.19595)",
        ),
        EstimatorSpec(
            name="optimal_token_baseline",
            fn=_est("optimal_token_baseline"),
            params=OptimalTokenBaselineParams,
            needs_groups=True,
            needs_sum_pi_squared=True,
            description="OTB: per-token group baseline weighted by each path's cumulative gradient variance",
            paper="Li et al. 2025, Optimal Token Baseline (https://richardli.xyz/optimal-token-baseline)",
        ),
        EstimatorSpec(
            name="tir_optimal_token_baseline",
            fn=_est("tir_optimal_token_baseline"),
            params=TirOptimalTokenBaselineParams,
            needs_groups=True,
            needs_sum_pi_squared=True,
            description=(
                "TIR-OTB: OTB aligned by valid-token index (multi-turn responses with masked tool spans)"
            ),
            paper="Li et al. 2025, Optimal Token Baseline (https://richardli.xyz/optimal-token-baseline)",
        ),
    ]


@hookimpl
def rlkit_register_estimators() -> list[EstimatorSpec]:
    return [
        EstimatorSpec(
            name="ppo",
            aliases=("gae",),
            fn=_est("ppo"),
            params=GaeParams,
            needs_critic=True,
            description="PPO: GAE advantages from a learned critic, whitened over the batch",
            paper="Schulman et al. 2017 (arXiv:1707.06347); GAE: Schulman et al. 2016 (arXiv:1506.02438)",
        ),
        EstimatorSpec(
            name="reinforce_plus_plus",
            fn=_est("reinforce_plus_plus"),
            params=DiscountParams,
            description="REINFORCE++: discounted returns whitened over the batch",
            paper="Hu 2025 (arXiv:2501.03262)",
        ),
        EstimatorSpec(
            name="reinforce_plus_plus_baseline",
            fn=_est("reinforce_plus_plus_baseline"),
            needs_groups=True,
            description="REINFORCE++-baseline: score - group mean, whitened over the batch",
            paper="Hu 2025 (arXiv:2501.03262)",
        ),
        EstimatorSpec(
            name="remax",
            fn=_est("remax"),
            needs_greedy_baseline=True,
            description="ReMax: return minus the greedy rollout's score",
            paper="Li et al. 2023 (arXiv:2310.10505)",
        ),
        *_grpo_family(),
        *_other_group_baselines(),
    ]


@hookimpl
def rlkit_register_policy_losses() -> list[PolicyLossSpec]:
    return [
        PolicyLossSpec(
            name="ppo_clip",
            fn=_loss("ppo_clip"),
            params=PPOClipParams,
            description="PPO clipped surrogate, asymmetric range, dual clip for negative advantages",
            paper="Schulman et al. 2017 (arXiv:1707.06347); dual clip: Ye et al. 2020 (arXiv:1912.09729)",
        ),
        PolicyLossSpec(
            name="gspo",
            fn=_loss("gspo"),
            params=ClipParams,
            description="GSPO: clipped sequence-level (geometric-mean) ratio, per-token gradient",
            paper="Zheng et al. 2025 (arXiv:2507.18071)",
        ),
        PolicyLossSpec(
            name="cispo",
            fn=_loss("cispo"),
            params=ClipParams,
            description="CISPO: stop-gradient clipped IS weight times advantage times log-prob",
            paper="MiniMax 2025, MiniMax-M1 (arXiv:2506.13585)",
        ),
        PolicyLossSpec(
            name="gpg",
            fn=_loss("gpg"),
            description="GPG: plain policy gradient, -advantage * log-prob",
            paper="Chu et al. 2025, GPG (arXiv:2504.02546)",
        ),
        PolicyLossSpec(
            name="sapo",
            fn=_loss("sapo"),
            params=SapoParams,
            description="SAPO: soft sigmoid gate on the ratio instead of a hard clip",
            paper="Gao et al. 2025, Soft Adaptive Policy Optimization (arXiv:2511.20347)",
        ),
        *_entropy_and_sequence_losses(),
    ]


def _entropy_and_sequence_losses() -> list[PolicyLossSpec]:
    """Entropy-aware and sequence-level losses (docs/algorithms.md gives formulas and aggregation).
    Clip-Cov and KL-Cov declare a ``mini_batch_selection``: the actor makes it over the global
    mini-batch and passes each micro-batch its rows as ``selected``."""
    return [
        PolicyLossSpec(
            name="clip_cov",
            fn=_loss("clip_cov", "cov_losses"),
            params=ClipCovParams,
            mini_batch_selection=_loss("clip_cov_mini_batch_selection", "cov_losses"),
            description="Clip-Cov: PPO clip, plus a random few high-covariance tokens get no gradient",
            paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617)",
        ),
        PolicyLossSpec(
            name="kl_cov",
            fn=_loss("kl_cov", "cov_losses"),
            params=KLCovParams,
            mini_batch_selection=_loss("kl_cov_mini_batch_selection", "cov_losses"),
            description="KL-Cov: no clip; a |log ratio| penalty on the top-covariance tokens",
            paper="Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs (arXiv:2505.22617)",
        ),
        PolicyLossSpec(
            name="geo_mean",
            aliases=("gmpo",),
            fn=_loss("geo_mean"),
            params=GeoMeanParams,
            description="GMPO: geometric mean of token ratios clipped in log space (use seq-mean-token-mean)",
            paper="Zhao et al. 2025, Geometric-Mean Policy Optimization (arXiv:2507.20673)",
        ),
        PolicyLossSpec(
            name="luspo",
            fn=_loss("luspo"),
            params=LuspoParams,
            description="LUSPO: GSPO's sequence loss scaled by length (use seq-mean-token-sum)",
            paper="Length-Unbiased Sequence Policy Optimization (arXiv:2602.05261)",
        ),
        PolicyLossSpec(
            name="vespo",
            fn=_loss("vespo"),
            params=VespoParams,
            description="VESPO: REINFORCE scaled by a Gamma kernel of the sequence IS weight",
            paper="Variational Sequence-Level Soft Policy Optimization (arXiv:2602.10693)",
        ),
    ]


def _corr(name: str) -> LazyFunction:
    return LazyFunction(f"rlkit.algos.rollout_correction:{name}")


@hookimpl
def rlkit_register_rollout_corrections() -> list[RolloutCorrectionSpec]:
    """``algorithm.rollout_correction``: rho = pi_old / pi_rollout per token (docs/algorithms.md)."""
    return [
        RolloutCorrectionSpec(
            name="token_tis",
            fn=_corr("token_tis"),
            params=TokenTISParams,
            output="weights",
            description="token-level truncated IS: weight min(rho_t, threshold)",
            paper="Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
        ),
        RolloutCorrectionSpec(
            name="seq_tis",
            fn=_corr("seq_tis"),
            params=SeqTISParams,
            output="weights",
            description="sequence-level truncated IS: weight min(prod_t rho_t, threshold) on every token",
            paper="Liu, Li et al. 2025, When Speed Kills Stability (https://richardli.xyz/rl-collapse)",
        ),
        RolloutCorrectionSpec(
            name="token_mis",
            fn=_corr("token_mis"),
            params=TokenMISParams,
            output="mask",
            description="token-level masked IS: drop tokens whose rho_t is outside [lower, upper]",
            paper="Liu, Li et al. 2025, When Speed Kills Stability (https://richardli.xyz/rl-collapse)",
        ),
        RolloutCorrectionSpec(
            name="seq_mis",
            fn=_corr("seq_mis"),
            params=SeqMISParams,
            output="mask",
            description=(
                "sequence-level masked IS: drop sequences whose ratio (product or geometric) is outside "
                "bounds"
            ),
            paper="Liu, Li et al. 2025, When Speed Kills Stability (https://richardli.xyz/rl-collapse)",
        ),
        RolloutCorrectionSpec(
            name="icepop",
            fn=_corr("icepop"),
            params=IcePopParams,
            output="weights",
            description="IcePop: weight rho_t inside [lower, upper], 0 outside",
            paper="Ling Team 2025, Every Step Evolves: Ring-1T (arXiv:2510.18855)",
        ),
        RolloutCorrectionSpec(
            name="decoupled",
            fn=_corr("decoupled"),
            params=DecoupledParams,
            output="weights",
            bypass=True,
            description=(
                "decoupled PPO: behaviour weight pi_prox / pi_behav, the clip anchored at pi_prox (= old)"
            ),
            paper="Hilton et al. 2021 (arXiv:2110.00641); AReaL, Fu et al. 2025 (arXiv:2505.24298)",
        ),
    ]
