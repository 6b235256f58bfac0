"""Conformance checks for rollout backends and agent loops (``rlkit.plugin.protocols``).

``check_rollout_backend`` builds the backend exactly as ``ActorRolloutRefWorker`` does and runs
``generate`` on a few left-padded chat prompts: sampled with ``n`` samples, greedy, and with a
shorter ``max_new_tokens``. With a model it also recomputes every response token's log-prob with a
forward pass (what the actor does) and compares. A tiny model is enough
(``rlkit.model.tiny.build_tiny_model``, or the ``rlkit_tiny_model`` fixture).
Shapes: ``B`` prompts, ``n`` samples per prompt, ``P`` prompt width, ``T`` response width.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import torch

from rlkit.testing._common import ContractError, resolve_component, who

__all__ = ["check_rollout_backend", "check_agent_loop", "chat_prompts", "hf_greedy", "assert_same_greedy"]

_BACKEND = (
    "generate(prompts, *, n, temperature, top_p, top_k, max_new_tokens, do_sample, stop) -> Batch in the "
    "layout of rlkit.rollout.base  (rlkit.plugin.protocols.RolloutBackend)"
)
_LOOP = (
    "cls(generator, tokenizer, tools, *, max_response_length, sampling[, params]); await run(...) -> "
    "Trajectory  (rlkit.plugin.protocols.AgentLoop)"
)
_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
QUESTIONS = ("What is 2 + 3?", "Solve: what is the sum of four and five times two?", "Compute 7 * 8.")


def chat_prompts(tokenizer: Any, questions: tuple[str, ...] = QUESTIONS) -> Any:
    """A Batch of ``input_ids, attention_mask [B, P]``: the questions through the chat template (plain
    text without one), left-padded to one width."""
    from rlkit.batch import Batch

    rows = []
    for q in questions:
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        else:
            text = q
        rows.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # [B, P]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # [B, P]
    return Batch({"input_ids": ids, "attention_mask": mask})


def hf_greedy(module: Any, tokenizer: Any, prompts: Any, max_new: int) -> Any:
    """The built-in HF backend's greedy rollout of ``prompts`` (one per prompt, ``max_new`` tokens) from
    ``module``: the reference an engine backend's greedy output is compared with."""
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout

    hf = HFRollout(
        module=module, tokenizer=tokenizer, rollout_config=RolloutConfig(), max_response_length=max_new
    )
    return hf.generate(prompts, n=1, do_sample=False)


def assert_same_greedy(ours: Any, ref: Any, *, atol: float) -> None:
    """Same greedy tokens and response mask, and rollout log-probs within ``atol`` of ``ref``'s."""
    assert torch.equal(ours["responses"], ref["responses"]) and torch.equal(
        ours["response_mask"], ref["response_mask"]
    )
    gap = (ours["rollout_log_probs"] - ref["rollout_log_probs"]).abs().max().item()
    assert gap < atol, f"greedy log-probs differ from the reference's by {gap:.2e} (allowed {atol:.0e})"


