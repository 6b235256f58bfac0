"""Cross-field rules of a schema-valid recipe: what no single key's type can say. The role plan, the
estimator's mode, the agent loop, rollout correction, bypass, LoRA, a backend's limits, environments and batch
sizes. ``rlkit.recipe.validate`` runs :func:`check_rules` after schema validation; every rule returns
``(key, problem)`` pairs, and the problems of all rules are reported together."""

from __future__ import annotations

from typing import Any

from rlkit.plugin.registry import Registries
from rlkit.recipe.compose import Resolved, plan_roles
from rlkit.recipe.schema import CriticConfig, Recipe

__all__ = ["check_rules", "uses_critic", "uses_ref", "role_world_size"]


def uses_critic(recipe: Recipe, registries: Registries) -> bool:
    """A critic runs when the estimator needs one (validation keeps ``critic.enable`` consistent)."""
    return registries.estimators.get(recipe.algorithm.estimator.name).needs_critic


def uses_ref(recipe: Recipe) -> bool:
    """A reference model runs when a KL term needs it, or when the recipe asks for one."""
    needed = recipe.actor.use_kl_loss or recipe.algorithm.use_kl_in_reward
    return needed if recipe.ref.enable is None else recipe.ref.enable


def role_world_size(recipe: Recipe, slot: str, registries: Registries | None = None) -> int:
    """Ranks of the pool the role filling ``slot`` is mapped to (unmapped slots use the first pool)."""
    pools = recipe.resources.pools
    mapped = {}
    for role, pool in recipe.resources.roles.items():
        spec = registries.roles.get(role) if registries is not None and role in registries.roles else None
        mapped[spec.fills if spec is not None else role] = pool
    pool = pools.get(mapped.get(slot, ""), next(iter(pools.values())))
    return pool.nodes * pool.bundles_per_node


def check_rules(recipe: Recipe, explicit: dict, registries: Registries) -> list[tuple[str, str]]:
    """Every cross-field problem of a schema-valid ``recipe`` as ``(key, problem)`` pairs; ``explicit``: the
    mapping as the user wrote it (before the estimator's recipe defaults)."""
    problems: list[tuple[str, str]] = _check_batch_sizes(recipe, registries) + _check_allocator(recipe)
    est_name = recipe.algorithm.estimator.name
    if est_name not in registries.estimators:
        return problems  # already reported by rlkit.recipe.validate (the component check)
    est = registries.estimators.get(est_name)
    estimator = Resolved("estimators", est.name, est)  # the rules look at the spec, not its parameters
    problems += _check_estimator_needs(recipe, explicit, est)
    problems += _check_pools(recipe)
    problems += _check_environment(recipe, registries)
    problems += _check_overlong_buffer(recipe)
    problems += plan_roles(recipe, registries, estimator)[1]
    problems += _check_mode(recipe, est, registries)
    problems += _check_agent(recipe, registries)
    problems += _check_rollout_correction(recipe, registries)
    problems += _check_lora(recipe, registries)
    problems += _check_backend_limits(recipe, registries)
    problems += _check_reward_model(recipe)
    return problems


