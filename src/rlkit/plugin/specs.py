"""What a plugin hands to a registry: one small frozen dataclass per registry kind.

A hook implementation returns a list of these::

    @rlkit.hookimpl
    def rlkit_register_estimators():
        return [EstimatorSpec(name="my_adv", fn=my_advantage, needs_groups=True)]

Call contracts (the trainer and workers call every entry the same way):

- ``EstimatorSpec.fn(inputs, **params) -> (advantages, returns)``: ``inputs`` is one
  ``rlkit.algos.estimators.EstimatorInputs`` (``token_level_rewards [B, T]``, ``response_mask [B, T]``,
  ``group_id [B]``, and only what the spec declares: ``values`` with ``needs_critic``, ``reward_baselines``
  with ``needs_greedy_baseline``, ``old_log_prob``/``sum_pi_squared``/``rollout_is_weights`` with
  ``needs_sum_pi_squared``); out ``[B, T], [B, T]``; ``params`` are the fields of the spec's params model,
  as keyword scalars.
- ``PolicyLossSpec.fn(log_prob, old_log_prob, advantages, response_mask, **params)
  -> (per_token_loss [B, T], metrics dict)``; ``params`` as above. Aggregation over tokens happens
  outside the loss (``rlkit.algos.agg_loss``) so it can use the global token count.

Parameters (the one parameter door): any spec may declare ``params``, a pydantic model class (or a
``"module:Class"`` string). The recipe gives the component its parameters beside its name::

    algorithm:
      estimator: {name: my_adv, my_param: 2}     # the short form `estimator: grpo` also works

Validation checks them against the model (unknown keys forbidden; every error names the plugin);
functions receive the validated fields as keyword arguments, classes receive the model instance as
``params=``. A spec without a params model takes no parameters.
- ``ComputeScoreSpec.fn(data_source, solution_str, ground_truth, extra_info=None)
  -> float | dict`` (veRL's contract; a dict has a ``score`` key plus extra metrics).
- ``RewardManagerSpec.cls``, ``RolloutBackendSpec.cls``, ``RoleSpec.cls``, ``TrackerSpec.cls``,
  ``ToolSpec.cls``: classes; their constructor contracts live beside their base classes
  (``rlkit.rewards``, ``rlkit.rollout``, ``rlkit.workers``, ``rlkit.runtime.tracking``,
  ``rlkit.rollout.tools``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Spec",
    "EstimatorSpec",
    "PolicyLossSpec",
    "RewardManagerSpec",
    "ComputeScoreSpec",
    "RolloutBackendSpec",
    "RoleSpec",
    "TrackerSpec",
    "ToolSpec",
    "AgentLoopSpec",
    "RolloutCorrectionSpec",
    "EnvironmentSpec",
]


@dataclass(frozen=True)
class Spec:
    """Fields every registry entry has."""

    name: str  # the name a recipe uses
    aliases: tuple[str, ...] = ()  # other names that resolve to this entry
    description: str = ""  # one line, shown by `rlkit plugins`
    params: Any = None  # pydantic model class (or "module:Class") of the component's parameters; None = none


@dataclass(frozen=True)
class EstimatorSpec(Spec):
    """An advantage estimator: what a recipe names as its algorithm (``algorithm.estimator``)."""

    fn: Callable[..., Any] | None = None
    needs_critic: bool = False  # PPO/GAE: a critic role must exist and inputs.values is filled
    needs_groups: bool = False  # group-relative: rollout.n must be > 1 (singleton groups degrade)
    needs_greedy_baseline: bool = False  # ReMax: a greedy rollout's score fills inputs.reward_baselines
    # OTB: the trainer recomputes old_log_prob with sum_pi_squared (sum over the vocabulary of pi^2 per token)
    # and fills inputs.old_log_prob, .sum_pi_squared (and .rollout_is_weights with a weighting correction)
    needs_sum_pi_squared: bool = False
    # Defaults the estimator sets on other parts of the recipe, as dotted keys
    # ("actor.policy_loss.clip_ratio_high": 0.28). A key the user set explicitly always wins; a
    # parameter default applies only when the chosen component's params model has that field.
    recipe_defaults: Mapping[str, Any] = field(default_factory=dict)
    paper: str = ""  # citation or URL, shown in docs


@dataclass(frozen=True)
class PolicyLossSpec(Spec):
    fn: Callable[..., Any] | None = None
    paper: str = ""
    # A loss whose token choice depends on the whole mini-batch (Clip-Cov, KL-Cov): the actor calls
    # ``mini_batch_selection(log_prob, old_log_prob, advantages, response_mask, *, generator, **params)
    # -> bool [B, T]`` once over the global mini-batch (all ranks, before any micro-batch) and passes each
    # micro-batch its rows as ``fn(..., selected=...)``, so the split never changes the gradient.
    mini_batch_selection: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RewardManagerSpec(Spec):
    """``cls(tokenizer, score_fn, *, num_examine, default_score, params)`` (``rlkit.rewards.managers``)."""

    cls: type | str | None = None
    # True: the manager calls score_fn once per batch with lists (data_sources=, solution_strs=,
    # ground_truths=, extra_infos=); False: once per sample with veRL's compute_score arguments.
    batched_scores: bool = False


@dataclass(frozen=True)
class ComputeScoreSpec(Spec):
    """A scoring function; ``name`` is the ``data_source`` it scores (aliases: more sources)."""

    fn: Callable[..., Any] | None = None


@dataclass(frozen=True)
class RolloutBackendSpec(Spec):
    """An engine class (``rlkit.rollout.base.RolloutBackend``). Optional capabilities are declared here,
    never probed with ``hasattr``: ``generate_ids`` (token-level turns for agent loops) and
    ``memory_release`` (``release_memory``/``resume_memory`` between generation and the update);
    ``rollout_log_probs`` False for an engine that cannot report the sampled tokens' log-probs
    (validation then refuses ``algorithm.rollout_correction``). Limits checked at recipe validation:
    ``lora`` (takes a LoRA actor's weights: ``actor.lora``), ``truncated_sampling`` False for an engine whose
    log-probs are not the untruncated ones under ``rollout.top_k``/``top_p``, ``max_ranks`` (ranks of the
    worker group holding the engine, None = any)."""

    cls: type | str | None = None
    generate_ids: bool = False
    memory_release: bool = False
    rollout_log_probs: bool = True  # returns rollout_log_probs (what rollout corrections compare against)
    lora: bool = False  # serves a LoRA actor (shares its module, or loads its adapter tensors)
    truncated_sampling: bool = True  # top-k / top-p with rlkit's untruncated rollout_log_probs
    max_ranks: int | None = None  # most ranks of the worker group holding the engine


@dataclass(frozen=True)
class RoleSpec(Spec):
    """A worker class (``rlkit.workers.base.Worker``) and the step slot it fills: ``actor_rollout_ref``,
    ``actor``, ``rollout``, ``ref``, ``critic`` or ``reward_model`` (``rlkit.plugin.protocols`` lists the
    methods each slot needs). A third-party role fills a slot by naming it in ``slot``."""

    cls: type | str | None = None
    slot: str = ""  # defaults to the role's own name
    needs_model: bool = True

    @property
    def fills(self) -> str:
        return self.slot or self.name


@dataclass(frozen=True)
class TrackerSpec(Spec):
    cls: type | None = None


@dataclass(frozen=True)
class ToolSpec(Spec):
    cls: type | str | None = None


@dataclass(frozen=True)
class AgentLoopSpec(Spec):
    """A multi-turn agent loop (``rollout.agent``, or a data row's ``agent_name``):
    ``cls(generator, tokenizer, tools, *, max_response_length, sampling[, params])`` with an async
    ``run(messages, tools_kwargs, prompt_ids) -> Trajectory`` (contract:
    ``rlkit.plugin.protocols.AgentLoop``)."""

    cls: type | str | None = None
    uses_tools: bool = False  # True: the loop offers the recipe's rollout.tools to the model
    # True: ``run`` also takes ``extra_info=`` (the row's) and its params carry the recipe's data.environment
    uses_environment: bool = False


@dataclass(frozen=True)
class RolloutCorrectionSpec(Spec):
    """A rollout correction (``algorithm.rollout_correction``): ``fn(old_log_prob, rollout_log_probs,
    response_mask, **params) -> (tensor [B, T], metrics)``. ``output`` says what the tensor is:
    ``"weights"`` multiply the policy loss per token (no gradient), ``"mask"`` (0/1) replaces the
    ``response_mask`` of the actor update (rejected tokens leave the loss and its token counts).
    Metrics are un-prefixed; the trainer logs them under ``rollout_corr/``."""

    fn: Callable[..., Any] | None = None
    output: str = "weights"  # "weights" | "mask"
    paper: str = ""
    # True: its params model has a bool ``bypass`` (and its function a ``bypass`` keyword: pi_old :=
    # pi_rollout); set, the trainer uses rollout_log_probs as old_log_prob, skips the old-log-prob pass and
    # the call (rlkit.step.correction)
    bypass: bool = False


@dataclass(frozen=True)
class EnvironmentSpec(Spec):
    """An environment (``data.environment``): ``cls(params=...)`` (``params`` only with a params model) giving
    its rows, their score and, with ``multi_turn``, an episode per row (contract:
    ``rlkit.plugin.protocols.Environment``; docs/environments.md). Its rows carry ``data_source`` =
    ``name``."""

    cls: type | str | None = None
    # True: rows run through the `environment` agent loop, the env replying each turn
    multi_turn: bool = False
    # an agent loop (registry `agent_loops`) that plays and scores this environment's episodes itself: its
    # rows name it in extra_info.agent_name and score() is never asked (e.g. verifiers, whose rubric scores)
    played_by: str | None = None
