"""Registers the ``sglang`` rollout backend (lazy class reference: nothing heavy is imported here)."""

from __future__ import annotations

import rlkit
from rlkit.plugin.specs import RolloutBackendSpec


@rlkit.hookimpl
def rlkit_register_rollout_backends() -> list[RolloutBackendSpec]:
    return [
        RolloutBackendSpec(
            name="sglang",
            cls="rlkit_sglang.backend:SglangRollout",
            params="rlkit_sglang.params:SglangParams",
            generate_ids=True,
            memory_release=True,
            lora=True,  # --enable-lora, /load_lora_adapter: the adapter alone travels at each sync
            description="SGLang servers over HTTP (launched per replica or attached by URL)",
        )
    ]
