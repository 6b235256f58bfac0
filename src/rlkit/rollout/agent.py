"""Multi-turn rollouts: an asyncio agent loop that lets the policy call tools between its turns.

Every request is a small state machine::

    PENDING → GENERATING → (CALLING_TOOLS → GENERATING)* → DONE

bounded by ``max_turns`` assistant turns and ``max_response_length`` response tokens. After each
assistant turn the loop parses Hermes-format tool calls (``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, any number per turn), runs them concurrently (``rlkit.rollout.tools.call_tool``:
a failing call is an error message, never an exception), appends one ``{"role": "tool"}`` message per
call, and tokenizes only the *delta* the chat template adds for them (veRL's approach): the text of
the conversation after the tool messages minus the text before, plus whatever the template closes
the assistant turn with that the model did not generate (ChatML's ``\\n`` after ``<|im_end|>``).

The response of a trajectory is every token after the prompt: assistant tokens (``response_mask``
1, their rollout log-probs recorded) interleaved with tool/template tokens (mask 0, log-prob 0), so
the loss sees only what the policy generated. The output Batch has the single-turn layout
(``rlkit.rollout.base``), truncated/padded to ``max_response_length``, plus ``meta["metrics"]``:
``num_turns/{mean,max,min}`` (assistant turns) and ``tool_call_counts/{mean,max,min}``.

The loop needs one thing from a backend: ``await generate_ids(prompt_ids, sampling) -> (ids,
logprobs, finish_reason)`` (``TurnGenerator``). ``HFTurnGenerator`` adapts the HF backend (and
batches concurrent requests); the sglang backend implements it natively. ``AgentLoopRollout``
wraps a backend into the ``generate(prompts: Batch, ...)`` contract; a row's ``agent_name``
(``single_turn`` | ``tool``; non-tensor field or ``extra_info.agent_name``) picks its loop, and
``extra_info.tools_kwargs`` (``{tool_name: {kwarg: value}}``) reaches that row's tool calls.

Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkit.batch import Batch
from rlkit.errors import RlkitError
from rlkit.plugin.protocols import GeneratesIds
from rlkit.rollout.base import assemble_rollout
from rlkit.rollout.tools.base import Tool, ToolResult, call_tool, truncate

__all__ = [
    "TurnGenerator",
    "HFTurnGenerator",
    "ToolCall",
    "parse_hermes_tool_calls",
    "AgentState",
    "Trajectory",
    "ToolAgentLoop",
    "AgentLoopRollout",
    "agent_metrics",
]


# What the loop needs from a backend: ``rlkit.plugin.protocols.GeneratesIds`` (a backend declaring the
# ``generate_ids`` capability implements it; ``HFTurnGenerator`` adapts one that does not).
TurnGenerator = GeneratesIds


class HFTurnGenerator:
    """``TurnGenerator`` over a backend's batched ``generate`` (``rlkit.rollout.hf.HFRollout``, the vLLM
    plugin's ``VllmRollout``: any backend without the ``generate_ids`` capability): requests that arrive
    together with the same sampling settings run as one left-padded batch (generated up to the largest
    budget, each cut to its own). Reads the backend's ``pad_token_id``, ``eos_token_ids`` (a tensor or a
    list) and ``max_response_length``."""

    def __init__(self, rollout):
        self.rollout = rollout
        self._pending: list[tuple[list[int], dict, asyncio.Future]] = []
        self._flush_scheduled = False
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None  # each generate() call runs its own loop

    async def generate_ids(self, prompt_ids: list[int], sampling: dict) -> tuple[list[int], list[float], str]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((list(prompt_ids), dict(sampling), future))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(lambda: asyncio.ensure_future(self._flush()))
        return await future

    async def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        loop = asyncio.get_running_loop()
        if (
            self._lock is None or self._lock_loop is not loop
        ):  # a lock is bound to the loop it first waited in
            self._lock, self._lock_loop = asyncio.Lock(), loop
        groups: dict[str, list[tuple[list[int], dict, asyncio.Future]]] = {}
        for item in pending:
            key = json.dumps({k: v for k, v in item[1].items() if k != "max_new_tokens"}, sort_keys=True)
            groups.setdefault(key, []).append(item)
        async with self._lock:  # one forward at a time: the module is shared
            for items in groups.values():
                try:
                    results = await asyncio.to_thread(self._run, [i[0] for i in items], [i[1] for i in items])
                except Exception as exc:
                    for *_, fut in items:
                        fut.done() or fut.set_exception(exc)
                    continue
                for (*_, fut), res in zip(items, results):
                    fut.done() or fut.set_result(res)

    def _run(
        self, prompts: list[list[int]], samplings: list[dict]
    ) -> list[tuple[list[int], list[float], str]]:
        budgets = [int(s.get("max_new_tokens") or self.rollout.max_response_length) for s in samplings]
        pad = self.rollout.pad_token_id
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [B, P]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, P]
        s = samplings[0]
        out = self.rollout.generate(
            Batch({"input_ids": ids, "attention_mask": mask}),
            n=1,
            temperature=s.get("temperature"),
            top_p=s.get("top_p"),
            top_k=s.get("top_k"),
            max_new_tokens=max(budgets),
            do_sample=s.get("do_sample"),
            stop=s.get("stop"),
        )
        eos = {int(i) for i in self.rollout.eos_token_ids}
        results = []
        for r, budget in enumerate(budgets):
            length = int(out["response_mask"][r].sum())
            tokens = out["responses"][r, :length].tolist()
            logps = out["rollout_log_probs"][r, :length].tolist()
            if length > budget:
                results.append((tokens[:budget], logps[:budget], "length"))
            else:
                ended = length < max(budgets) or (tokens and tokens[-1] in eos)
                results.append((tokens, logps, "stop" if ended else "length"))
        return results


# ----- tool-call parsing ----------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: Any = None
    error: str | None = None  # set when the call could not be parsed


def parse_hermes_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``; malformed ones carry ``error``."""
    calls = []
    for raw in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(raw.strip())
        except json.JSONDecodeError as exc:
            calls.append(
                ToolCall(None, error=f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})")
            )
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(None, error='a tool call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                calls.append(ToolCall(obj["name"], error="the tool call's arguments are not valid JSON"))
                continue
        calls.append(ToolCall(obj["name"], args))
    return calls


# ----- one trajectory -------------------------------------------------------------------------------
class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    CALLING_TOOLS = "calling_tools"
    DONE = "done"


@dataclass
class Trajectory:
    prompt_ids: list[int]
    messages: list[dict]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)  # 1 = generated by the policy
    log_probs: list[float] = field(default_factory=list)
    num_turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0
    finish_reason: str = ""  # "stop" | "length" | "max_turns" (| "env_error" | "env_timeout")
    state: AgentState = AgentState.PENDING
    reward: Any = (
        None  # an environment's episode reward (number or rubric dict; {"error": ...} when it failed)
    )
    env_errors: int = 0
    env_timeouts: int = 0
    env_truncated: bool = False  # cut by the turn or token limit before the environment said done

    def extend(self, ids: list[int], mask_value: int, log_probs: list[float] | None = None) -> None:
        self.response_ids += ids
        self.response_mask += [mask_value] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)


