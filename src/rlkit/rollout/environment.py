"""The ``environment`` agent loop: multi-turn episodes whose user turns the environment writes.

It is the tool loop's machinery (``rlkit.rollout.agent.ToolAgentLoop``) with the environment in the tool's
place: after each assistant turn the loop hands the turn's text to the row's ``Episode.step`` and appends
the reply as a ``{"role": "user"}`` message, tokenized as the chat template's delta (the same
``_delta_ids`` as tool results), so the reply's tokens are context with ``response_mask`` 0 and log-prob
0: the loss sees only what the policy generated. When the episode ends (``done``), runs out of turns
(``max_turns``) or of tokens (``max_response_length``), the loop asks ``Episode.reward()`` and keeps it on
the trajectory (``Trajectory.reward``); the rollout hands it to the reward manager as the per-sample
``env_reward`` field (``rlkit.rewards.environment``).

Bad environments: a ``step`` (or ``episode``/``reward``) that raises, or a ``step`` that runs past
``reply_timeout_s`` (it runs in a daemon thread, which a hung reply is left in), ends the episode with
``env_reward = {"error": ...}``; the reward manager counts it in ``reward/errors``. Metrics (over this
batch's episodes): ``env/errors``, ``env/timeouts``, ``env/truncated`` (episodes cut by the turn or token
limit before the environment said done), ``env/turns/mean``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from rlkit.data.environment import build_environment
from rlkit.errors import RlkitError
from rlkit.rollout.agent import AgentState, ToolAgentLoop, Trajectory
from rlkit.rollout.tools.base import truncate

__all__ = ["EnvironmentAgentLoop"]


class _ReplyTimeout(Exception):
    pass


async def _in_thread(fn: Any, *args: Any, timeout_s: float) -> Any:
    """``fn(*args)`` in a daemon thread, awaited at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def hand_over(settle: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the rollout finished (its event loop closed) while this call hung
            pass

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            error = exc
            hand_over(lambda: future.done() or future.set_exception(error))
            return
        hand_over(lambda: future.done() or future.set_result(result))

    threading.Thread(target=work, daemon=True, name="rlkit-env-reply").start()
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        raise _ReplyTimeout(f"the environment's reply took longer than {timeout_s:g} s") from None


class EnvironmentAgentLoop(ToolAgentLoop):
    """One episode per call of ``run``; ``params`` (``EnvironmentAgentParams``) carries the environment."""

    def __init__(
        self,
        generator: Any,
        tokenizer: Any,
        tools: Any = None,
        *,
        max_response_length: int = 256,
        sampling: dict | None = None,
        params: Any = None,
    ):
        if params is None or params.environment is None:
            raise RlkitError(
                "the `environment` agent loop needs an environment: set data.environment in the recipe "
                "(docs/environments.md)."
            )
        super().__init__(
            generator,
            tokenizer,
            None,
            max_turns=params.max_turns,
            max_response_length=max_response_length,
            sampling=sampling,
        )
        self.params = params
        self.resolved = params.environment
        self.env = build_environment(self.resolved)

    async def run(
        self,
        messages: list[dict],
        tools_kwargs: dict | None = None,
        prompt_ids: list[int] | None = None,
        extra_info: dict | None = None,
    ) -> Trajectory:
        messages = [dict(m) for m in messages]
        traj = Trajectory(
            prompt_ids=list(prompt_ids) if prompt_ids is not None else self.prompt_ids(messages),
            messages=messages,
        )
        timeout = self.params.reply_timeout_s
        try:
            episode = await _in_thread(self.env.episode, dict(extra_info or {}), timeout_s=timeout)
            done = await self._turns(traj, episode)
            traj.reward = await _in_thread(episode.reward, timeout_s=timeout)
            traj.env_truncated = not done
        except _ReplyTimeout as exc:
            traj.reward, traj.env_timeouts, traj.finish_reason = {"error": str(exc)}, 1, "env_timeout"
        except Exception as exc:  # noqa: BLE001 - an environment's failure is counted, never fatal
            traj.reward = {"error": f"{type(exc).__name__}: {exc}"}
            traj.env_errors, traj.finish_reason = 1, "env_error"
        traj.state = AgentState.DONE
        if len(traj.response_ids) > self.max_response_length:  # the last reply overshot
            for name in ("response_ids", "response_mask", "log_probs"):
                setattr(traj, name, getattr(traj, name)[: self.max_response_length])
        return traj

    async def _turns(self, traj: Trajectory, episode: Any) -> bool:
        """Assistant turn, environment reply, ... until done or a limit; whether the environment said done."""
        while True:
            budget = self.max_response_length - len(traj.response_ids)
            if budget <= 0:
                traj.finish_reason = "length"
                return False
            traj.state = AgentState.GENERATING
            ids, logps, reason = await self.generator.generate_ids(
                traj.prompt_ids + traj.response_ids, {**self.sampling, "max_new_tokens": budget}
            )
            traj.extend(ids, 1, logps)
            traj.num_turns += 1
            content = self.tokenizer.decode(ids, skip_special_tokens=True)
            traj.messages.append({"role": "assistant", "content": content})
            traj.state = AgentState.CALLING_TOOLS
            reply, done = await _in_thread(episode.step, content, timeout_s=self.params.reply_timeout_s)
            if done:
                traj.finish_reason = "stop"
                return True
            if reason == "length" or traj.num_turns >= self.max_turns:
                traj.finish_reason = "length" if reason == "length" else "max_turns"
                return False
            user = [{"role": "user", "content": truncate(str(reply or ""), self.params.max_reply_chars)}]
            traj.extend(self._delta_ids(traj.messages, user, ids), 0)
            traj.messages += user
