"""The ``verifiers`` agent loop: verifiers plays the episode, rlkit trains on the tokens it was served.

For each row (one verifiers task) the loop runs the verifiers environment's own episode
(``Env.run_slot``: its ``run``, seats, turn limits and rubric) with every seat on the in-process chat
harness (``rlkit_verifiers.harness``) and verifiers' ``TrainClient``, which renders each prompt to token
ids on verifiers' side (``rlkit_verifiers.renderer``: one token sequence per episode) and generates through
the token-in endpoint this process serves over the rollout's own generator (``rlkit_verifiers.endpoint``).
The episode's trace then is the training sample: its branch's token ids split at the first sampled token
into prompt and response, ``response_mask`` = verifiers' ``sampled_mask`` (environment and template tokens
0), ``log_probs`` = the ones the endpoint returned. The reward is the trace's: ``score`` = the rubric's
weighted sum, each part (unweighted) beside it, logged as ``reward_extra/<part>``.

A failed or timed-out episode (``episode_timeout_s``) ends with ``env_reward = {"error": ...}``, counted in
``env/errors`` and ``reward/errors``; an episode cut by verifiers' limits or by ``data.max_response_length``
counts in ``env/truncated``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import PrivateAttr

from rlkit.builtin.params import Params
from rlkit.errors import RlkitError
from rlkit.rollout.agent import AgentState, Trajectory
from rlkit_verifiers.endpoint import SERVED_MODEL, shared_endpoint
from rlkit_verifiers.env import verifiers_environment

__all__ = ["VerifiersAgentLoop", "VerifiersAgentParams", "trajectory_from_episode"]


logger = logging.getLogger(__name__)


class VerifiersAgentParams(Params):
    """``rollout.agent: {name: verifiers}``; the environment comes from ``data.environment``."""

    _environment: Any = PrivateAttr(None)

    def with_environment(self, environment: Any) -> VerifiersAgentParams:
        out = self.model_copy()
        out._environment = environment
        return out

    @property
    def environment(self) -> Any:
        return self._environment


class _Serving:
    """One ``Env.serving()`` (verifiers' interception server) per event loop, held by a task of its own
    while episodes of that loop run, closed when the last one ends."""

    def __init__(self, env: Any, loop: asyncio.AbstractEventLoop):
        _unbind_renderers_lock()
        self.env, self.users = env, 0
        self.ready: asyncio.Future = loop.create_future()
        self.stop = asyncio.Event()
        self.task = loop.create_task(self._hold())

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set_result(None)
                await self.stop.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the episodes waiting on it
            if not self.ready.done():
                self.ready.set_exception(exc)


_SERVING: dict[tuple[int, int], _Serving] = {}


def _unbind_renderers_lock() -> None:
    """A fresh ``renderers.client._max_prompt_len_lock`` for a new event loop. renderers 0.1.12 serialises
    its first ``GET /v1/models`` per (endpoint URL, model) with one module-level ``asyncio.Lock``, which
    binds to the first event loop that waits on it; rlkit runs an event loop per generate call, so a URL
    first seen in a later loop (another endpoint, or one that failed) failed every waiting model call with
    "bound to a different event loop". Called before a loop's first episode, when no episode holds it."""
    try:
        import renderers.client as client
    except ImportError:
        return
    lock = getattr(client, "_max_prompt_len_lock", None)
    if isinstance(lock, asyncio.Lock) and not lock.locked():
        client._max_prompt_len_lock = asyncio.Lock()


class VerifiersAgentLoop:
    schemas = None

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
                "the `verifiers` agent loop needs data.environment: {name: verifiers, env_id: ...} "
                "(docs/environments.md)."
            )
        self.generator, self.tokenizer = generator, tokenizer
        self.max_response_length = max_response_length
        self.sampling = dict(sampling or {})
        self.env_params = params.environment.params

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def run(
        self,
        messages: list[dict],
        tools_kwargs: dict | None = None,
        prompt_ids: list[int] | None = None,
        extra_info: dict | None = None,
    ) -> Trajectory:
        fallback = list(prompt_ids) if prompt_ids is not None else self.prompt_ids(messages)
        loaded = verifiers_environment(self.env_params)
        task = loaded.tasks[int((extra_info or {})["vf_index"])]
        loop = asyncio.get_running_loop()
        vocab = max(len(self.tokenizer), int(getattr(self.tokenizer, "vocab_size", 0) or 0))
        endpoint = shared_endpoint(vocab, max_model_len=1 << 20)
        endpoint.bind(loop, self.generator, self.max_response_length)
        key = (id(loop), id(loaded))
        serving = _SERVING.get(key) or _SERVING.setdefault(key, _Serving(loaded.env, loop))
        serving.users += 1
        try:
            await asyncio.shield(serving.ready)
            episode = await asyncio.wait_for(
                loaded.env.run_slot(_slot(task), self._context(endpoint.url)),
                self.env_params.episode_timeout_s,
            )
            traj = trajectory_from_episode(episode, fallback, self.max_response_length)
        except Exception as exc:  # noqa: BLE001 - an environment's failure is counted, never fatal
            traj = _failed(fallback, f"{type(exc).__name__}: {exc}", timeout=isinstance(exc, TimeoutError))
        finally:
            serving.users -= 1
            if serving.users == 0:
                _SERVING.pop(key, None)
                serving.stop.set()
                await serving.task
        traj.messages = [*messages, *traj.messages]
        return traj

    def _context(self, url: str) -> Any:
        from renderers import CustomRendererConfig
        from verifiers.v1 import ModelContext, TrainClientConfig
        from verifiers.v1.types import SamplingConfig

        from rlkit_verifiers.renderer import IMPORT_PATH

        s = self.sampling
        sampling = {
            "temperature": float(s.get("temperature", 1.0)) if s.get("do_sample", True) else 0.0,
            "top_p": float(s.get("top_p", 1.0)),
            "max_tokens": min(
                self.env_params.max_tokens_per_turn or self.max_response_length, self.max_response_length
            ),
            **({"top_k": int(s["top_k"])} if int(s.get("top_k") or 0) > 0 else {}),
            **({"stop": list(s["stop"])} if s.get("stop") else {}),
        }
        client = TrainClientConfig(
            base_url=f"{url}/v1",
            api_key_var="RLKIT_VERIFIERS_API_KEY",
            renderer=CustomRendererConfig(import_path=IMPORT_PATH),
            renderer_model_name=self.tokenizer.name_or_path,
        )
        return ModelContext(model=SERVED_MODEL, client=client, sampling=SamplingConfig(**sampling))


