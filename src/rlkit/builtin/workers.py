"""Registers rlkit's built-in worker roles through the public hooks (lazy class references)."""

from __future__ import annotations

from rlkit.hookspecs import hookimpl
from rlkit.specs import RoleSpec

_ROLES = "rlkit.workers.roles"


@hookimpl
def rlkit_register_roles() -> list[RoleSpec]:
    return [
        RoleSpec(name="actor_rollout_ref", cls=f"{_ROLES}:ActorRolloutRefWorker",
                 description="hybrid engine: FSDP2 actor + HF rollout sharing its module + optional frozen ref"),
        RoleSpec(name="actor", cls=f"{_ROLES}:ActorRolloutRefWorker",
                 description="FSDP2 policy alone (build with rollout_config=None)"),
        RoleSpec(name="rollout", cls=f"{_ROLES}:ActorRolloutRefWorker",
                 description="rollout alone with its own sharded copy (build with actor_config=None)"),
        RoleSpec(name="ref", cls=f"{_ROLES}:RefWorker", description="frozen reference policy log-probs"),
        RoleSpec(name="critic", cls=f"{_ROLES}:CriticWorker", description="FSDP2 value model, clipped value loss"),
        RoleSpec(name="reward_model", cls=f"{_ROLES}:RewardModelWorker",
                 description="sequence-classification reward model scores (rm_scores)"),
    ]
