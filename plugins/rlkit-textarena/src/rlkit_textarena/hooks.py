"""Registers the ``textarena`` environment (lazy: textarena is imported only when a run uses it)."""

from __future__ import annotations

from rlkit import hookimpl
from rlkit.plugin.specs import EnvironmentSpec


@hookimpl
def rlkit_register_environments() -> list[EnvironmentSpec]:
    return [
        EnvironmentSpec(
            name="textarena",
            cls="rlkit_textarena.env:TextArenaEnv",
            params="rlkit_textarena.env:TextArenaParams",
            multi_turn=True,
            description="a single-player TextArena game (GuessTheNumber-v0, ...): its lines are user turns",
        ),
    ]
