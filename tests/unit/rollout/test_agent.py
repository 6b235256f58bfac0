"""The tool agent loop: tool results land in the trajectory and are masked out of the loss."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from rlkit.batch import Batch
from rlkit.plugin.manager import make_plugin_manager
from rlkit.plugin.registry import build_registries
from rlkit.recipe.compose import resolve
from rlkit.recipe.schema import RolloutConfig
from rlkit.rollout.agent import (
    AgentLoopRollout,
    AgentState,
    HFTurnGenerator,
    ToolAgentLoop,
    parse_hermes_tool_calls,
)
from rlkit.rollout.tools import Tool, ToolResult
from rlkit.rollout.tools.calculator import CalculatorTool


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from rlkit.model.load import load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def registries():
    return build_registries(make_plugin_manager(entry_points=False))


def resolved_loops(registries, agent):
    """Agent loops as the driver resolves them (``rlkit.recipe.compose.compose``): every registered loop with
    its default parameters, the recipe's ``rollout.agent`` with its own; returns ``(loops, default name)``."""
    loops = {}
    for entry in registries.agent_loops:
        loops[entry.spec.name], problems = resolve(
            "rollout.agent", "agent_loops", entry.spec.name, registries
        )
        assert not problems, problems
    default, problems = resolve("rollout.agent", "agent_loops", agent, registries)
    assert not problems, problems
    loops[default.name] = default
    return loops, default.name


