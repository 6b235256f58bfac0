"""rlkit's vLLM rollout backend (module name ``rlkit_vllm``; never a folder named ``vllm``).

``VllmRollout`` is the ``vllm`` rollout backend (registered by ``rlkit_vllm.hooks``); ``VllmParams`` its
parameters. Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

from rlkit_vllm.params import VllmParams

__all__ = ["VllmParams", "VllmRollout", "VllmError"]


def __getattr__(name: str):
    if name in ("VllmRollout", "VllmError"):  # import torch; keep `import rlkit_vllm` light
        from rlkit_vllm import backend

        return getattr(backend, name)
    raise AttributeError(name)
