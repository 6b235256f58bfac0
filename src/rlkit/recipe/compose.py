"""The composition root: every name in a recipe resolved once, on the driver, into a ``Pipeline``.

    registries = build_registries()
    recipe = load_recipe("recipes/grpo.yaml", registries=registries)   # validation uses the same resolver
    pipeline = compose(recipe, registries)                             # typed, picklable
    # rlkit.algos.estimators
    pipeline.estimator.fn(EstimatorInputs(rewards, mask, group_id), **pipeline.estimator.kwargs)

Workers receive the resolved parts they need (the actor its policy loss, the rollout its backend,
agent loops and tools) as arguments: no worker re-reads entry points, and nothing here is a
process-global registry. ``resolve`` is the one function that turns a ``Component`` (name +
parameters) into a ``Resolved`` (spec + validated params model); ``rlkit.recipe.validate`` calls it
to report problems, ``compose`` calls it to build.

Step slots and roles: ``actor_rollout_ref`` (always), ``rollout`` (a rollout pool of its own, when
``trainer.mode`` is one_step_off or async; it must be mapped to a pool the actor does not use), ``ref`` (a
separate reference worker when a role filling it is mapped in ``resources.roles``; otherwise the reference
lives in the actor's process), ``critic`` (when the estimator needs one), ``reward_model``
(``reward.reward_model.enable``). A role fills the slot its spec names (``RoleSpec.slot``), so a third-party
role replaces a built-in by being mapped in ``resources.roles``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from rlkit.errors import RecipeError
from rlkit.plugin.registry import Registries, load_object, suggest

__all__ = [
    "Resolved",
    "PlacedRole",
    "Pipeline",
    "resolve",
    "params_model",
    "compose",
    "plan_roles",
    "SLOTS",
    "COMPONENT_KEYS",
    "COMPONENT_LISTS",
]

# recipe key -> registry kind, for keys holding one Component (or None where optional)
COMPONENT_KEYS = {
    "algorithm.estimator": "estimators",
    "actor.policy_loss": "policy_losses",
    "reward.manager": "reward_managers",
    "rollout.backend": "rollout_backends",
    "rollout.agent": "agent_loops",
    "algorithm.rollout_correction": "rollout_corrections",
    "data.environment": "environments",
}
# recipe key -> registry kind, for keys holding a list of Components
COMPONENT_LISTS = {"rollout.tools": "tools", "tracking.backends": "trackers"}

SLOTS = ("actor_rollout_ref", "rollout", "ref", "critic", "reward_model")


@dataclass(frozen=True)
class Resolved:
    """One component: its registry spec, its validated parameters and who registered it."""

    kind: str  # registry kind ("estimators", ...)
    name: str  # canonical name (aliases resolved)
    spec: Any
    params: BaseModel | None = None
    source: str = ""  # the plugin that registered it, for messages

    @property
    def kwargs(self) -> dict[str, Any]:
        """The parameters as keyword scalars (what a pure function receives)."""
        return self.params.model_dump() if self.params is not None else {}

    @property
    def fn(self) -> Callable[..., Any]:
        return load_object(self.spec.fn)

    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Instantiate the spec's class; a spec with a params model also gets ``params=``."""
        cls = load_object(self.spec.cls)
        if self.spec.params is not None:
            kwargs["params"] = self.params
        return cls(*args, **kwargs)


@dataclass(frozen=True)
class PlacedRole:
    """A worker role filling a step slot, on a resource pool."""

    slot: str
    role: Resolved
    pool: str


@dataclass(frozen=True)
class Pipeline:
    """Everything the recipe names, resolved (see the module docstring)."""

    estimator: Resolved
    policy_loss: Resolved
    reward_manager: Resolved
    rollout_backend: Resolved
    agent_loops: Mapping[str, Resolved]  # every registered loop: a data row may pick its own
    default_agent: str | None  # rollout.agent
    tools: tuple[Resolved, ...]
    trackers: tuple[Resolved, ...]
    score_fns: Mapping[str, Callable[..., Any]]  # data_source (and aliases) -> compute_score
    roles: Mapping[str, PlacedRole] = field(default_factory=dict)  # slot -> role
    rollout_correction: Resolved | None = None  # algorithm.rollout_correction (None = off)
    environment: Resolved | None = None  # data.environment: gives the rows, scores its data_source

    def role(self, slot: str) -> PlacedRole | None:
        return self.roles.get(slot)


