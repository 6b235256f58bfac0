"""A single-player TextArena game as a multi-turn environment.

A row is one game: its seed (``extra_info.seed``, ``seed + i`` for row ``i``) and, as the prompt, the game's
opening observation. In an episode the ``environment`` agent loop hands each assistant turn to
``env.step(action=...)`` (TextArena's action wrapper puts a bare guess in brackets); the game's new
observation lines, without the echo of the player's own move, are the next user turn. At the end
``env.close()`` gives the player's reward (TextArena: 1 for a win, lower otherwise); the rubric is
``score`` = that reward and ``won`` (1 when it is 1) and ``turns`` (the game's turn count).
Games that need a network, other players or a model (most two-player ones) are not supported.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from rlkit.errors import RlkitError

__all__ = ["TextArenaParams", "TextArenaEnv", "TextArenaEpisode"]


class TextArenaParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env_id: str = Field("GuessTheNumber-v0", description="a single-player TextArena game id")
    size: PositiveInt = Field(64, description="training games (one row each)")
    val_size: int = Field(8, ge=0, description="validation games (0 = none), seeds after the training ones")
    seed: int = Field(1, description="seed of the first training game")


def _make(env_id: str) -> Any:
    import textarena as ta

    try:
        return ta.make(env_id)
    except Exception as exc:
        raise RlkitError(
            f"data.environment (textarena): cannot make game {env_id!r}: {type(exc).__name__}: {exc}. "
            "Use a single-player game that runs locally, e.g. GuessTheNumber-v0."
        ) from exc


class TextArenaEpisode:
    """One game: ``step(text) -> (reply, done)`` and ``reward()`` (``rlkit.plugin.protocols.Episode``)."""

    def __init__(self, env_id: str, seed: int):
        self.env = _make(env_id)
        self.env.reset(num_players=1, seed=seed)
        _, self.seen = self.env.get_observation()
        self.result: tuple[dict, dict] | None = None

    def opening(self) -> str:
        return str(self.seen).strip()

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        done, _ = self.env.step(action=assistant_text)
        if done:
            self.result = self.env.close()
            return None, True
        _, observation = self.env.get_observation()
        new = (
            str(observation)[len(str(self.seen)) :]
            if str(observation).startswith(str(self.seen))
            else str(observation)
        )
        self.seen = observation
        lines = [line for line in new.strip().split("\n") if not line.startswith("[Player]")]
        return "\n".join(lines).strip() or "(no reply)", False

    def reward(self) -> dict[str, float]:
        if self.result is None:  # cut by rlkit's turn or token limit: the game did not finish
            return {"score": 0.0, "won": 0.0, "finished": 0.0}
        rewards, info = self.result
        value = float(rewards.get(0, 0.0))
        return {
            "score": value,
            "won": float(value >= 1.0),
            "finished": 1.0,
            "turns": float((info.get(0) or {}).get("turn_count", 0)),
        }


class TextArenaEnv:
    """``rlkit.plugin.protocols.Environment`` (multi-turn) over one TextArena game id."""

    def __init__(self, params: TextArenaParams):
        self.params = params

    def rows(self, split: str) -> list[dict[str, Any]]:
        p = self.params
        size, first = (p.size, p.seed) if split == "train" else (p.val_size, p.seed + p.size)
        rows = []
        for i in range(size):
            seed = first + i
            rows.append(
                {
                    "prompt": [{"role": "user", "content": TextArenaEpisode(p.env_id, seed).opening()}],
                    "ability": "game",
                    "reward_model": {"style": "rule", "ground_truth": ""},
                    "extra_info": {"split": split, "seed": seed, "env_id": p.env_id},
                }
            )
        return rows

    def score(self, solution_str: str, ground_truth: Any, extra_info: dict | None) -> Any:
        raise RlkitError(
            "textarena is multi-turn: its episodes are scored when they end (the environment agent loop)"
        )

    def episode(self, extra_info: dict) -> TextArenaEpisode:
        return TextArenaEpisode(str(extra_info.get("env_id") or self.params.env_id), int(extra_info["seed"]))
