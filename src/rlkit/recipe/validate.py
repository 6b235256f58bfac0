"""Turn a YAML file plus overrides into a validated ``Recipe``.

Order: load YAML → component short forms become ``{name: ...}`` → apply overrides → apply the
estimator's recipe defaults (only to keys the user did not set) → every component's name and
parameters through ``rlkit.recipe.compose.resolve`` (the resolver composition uses, so what validates is
what runs) → schema validation → cross-field rules (including the role plan) → files and this machine
(``rlkit.recipe.checks_files``). Every problem found is collected; ``RecipeError`` lists them all at once.
Relative paths in a recipe are relative to the working directory, as in veRL.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlkit.errors import RecipeError
from rlkit.plugin.registry import Registries, build_registries, suggest
from rlkit.recipe.checks_files import check_machine
from rlkit.recipe.compose import COMPONENT_KEYS, COMPONENT_LISTS, Resolved, params_model, plan_roles, resolve
from rlkit.recipe.load import apply_overrides, get_path, has_path, load_yaml, set_path
from rlkit.recipe.schema import CriticConfig, Recipe

__all__ = ["load_recipe", "validate_recipe", "recipe_to_dict", "uses_critic", "uses_ref", "role_world_size"]


def load_recipe(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    registries: Registries | None = None,
    check_files: bool = True,
) -> Recipe:
    """Load, override and validate a recipe file. Raises ``RecipeError`` listing every problem."""
    raw = load_yaml(path)
    return validate_recipe(
        raw, list(overrides), source=str(path), registries=registries, check_files=check_files
    )


def validate_recipe(
    raw: dict[str, Any],
    overrides: list[str] | None = None,
    *,
    source: str | None = None,
    registries: Registries | None = None,
    check_files: bool = True,
) -> Recipe:
    """Validate a recipe mapping (not modified). See the module docstring for the order."""
    registries = registries or build_registries()
    raw = copy.deepcopy(raw)
    _long_forms(raw)
    problems = []
    for override in overrides or []:  # one at a time: `estimator=ppo` then `estimator.lam=0.9` works
        problems += apply_overrides(raw, [override])
        _long_forms(raw)
    explicit = copy.deepcopy(raw)  # what the user wrote, before estimator defaults
    _apply_estimator_defaults(raw, registries)
    problems += _check_components(raw, registries)

    recipe = None
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        problems += [(_loc(err["loc"]), _message(err)) for err in exc.errors()]
        recipe = _validate_without_unknown_keys(raw, exc)  # so the rules below still run
    if recipe is not None:
        problems += _check_rules(recipe, explicit, registries)
        if check_files:
            problems += check_machine(recipe, registries)
    if problems:
        raise RecipeError(problems, source)
    return recipe


def _validate_without_unknown_keys(raw: dict, exc: ValidationError) -> Recipe | None:
    """Drop unknown keys (already reported) and try again; None if other errors remain."""
    if any(err["type"] != "extra_forbidden" for err in exc.errors()):
        return None
    pruned = copy.deepcopy(raw)
    for err in exc.errors():
        parent = get_path(pruned, [str(p) for p in err["loc"][:-1]]) if len(err["loc"]) > 1 else pruned
        if isinstance(parent, dict):
            parent.pop(err["loc"][-1], None)
    try:
        return Recipe.model_validate(pruned)
    except ValidationError:
        return None


def _valid_keys(loc: tuple) -> list[str]:
    """Field names of the section at ``loc`` (for did-you-mean on unknown keys)."""
    model: Any = Recipe
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if hasattr(c, "model_fields")), None)
        if model is None:
            return []
    return list(model.model_fields)


def _loc(loc: tuple) -> str:
    return ".".join(str(part) for part in loc)


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        valid = _valid_keys(err["loc"][:-1])
        hint = (
            suggest(str(err["loc"][-1]), valid) or f" Valid keys here: {', '.join(valid)}." if valid else ""
        )
        return "unknown key." + hint + " (`rlkit recipe show` prints every key with its value)"
    if err["type"] == "missing":
        return "required key is missing"
    value = err.get("input")
    shown = repr(value) if not isinstance(value, dict) else "a mapping"
    return f"{err['msg']} (got {shown})"


def _default_name(key: str) -> str | None:
    """The schema's default component name at ``key`` (``actor.policy_loss`` → ``ppo_clip``)."""
    section, field = key.split(".")
    factory = Recipe.model_fields[section].default_factory
    if factory is None:  # a required section (data): its optional components default to none
        return None
    default = factory().__class__.model_fields[field].default
    return getattr(default, "name", None)


