"""Registers the ``vllm`` rollout backend (lazy class reference: nothing heavy is imported here)."""

from __future__ import annotations

import rlkit
from rlkit.plugin.specs import RolloutBackendSpec


@rlkit.hookimpl
def rlkit_register_rollout_backends() -> list[RolloutBackendSpec]:
    return [
        RolloutBackendSpec(
            name="vllm",
            cls="rlkit_vllm.backend:VllmRollout",
            params="rlkit_vllm.params:VllmParams",
            # Not declared: generate_ids (agent loops drive `generate` batch by batch instead) and
            # memory_release (vLLM's sleep/wake_up frees nothing on CPU; docs/vllm.md).
            generate_ids=False,
            memory_release=False,
            lora=True,  # vLLM's own LoRA loading (enable_lora): the adapter alone travels at each sync
            truncated_sampling=False,  # vLLM's processed log-probs come after top-k / top-p truncation
            max_ranks=1,  # one in-process engine per process; a sharded actor needs vLLM's external launcher
            description=(
                "vLLM engine in the actor's process (hybrid engine; weights reloaded after each update)"
            ),
        )
    ]