class ToolAgentLoop:
    """Runs one conversation to its end; ``max_turns=1`` with no tools is the single-turn loop."""

    def __init__(
        self,
        generator: TurnGenerator,
        tokenizer,
        tools: dict[str, Tool] | None = None,
        *,
        max_turns: int = 4,
        max_response_length: int = 256,
        sampling: dict | None = None,
        max_tool_response_chars: int = 2000,
        params: Any = None,
    ):
        """``params`` (``ToolAgentParams``, from ``rollout.agent: {name: tool, max_turns: ...}``) wins over
        the keyword defaults when given."""
        if params is not None:
            max_turns, max_tool_response_chars = params.max_turns, params.max_tool_response_chars
        self.generator = generator
        self.tokenizer = tokenizer
        self.tools = tools or {}
        self.max_turns = max_turns
        self.max_response_length = max_response_length
        self.sampling = dict(sampling or {})
        self.max_tool_response_chars = max_tool_response_chars
        self.schemas = [t.schema() for t in self.tools.values()] or None

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        kwargs = {"tools": self.schemas} if self.schemas else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    async def run(
        self, messages: list[dict], tools_kwargs: dict | None = None, prompt_ids: list[int] | None = None
    ) -> Trajectory:
        messages = [dict(m) for m in messages]
        traj = Trajectory(
            prompt_ids=list(prompt_ids) if prompt_ids is not None else self.prompt_ids(messages),
            messages=messages,
        )
        tools_kwargs = tools_kwargs or {}
        while True:
            budget = self.max_response_length - len(traj.response_ids)
            if budget <= 0:
                traj.finish_reason = "length"
                break
            traj.state = AgentState.GENERATING
            ids, logps, reason = await self.generator.generate_ids(
                traj.prompt_ids + traj.response_ids, {**self.sampling, "max_new_tokens": budget}
            )
            traj.extend(ids, 1, logps)
            traj.num_turns += 1
            content = self.tokenizer.decode(ids, skip_special_tokens=True)
            traj.messages.append({"role": "assistant", "content": content})
            calls = parse_hermes_tool_calls(content) if self.tools else []
            if reason == "length" or not calls or traj.num_turns >= self.max_turns:
                traj.finish_reason = "length" if reason == "length" else ("max_turns" if calls else "stop")
                break
            traj.state = AgentState.CALLING_TOOLS
            results = await asyncio.gather(*(self._call(c, tools_kwargs) for c in calls))
            traj.tool_calls += len(calls)
            traj.tool_errors += sum(not r.ok for r in results)
            tool_messages = [
                {"role": "tool", "name": c.name or "unknown", "content": r.text}
                for c, r in zip(calls, results)
            ]
            traj.extend(self._delta_ids(traj.messages, tool_messages, ids), 0)
            traj.messages += tool_messages
        traj.state = AgentState.DONE
        if len(traj.response_ids) > self.max_response_length:  # the last tool delta overshot
            for name in ("response_ids", "response_mask", "log_probs"):
                setattr(traj, name, getattr(traj, name)[: self.max_response_length])
            traj.finish_reason = "length"
        return traj

    async def _call(self, call: ToolCall, tools_kwargs: dict) -> ToolResult:
        if call.error:
            return ToolResult(
                f'Error: {call.error}. Write <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>.',
                ok=False,
            )
        tool = self.tools.get(call.name or "")
        if tool is None:
            return ToolResult(
                f"Error: there is no tool named {call.name!r}; available: {', '.join(sorted(self.tools))}.",
                ok=False,
            )
        result = await call_tool(tool, call.arguments, **(tools_kwargs.get(call.name) or {}))
        result.text = truncate(result.text, self.max_tool_response_chars)
        return result

    def _delta_ids(self, messages: list[dict], tool_messages: list[dict], generated: list[int]) -> list[int]:
        """Token ids the chat template adds after the generated turn for ``tool_messages`` (through
        the next assistant header): the rendered conversation after minus before, plus the part of
        the assistant turn's closing markup the model did not generate itself."""
        before = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + tool_messages, add_generation_prompt=True)
        if not after.startswith(before):  # a template that rewrites earlier turns: render the tools alone
            base = [{"role": "user", "content": "x"}]
            alone = self.render(base + tool_messages, add_generation_prompt=True)
            return self.encode(alone[len(self.render(base, add_generation_prompt=False)) :])
        content = messages[-1]["content"]
        end = before.rfind(content) + len(content) if content else len(before)
        closing = before[end:]  # e.g. "<|im_end|>\n"
        generated_text = self.tokenizer.decode(generated, skip_special_tokens=False)
        tail = generated_text[len(content) :] if generated_text.startswith(content) else ""
        if tail and closing.startswith(tail):  # the model generated part of it (its eos)
            closing = closing[len(tail) :]
        return self.encode(closing + after[len(before) :])


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, values in (
        ("num_turns", [t.num_turns for t in trajectories]),
        ("tool_call_counts", [t.tool_calls for t in trajectories]),
    ):
        if values:
            out[f"{key}/mean"] = sum(values) / len(values)
            out[f"{key}/max"] = float(max(values))
            out[f"{key}/min"] = float(min(values))
    # the environment loop's (rlkit.rollout.environment)
    episodes = [t for t in trajectories if t.reward is not None]
    if episodes:
        out |= {
            "env/errors": float(sum(t.env_errors for t in episodes)),
            "env/timeouts": float(sum(t.env_timeouts for t in episodes)),
            "env/truncated": float(sum(t.env_truncated for t in episodes)),
        }
    return out