def _check_estimator_needs(recipe: Recipe, explicit: dict, est: Any) -> list[tuple[str, str]]:
    """What the estimator needs (a critic, groups) or makes pointless (critic options), and what the KL terms
    and dynamic sampling need."""
    problems, est_name = [], est.name
    default_critic = CriticConfig()
    critic_keys = sorted(  # critic options the user changed from their defaults
        k
        for k in (explicit.get("critic") or {})
        if k != "enable" and getattr(recipe.critic, k, None) != getattr(default_critic, k, None)
    )
    if est.needs_critic and recipe.critic.enable is False:
        problems.append(
            (
                "critic.enable",
                f"estimator '{est_name}' needs a critic; remove critic.enable=false or pick a "
                "critic-free estimator such as grpo",
            )
        )
    if not est.needs_critic and recipe.critic.enable:
        problems.append(
            (
                "critic.enable",
                f"estimator '{est_name}' uses no critic; set algorithm.estimator=ppo to train one, or "
                "remove critic.enable",
            )
        )
    elif not est.needs_critic and critic_keys:
        problems.append(
            (
                f"critic.{critic_keys[0]}",
                f"critic options ({', '.join(critic_keys)}) are set but estimator '{est_name}' uses no "
                "critic; remove them or set algorithm.estimator=ppo",
            )
        )
    if est.needs_groups and recipe.rollout.n < 2:
        problems.append(
            (
                "rollout.n",
                f"estimator '{est_name}' compares responses within a group; set rollout.n to 2 or more "
                f"(got {recipe.rollout.n})",
            )
        )
    if recipe.algorithm.filter_groups.enable and recipe.rollout.n < 2:
        problems.append(
            (
                "algorithm.filter_groups.enable",
                "dynamic sampling filters groups of responses; it needs rollout.n >= 2",
            )
        )
    if recipe.ref.enable is False and (recipe.actor.use_kl_loss or recipe.algorithm.use_kl_in_reward):
        problems.append(
            (
                "ref.enable",
                "a KL term (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the reference model; "
                "remove ref.enable=false or turn the KL term off",
            )
        )
    return problems


def _check_pools(recipe: Recipe) -> list[tuple[str, str]]:
    """Every role placed on a pool the recipe declares."""
    return [
        (f"resources.roles.{role}", f"unknown pool '{pool}'; pools: {', '.join(recipe.resources.pools)}")
        for role, pool in recipe.resources.roles.items()
        if pool not in recipe.resources.pools
    ]


def _check_overlong_buffer(recipe: Recipe) -> list[tuple[str, str]]:
    """DAPO's overlong buffer inside the response length."""
    ob = recipe.reward.overlong_buffer
    if ob.enable and ob.len > recipe.data.max_response_length:
        return [
            (
                "reward.overlong_buffer.len",
                f"{ob.len} tokens does not fit in data.max_response_length="
                f"{recipe.data.max_response_length}; the penalty starts len tokens before the maximum "
                "(DAPO: 4096 of 20480), so set it at most that",
            )
        ]
    return []


def _check_reward_model(recipe: Recipe) -> list[tuple[str, str]]:
    """A reward model enabled with its folder, and a folder only with the model enabled."""
    problems = []
    rm = recipe.reward.reward_model
    if rm.enable and not rm.path:
        problems.append(
            (
                "reward.reward_model.path",
                "reward.reward_model.enable is true but no model folder is given; "
                "set reward.reward_model.path=<folder of a sequence-classification model>",
            )
        )
    elif rm.path and not rm.enable:
        problems.append(
            (
                "reward.reward_model.path",
                "a reward model path is set but reward.reward_model.enable is false; "
                "enable it or remove the path",
            )
        )
    return problems


def _check_mode(recipe: Recipe, est: Any, registries: Registries) -> list[tuple[str, str]]:
    """``trainer.mode`` against what the step does outside one generation call (docs/async.md)."""
    trainer, problems = recipe.trainer, []
    if trainer.mode == "sync":
        if trainer.max_staleness is not None:
            problems.append(
                (
                    "trainer.max_staleness",
                    "trainer.mode=sync trains every batch on the weights that generated "
                    "it; remove trainer.max_staleness or set trainer.mode=async",
                )
            )
        return problems
    if trainer.mode == "one_step_off" and trainer.max_staleness not in (None, 1):
        problems.append(
            (
                "trainer.max_staleness",
                f"trainer.mode=one_step_off is exactly 1 version behind (got "
                f"{trainer.max_staleness}); remove it, or set trainer.mode=async for a larger bound",
            )
        )
    if recipe.algorithm.filter_groups.enable:
        problems.append(
            (
                "algorithm.filter_groups.enable",
                f"dynamic sampling refills a step with new generations "
                f"while it runs, which trainer.mode={trainer.mode} generates ahead; set trainer.mode=sync or "
                "algorithm.filter_groups.enable=false",
            )
        )
    if est.needs_greedy_baseline:
        problems.append(
            (
                "algorithm.estimator",
                f"estimator '{est.name}' needs a greedy rollout of the current policy "
                f"in the step, which trainer.mode={trainer.mode} does not run; set trainer.mode=sync or pick "
                "another estimator",
            )
        )
    samples = recipe.data.train_batch_size * recipe.rollout.n
    ranks = role_world_size(recipe, "rollout", registries)
    if samples < ranks:
        problems.append(
            (
                "data.train_batch_size",
                f"a generation batch of {samples} samples cannot be split over "
                f"{ranks} rollout ranks; make train_batch_size x rollout.n at least that",
            )
        )
    return problems