def check_rollout_backend(
    cls_or_spec: Any,
    module: Any,
    tokenizer: Any,
    *,
    registries: Any = None,
    n: int = 2,
    max_response_length: int = 8,
    temperature: float = 0.8,
    top_k: int = 20,
    compare_log_probs: bool = True,
    atol: float = 2e-3,
    device: str = "cpu",
    seed: int = 0,
    **params: Any,
) -> Any:
    """Check a rollout backend against ``rlkit.plugin.protocols.RolloutBackend``; raise ``ContractError``.

    ``cls_or_spec``: the class, a ``RolloutBackendSpec`` (its declared capabilities are checked too)
    or a registered name; ``module``: the causal LM it samples from (the actor's, as in the hybrid
    engine; a backend with its own engine must serve the same weights for ``compare_log_probs``);
    ``params``: the backend's parameters. Returns the built backend (still open). Checked:

    - keys, shapes ``[B*n, P]`` / ``[B*n, T]`` / ``[B*n, P+T]`` with ``T = max_new_tokens``; row
      ``i*n + j`` holds prompt ``i`` (``n`` ordering); ``input_ids = prompts ‖ responses``;
      ``attention_mask = prompt mask ‖ response_mask``; ``position_ids`` as the layout says;
    - ``response_mask`` is 1 up to the end of each response (at least one token, at most
      ``max_new_tokens``), pad ids after; a response that ends early ends with eos;
    - ``rollout_log_probs`` (returned unless the spec declares ``rollout_log_probs=False``; rollout
      corrections need them): one finite log-prob <= 0 per response token, 0 where
      masked, equal (``atol``) to ``log_softmax(logits / temperature)`` of ``module``'s forward — the
      untruncated distribution even with ``top_k`` — and to temperature 1 when greedy;
    - greedy with ``n`` samples repeats the ``n=1`` greedy response ``n`` times, in order; meta
      ``temperature`` and ``do_sample``; ``update_weights(module)`` is accepted;
    - declared capabilities: ``generate_ids`` returns ``(ids, logprobs, "stop" | "length")`` within
      its budget; ``memory_release``: ``release_memory`` then ``resume_memory``, then generation works.
    """
    from rlkit.plugin.protocols import CAPABILITIES
    from rlkit.recipe.schema import RolloutConfig

    backend_c = resolve_component("rollout_backends", cls_or_spec, params, registries)
    name = who(backend_c)
    config = RolloutConfig(n=n, temperature=temperature, top_k=top_k)
    backend = _build_backend(name, backend_c, module, tokenizer, config, max_response_length, device, seed)
    prompts = chat_prompts(tokenizer)
    sampled = backend.generate(prompts)
    _check_layout(name, sampled, prompts, tokenizer, n, max_response_length)
    if backend_c.spec.rollout_log_probs and "rollout_log_probs" not in sampled:
        raise _fail(
            name,
            "generate returned no rollout_log_probs, but the spec declares rollout_log_probs=True "
            "(the default): return them, or declare rollout_log_probs=False (no rollout correction then).",
        )
    if compare_log_probs and module is not None:
        _check_log_probs(name, sampled, module, temperature, atol)
    greedy = _check_greedy(name, backend, prompts, tokenizer, n, max_response_length)
    if compare_log_probs and module is not None:
        _check_log_probs(name, greedy, module, 1.0, atol)
    short = backend.generate(prompts, n=1, max_new_tokens=3)
    _check_layout(name, short, prompts, tokenizer, 1, 3)
    if module is not None:
        backend.update_weights(module)  # what sync_weights hands over in the hybrid engine
    _check_capabilities(
        name, backend, backend_c.spec, CAPABILITIES, prompts, tokenizer, n, max_response_length
    )
    return backend


def _build_backend(name, backend_c, module, tokenizer, config, max_response_length, device, seed) -> Any:
    """The backend built with rlkit's keywords; it must have ``generate`` and ``update_weights``."""
    from rlkit.plugin.protocols import RolloutBackend

    try:
        backend = backend_c.build(
            module=module,
            tokenizer=tokenizer,
            rollout_config=config,
            max_response_length=max_response_length,
            device=torch.device(device),
            seed=seed,
        )
    except TypeError as exc:
        raise ContractError(
            f"{name}: the constructor refused rlkit's keywords: {exc}\nContract: {_BACKEND}"
        ) from exc
    if not isinstance(backend, RolloutBackend):
        raise ContractError(
            f"{name}: {type(backend).__name__} lacks generate() or update_weights().\nContract: {_BACKEND}"
        )
    return backend


def _check_greedy(name, backend, prompts, tokenizer, n: int, max_response_length: int) -> Any:
    """Greedy with ``n`` samples: the layout, the ``n=1`` greedy response repeated in place, greedy meta.
    Returns the ``n``-sample greedy batch."""
    greedy = backend.generate(prompts, n=n, do_sample=False)
    _check_layout(name, greedy, prompts, tokenizer, n, max_response_length)
    single = backend.generate(prompts, n=1, do_sample=False)
    if not torch.equal(greedy["responses"], single["responses"].repeat_interleave(n, dim=0)):
        raise ContractError(
            f"{name}: greedy responses with n={n} are not the n=1 greedy responses repeated in place "
            f"(row i*n + j must be sample j of prompt i).\nContract: {_BACKEND}"
        )
    if greedy.meta.get("temperature") != 1.0 or greedy.meta.get("do_sample") is not False:
        raise ContractError(
            f"{name}: greedy meta must be temperature=1.0, do_sample=False; got {greedy.meta}."
        )
    return greedy