class SingleTurnAgentLoop(ToolAgentLoop):
    """One assistant turn and no tools: a plain rollout through the agent machinery."""

    def __init__(
        self,
        generator: TurnGenerator,
        tokenizer,
        tools: dict[str, Tool] | None = None,
        *,
        max_response_length: int = 256,
        sampling: dict | None = None,
    ):
        super().__init__(
            generator,
            tokenizer,
            None,
            max_turns=1,
            max_response_length=max_response_length,
            sampling=sampling,
        )


# ----- the batch-level wrapper ------------------------------------------------------------------------
class AgentLoopRollout:
    """A backend plus agent loops, behind the ``generate(prompts: Batch, ...)`` contract."""

    def __init__(
        self,
        backend,
        tokenizer,
        *,
        rollout_config,
        max_response_length: int,
        loops: dict[str, Any],
        default_agent: str,
        tools: tuple[Any, ...] | dict[str, Tool] = (),
        generate_ids: bool = False,
    ):
        """``loops``: agent-loop name → resolved component (``rlkit.recipe.compose.Resolved``); ``tools``:
        resolved tool components (or built ``Tool`` objects by name); ``generate_ids``: the backend's declared
        capability (``RolloutBackendSpec.generate_ids``), else turns go through ``HFTurnGenerator``."""
        self.backend = backend
        self.generator: TurnGenerator = backend if generate_ids else HFTurnGenerator(backend)
        self.tokenizer = tokenizer
        self.config = rollout_config
        self.max_response_length = max_response_length
        self.loops = dict(loops)
        self.default_agent = default_agent
        if not isinstance(tools, dict):
            from rlkit.rollout.tools import build_tools

            tools = build_tools(tools)
        self.tools = tools
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )

    def update_weights(self, weights) -> None:
        self.backend.update_weights(weights)

    def _loop(self, agent: str, sampling: dict, max_len: int) -> ToolAgentLoop:
        resolved = self.loops.get(agent)
        if resolved is None:
            raise RlkitError(
                f"unknown agent_name {agent!r} in a data row; registered agent loops: "
                f"{', '.join(sorted(self.loops))} (registry `agent_loops`)."
            )
        tools = self.tools if resolved.spec.uses_tools else None
        return resolved.build(
            self.generator, self.tokenizer, tools, max_response_length=max_len, sampling=sampling
        )

    def generate(
        self,
        prompts: Batch,
        *,
        n: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        stop: list[str] | None = None,
    ) -> Batch:
        cfg = self.config
        n = cfg.n if n is None else n
        temperature = cfg.temperature if temperature is None else temperature
        do_sample = (temperature > 0) if do_sample is None else do_sample
        sampling = {
            "temperature": temperature,
            "top_p": cfg.top_p if top_p is None else top_p,
            "top_k": cfg.top_k if top_k is None else top_k,
            "do_sample": do_sample,
            "stop": list(cfg.stop if stop is None else stop),
        }
        max_len = self.max_response_length if max_new_tokens is None else max_new_tokens
        trajectories = asyncio.run(self._run_all(prompts, n, sampling, max_len))
        batch = self._assemble(trajectories, max_len)
        batch.meta.update(
            {
                "temperature": float(temperature) if do_sample and temperature > 0 else 1.0,
                "do_sample": bool(do_sample),
                "metrics": agent_metrics(trajectories),
            }
        )
        return batch

    async def _run_all(self, prompts: Batch, n: int, sampling: dict, max_len: int) -> list[Trajectory]:
        ids, mask = prompts["input_ids"], prompts["attention_mask"].long()  # [B, P]
        nt = prompts.non_tensors
        jobs = []
        for i in range(ids.shape[0]):
            extra = dict(nt["extra_info"][i] or {}) if "extra_info" in nt else {}
            agent = (
                (nt["agent_name"][i] if "agent_name" in nt else None)
                or extra.get("agent_name")
                or self.default_agent
            )
            loop = self._loop(agent, sampling, max_len)
            raw = list(nt["raw_prompt"][i]) if "raw_prompt" in nt else None
            row_ids = ids[i][mask[i].bool()].tolist()
            # A loop with tools re-renders the messages with the tool schemas; otherwise the given ids are the
            # prompt.
            prompt_ids = loop.prompt_ids(raw) if (raw and loop.schemas) else row_ids
            messages = raw if raw else [{"role": "user", "content": self.tokenizer.decode(row_ids)}]
            row = {"extra_info": extra} if self.loops[agent].spec.uses_environment else {}
            for _ in range(n):
                jobs.append(loop.run(messages, extra.get("tools_kwargs") or {}, prompt_ids=prompt_ids, **row))
        return list(await asyncio.gather(*jobs))

    def _assemble(self, trajectories: list[Trajectory], t_len: int) -> Batch:
        width = max(len(t.prompt_ids) for t in trajectories)
        b = len(trajectories)
        prompt_ids = torch.full((b, width), self.pad_token_id, dtype=torch.long)  # [B*n, P]
        prompt_mask = torch.zeros((b, width), dtype=torch.long)
        responses = torch.full((b, t_len), self.pad_token_id, dtype=torch.long)  # [B*n, T]
        response_mask = torch.zeros((b, t_len), dtype=torch.long)
        log_probs = torch.zeros((b, t_len), dtype=torch.float32)
        for r, t in enumerate(trajectories):
            p = len(t.prompt_ids)
            prompt_ids[r, width - p :] = torch.tensor(t.prompt_ids, dtype=torch.long)
            prompt_mask[r, width - p :] = 1
            k = len(t.response_ids)
            if k:
                responses[r, :k] = torch.tensor(t.response_ids, dtype=torch.long)
                response_mask[r, :k] = torch.tensor(t.response_mask, dtype=torch.long)
                log_probs[r, :k] = torch.tensor(t.log_probs, dtype=torch.float32)
        batch = assemble_rollout(prompt_ids, prompt_mask, responses, response_mask, log_probs, {})
        # Tool tokens are context the model attends to, though excluded from the loss.
        attention = torch.zeros((b, t_len), dtype=torch.long)
        for r, t in enumerate(trajectories):
            attention[r, : len(t.response_ids)] = 1
        batch.tensors["attention_mask"] = torch.cat([prompt_mask, attention], dim=1)
        batch.non_tensors["num_turns"] = _objects([t.num_turns for t in trajectories])
        batch.non_tensors["tool_call_counts"] = _objects([t.tool_calls for t in trajectories])
        if any(t.reward is not None for t in trajectories):  # the reward manager's per-sample env_reward
            batch.non_tensors["env_reward"] = _objects([t.reward for t in trajectories])
        return batch


def _objects(values: list) -> Any:
    import numpy as np

    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr
