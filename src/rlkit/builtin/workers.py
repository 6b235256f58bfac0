"""Registers rlkit's built-in worker roles through the public hooks (lazy class references).

Each role fills a step slot (``RoleSpec.slot``, default its name). ``rollout`` generates in a pool of its
own for ``trainer.mode`` one_step_off / async (docs/async.md); the hybrid role stays the actor.
"""

from __future__ import annotations

from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import RoleSpec

_ROLES = "rlkit.workers.roles"


@hookimpl
def rlkit_register_roles() -> list[RoleSpec]:
    return [
        RoleSpec(
            name="actor_rollout_ref",
            cls=f"{_ROLES}:ActorRolloutRefWorker",
            description="hybrid engine: FSDP2 actor + HF rollout sharing its module + optional frozen ref",
        ),
        RoleSpec(
            name="rollout",
            cls="rlkit.workers.rollout_worker:RolloutWorker",
            description="rollout engine in a pool of its own, weights pushed by version (trainer.mode async)",
        ),
        RoleSpec(name="ref", cls=f"{_ROLES}:RefWorker", description="frozen reference policy log-probs"),
        RoleSpec(
            name="critic", cls=f"{_ROLES}:CriticWorker", description="FSDP2 value model, clipped value loss"
        ),
        RoleSpec(
            name="reward_model",
            cls=f"{_ROLES}:RewardModelWorker",
            description="sequence-classification reward model scores (rm_scores)",
        ),
    ]
