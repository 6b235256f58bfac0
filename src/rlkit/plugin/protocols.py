"""The contracts a plugin writes against: one ``typing.Protocol`` per class-carrying registry kind.

A spec (``rlkit.plugin.specs``) names a class; this module says what that class must look like: how rlkit
constructs it and which methods the trainer, the runtime and the workers call on it. Optional
capabilities are **declared on the spec** and never probed with ``hasattr``; each declared flag has
its own protocol here (``CAPABILITIES``). ``rlkit.testing`` runs a component against these
contracts; tests/unit/test_protocols.py checks every built-in against them.

=================  ===================  ============================================================
registry           protocol             constructed as
=================  ===================  ============================================================
reward_managers    ``RewardManager``    ``cls(tokenizer, score_fn, *, num_examine, default_score,
                                        timeout_s[, params])``
rollout_backends   ``RolloutBackend``   ``cls(*, module, tokenizer, rollout_config,
                                        max_response_length, device, seed[, params])``
trackers           ``Tracker``          ``cls(config: TrackerConfig)``
roles              ``ActorRolloutRefRole``, ``RolloutRole``, ``RefRole``, ``CriticRole``, ``RewardModelRole``
                                        (``SLOT_PROTOCOLS``): ``cls(rank, world_size, master_addr,
                                        master_port, device, threads, **ROLE_KWARGS[slot])``
agent_loops        ``AgentLoop``        ``cls(generator, tokenizer, tools, *, max_response_length,
                                        sampling[, params])``
tools              ``Tool``             ``cls()`` (``[, params]``)
environments       ``Environment``      ``cls()`` (``[, params]``); multi-turn ones make ``Episode`` objects
=================  ===================  ============================================================

``[, params]``: passed (as ``params=``, the validated pydantic model) only when the spec declares a
params model (``Spec.params``); a class whose spec declares none is never given ``params``.
Functions (estimators, policy losses, compute_score) have their call contracts in ``rlkit.plugin.specs``.

``isinstance(obj, Proto)`` checks that the methods exist (``typing.runtime_checkable``), not their
signatures; ``rlkit.testing`` calls them. Shapes: ``B`` samples, ``P`` prompt width, ``T`` response
width, ``n`` samples per prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # keep this module free of torch: `rlkit plugins` imports the specs that point here
    from pathlib import Path

    import torch
    from torch import nn

    from rlkit.batch import Batch
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rewards.managers import RewardResult
    from rlkit.rollout.agent import Trajectory
    from rlkit.rollout.tools.base import ToolResult
    from rlkit.runtime.tracking import TrackerConfig

__all__ = [
    "RewardManager",
    "SupportsClose",
    "RolloutBackend",
    "GeneratesIds",
    "ReleasesMemory",
    "CAPABILITIES",
    "Tracker",
    "Role",
    "ActorRolloutRefRole",
    "RolloutRole",
    "RefRole",
    "CriticRole",
    "RewardModelRole",
    "SLOT_PROTOCOLS",
    "ROLE_ARGS",
    "ROLE_KWARGS",
    "AgentLoop",
    "Tool",
    "Environment",
    "Episode",
]


# ----- reward managers ------------------------------------------------------------------------------
@runtime_checkable
class RewardManager(Protocol):
    """Turns a batch of responses into token-level scores (registry ``reward_managers``).

    ``score_fn`` is per sample, ``score_fn(data_source, solution_str, ground_truth, extra_info)``, or,
    when the spec declares ``batched_scores=True``, one call per batch with keyword lists
    ``score_fn(data_sources=, solution_strs=, ground_truths=, extra_infos=) -> list``. It may be None
    (every score 0). ``timeout_s`` is ``reward.timeout_s`` (a manager that cannot time out may ignore
    it). Subclassing ``rlkit.rewards.managers.RewardManager`` gives all of this; implement
    ``score_all``.
    """

    def __init__(
        self,
        tokenizer: Any,
        score_fn: Callable[..., Any] | None,
        *,
        num_examine: int = 0,
        default_score: float = 0.0,
        timeout_s: float = 10.0,
        params: Any = None,
    ) -> None: ...

    def __call__(self, batch: Batch) -> RewardResult:
        """Reads ``responses, response_mask [B, T]`` and the per-sample fields ``data_source``,
        ``reward_model`` (``{"ground_truth": ...}``), ``extra_info``. Returns a ``RewardResult``:

        - ``token_level_scores [B, T]`` float32: each sequence's score on its last valid token (the
          last 1 of ``response_mask``; position 0 for an empty response), 0 everywhere else;
        - ``extra``: per-sample values from dict scores, each a list of length B;
        - ``metrics``: floats, at least ``reward/errors`` and ``reward/timeouts``.

        A score function that raises or returns something that is not a finite number (or a dict
        with a finite ``score``) gives that sample ``default_score`` and counts in ``reward/errors``;
        the call itself never raises for a bad score.
        """
        ...


@runtime_checkable
class SupportsClose(Protocol):
    """Optional on a reward manager: ``close()`` at the end of the run (stop worker processes)."""

    def close(self) -> None: ...


# ----- rollout backends -----------------------------------------------------------------------------
@runtime_checkable
class RolloutBackend(Protocol):
    """A generation engine (registry ``rollout_backends``); the Batch layout is ``rlkit.rollout.base``.

    Constructed with keywords only, as ``ActorRolloutRefWorker`` does: ``module`` is the actor's
    (possibly FSDP-sharded) causal LM in the same process (the hybrid engine; a backend with its own
    engine may ignore it), ``rollout_config`` the recipe's ``rollout`` section, ``max_response_length``
    ``data.max_response_length``, ``seed`` differs per rank.
    """

    def __init__(
        self,
        *,
        module: nn.Module | None,
        tokenizer: Any,
        rollout_config: RolloutConfig,
        max_response_length: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        params: Any = None,
    ) -> None: ...

    def generate(
        self,
        prompts: Batch,
        *,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        stop: list[str] | None = None,
    ) -> Batch:
        """``prompts["input_ids"], prompts["attention_mask"] [B, P]`` (left-padded; a None keyword falls
        back to the rollout config) → a Batch of ``B * n`` rows, row ``i * n + j`` being sample ``j``
        of prompt ``i``: ``prompts [B*n, P]``, ``responses [B*n, T]`` (``T = max_new_tokens``, pad id
        after the end), ``input_ids, attention_mask, position_ids [B*n, P+T]``, ``response_mask
        [B*n, T]`` (1 up to and including the token that ended the response), ``rollout_log_probs
        [B*n, T]`` (one log-prob per response token of the untruncated temperature-scaled
        distribution, 0 where masked; temperature 1 when greedy); meta ``temperature``, ``do_sample``.
        """
        ...

    def update_weights(self, weights: nn.Module | dict[str, torch.Tensor]) -> None:
        """Take the actor's new weights: the module itself (hybrid engine, ``sync_weights``) or a
        full state dict (a rollout-only worker, ``update_rollout_weights``)."""
        ...


@runtime_checkable
class GeneratesIds(Protocol):
    """Capability ``RolloutBackendSpec.generate_ids``: token-level turns for agent loops
    (``rlkit.rollout.agent``). Without it, agent loops drive the backend's ``generate`` one batch at
    a time (``HFTurnGenerator``)."""

    async def generate_ids(
        self, prompt_ids: list[int], sampling: dict[str, Any]
    ) -> tuple[list[int], list[float], str]:
        """Continue ``prompt_ids`` once: ``(token_ids, logprobs, finish_reason)`` with one log-prob per
        token and ``finish_reason`` ``"stop"`` (eos or a stop string) or ``"length"``
        (``sampling["max_new_tokens"]`` reached). ``sampling``: temperature, top_p, top_k, do_sample,
        stop, max_new_tokens."""
        ...


@runtime_checkable
class ReleasesMemory(Protocol):
    """Capability ``RolloutBackendSpec.memory_release``: an engine with its own accelerator memory
    gives it back after generation (``release_memory``) and takes it again before the next weight
    sync (``resume_memory``), so the colocated actor update can use it (veRL's sleep/wake)."""

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...


# ``RolloutBackendSpec`` flag -> the protocol a backend declaring it must satisfy.
CAPABILITIES: Mapping[str, type] = {"generate_ids": GeneratesIds, "memory_release": ReleasesMemory}


# ----- trackers -------------------------------------------------------------------------------------
@runtime_checkable
class Tracker(Protocol):
    """An experiment tracker (registry ``trackers``), built as ``cls(config: TrackerConfig)``.

    ``name`` is the key of its run id in checkpoints; ``run_id`` ("" when it has none) comes back in
    ``config.run_ids[name]`` when a run resumes, and the tracker then continues that run. A call that
    raises never stops training (``rlkit.runtime.tracking.Tracking`` reports it once and counts it).
    """

    name: str
    run_id: str

    def __init__(self, config: TrackerConfig) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None:
        """The resolved recipe, as nested dicts (once per run)."""
        ...

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics (veRL names with slashes: ``critic/score/mean``)."""
        ...

    def log_artifact(self, path: str | Path) -> None: ...

    def log_text(self, text: str, name: str) -> None:
        """A text file ``name`` (may contain ``/``) of the run: the recipe, generations tables."""
        ...

    def finish(self, status: str = "FINISHED") -> None:
        """``FINISHED`` or ``FAILED``."""
        ...


# ----- roles ----------------------------------------------------------------------------------------
@runtime_checkable
class Role(Protocol):
    """What ``WorkerGroup`` calls on every role class (``rlkit.workers.base.Worker`` provides both).

    Constructed once per rank inside a Ray actor as ``cls(*ROLE_ARGS, **ROLE_KWARGS[slot])``; every
    rank's constructor runs at the same time and joins one torch.distributed group. Methods taking a
    Batch are called with ``dispatch="split"`` (each rank gets its part; results are concatenated in
    the original order), the others on every rank or rank 0.
    """

    def ping(self) -> tuple[int, int, int]:
        """``(rank, world_size, pid)`` once constructed."""
        ...

    def destroy(self) -> None:
        """Free models and leave the process group (idempotent)."""
        ...


@runtime_checkable
class ActorRolloutRefRole(Role, Protocol):
    """Slot ``actor_rollout_ref``: the policy, its rollout engine, and the reference model when no
    separate ``ref`` role is mapped (``ref_config`` given)."""

    def generate_sequences(self, prompts: Batch, **sampling: Any) -> Batch:
        """The backend's ``generate`` (``RolloutBackend``); the trainer sends ``prompts.repeat(n)`` with
        ``n=1`` so each rank returns one row per input row, and may set ``do_sample``,
        ``temperature``, ``top_p``. Meta ``metrics`` (optional) is logged."""
        ...

    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_prob [B, T]`` under the current weights. Called with ``with_sum_pi_squared=True`` only
        when the estimator declares ``needs_sum_pi_squared`` (then also ``sum_pi_squared [B, T]``)."""
        ...

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B, T]`` (called only when the reference lives here)."""
        ...

    def update_actor(self, batch: Batch) -> dict[str, float]:
        """One policy update on ``advantages [B, T]`` (times ``rollout_is_weights [B, T]`` per token when the
        batch has them); the same ``actor/*`` metrics on every rank."""
        ...

    def sync_weights(self) -> None:
        """Hand the updated weights to the rollout engine (every rank)."""
        ...

    def num_params(self) -> int:
        """Parameters of the full model (rank 0), for ``perf/mfu/actor``."""
        ...

    def save_checkpoint(self, directory: str) -> None:
        """Write this role's sub-folders of the step's checkpoint folder (every rank)."""
        ...

    def load_checkpoint(self, directory: str) -> None: ...


@runtime_checkable
class RolloutRole(Role, Protocol):
    """Slot ``rollout``: generation in a pool of its own (``trainer.mode`` one_step_off / async), on weights
    the driver pushes by version (``rlkit.step.ahead``)."""

    def generate_sequences(self, prompts: Batch, **sampling: Any) -> Batch:
        """As ``ActorRolloutRefRole.generate_sequences``, plus ``rollout_version [B]`` (long): the version of
        the weights each row was generated with."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> float:
        """Load the actor's weights of ``version`` (every rank): its full state dict, or with ``lora`` (the
        constructor's ``actor.lora``) the adapter's tensors alone; the seconds it took."""
        ...

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...


@runtime_checkable
class RefRole(Role, Protocol):
    """Slot ``ref``: a separate frozen reference policy (mapped in ``resources.roles``)."""

    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B, T]``."""
        ...


@runtime_checkable
class CriticRole(Role, Protocol):
    """Slot ``critic``: the value model, when the estimator declares ``needs_critic``."""

    def compute_values(self, batch: Batch) -> Batch:
        """``values [B, T]``."""
        ...

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """One value update on ``values, returns [B, T]``; the same ``critic/*`` metrics on every rank."""
        ...

    def save_checkpoint(self, directory: str) -> None: ...

    def load_checkpoint(self, directory: str) -> None: ...


@runtime_checkable
class RewardModelRole(Role, Protocol):
    """Slot ``reward_model``: a model that scores whole sequences (``reward.reward_model.enable``)."""

    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores [B]`` from ``input_ids, attention_mask, position_ids [B, P+T]``."""
        ...


SLOT_PROTOCOLS: Mapping[str, type] = {
    "actor_rollout_ref": ActorRolloutRefRole,
    "rollout": RolloutRole,
    "ref": RefRole,
    "critic": CriticRole,
    "reward_model": RewardModelRole,
}

# Positional arguments of every role constructor (``WorkerGroup``), then the keywords the runtime
# passes for each slot (``rlkit.runtime.build.Runtime._role_kwargs``; a test keeps the two in step).
ROLE_ARGS = ("rank", "world_size", "master_addr", "master_port", "device", "threads")
ROLE_KWARGS: Mapping[str, frozenset[str]] = {
    "actor_rollout_ref": frozenset(
        {
            "model_config",
            "actor_config",
            "rollout_config",
            "ref_config",
            "max_response_length",
            "total_steps",
            "seed",
            "policy_loss",
            "rollout_backend",
            "agent_loops",
            "default_agent",
            "tools",
        }
    ),
    "rollout": frozenset(
        {
            "model_config",
            "rollout_config",
            "max_response_length",
            "seed",
            "rollout_backend",
            "agent_loops",
            "default_agent",
            "tools",
            "lora",
        }
    ),
    "ref": frozenset({"model_config", "ref_config", "temperature", "mixed_precision"}),
    "critic": frozenset(
        {
            "model_config",
            "critic_config",
            "rollout_n",
            "ppo_mini_batch_size",
            "total_steps",
            "mixed_precision",
            "seed",
        }
    ),
    "reward_model": frozenset({"model_config", "reward_model_path", "micro_batch_size", "mixed_precision"}),
}


# ----- agent loops and tools ------------------------------------------------------------------------
@runtime_checkable
class AgentLoop(Protocol):
    """One multi-turn conversation (registry ``agent_loops``; ``rlkit.rollout.agent``).

    Built per batch by ``AgentLoopRollout`` as ``cls(generator, tokenizer, tools, *,
    max_response_length, sampling[, params])``: ``generator`` is a ``GeneratesIds``, ``tools`` a
    dict name → ``Tool`` when the spec declares ``uses_tools`` (else None), ``sampling`` the
    sampling settings of this call (temperature, top_p, top_k, do_sample, stop).
    """

    schemas: list[dict[str, Any]] | None  # tool schemas for the chat template (None: no tools)

    def __init__(
        self,
        generator: GeneratesIds,
        tokenizer: Any,
        tools: Mapping[str, Tool] | None,
        *,
        max_response_length: int,
        sampling: dict[str, Any] | None = None,
        params: Any = None,
    ) -> None: ...

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids for ``messages`` (used when ``schemas`` changes the rendering)."""
        ...

    async def run(
        self,
        messages: list[dict[str, Any]],
        tools_kwargs: dict[str, Any] | None = None,
        prompt_ids: list[int] | None = None,
    ) -> Trajectory:
        """Run to the end. The ``Trajectory`` keeps ``prompt_ids`` and has ``response_ids``,
        ``response_mask`` (1 = generated by the policy, 0 = tool/template tokens) and ``log_probs``
        (0 where the mask is 0) of one length <= ``max_response_length``, ``num_turns`` >= 1,
        ``tool_calls`` and ``finish_reason`` (``stop``, ``length`` or ``max_turns``)."""
        ...


@runtime_checkable
class Tool(Protocol):
    """A tool an agent loop offers the model (registry ``tools``; ``rlkit.rollout.tools.base.Tool``
    is the base class). The loop calls it only through ``rlkit.rollout.tools.call_tool``, which
    checks required arguments and turns exceptions into failed results."""

    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object

    def schema(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        ...

    async def execute(self, arguments: dict[str, Any], **tools_kwargs: Any) -> ToolResult:
        """One call; ``tools_kwargs``: the data row's ``extra_info.tools_kwargs[name]``."""
        ...


# ----- environments ---------------------------------------------------------------------------------
@runtime_checkable
class Episode(Protocol):
    """One multi-turn episode of an environment (``Environment.episode``), driven by the ``environment``
    agent loop (``rlkit.rollout.environment``): after each assistant turn the loop calls ``step`` with the
    turn's text; the returned reply becomes a user turn (masked out of the loss) unless the episode is
    done."""

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        """``(reply, done)``: the environment's next user message (None or "" when done) and whether the
        episode ended. May raise or hang: the loop times it out and counts it (``env/errors``)."""
        ...

    def reward(self) -> float | dict[str, float]:
        """The episode's reward: a number, or a rubric's parts with ``score`` (each part logged)."""
        ...


@runtime_checkable
class Environment(Protocol):
    """A source of rows and their scores (registry ``environments``; docs/environments.md).

    ``rows(split)`` → veRL rows (``data_source`` = the spec's name, ``prompt`` messages,
    ``reward_model.ground_truth``, ``extra_info``), ``split`` ``"train"`` or ``"val"`` (an empty list: no
    validation rows). ``score(solution_str, ground_truth, extra_info)`` → a number, or a dict with ``score``
    and the rubric's weighted parts (each logged as ``reward_extra/<part>``); it runs in the reward
    manager's scoring child. A spec with ``multi_turn`` also has ``episode(extra_info) -> Episode``.
    """

    def rows(self, split: str) -> list[dict[str, Any]]: ...

    def score(self, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None) -> Any: ...