def _slot(task: Any) -> Any:
    from verifiers.v1.env import RunSlot

    return RunSlot(task)


def _failed(prompt_ids: list[int], message: str, *, timeout: bool = False) -> Trajectory:
    logger.warning("verifiers episode counted in env/%s: %s", "timeouts" if timeout else "errors", message)
    traj = Trajectory(prompt_ids=prompt_ids, messages=[])
    traj.reward = {"error": message}
    traj.env_timeouts, traj.env_errors = int(timeout), int(not timeout)
    traj.finish_reason = "env_timeout" if timeout else "env_error"
    traj.state = AgentState.DONE
    return traj


def trajectory_from_episode(episode: Any, prompt_ids: list[int], max_len: int) -> Trajectory:
    """The training sample of a verifiers episode: its (first model-calling) trace's last branch."""
    trace = next((t for t in episode.traces if t.calls), None)
    if episode.errors or trace is None:
        error = episode.errors[-1] if episode.errors else None
        why = f"{error.type}: {error.message}" if error else "the episode made no model call"
        return _failed(prompt_ids, f"verifiers episode failed: {why}", timeout=bool(episode.is_timeout))
    call_error = next((c.error for c in trace.calls if c.error is not None), None)
    if call_error is not None:  # verifiers records a failed model call on the trace, not the episode
        why = f"{call_error.type} {call_error.status_code or ''}: {call_error.message}"
        return _failed(prompt_ids, f"verifiers episode failed: a model call to the endpoint failed: {why}")
    if not trace.branches:
        return _failed(prompt_ids, "verifiers episode has no message in its trace")
    branch = trace.branches[-1]
    ids, sampled, logprobs = branch.token_ids, branch.sampled_mask, branch.logprobs
    if True not in sampled:
        return _failed(prompt_ids, "verifiers episode has no sampled token")
    first = sampled.index(True)
    traj = Trajectory(prompt_ids=ids[:first], messages=[])
    mask = [int(m) for m in sampled[first:]]
    traj.response_ids = ids[first:][:max_len]
    traj.response_mask = mask[:max_len]
    traj.log_probs = [lp if m else 0.0 for lp, m in zip(logprobs[first:], mask)][:max_len]
    traj.num_turns = len(trace.assistant_messages)
    cut = len(mask) > max_len
    traj.env_truncated = bool(trace.is_truncated or cut)
    traj.finish_reason = "length" if cut else "stop"
    parts = {name: float(r.score) for name, r in trace.rewards.items() if r is not None}
    traj.reward = {"score": float(trace.reward), **parts}
    traj.messages = [{"role": "assistant", "content": str(m.content or "")} for m in trace.assistant_messages]
    traj.state = AgentState.DONE
    return traj