def params_model(spec: Any) -> type[BaseModel] | None:
    model = load_object(spec.params) if spec.params is not None else None
    if model is not None and not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise RecipeError(
            [("", f"{spec.name}: its params must be a pydantic BaseModel class, got {model!r}")]
        )
    return model


def resolve(
    key: str, kind: str, component: Any, registries: Registries
) -> tuple[Resolved | None, list[tuple[str, str]]]:
    """``component`` (a ``Component``, a name, or ``{name, **params}``) → ``(Resolved, problems)``.

    Problems are ``(recipe key path, message)`` pairs naming the registry, the plugin and the valid
    choices; ``Resolved`` is None when there are any.
    """
    if isinstance(component, str):
        name, given = component, {}
    elif isinstance(component, Mapping):
        name, given = component.get("name"), {k: v for k, v in component.items() if k != "name"}
    else:
        name, given = getattr(component, "name", None), dict(getattr(component, "params", {}) or {})
    if not isinstance(name, str):
        return None, [
            (key, f"needs a name from registry `{kind}` (a string, or a mapping with a `name` key)")
        ]
    registry = registries[kind]
    if name not in registry:
        return None, [(key, registry.unknown_message(name))]
    entry = registry.entry(name)
    spec = entry.spec
    who = f"{kind} entry '{spec.name}' (from {entry.source})"
    model = params_model(spec)
    if model is None:
        if given:
            return None, [(f"{key}.{k}", f"{who} takes no parameters; remove it") for k in sorted(given)]
        return Resolved(kind, spec.name, spec, None, str(entry.source)), []
    try:
        params = model.model_validate(given)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                valid = list(model.model_fields)
                msg = f"unknown parameter of {who}. Valid: {', '.join(valid) or '(none)'}." + suggest(
                    str(err["loc"][-1]), valid
                )
            else:
                msg = f"{err['msg']} (got {err.get('input')!r}); parameter of {who}"
            problems.append((f"{key}.{where}" if where else key, msg))
        return None, problems
    return Resolved(kind, spec.name, spec, params, str(entry.source)), []


def _must(key: str, kind: str, component: Any, registries: Registries) -> Resolved:
    resolved, problems = resolve(key, kind, component, registries)
    if problems:
        raise RecipeError(problems)
    return resolved


def plan_roles(
    recipe: Any, registries: Registries, estimator: Resolved
) -> tuple[dict[str, PlacedRole], list[tuple[str, str]]]:
    """Which role fills each needed slot, on which pool (see the module docstring)."""
    res = recipe.resources
    needed, wants_ref = _needed_slots(recipe, estimator)
    problems: list[tuple[str, str]] = []
    placed: dict[str, PlacedRole] = {}
    for role_name, pool in res.roles.items():
        key = f"resources.roles.{role_name}"
        role, more = resolve(key, "roles", role_name, registries)
        problems += more
        if role is None:
            continue
        problem = _mapped_role_problem(role, placed, needed, wants_ref, estimator)
        if problem:
            problems.append((key, problem))
        else:
            placed[role.spec.fills] = PlacedRole(role.spec.fills, role, pool)
    mode = recipe.trainer.mode
    if "rollout" in needed and "rollout" not in placed:
        problems.append(
            (
                "resources.roles.rollout",
                f"trainer.mode={mode} generates in a rollout pool of its own: declare "
                "one (resources.pools.rollout: {nodes: 1, bundles_per_node: 1, cpus_per_bundle: 1}) and map "
                "the role to it (resources.roles.rollout=rollout), or set trainer.mode=sync",
            )
        )
        needed.discard("rollout")
    first_pool = next(iter(res.pools))
    for slot in sorted(needed - set(placed)):
        placed[slot] = PlacedRole(
            slot, _must(f"resources.roles.{slot}", "roles", slot, registries), first_pool
        )
    if "rollout" in placed and placed["rollout"].pool == placed["actor_rollout_ref"].pool:
        pool = placed["rollout"].pool
        problems.append(
            (
                "resources.roles.rollout",
                f"trainer.mode={mode}: the rollout role shares pool '{pool}' with "
                "actor_rollout_ref, so generation and training would take turns on the same resources; map "
                "the rollout (or actor_rollout_ref) to a pool of its own, or set trainer.mode=sync",
            )
        )
    return placed, problems