def _call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedPolicy:
    """A fake backend: turn k of a conversation (k = assistant headers in its prompt, minus one) emits
    ``turns[k]`` (text → ids of the real tokenizer) plus eos; concurrent conversations are fine."""

    def __init__(self, tokenizer, turns: list[str], logprob: float = -0.5):
        self.tokenizer, self.turns, self.logprob = tokenizer, turns, logprob
        self.seen: list[list[int]] = []

    async def generate_ids(self, prompt_ids, sampling):
        self.seen.append(list(prompt_ids))
        turn = self.tokenizer.decode(prompt_ids).count("<|im_start|>assistant") - 1
        text = self.turns[min(turn, len(self.turns) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[: sampling["max_new_tokens"]]
        return ids, [self.logprob] * len(ids), "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"


def _run(loop: ToolAgentLoop, question="What is 12 * 7?", **kw):
    return asyncio.run(loop.run([{"role": "user", "content": question}], **kw))


def test_tool_result_is_in_the_trajectory_and_masked_out(tokenizer):
    policy = ScriptedPolicy(tokenizer, [_call("calculator", expression="12 * 7"), "The answer is 84."])
    loop = ToolAgentLoop(
        policy, tokenizer, {"calculator": CalculatorTool()}, max_turns=4, max_response_length=200
    )
    traj = _run(loop)
    assert traj.state is AgentState.DONE and traj.finish_reason == "stop"
    assert (traj.num_turns, traj.tool_calls, traj.tool_errors) == (2, 1, 0)
    assert traj.messages[-2] == {"role": "tool", "name": "calculator", "content": "84"}
    ids, mask = traj.response_ids, traj.response_mask
    assert len(ids) == len(mask) == len(traj.log_probs)
    generated = tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    injected = tokenizer.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    assert generated == _call("calculator", expression="12 * 7") + "<|im_end|>The answer is 84.<|im_end|>"
    # Everything the template adds between the turns — the tool message with its result — has mask 0.
    assert injected == "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(traj.log_probs, mask))
    # prompt ‖ response is exactly the chat template's rendering of the whole conversation, and the
    # policy's second turn saw the tool result.
    full = tokenizer.decode(traj.prompt_ids + ids, skip_special_tokens=False)
    assert full + "\n" == loop.render(traj.messages, add_generation_prompt=False)
    assert policy.seen[1] == traj.prompt_ids + ids[: len(policy.seen[1]) - len(traj.prompt_ids)]
    assert tokenizer.decode(policy.seen[1]).rstrip().endswith("84<|im_end|>\n<|im_start|>assistant")


def test_max_turns_bounds_a_policy_that_never_stops_calling(tokenizer):
    policy = ScriptedPolicy(tokenizer, [_call("calculator", expression="1 + 1")])
    loop = ToolAgentLoop(
        policy, tokenizer, {"calculator": CalculatorTool()}, max_turns=3, max_response_length=500
    )
    traj = _run(loop)
    assert (traj.num_turns, traj.tool_calls, traj.finish_reason) == (3, 2, "max_turns")
    assert len(policy.seen) == 3


def test_malformed_and_unknown_tool_calls_become_error_messages(tokenizer):
    turns = [
        '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
        + _call("search", query="x")
        + _call("calculator", expression="2 ** 3"),
        "done",
    ]
    loop = ToolAgentLoop(
        ScriptedPolicy(tokenizer, turns),
        tokenizer,
        {"calculator": CalculatorTool()},
        max_turns=4,
        max_response_length=400,
    )
    traj = _run(loop)
    tool_msgs = [m for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 3 and (traj.tool_calls, traj.tool_errors) == (3, 2)
    assert "not valid JSON" in tool_msgs[0]["content"]
    assert "no tool named 'search'" in tool_msgs[1]["content"]
    assert tool_msgs[2]["content"] == "8"
    assert traj.finish_reason == "stop" and traj.num_turns == 2


def test_response_is_cut_at_max_response_length(tokenizer):
    policy = ScriptedPolicy(tokenizer, [_call("calculator", expression="3 * 3"), "The answer is nine. " * 20])
    loop = ToolAgentLoop(
        policy, tokenizer, {"calculator": CalculatorTool()}, max_turns=4, max_response_length=60
    )
    traj = _run(loop)
    assert len(traj.response_ids) == 60 and traj.finish_reason == "length"


def test_parse_hermes_several_calls_and_string_arguments():
    calls = parse_hermes_tool_calls(
        'a <tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> b '
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call> <tool_call>[1]</tool_call>'
    )
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("f", {"x": 1}, True),
        ("g", {}, True),
    ]
    assert calls[2].error and 'string "name"' in calls[2].error
    assert parse_hermes_tool_calls("no calls <tool_call>{unterminated") == []


class EchoKwargs(Tool):
    name = "echo"
    parameters = {"type": "object", "properties": {}, "required": []}

    async def execute(self, arguments, **tools_kwargs):
        return ToolResult(json.dumps(tools_kwargs, sort_keys=True))


def test_batch_rollout_picks_the_loop_per_row_and_passes_tools_kwargs(tokenizer, registries):
    policy = ScriptedPolicy(tokenizer, [_call("echo"), "ok"])
    rows = [[{"role": "user", "content": "use the tool"}], [{"role": "user", "content": "just answer"}]]
    encoded = [
        loop_ids
        for loop_ids in (
            tokenizer.apply_chat_template(r, add_generation_prompt=True, tokenize=False) for r in rows
        )
    ]
    encoded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in encoded]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    prompts = Batch(
        {"input_ids": ids, "attention_mask": mask},
        non_tensors={
            "raw_prompt": rows,
            "extra_info": [
                {"agent_name": "tool", "tools_kwargs": {"echo": {"secret": 42}}},
                {"agent_name": "single_turn"},
            ],
        },
    )
    loops, default = resolved_loops(registries, {"name": "tool", "max_turns": 3})
    rollout = AgentLoopRollout(
        policy,
        tokenizer,
        rollout_config=RolloutConfig(agent=default),
        max_response_length=160,
        loops=loops,
        default_agent=default,
        tools={"echo": EchoKwargs()},
        generate_ids=True,
    )
    assert rollout.generator is policy  # the declared capability: turns go straight to the backend
    assert rollout._loop("tool", {}, 160).max_turns == 3  # rollout.agent's parameter reached the loop
    assert rollout._loop("single_turn", {}, 160).max_turns == 1
    out = rollout.generate(prompts, n=2)
    assert out["responses"].shape == (4, 160) and out["input_ids"].shape[1] == out["prompts"].shape[1] + 160
    assert list(out.non_tensors["num_turns"]) == [2, 2, 1, 1]
    assert list(out.non_tensors["tool_call_counts"]) == [1, 1, 0, 0]
    assert out.meta["metrics"] == {
        "num_turns/mean": 1.5,
        "num_turns/max": 2.0,
        "num_turns/min": 1.0,
        "tool_call_counts/mean": 0.5,
        "tool_call_counts/max": 1.0,
        "tool_call_counts/min": 0.0,
    }
    text = tokenizer.decode(
        out["responses"][0][out["attention_mask"][0, -160:].bool()], skip_special_tokens=False
    )
    assert '{"secret": 42}' in text  # the row's tools_kwargs reached the tool
    # The tool tokens are attended to but excluded from the loss.
    p = out["prompts"].shape[1]
    assert out["attention_mask"][0, p:].sum() > out["response_mask"][0].sum()
    assert torch.equal(out["attention_mask"][2, p:], out["response_mask"][2])  # single turn: identical
    assert (out["rollout_log_probs"][out["response_mask"] == 0] == 0).all()


def test_hf_backend_through_the_adapter_matches_single_turn_generate(tiny_model_dir, tokenizer, registries):
    from rlkit.model.load import load_model
    from rlkit.recipe.schema import ModelConfig
    from rlkit.rollout.hf import HFRollout

    torch.set_num_threads(1)
    module = load_model(ModelConfig(path=str(tiny_model_dir)), tokenizer=tokenizer)
    cfg = RolloutConfig(temperature=0.0, agent={"name": "tool", "max_turns": 2}, tools=["calculator"])
    calculator, problems = resolve("rollout.tools.0", "tools", "calculator", registries)
    assert not problems, problems
    hf = HFRollout(module=module, tokenizer=tokenizer, rollout_config=cfg, max_response_length=12)
    texts = ["What is 1 + 2?", "What is the sum of 30 and 4? Think step by step"]
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False
        )
        for t in texts
    ]
    encoded = [tokenizer(e, add_special_tokens=False)["input_ids"] for e in encoded]
    width = max(map(len, encoded))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    prompts = Batch({"input_ids": ids, "attention_mask": mask})
    direct = hf.generate(prompts)
    loops, default = resolved_loops(registries, "single_turn")
    agent = AgentLoopRollout(
        hf,
        tokenizer,
        rollout_config=cfg.model_copy(update={"agent": default}),
        max_response_length=12,
        loops=loops,
        default_agent=default,
        tools=(calculator,),
    )
    assert isinstance(agent.generator, HFTurnGenerator)
    looped = agent.generate(prompts)
    for key in ("prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(looped[key], direct[key]), key
    torch.testing.assert_close(looped["rollout_log_probs"], direct["rollout_log_probs"])
    # The tool agent on the real model runs (a random tiny model rarely calls a tool) with the same layout.
    loops, default = resolved_loops(registries, cfg.agent)
    tool_agent = AgentLoopRollout(
        hf,
        tokenizer,
        rollout_config=cfg,
        max_response_length=12,
        loops=loops,
        default_agent=default,
        tools=(calculator,),
    )
    assert default == "tool" and type(tool_agent.tools["calculator"]).__name__ == "CalculatorTool"
    assert tool_agent._loop("tool", {}, 12).max_turns == 2
    tool_out = tool_agent.generate(prompts)
    assert tool_out["responses"].shape == (2, 12) and "num_turns/mean" in tool_out.meta["metrics"]
