"""Parameter models of the entropy-aware and sequence-level losses, the two optimal-token-baseline
estimators, and the rollout-correction functions.

Field names are the keyword scalars of the functions in ``rlkit.algos`` (``policy_losses``,
``estimators``, ``rollout_correction``), and the defaults are those functions' defaults, so
``fn(..., **Model().model_dump())`` is the function's default call (tested). docs/algorithms.md gives
each formula, paper and where the defaults come from. All are registered (``rlkit.builtin.algorithms``):
Clip-Cov / KL-Cov with their mini-batch selection, the optimal token baselines with
``needs_sum_pi_squared``, the rollout corrections in their own registry.
"""

from __future__ import annotations

from pydantic import Field, NonNegativeFloat, PositiveFloat, model_validator

from rlkit.builtin.params import ClipParams, Params

__all__ = [
    "ClipCovParams",
    "KLCovParams",
    "GeoMeanParams",
    "LuspoParams",
    "VespoParams",
    "OptimalTokenBaselineParams",
    "TirOptimalTokenBaselineParams",
    "TokenTISParams",
    "SeqTISParams",
    "TokenMISParams",
    "SeqMISParams",
    "IcePopParams",
    "DecoupledParams",
]


# ----- policy losses -------------------------------------------------------------------------------
class ClipCovParams(ClipParams):
    clip_cov_ratio: PositiveFloat = Field(
        0.0002,
        description="share of valid tokens whose gradient is cut (at least one), drawn among the candidates",
    )
    clip_cov_lb: float = Field(
        1.0, description="a candidate's covariance (A - mean A)(logp - mean logp) is above this"
    )
    clip_cov_ub: float = Field(5.0, description="... and below this")

    @model_validator(mode="after")
    def _bounds(self) -> ClipCovParams:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(
                f"clip_cov_lb ({self.clip_cov_lb}) must be below clip_cov_ub ({self.clip_cov_ub})"
            )
        return self


class KLCovParams(Params):
    kl_cov_ratio: PositiveFloat = Field(
        0.0002,
        description="share of valid tokens (the largest covariances, at least one) that get the KL penalty",
    )
    ppo_kl_coef: NonNegativeFloat = Field(
        1.0, description="coefficient of the |log ratio| penalty on those tokens"
    )


class GeoMeanParams(ClipParams):
    clip_ratio_low: float = Field(
        0.4, ge=0, description="GMPO clips the log ratio at -clip_ratio_low (log space)"
    )
    clip_ratio_high: float = Field(
        0.4, ge=0, description="GMPO clips the log ratio at +clip_ratio_high (log space)"
    )


class LuspoParams(ClipParams):
    clip_ratio_low: float = Field(
        2e-3, ge=0, description="sequence ratio >= 1 - clip_ratio_low (paper: 2e-3)"
    )
    clip_ratio_high: float = Field(
        2.5e-3, ge=0, description="sequence ratio <= 1 + clip_ratio_high (paper: 2.5e-3)"
    )


class VespoParams(Params):
    k_pos: NonNegativeFloat = Field(
        2.0, description="power of the Gamma kernel w^k exp(lambda (1 - w)) where A >= 0"
    )
    lambda_pos: PositiveFloat = Field(3.0, description="decay of the Gamma kernel where A >= 0")
    k_neg: NonNegativeFloat = Field(3.0, description="power of the Gamma kernel where A < 0")
    lambda_neg: PositiveFloat = Field(2.0, description="decay of the Gamma kernel where A < 0")


# ----- estimators ----------------------------------------------------------------------------------
class OptimalTokenBaselineParams(Params):
    handle_zero_tail: bool = Field(
        False, description="zero the baseline of a group's unique longest response beyond the second-longest"
    )
    epsilon: PositiveFloat = Field(1e-8, description="added to the summed path variance before dividing")


class TirOptimalTokenBaselineParams(OptimalTokenBaselineParams):
    handle_zero_tail: bool = Field(
        True, description="zero the baseline of a group's unique longest response beyond the second-longest"
    )


# ----- rollout correction --------------------------------------------------------------------------
class TokenTISParams(Params):
    threshold: PositiveFloat = Field(
        2.0, description="cap C: each token's weight is min(pi_old / pi_rollout, C)"
    )


class SeqTISParams(Params):
    threshold: PositiveFloat = Field(2.0, description="cap C: each sequence's weight is min(prod_t ratio, C)")


class _Bounds(Params):
    @model_validator(mode="after")
    def _ordered(self) -> _Bounds:
        lower, upper = self.lower, self.upper  # type: ignore[attr-defined]
        if lower >= upper:
            raise ValueError(f"lower ({lower}) must be below upper ({upper})")
        return self


class TokenMISParams(_Bounds):
    lower: NonNegativeFloat = Field(0.5, description="a token whose ratio is below this is dropped")
    upper: PositiveFloat = Field(2.0, description="a token whose ratio is above this is dropped")


class SeqMISParams(_Bounds):
    lower: NonNegativeFloat = Field(0.5, description="a sequence whose ratio is below this is dropped")
    upper: PositiveFloat = Field(2.0, description="a sequence whose ratio is above this is dropped")
    geometric: bool = Field(
        False, description="sequence ratio = geometric mean of the token ratios (not product)"
    )


class IcePopParams(_Bounds):
    lower: NonNegativeFloat = Field(0.5, description="a token whose ratio is below this gets weight 0")
    upper: PositiveFloat = Field(5.0, description="a token whose ratio is above this gets weight 0")


class DecoupledParams(Params):
    cap: PositiveFloat | None = Field(
        None,
        description="a token whose behaviour weight pi_prox / pi_behav exceeds this gets 0; None = no cap",
    )
    # the trainer reads it (rlkit.step.correction.bypass_on): set, it skips the pass and this function, whose
    # result is known
    bypass: bool = Field(
        False,
        description=(
            "veRL's bypass mode: pi_prox := pi_rollout, so the actor's old-log-prob pass is skipped, the "
            "weight is 1 on every token and the update is plain PPO clipped against the rollout policy"
        ),
    )

    @model_validator(mode="after")
    def _cap_needs_a_proximal_policy(self) -> DecoupledParams:
        if self.bypass and self.cap is not None:
            raise ValueError(
                f"cap ({self.cap}) has no effect with bypass: true (pi_prox = pi_rollout makes every "
                "behaviour weight exactly 1); remove cap, or set bypass: false to weigh by pi_old / "
                "pi_rollout"
            )
        return self