def _long_forms(raw: dict) -> None:
    """``estimator: grpo`` → ``estimator: {name: grpo}`` so overrides and defaults can reach parameters;
    parameters given without a name (``actor.policy_loss.clip_ratio_high=0.28``) belong to the default."""
    for key in COMPONENT_KEYS:
        value = get_path(raw, key)
        if value is None and not has_path(raw, key) and _default_name(key):  # absent: the schema's default,
            value = _default_name(key)  # written out so its parameters get their defaults too
        if isinstance(value, str):
            try:
                set_path(raw, key, {"name": value})
            except ValueError:
                pass  # the section itself is not a mapping; schema validation reports it
        elif isinstance(value, dict) and "name" not in value and _default_name(key):
            value["name"] = _default_name(key)
    for key in COMPONENT_LISTS:
        values = get_path(raw, key)
        if isinstance(values, list):
            set_path(raw, key, [{"name": v} if isinstance(v, str) else v for v in values])


def _check_components(raw: dict, registries: Registries) -> list[tuple[str, str]]:
    """Every component's name and parameters; valid ones get their defaults written in (``recipe show``)."""
    problems = []
    for key, kind in COMPONENT_KEYS.items():
        value = get_path(raw, key)
        if value is None:
            continue
        resolved, more = resolve(key, kind, value, registries)
        problems += more
        if resolved is not None:
            set_path(
                raw, key, {"name": value["name"] if isinstance(value, dict) else value, **resolved.kwargs}
            )
    for key, kind in COMPONENT_LISTS.items():
        values = get_path(raw, key)
        for i, value in enumerate(values if isinstance(values, list) else []):
            resolved, more = resolve(f"{key}.{i}", kind, value, registries)
            problems += more
            if resolved is not None:
                values[i] = {"name": value["name"] if isinstance(value, dict) else value, **resolved.kwargs}
    return problems


def _accepts(raw: dict, key: str, registries: Registries) -> bool:
    """Whether a default at ``key`` can apply: a component parameter only if that component has it."""
    for component_key, kind in COMPONENT_KEYS.items():
        prefix = component_key + "."
        if key.startswith(prefix):
            name = get_path(raw, component_key + ".name")
            if not isinstance(name, str) or name not in registries[kind]:
                return False
            model = params_model(registries[kind].get(name))
            return model is not None and key[len(prefix) :].split(".")[0] in model.model_fields
    return True


def _apply_estimator_defaults(raw: dict, registries: Registries) -> None:
    name = get_path(raw, "algorithm.estimator.name", "grpo")
    if not isinstance(name, str) or name not in registries.estimators:
        return
    for key, value in registries.estimators.get(name).recipe_defaults.items():
        if not has_path(raw, key) and _accepts(raw, key, registries):
            try:
                set_path(raw, key, copy.deepcopy(value))
            except ValueError:
                pass  # the user's own value at that path is wrong; schema validation reports it


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


def _check_rules(recipe: Recipe, explicit: dict, registries: Registries) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = _check_batch_sizes(recipe, registries)
    est_name = recipe.algorithm.estimator.name
    if est_name not in registries.estimators:
        return problems  # already reported by _check_components
    est = registries.estimators.get(est_name)
    estimator = Resolved("estimators", est.name, est)  # the rules look at the spec, not its parameters
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
    for role, pool in recipe.resources.roles.items():
        if pool not in recipe.resources.pools:
            problems.append(
                (
                    f"resources.roles.{role}",
                    f"unknown pool '{pool}'; pools: {', '.join(recipe.resources.pools)}",
                )
            )
    problems += _check_environment(recipe, registries)
    ob = recipe.reward.overlong_buffer
    if ob.enable and ob.len > recipe.data.max_response_length:
        problems.append(
            (
                "reward.overlong_buffer.len",
                f"{ob.len} tokens does not fit in data.max_response_length="
                f"{recipe.data.max_response_length}; the penalty starts len tokens before the maximum "
                "(DAPO: 4096 of 20480), so set it at most that",
            )
        )
    problems += plan_roles(recipe, registries, estimator)[1]
    problems += _check_mode(recipe, est, registries)
    problems += _check_agent(recipe, registries)
    problems += _check_rollout_correction(recipe, registries)
    problems += _check_lora(recipe, registries)
    problems += _check_backend_limits(recipe, registries)
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


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The effective recipe as plain data (what `rlkit recipe show` prints and MLflow records)."""
    return recipe.model_dump(mode="json")
