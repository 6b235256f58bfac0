"""Conformance checks for trackers and worker roles (``rlkit.plugin.protocols``).

``check_tracker`` runs a tracker for real in a folder of your choice. ``check_role`` is static: a
role's constructor joins a process group and loads a model, so it is checked by its signatures
against the slot it fills (``RoleSpec.fills``): the keywords the runtime passes and the methods the
trainer calls. Run the role for real through ``rlkit.workers.WorkerGroup`` on a Ray cluster (as
tests/unit/workers/test_roles.py does) or end to end with ``rlkit run``.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

from rlkit.testing._common import ContractError, resolve_component, who

__all__ = ["check_tracker", "check_role", "check_tool"]

_TRACKER = (
    "cls(config: TrackerConfig); log_params, log, log_artifact, log_text, finish; name, run_id  "
    "(rlkit.plugin.protocols.Tracker)"
)


def check_tracker(cls_or_spec: Any, directory: str | Path, *, registries: Any = None, **params: Any) -> None:
    """Check a tracker against ``rlkit.plugin.protocols.Tracker``, writing under ``directory``; raise
    ``ContractError``.

    Built as the runtime builds it, from a ``TrackerConfig`` whose ``output_dir`` is in ``directory``
    (``mlflow_uri``/``jsonl_path`` unset: the tracker's defaults must land there too). Checked: ``name``
    and ``run_id`` are strings; ``log_params`` (nested dicts), ``log`` (slashes, ``@``, a NaN),
    ``log_text`` (a name with ``/``), ``log_artifact`` and ``finish`` return without raising; a tracker
    built again with ``run_ids={name: run_id}`` (a resumed run) reports the same ``run_id``.
    """
    from rlkit.plugin.protocols import Tracker
    from rlkit.runtime.tracking import TrackerConfig

    tracker_c = resolve_component("trackers", cls_or_spec, params, registries)
    name = who(tracker_c)
    root = Path(directory)
    config = TrackerConfig(
        project="conformance", experiment="run", output_dir=root / "conformance" / "run", total_steps=2
    )
    tracker = tracker_c.build(config)
    if (
        not isinstance(tracker, Tracker)
        or not isinstance(tracker.name, str)
        or not isinstance(tracker.run_id, str)
    ):
        raise ContractError(
            f"{name}: {type(tracker).__name__} needs string attributes name and run_id and the methods "
            f"of the protocol.\nContract: {_TRACKER}"
        )
    artifact = root / "artifact.txt"
    artifact.write_text("conformance\n")
    calls = [
        ("log_params", ({"model": {"path": "tiny"}, "trainer": {"total_steps": 2}},)),
        ("log", ({"critic/score/mean": 0.5, "val-core/x/acc/mean@1": 1.0, "actor/grad_norm": math.nan}, 1)),
        ("log", ({"critic/score/mean": 0.75, "training/global_step": 2.0}, 2)),
        ("log_text", ("| a | b |\n|---|---|\n", "generations/step_2.md")),
        ("log_artifact", (str(artifact),)),
        ("finish", ("FINISHED",)),
    ]
    for method, args in calls:
        try:
            getattr(tracker, method)(*args)
        except Exception as exc:
            raise ContractError(
                f"{name}: {method}{args!r} raised {type(exc).__name__}: {exc}\nContract: {_TRACKER}"
            ) from exc
    if tracker.run_id:
        resumed_config = TrackerConfig(
            project=config.project,
            experiment=config.experiment,
            output_dir=config.output_dir,
            total_steps=4,
            run_ids={tracker.name: tracker.run_id},
        )
        again = tracker_c.build(resumed_config)
        again.finish("FINISHED")
        if again.run_id != tracker.run_id:
            raise ContractError(
                f"{name}: built with run_ids={{{tracker.name!r}: {tracker.run_id!r}}} (a resumed run) it "
                f"reports run_id {again.run_id!r}; it must continue the same run.\nContract: {_TRACKER}"
            )


def check_role(cls_or_spec: Any, *, registries: Any = None) -> None:
    """Check a role class against the slot it fills (``RoleSpec.fills``); raise ``ContractError``.

    Static (nothing is constructed): the constructor takes ``rlkit.plugin.protocols.ROLE_ARGS`` positionally
    and every keyword of ``ROLE_KWARGS[slot]``; the class has every method of
    ``SLOT_PROTOCOLS[slot]``, and each accepts the arguments the trainer passes.
    """
    from rlkit.plugin.protocols import ROLE_ARGS, ROLE_KWARGS, SLOT_PROTOCOLS
    from rlkit.recipe.compose import SLOTS

    role_c = resolve_component("roles", cls_or_spec, {}, registries)
    name = who(role_c)
    slot = role_c.spec.fills
    if slot not in SLOTS:
        raise ContractError(
            f"{name}: fills slot '{slot}', which the step does not have; slots: {', '.join(SLOTS)} "
            "(RoleSpec.slot)."
        )
    from rlkit.plugin.registry import load_object

    cls = load_object(role_c.spec.cls)
    sig = inspect.signature(cls.__init__)
    try:
        sig.bind(None, *[object()] * len(ROLE_ARGS), **{k: None for k in ROLE_KWARGS[slot]})
    except TypeError as exc:
        raise ContractError(
            f"{name}: {cls.__name__}(rank, world_size, master_addr, master_port, device, threads, *, "
            f"{', '.join(sorted(ROLE_KWARGS[slot]))}) does not bind: {exc}. The runtime passes exactly "
            f"these for slot '{slot}' (rlkit.plugin.protocols.ROLE_KWARGS)."
        ) from exc
    protocol = SLOT_PROTOCOLS[slot]
    for method, call in _slot_calls(slot).items():
        fn = getattr(cls, method, None)
        if fn is None:
            raise ContractError(
                f"{name}: slot '{slot}' needs method {method}() (rlkit.plugin.protocols.{protocol.__name__})."
            )
        try:
            inspect.signature(fn).bind(None, *call[0], **call[1])
        except TypeError as exc:
            raise ContractError(
                f"{name}: {cls.__name__}.{method} cannot take the trainer's call {method}(*{call[0]}, "
                f"**{call[1]}): {exc} (rlkit.plugin.protocols.{protocol.__name__})."
            ) from exc


def _slot_calls(slot: str) -> dict[str, tuple[tuple, dict]]:
    """method → (args, kwargs) as the trainer and runtime call it on that slot (a placeholder for the
    batch)."""
    batch = "<batch>"
    role = {"ping": ((), {}), "destroy": ((), {})}
    ckpt = {"save_checkpoint": ((), {"directory": "<dir>"}), "load_checkpoint": ((), {"directory": "<dir>"})}
    calls = {
        "actor_rollout_ref": {
            "generate_sequences": ((batch,), {"n": 1, "do_sample": False, "temperature": 1.0, "top_p": 1.0}),
            "compute_log_prob": ((batch,), {}),
            "compute_ref_log_prob": ((batch,), {}),
            "update_actor": ((batch,), {}),
            "sync_weights": ((), {}),
            "num_params": ((), {}),
            **ckpt,
        },
        "rollout": {
            "generate_sequences": ((batch,), {"n": 1}),
            "update_weights": (({},), {"version": 1}),
            **ckpt,
        },
        "ref": {"compute_ref_log_prob": ((batch,), {})},
        "critic": {"compute_values": ((batch,), {}), "update_critic": ((batch,), {}), **ckpt},
        "reward_model": {"compute_rm_score": ((batch,), {})},
    }
    return role | calls[slot]


def check_tool(
    cls_or_spec: Any,
    arguments: dict[str, Any],
    *,
    expect_ok: bool = True,
    contains: str | None = None,
    tools_kwargs: dict[str, Any] | None = None,
    registries: Any = None,
    **params: Any,
) -> None:
    """Check a tool against ``rlkit.plugin.protocols.Tool``; raise ``ContractError``.

    Built as the rollout builds it (``cls()``, plus ``params=`` when its spec declares a model) and
    called through ``rlkit.rollout.tools.call_tool`` as the agent loop calls it. Checked: ``schema()``
    is an OpenAI function description named ``name`` with an object ``parameters`` schema; the call
    with ``arguments`` (and ``tools_kwargs``) gives a ``ToolResult`` with ``ok == expect_ok`` whose text
    contains ``contains``; a call missing a required argument, and one whose arguments are not an
    object, come back as failed results (the conversation goes on), not exceptions.
    """
    import asyncio

    from rlkit.plugin.protocols import Tool
    from rlkit.rollout.tools.base import ToolResult, call_tool

    tool_c = resolve_component("tools", cls_or_spec, params, registries)
    name = who(tool_c)
    contract = (
        "name, description, parameters, schema(), async execute(arguments, **tools_kwargs) -> "
        "ToolResult  (rlkit.plugin.protocols.Tool)"
    )
    tool = tool_c.build()
    if not isinstance(tool, Tool) or not inspect.iscoroutinefunction(tool.execute):
        raise ContractError(
            f"{name}: {type(tool).__name__} needs name, description, parameters, schema() and an async "
            f"execute().\nContract: {contract}"
        )
    schema = tool.schema()
    fn = schema.get("function", {}) if isinstance(schema, dict) else {}
    if (
        schema.get("type") != "function"
        or fn.get("name") != tool.name
        or fn.get("parameters", {}).get("type") != "object"
    ):
        raise ContractError(
            f"{name}: schema() must be {{'type': 'function', 'function': {{'name': {tool.name!r}, "
            f"'description', 'parameters': {{'type': 'object', ...}}}}}}; got {schema!r}."
        )
    result = asyncio.run(call_tool(tool, arguments, **(tools_kwargs or {})))
    if (
        not isinstance(result, ToolResult)
        or result.ok != expect_ok
        or (contains is not None and contains not in result.text)
    ):
        raise ContractError(
            f"{name}: calling it with {arguments!r} gave {result!r}; expected ok={expect_ok}"
            + (f" and text containing {contains!r}." if contains is not None else ".")
        )
    bad = [asyncio.run(call_tool(tool, "not an object"))]
    if tool.parameters.get("required"):
        bad.append(asyncio.run(call_tool(tool, {})))
    if any(r.ok for r in bad):
        raise ContractError(
            f"{name}: calls with missing or malformed arguments must come back with ok=False; got {bad!r}."
        )