def _check_agent(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    agent = recipe.rollout.agent
    uses_tools = (
        agent is not None
        and agent.name in registries.agent_loops
        and registries.agent_loops.get(agent.name).uses_tools
    )
    if uses_tools and not recipe.rollout.tools:
        return [
            (
                "rollout.tools",
                f"rollout.agent={agent.name} offers tools but none are listed, e.g. "
                "rollout.tools=[calculator]",
            )
        ]
    if recipe.rollout.tools and agent is None:
        return [
            (
                "rollout.tools",
                "tools are listed but no agent loop offers them; set rollout.agent=tool (or remove the "
                "tools)",
            )
        ]
    return []


def _check_rollout_correction(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """A correction compares the trainer's log-probs with the rollout engine's: the backend must report them.
    Bypass (pi_old := pi_rollout) is refused where it would do nothing or starve a component of the pass."""
    correction, backend = recipe.algorithm.rollout_correction, recipe.rollout.backend.name
    if correction is None:
        return []
    problems = _check_bypass(recipe, registries)
    if backend not in registries.rollout_backends:
        return problems
    if not registries.rollout_backends.get(backend).rollout_log_probs:
        return [
            (
                "algorithm.rollout_correction",
                f"'{correction.name}' weighs tokens by pi_old / pi_rollout, but rollout backend '{backend}' "
                "does not return rollout_log_probs (its spec declares rollout_log_probs=False); use a "
                "backend that does (hf, sglang, vllm) or remove algorithm.rollout_correction",
            )
        ] + problems
    return problems


def _check_bypass(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """``bypass`` on a correction without it (its ratio would be 1 everywhere), or with an estimator that
    needs the old-log-prob pass bypass skips (OTB's sum_pi_squared)."""
    correction = recipe.algorithm.rollout_correction
    if correction.name not in registries.rollout_corrections or not correction.params.get("bypass", False):
        return []
    key = "algorithm.rollout_correction.bypass"
    if not registries.rollout_corrections.get(correction.name).bypass:
        with_bypass = sorted(e.spec.name for e in registries.rollout_corrections if e.spec.bypass)
        return [
            (
                key,
                f"'{correction.name}' has no bypass mode: bypass makes pi_old = pi_rollout, so its ratio "
                "pi_old / pi_rollout would be 1 on every token and it would do nothing. Corrections with "
                f"bypass: {with_bypass} ({{name: decoupled, bypass: true}} is PPO clipped against the "
                "rollout policy); or remove bypass to correct pi_old / pi_rollout with the old-log-prob "
                "pass",
            )
        ]
    est = recipe.algorithm.estimator.name
    if est in registries.estimators and registries.estimators.get(est).needs_sum_pi_squared:
        return [
            (
                key,
                f"estimator '{est}' needs sum_pi_squared from the actor's old-log-prob pass, which bypass "
                "skips; use bypass: false, or an estimator without it (e.g. grpo)",
            )
        ]
    return []


def _check_lora(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """actor.lora needs a backend that takes a LoRA actor (its spec's ``lora``); outside the sync mode, the hf
    backend (the rollout pool's module carries the adapter, pushes send its tensors alone; docs/lora.md)."""
    backend = recipe.rollout.backend.name
    if recipe.actor.lora is None or backend not in registries.rollout_backends:
        return []
    if not registries.rollout_backends.get(backend).lora:
        return [
            (
                "actor.lora",
                f"rollout backend '{backend}' does not take a LoRA actor (its spec declares lora=False): "
                "use rollout.backend=hf, sglang or vllm, or remove actor.lora",
            )
        ]
    if recipe.trainer.mode != "sync" and backend != "hf":
        return [
            (
                "actor.lora",
                f"LoRA with trainer.mode={recipe.trainer.mode} runs with rollout.backend=hf only (a "
                f"rollout pool of '{backend}' engines loading the pushed adapter is not yet verified): "
                "set rollout.backend=hf or trainer.mode=sync, or remove actor.lora",
            )
        ]
    return []


def _check_backend_limits(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """What the rollout backend's spec declares it cannot do: truncated sampling, more than ``max_ranks``
    ranks."""
    name, rollout = recipe.rollout.backend.name, recipe.rollout
    if name not in registries.rollout_backends:
        return []
    spec, problems = registries.rollout_backends.get(name), []
    if not spec.truncated_sampling:
        checks = [("top_k", rollout.top_k, 0), ("top_p", rollout.top_p, 1.0)]
        # greedy ignores it
        checks += [("val.top_p", rollout.val.top_p, 1.0)] if rollout.val.do_sample else []
        for key, value, off in checks:
            if value != off:
                problems.append(
                    (
                        f"rollout.{key}",
                        f"rollout backend '{name}' reports log-probs after its top-k / top-p truncation, not "
                        "the untruncated distribution the trainer recomputes (rlkit.rollout.base); set "
                        f"rollout.{key}={off}, or use rollout.backend=hf",
                    )
                )
    slot = "actor_rollout_ref" if recipe.trainer.mode == "sync" else "rollout"
    ranks = role_world_size(recipe, slot, registries)
    if spec.max_ranks is not None and ranks > spec.max_ranks:
        problems.append(
            (
                f"resources.roles.{slot}",
                f"rollout backend '{name}' runs in a worker group of at most "
                f"{spec.max_ranks} rank(s); the {slot} pool has {ranks}. Map {slot} to a pool of "
                f"{spec.max_ranks} bundle(s) (resources.pools.<pool>: nodes=1, bundles_per_node="
                f"{spec.max_ranks}), or use rollout.backend=hf",
            )
        )
    copy_dtype = recipe.rollout.backend.params.get("dtype")
    # the hybrid engine decodes with the actor's own module, FSDP-sharded above 1 rank (a rollout pool's ranks
    # each hold a plain copy: rlkit.workers.rollout_worker)
    if name == "hf" and copy_dtype in ("bfloat16", "float16") and ranks > 1 and slot == "actor_rollout_ref":
        problems.append(
            (
                "rollout.backend.dtype",
                f"the hf backend decodes with a {copy_dtype} copy of an unsharded "
                f"module only; the {slot} pool has {ranks} ranks, so its module is FSDP-sharded and decodes "
                "in the actor's own dtype. Set rollout.backend.dtype=auto (or float32), or give "
                f"{slot} a pool of 1 bundle",
            )
        )
    if name == "hf" and recipe.rollout.backend.params.get("linears") == "onnxruntime":
        problems += _check_onnxruntime_linears(recipe, copy_dtype, ranks, slot)
    return problems


def _check_allocator(recipe: Recipe) -> list[tuple[str, str]]:
    """``resources.allocator: keep_freed`` needs glibc where rlkit starts the cluster here."""
    from rlkit.hardware.allocator import keep_freed_unavailable

    res = recipe.resources
    if res.allocator == "keep_freed" and (reason := keep_freed_unavailable(res.ray_address is None)):
        return [("resources.allocator", reason)]
    return []


def _check_onnxruntime_linears(
    recipe: Recipe, copy_dtype: Any, ranks: int, slot: str
) -> list[tuple[str, str]]:
    """``rollout.backend.linears: onnxruntime`` (rlkit.rollout.mlas_weights): an fp32 decode copy of an
    unsharded module on the CPU, with onnxruntime installed."""
    from rlkit.hardware import onnxruntime_unavailable

    key, problems = "rollout.backend.linears", []
    if copy_dtype in ("bfloat16", "float16"):
        problems.append(
            (
                key,
                f"the onnxruntime linears decode in float32, not {copy_dtype}; set rollout.backend.dtype="
                "float32 (or auto), or rollout.backend.linears=torch",
            )
        )
    if recipe.resources.device == "cuda":
        problems.append(
            (key, "the onnxruntime linears run on the CPU; set rollout.backend.linears=torch on cuda")
        )
    if ranks > 1 and slot == "actor_rollout_ref":
        problems.append(
            (
                key,
                f"the onnxruntime linears pack an unsharded module's weights; the {slot} pool has {ranks} "
                f"ranks (FSDP-sharded). Give {slot} a pool of 1 bundle, or set rollout.backend.linears=torch",
            )
        )
    if reason := onnxruntime_unavailable():
        problems.append((key, f"{reason}; or set rollout.backend.linears=torch"))
    return problems


def _check_environment(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    """data.environment gives the rows (so no files beside it); without it, train_files are needed."""
    data, env = recipe.data, recipe.data.environment
    if env is None:
        return (
            []
            if data.train_files
            else [
                (
                    "data.train_files",
                    "required: give parquet files, or set "
                    "data.environment to take the rows from an environment",
                )
            ]
        )
    problems = [
        (f"data.{key}", f"data.environment '{env.name}' gives the rows; remove data.{key}")
        for key in ("train_files", "val_files")
        if getattr(data, key)
    ]
    agent = recipe.rollout.agent
    if (
        env.name in registries.environments
        and registries.environments.get(env.name).multi_turn
        and agent is not None
        and agent.name in registries.agent_loops
        and not registries.agent_loops.get(agent.name).uses_environment
    ):
        problems.append(
            (
                "rollout.agent",
                f"environment '{env.name}' is multi-turn: its episodes run in the `environment` agent loop, "
                f"not '{agent.name}'; remove rollout.agent or set it to environment",
            )
        )
    played_by = (
        registries.environments.get(env.name).played_by if env.name in registries.environments else None
    )
    if played_by and agent is not None and agent.name != played_by:
        problems.append(
            (
                "rollout.agent",
                f"environment '{env.name}' is played by the '{played_by}' agent loop, not '{agent.name}'; "
                f"set rollout.agent: {{name: {played_by}}}",
            )
        )
    return problems


def _check_batch_sizes(recipe: Recipe, registries: Registries) -> list[tuple[str, str]]:
    problems = []
    data, actor = recipe.data, recipe.actor
    if data.train_batch_size % actor.ppo_mini_batch_size:
        problems.append(
            (
                "actor.ppo_mini_batch_size",
                f"{actor.ppo_mini_batch_size} does not divide "
                f"data.train_batch_size={data.train_batch_size}; both count prompts",
            )
        )
    ranks = role_world_size(recipe, "actor_rollout_ref", registries)
    samples = actor.ppo_mini_batch_size * recipe.rollout.n
    if samples % ranks:
        problems.append(
            (
                "actor.ppo_mini_batch_size",
                f"a mini-batch of {samples} samples (ppo_mini_batch_size × rollout.n) does not split "
                f"evenly over {ranks} actor ranks",
            )
        )
    return problems
