"""An in-process chat harness for verifiers v1: each segment is one chat-completions call to the rollout's
interception endpoint, made from this process.

verifiers' own chat loop (the ``null`` harness) is a PEP 723 script started through ``uv``, which installs
its dependencies from the network first; a harness may instead run its loop in-process as long as every
model call goes through the interception endpoint (``verifiers.v1.harness.Harness.launch``), which this
one does. No tools, no program, no sandbox: the environment plays the user (``Env.run``), the harness
answers once per segment, and ``resume`` replays the conversation (verifiers' default).
"""

from __future__ import annotations

from typing import Any

from verifiers.v1.configs.harness import HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harness import Harness
from verifiers.v1.runtimes import ProgramResult

__all__ = ["InProcessChatHarness", "InProcessChatHarnessConfig"]


class InProcessChatHarnessConfig(HarnessConfig):
    pass


class InProcessChatHarness(Harness[InProcessChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        from openai import AsyncOpenAI

        system_prompt, prompt = self.resolve_prompt(data)
        messages: list[dict] = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return ProgramResult(exit_code=0, stdout="", stderr="")
