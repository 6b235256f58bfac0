"""Registers rlkit's built-in rollout backends through the public hooks."""

from __future__ import annotations

from rlkit.builtin.params import EnvironmentAgentParams, HFRolloutParams, ToolAgentParams
from rlkit.plugin.hookspecs import hookimpl
from rlkit.plugin.specs import AgentLoopSpec, RolloutBackendSpec


@hookimpl
def rlkit_register_rollout_backends() -> list[RolloutBackendSpec]:
    return [
        RolloutBackendSpec(
            name="hf",
            cls="rlkit.rollout.hf:HFRollout",
            params=HFRolloutParams,
            lora=True,
            description="transformers model in the actor's process: KV-cache sampling, stop strings, greedy",
        ),
    ]


@hookimpl
def rlkit_register_agent_loops() -> list[AgentLoopSpec]:
    return [
        AgentLoopSpec(
            name="single_turn",
            cls="rlkit.rollout.agent:SingleTurnAgentLoop",
            description=(
                "one assistant turn, no tools (what a plain rollout does, through the agent machinery)"
            ),
        ),
        AgentLoopSpec(
            name="tool",
            cls="rlkit.rollout.agent:ToolAgentLoop",
            params=ToolAgentParams,
            uses_tools=True,
            description="Hermes-style tool calls between assistant turns; tool tokens masked out of the loss",
        ),
        AgentLoopSpec(
            name="environment",
            cls="rlkit.rollout.environment:EnvironmentAgentLoop",
            params=EnvironmentAgentParams,
            uses_environment=True,
            description=(
                "multi-turn episodes of data.environment: its replies are user turns, masked out of the loss"
            ),
        ),
    ]
