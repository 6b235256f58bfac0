"""``python``: run a snippet of Python in the sandbox (``rlkit.rollout.tools.sandbox``).

The model sees what the snippet printed. A failure — an exception, a timeout, the CPU, memory or
output limit, a refused network / file / process operation — comes back as ``ok=False`` with a
message that says which limit stopped it and the tail of stderr; it never raises.

Config (``cls(**config)``): ``wall_s``, ``cpu_s``, ``memory_mb``, ``max_processes``, ``max_file_mb``,
``max_output_chars``, ``max_open_files``, ``isolation`` — the fields of ``SandboxLimits``. With
``isolation="strict"`` (the default) the tool refuses to start (``SandboxError``) where the OS cannot
give the boundary; ``"weak"`` starts anyway, with a warning.
"""

from __future__ import annotations

import asyncio
from dataclasses import fields
from typing import Any

from rlkit.rollout.tools.base import Tool, ToolResult
from rlkit.rollout.tools.sandbox import SandboxLimits, require_isolation, run_python

__all__ = ["PythonTool"]

_REASONS = {
    "timeout": "the code ran past the wall-time limit of {wall_s} s and was killed",
    "cpu": "the code used more than {cpu_s} s of CPU time and was killed",
    "memory": "the code ran out of memory (limit {memory_mb} MiB)",
    "file_size": "the code wrote more than {max_file_mb} MiB (output or file)",
    "policy": "the code tried an operation the sandbox refuses",
    "killed": "the sandboxed process was killed",
    "setup": "the sandbox could not be set up, so the code did not run",
}


class PythonTool(Tool):
    name = "python"
    description = (
        "Run Python 3 code in a sandbox (no network, a read-only filesystem except a private "
        "temporary directory, limited time and memory) and return what it prints."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; use print() to show results"}},
        "required": ["code"],
    }

    def __init__(self, *, params: Any = None, **config: Any):
        """``params``: ``PythonToolParams`` (``rollout.tools: [{name: python, wall_s: 3}]``); keyword
        options (the ``SandboxLimits`` fields) are for code that builds the tool directly."""
        if params is not None:
            config = {**params.model_dump(), **config}
        super().__init__(**config)
        known = {f.name for f in fields(SandboxLimits)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"python tool: unknown option(s) {unknown}; valid: {sorted(known)}")
        self.limits = SandboxLimits(**config)
        self.isolation = require_isolation(self.limits.isolation)  # refuses here, not at the first call

    async def execute(self, arguments: dict[str, Any], **tools_kwargs: Any) -> ToolResult:
        code = arguments["code"]
        if not isinstance(code, str):
            return ToolResult("Error: argument 'code' must be a string.", ok=False)
        res = await asyncio.to_thread(run_python, code, self.limits)
        metrics = {"wall_s": res.wall_s, "exit_code": res.exit_code, "violation": res.violation}
        if res.ok:
            text = res.stdout if res.stdout else "(no output)"
            if res.stderr:
                text += "\n[stderr]\n" + res.stderr
            return ToolResult(text, ok=True, metrics=metrics)
        reason = _REASONS.get(res.violation or "", "the code exited with status {code}")
        reason = reason.format(code=res.exit_code, **vars(self.limits))
        parts = [f"Error: {reason}."]
        if res.stdout:
            parts.append("[stdout]\n" + res.stdout)
        if res.stderr:
            parts.append("[stderr]\n" + res.stderr)
        return ToolResult("\n".join(parts), ok=False, metrics=metrics)
