"""A verifiers v1 environment for rlkit-verifiers' tests: guess a hidden number from 1 to ``high``.

The environment plays the user: after each assistant turn it answers ``higher``, ``lower`` or ends the
game, for at most ``max_turns`` assistant turns. The rubric has two weighted parts: ``solved`` (1.0 when
a turn named the number) and ``format`` (weight 0.5: the share of assistant turns that hold a number),
so even a random model's episodes score apart. Offline and in-process: no program, tool or network.
"""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

__all__ = ["GuessNumberEnv", "GuessNumberTaskset"]

_NUMBER = re.compile(r"-?\d+")


class GuessNumberConfig(vf.TasksetConfig):
    size: int = 16
    high: int = 8
    max_turns: int = 3
    seed: int = 0


class GuessNumberData(vf.TaskData):
    info: dict


class GuessNumberTask(vf.Task[GuessNumberData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def solved(self, trace) -> float:
        return float(trace.info.get("solved", 0.0))

    @vf.reward(weight=0.5)
    async def format(self, trace) -> float:
        replies = [str(m.content or "") for m in trace.assistant_messages]
        return sum(bool(_NUMBER.search(r)) for r in replies) / len(replies) if replies else 0.0


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            target = rng.randint(1, self.config.high)
            prompt = (
                f"I am thinking of a number from 1 to {self.config.high}. Guess it: answer with one number. "
                "I will say higher or lower."
            )
            yield GuessNumberTask(
                GuessNumberData(
                    name=f"guess#{i}",
                    prompt=prompt,
                    info={"target": target, "max_turns": self.config.max_turns},
                ),
                self.config.task,
            )


class GuessNumberEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class GuessNumberEnv(vf.Env[GuessNumberEnvConfig]):
    async def run(self, task, agents):
        target, max_turns = task.data.info["target"], task.data.info["max_turns"]
        solved = 0.0
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            for turn in range(1, max_turns + 1):
                if segment.terminated:
                    break
                found = _NUMBER.search(segment.last_reply or "")
                guess = int(found.group()) if found else None
                if guess == target:
                    solved = 1.0
                    break
                if turn == max_turns:
                    break
                hint = (
                    "no number found; answer with one number"
                    if guess is None
                    else ("higher" if guess < target else "lower")
                )
                segment = await interaction.turn(hint)
            interaction.trace.info["solved"] = solved  # before the run closes: the rubric reads it