def _fail(name: str, problem: str) -> ContractError:
    return ContractError(f"{name}: {problem}\nContract: {_BACKEND}")


def _check_layout(name: str, out: Any, prompts: Any, tokenizer: Any, n: int, max_new: int) -> None:
    from rlkit.batch import Batch

    if not isinstance(out, Batch):
        raise _fail(name, f"generate returned {type(out).__name__}, not an rlkit Batch.")
    missing = [k for k in _KEYS if k not in out]
    if missing:
        raise _fail(name, f"the Batch lacks {missing} (has {sorted(out.keys())}).")
    b = prompts["input_ids"].shape[0] * n
    p_in = prompts["attention_mask"]
    width_p = out["prompts"].shape[1]
    resp, rmask = out["responses"], out["response_mask"]
    if tuple(resp.shape) != (b, max_new) or tuple(rmask.shape) != (b, max_new):
        raise _fail(
            name,
            f"responses/response_mask have shapes {tuple(resp.shape)}/{tuple(rmask.shape)}; expected "
            f"[B*n, T] = {(b, max_new)} (T = max_new_tokens).",
        )
    for key in ("input_ids", "attention_mask", "position_ids"):
        if tuple(out[key].shape) != (b, width_p + max_new):
            raise _fail(
                name,
                f"{key} has shape {tuple(out[key].shape)}; expected [B*n, P+T] = {(b, width_p + max_new)}.",
            )
    pmask = out["attention_mask"][:, :width_p]
    for r in range(b):  # row i*n + j holds prompt i, whatever the padding width
        given = prompts["input_ids"][r // n][p_in[r // n].bool()]
        if not torch.equal(out["prompts"][r][pmask[r].bool()], given):
            raise _fail(
                name,
                f"row {r} does not hold prompt {r // n}: rows are prompt-major (i*n + j), with the "
                "prompt ids as given.",
            )
    if not torch.equal(out["input_ids"], torch.cat([out["prompts"], resp], dim=1)):
        raise _fail(name, "input_ids is not prompts ‖ responses.")
    if not torch.equal(out["attention_mask"][:, width_p:].long(), rmask.long()):
        raise _fail(name, "attention_mask's response part is not response_mask.")
    _check_positions(name, out, width_p, max_new)
    _check_mask_and_ends(name, out, tokenizer, max_new)
    if not {"temperature", "do_sample"} <= set(out.meta):
        raise _fail(name, f"meta must carry temperature and do_sample; got {sorted(out.meta)}.")


def _check_positions(name: str, out: Any, width_p: int, max_new: int) -> None:
    pmask = out["attention_mask"][:, :width_p].long()
    expect_p = (pmask.cumsum(-1) - 1).clamp(min=0)
    pos = out["position_ids"]
    expect_r = expect_p[:, -1:] + torch.arange(1, max_new + 1)
    if not torch.equal(pos[:, :width_p][pmask.bool()], expect_p[pmask.bool()]) or not torch.equal(
        pos[:, width_p:], expect_r
    ):
        raise _fail(
            name,
            "position_ids must be cumsum(prompt mask) - 1 over the prompt, then count on by one per "
            "response column (padding columns included).",
        )


def _check_mask_and_ends(name: str, out: Any, tokenizer: Any, max_new: int) -> None:
    rmask, resp = out["response_mask"].long(), out["responses"]
    if not torch.equal(rmask, rmask.cummin(dim=1).values) or not ((rmask == 0) | (rmask == 1)).all():
        raise _fail(
            name, "response_mask must be 1 up to the end of each response and 0 after (a prefix of ones)."
        )
    lengths = rmask.sum(1)
    if (lengths < 1).any():
        raise _fail(name, f"rows {(lengths < 1).nonzero().flatten().tolist()} have no response token.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if (resp[rmask == 0] != pad).any():
        raise _fail(name, f"responses must hold the pad id ({pad}) after the end of each response.")
    eos = tokenizer.eos_token_id
    for r in (lengths < max_new).nonzero().flatten().tolist():
        if int(resp[r, lengths[r] - 1]) != eos:
            raise _fail(
                name, f"row {r} ends after {int(lengths[r])} of {max_new} tokens without eos ({eos})."
            )
    if "rollout_log_probs" in out:
        lp = out["rollout_log_probs"]
        if (
            tuple(lp.shape) != tuple(rmask.shape)
            or not lp.is_floating_point()
            or not torch.isfinite(lp).all()
        ):
            raise _fail(name, f"rollout_log_probs must be finite floats [B*n, T] = {tuple(rmask.shape)}.")
        if (lp[rmask == 0] != 0).any() or (lp[rmask == 1] > 1e-6).any():
            raise _fail(
                name, "rollout_log_probs must be one log-prob (<= 0) per response token and 0 where masked."
            )


@torch.no_grad()
def _check_log_probs(name: str, out: Any, module: Any, temperature: float, atol: float) -> None:
    """The actor's recomputation: log_softmax(logits / temperature) of the sampled tokens."""
    if "rollout_log_probs" not in out:
        return
    width_p = out["prompts"].shape[1]
    was_training = module.training
    module.eval()
    try:
        logits = module(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    finally:
        module.train(was_training)
    t = out["responses"].shape[1]
    # [B*n, T, V]
    logp = torch.log_softmax(logits[:, width_p - 1 : width_p - 1 + t].float() / temperature, dim=-1)
    expected = logp.gather(-1, out["responses"][..., None]).squeeze(-1) * out["response_mask"]
    worst = float((expected - out["rollout_log_probs"]).abs().max())
    if worst > atol:
        raise _fail(
            name,
            f"rollout_log_probs differ from the model's log_softmax(logits / {temperature}) of the sampled "
            f"tokens by up to {worst:.3g} (> {atol}): report the untruncated temperature-scaled "
            "distribution's log-prob (before top-k / top-p), temperature 1 when greedy.",
        )


def _check_capabilities(
    name: str, backend: Any, spec: Any, capabilities: dict, prompts: Any, tokenizer: Any, n: int, max_new: int
) -> None:
    for flag, protocol in capabilities.items():
        if getattr(spec, flag, False) and not isinstance(backend, protocol):
            methods = [m for m in vars(protocol) if not m.startswith("_")]
            raise _fail(
                name,
                f"the spec declares {flag}=True but {type(backend).__name__} lacks {methods} "
                f"(rlkit.plugin.protocols.{protocol.__name__}).",
            )
    if getattr(spec, "generate_ids", False):
        if not inspect.iscoroutinefunction(backend.generate_ids):
            raise _fail(name, "generate_ids must be an async method (agent loops await it).")
        row = prompts["input_ids"][0][prompts["attention_mask"][0].bool()].tolist()
        ids, logps, reason = asyncio.run(
            backend.generate_ids(
                row,
                {
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": 0,
                    "do_sample": True,
                    "stop": [],
                    "max_new_tokens": 4,
                },
            )
        )
        if not (
            isinstance(ids, list)
            and len(ids) == len(logps)
            and 1 <= len(ids) <= 4
            and reason in ("stop", "length")
        ):
            raise _fail(
                name,
                f"generate_ids returned {len(ids)} ids, {len(logps)} log-probs, finish_reason {reason!r}; "
                "expected 1..max_new_tokens ids, one log-prob each, 'stop' or 'length'.",
            )
    if getattr(spec, "memory_release", False):
        backend.release_memory()
        backend.resume_memory()  # then generation works again
        _check_layout(name, backend.generate(prompts, n=1), prompts, tokenizer, 1, max_new)


class _TwoRepliesEpisode:
    """The default environment of ``check_agent_loop`` for a loop declaring ``uses_environment``."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, assistant_text: str) -> tuple[str | None, bool]:
        self.turns += 1
        return ("Go on.", False) if self.turns < 3 else (None, True)

    def reward(self) -> float:
        return float(self.turns)


class _TwoRepliesEnv:
    def rows(self, split: str) -> list[dict]:
        return [{"prompt": [{"role": "user", "content": QUESTIONS[0]}]}] if split == "train" else []

    def score(self, solution_str: str, ground_truth: Any, extra_info: Any) -> float:
        return 0.0

    def episode(self, extra_info: dict) -> _TwoRepliesEpisode:
        return _TwoRepliesEpisode()


def check_agent_loop(
    spec_or_name: Any,
    generator: Any,
    tokenizer: Any,
    *,
    tools: dict | None = None,
    registries: Any = None,
    max_response_length: int = 12,
    environment: Any = None,
    **params: Any,
) -> None:
    """Check an agent loop against ``rlkit.plugin.protocols.AgentLoop``; raise ``ContractError``.

    ``generator``: a ``rlkit.plugin.protocols.GeneratesIds`` (``HFTurnGenerator(HFRollout(...))`` on a tiny
    model, or a backend declaring ``generate_ids``); ``tools``: name → tool, offered when the spec
    declares ``uses_tools``; ``environment``: a resolved environment (``rlkit.recipe.compose.Resolved``) for a
    loop declaring ``uses_environment`` (default: one that replies twice, then ends). Built as
    ``AgentLoopRollout`` builds it; ``run`` is awaited with and
    without given ``prompt_ids``. Checked: the constructor, ``schemas``, ``prompt_ids(messages)`` →
    ints, and a ``Trajectory`` whose prompt is the one given, whose ``response_ids``,
    ``response_mask`` (0/1, starting with the policy's tokens) and ``log_probs`` (<= 0, 0 where
    masked) have one length <= ``max_response_length``, with ``num_turns >= 1`` and
    ``finish_reason`` in stop / length / max_turns.
    """
    from rlkit.plugin.protocols import AgentLoop

    loop_c = resolve_component("agent_loops", spec_or_name, params, registries)
    name = who(loop_c)

    def fail(problem: str) -> ContractError:
        return ContractError(f"{name}: {problem}\nContract: {_LOOP}")

    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "do_sample": True, "stop": []}
    offered = (tools or {}) if loop_c.spec.uses_tools else None
    if loop_c.spec.uses_environment:  # as the composition root does: the loop's params carry the environment
        from dataclasses import replace

        from rlkit.plugin.specs import EnvironmentSpec

        environment = environment or resolve_component(
            "environments", EnvironmentSpec(name="conformance", cls=_TwoRepliesEnv, multi_turn=True), {}
        )
        loop_c = replace(loop_c, params=loop_c.params.with_environment(environment))
    try:
        loop = loop_c.build(
            generator, tokenizer, offered, max_response_length=max_response_length, sampling=sampling
        )
    except TypeError as exc:
        raise fail(f"the constructor refused rlkit's arguments: {exc}") from exc
    if not isinstance(loop, AgentLoop) or not inspect.iscoroutinefunction(loop.run):
        raise fail(
            f"{type(loop).__name__} needs a `schemas` attribute, prompt_ids(messages) and an async run(...)."
        )
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = loop.prompt_ids(messages)
    if not (isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt)):
        raise fail(f"prompt_ids(messages) must return a non-empty list of ints, got {prompt!r}.")
    for given in (prompt, None):
        traj = asyncio.run(loop.run([dict(m) for m in messages], {}, prompt_ids=given))
        _check_trajectory(fail, traj, prompt, max_response_length)


def _check_trajectory(fail: Any, traj: Any, prompt: list[int], max_len: int) -> None:
    ids, mask, logps = (
        list(getattr(traj, k, None) or []) for k in ("response_ids", "response_mask", "log_probs")
    )
    if list(getattr(traj, "prompt_ids", [])) != prompt:
        raise fail("the trajectory's prompt_ids are not the prompt it was given (or prompt_ids(messages)).")
    if not (len(ids) == len(mask) == len(logps)) or not 1 <= len(ids) <= max_len:
        raise fail(
            f"response_ids/response_mask/log_probs have lengths {len(ids)}/{len(mask)}/{len(logps)}; "
            f"expected one length in 1..max_response_length={max_len}."
        )
    if set(mask) - {0, 1} or mask[0] != 1:
        raise fail(f"response_mask must be 0/1 and start with the policy's own tokens (1); got {mask}.")
    if any(lp != 0 for lp, m in zip(logps, mask) if m == 0) or any(lp > 1e-6 for lp in logps):
        raise fail("log_probs must be <= 0 for the policy's tokens and 0 for tool/template tokens.")
    if getattr(traj, "num_turns", 0) < 1 or getattr(traj, "finish_reason", "") not in (
        "stop",
        "length",
        "max_turns",
    ):
        raise fail(
            f"num_turns {getattr(traj, 'num_turns', None)} (must be >= 1), finish_reason "
            f"{getattr(traj, 'finish_reason', None)!r} (stop, length or max_turns)."
        )
