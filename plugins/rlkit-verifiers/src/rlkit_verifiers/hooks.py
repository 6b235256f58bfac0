"""Registers the ``verifiers`` environment and the ``verifiers`` agent loop that plays its episodes
(lazy: verifiers is imported only when a run uses them)."""

from __future__ import annotations

from rlkit import hookimpl
from rlkit.plugin.specs import AgentLoopSpec, EnvironmentSpec


@hookimpl
def rlkit_register_environments() -> list[EnvironmentSpec]:
    return [
        EnvironmentSpec(
            name="verifiers",
            cls="rlkit_verifiers.env:VerifiersEnv",
            params="rlkit_verifiers.env:VerifiersParams",
            played_by="verifiers",
            description="a verifiers v1 environment (env_id, args): its tasks as rows, played by the "
            "`verifiers` agent loop",
        ),
    ]


@hookimpl
def rlkit_register_agent_loops() -> list[AgentLoopSpec]:
    return [
        AgentLoopSpec(
            name="verifiers",
            cls="rlkit_verifiers.loop:VerifiersAgentLoop",
            params="rlkit_verifiers.loop:VerifiersAgentParams",
            uses_environment=True,
            description="verifiers plays each episode against rlkit's token-in endpoint; rlkit trains on "
            "the token ids and log-probs it returned, with the rubric's reward",
        ),
    ]
