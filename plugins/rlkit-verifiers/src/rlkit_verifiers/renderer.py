"""A ``renderers`` renderer that keeps a multi-turn episode one token sequence: the chat template's delta.

verifiers' ``TrainClient`` renders each turn's prompt with a ``renderers.Renderer``. The generic
``DefaultRenderer`` (any model's Jinja chat template) re-renders the whole conversation every turn, so the
previous turn's sampled tokens come back re-tokenized from their text; where they differ, verifiers'
trace forks and the episode no longer is one training sequence. ``ChatTemplateBridgeRenderer`` bridges
instead (``bridge_to_next_turn``): the next prompt is the previous prompt and completion *verbatim*, its
turn close (the model's own eos, or the template's when the turn was cut), then the template's rendering
of the new user/tool messages and the next assistant header: what rlkit's own agent loops append
(``rlkit.rollout.agent.ToolAgentLoop._delta_ids``). Used through ``renderers.CustomRendererConfig(
import_path="rlkit_verifiers.renderer.ChatTemplateBridgeRenderer")``.
"""

from __future__ import annotations

from typing import Any

from renderers import DefaultRendererConfig, RenderedTokens
from renderers.base import trim_to_turn_close
from renderers.default import DefaultRenderer

__all__ = ["ChatTemplateBridgeRenderer", "IMPORT_PATH"]

IMPORT_PATH = "rlkit_verifiers.renderer.ChatTemplateBridgeRenderer"
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatTemplateBridgeRenderer(DefaultRenderer):
    """``DefaultRenderer`` whose turns extend the previous prompt + completion token for token."""

    config_class = DefaultRendererConfig

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        kwargs = dict(self.config.model_extra or {})
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False)) if text else []

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
    ) -> RenderedTokens | None:
        eos = self._tokenizer.eos_token_id
        if tools or not previous_prompt_ids or not new_messages or eos is None:
            return None  # a full re-render (verifiers' fallback)
        if any(m.get("role") not in ("user", "tool") for m in new_messages):
            return None
        previous = trim_to_turn_close(
            previous_prompt_ids, previous_completion_ids, {eos}, synthesize_close=eos
        )
        closed = self._text(_BASE, False)
        eos_text = self._tokenizer.decode([eos])
        end_of_turn = closed.rfind(eos_text)
        if end_of_turn < 0:
            return None  # the template does not close turns with eos: re-render
        ids = self._encode(closed[end_of_turn + len(eos_text) :])  # the template's text after the close
        indices = [-1] * len(ids)
        rendered = closed
        for i in range(len(new_messages)):
            text = self._text(_BASE + list(new_messages[: i + 1]), False)
            if not text.startswith(rendered):
                return None  # a template that rewrites earlier turns
            piece = self._encode(text[len(rendered) :])
            ids, indices, rendered = ids + piece, indices + [i] * len(piece), text
        header = self._text(_BASE + list(new_messages), True)
        if not header.startswith(rendered):
            return None
        piece = self._encode(header[len(rendered) :])
        ids, indices = ids + piece, indices + [-1] * len(piece)
        return RenderedTokens(
            token_ids=previous + ids,
            message_indices=[-1] * len(previous) + indices,
            sampled_mask=[False] * (len(previous) + len(ids)),
            message_roles=[m.get("role") or "" for m in new_messages],
        )
