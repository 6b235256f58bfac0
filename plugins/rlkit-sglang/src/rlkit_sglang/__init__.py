"""rlkit's SGLang rollout backend (module name ``rlkit_sglang``; never a folder named ``sglang``).

``SglangClient`` speaks SGLang's native HTTP API; ``SglangRollout`` is the ``sglang`` rollout backend.
"""

from __future__ import annotations

from rlkit_sglang.client import GenerateOutput, SglangClient, SglangServerError

__all__ = ["SglangClient", "SglangServerError", "GenerateOutput", "SglangRollout"]


def __getattr__(name: str):
    if name == "SglangRollout":  # imports torch; keep `import rlkit_sglang` light
        from rlkit_sglang.backend import SglangRollout

        return SglangRollout
    raise AttributeError(name)