def _needed_slots(recipe: Any, estimator: Resolved) -> tuple[set[str], bool]:
    """The slots the step needs filled, and whether a KL term wants the reference model."""
    needed = {"actor_rollout_ref"}
    if estimator.spec.needs_critic:
        needed.add("critic")
    if recipe.reward.reward_model.enable:
        needed.add("reward_model")
    if recipe.trainer.mode != "sync":
        needed.add("rollout")
    wants_ref = (
        recipe.actor.use_kl_loss or recipe.algorithm.use_kl_in_reward
        if recipe.ref.enable is None
        else recipe.ref.enable
    )
    return needed, wants_ref


def _mapped_role_problem(
    role: Resolved, placed: dict[str, PlacedRole], needed: set[str], wants_ref: bool, estimator: Resolved
) -> str | None:
    """Why a role mapped in ``resources.roles`` cannot fill its slot, or None when it can."""
    slot = role.spec.fills
    if slot not in SLOTS:
        return (
            f"role '{role.name}' fills slot '{slot}', which the step does not have; slots: {', '.join(SLOTS)}"
        )
    if slot in placed:
        first = placed[slot].role.name
        return f"slot '{slot}' is filled twice (roles '{first}' and '{role.name}'); map only one"
    if slot == "ref" and not wants_ref:
        return (
            "a separate reference worker is mapped but no KL term uses it; set "
            "actor.use_kl_loss=true or algorithm.use_kl_in_reward=true, or remove this role"
        )
    if slot not in needed and slot != "ref":
        why = {
            "critic": (
                f"estimator '{estimator.name}' uses no critic (set algorithm.estimator=ppo to train one)"
            ),
            "reward_model": "reward.reward_model.enable is false",
            "rollout": (
                "trainer.mode is sync (the actor's own engine generates; set trainer.mode=one_step_off "
                "or async to generate in this pool)"
            ),
        }.get(slot, "the step does not use it")
        return f"role '{role.name}' is mapped but {why}; remove it from resources.roles"
    return None


def _with_environment(loop: Resolved, environment: Resolved) -> Resolved:
    if not getattr(loop.spec, "uses_environment", False) or loop.params is None:
        return loop
    return Resolved(loop.kind, loop.name, loop.spec, loop.params.with_environment(environment), loop.source)


def compose(
    recipe: Any, registries: Registries, *, custom_score: Callable[..., Any] | None = None
) -> Pipeline:
    """Resolve every component of a validated recipe (raises ``RecipeError`` if one does not resolve)."""
    estimator = _must("algorithm.estimator", "estimators", recipe.algorithm.estimator, registries)
    roles, problems = plan_roles(recipe, registries, estimator)
    if problems:
        raise RecipeError(problems)
    agent = recipe.rollout.agent
    default = _must("rollout.agent", "agent_loops", agent, registries) if agent is not None else None
    loops = {
        e.spec.name: _must(f"rollout.agent({e.spec.name})", "agent_loops", e.spec.name, registries)
        for e in registries.agent_loops
    }  # a data row may name any loop; it runs with default params
    if default is not None:
        loops[default.name] = default
    environment = (
        _must("data.environment", "environments", recipe.data.environment, registries)
        if recipe.data.environment is not None
        else None
    )
    if environment is not None:  # the loops that run its episodes carry it (rlkit.rollout.environment)
        loops = {name: _with_environment(loop, environment) for name, loop in loops.items()}
        if environment.spec.multi_turn and default is None:
            default = loops.get("environment")
    correction = recipe.algorithm.rollout_correction
    scores: dict[str, Callable[..., Any]] = {}
    for entry in registries.compute_scores:
        for source in (entry.spec.name, *entry.spec.aliases):
            scores[source] = entry.spec.fn
    return Pipeline(
        estimator=estimator,
        policy_loss=_must("actor.policy_loss", "policy_losses", recipe.actor.policy_loss, registries),
        reward_manager=_must("reward.manager", "reward_managers", recipe.reward.manager, registries),
        rollout_backend=_must("rollout.backend", "rollout_backends", recipe.rollout.backend, registries),
        agent_loops=loops,
        default_agent=default.name if default is not None else None,
        tools=tuple(
            _must(f"rollout.tools.{i}", "tools", t, registries) for i, t in enumerate(recipe.rollout.tools)
        ),
        trackers=tuple(
            _must(f"tracking.backends.{i}", "trackers", t, registries)
            for i, t in enumerate(recipe.tracking.backends)
        ),
        score_fns=scores,
        roles=roles,
        environment=environment,
        rollout_correction=(
            _must("algorithm.rollout_correction", "rollout_corrections", correction, registries)
            if correction is not None
            else None
        ),
    )
