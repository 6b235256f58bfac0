"""rlkit-verifiers: verifiers v1 environments as rlkit environments (``data.environment: {name: verifiers}``).

This package is also the verifiers harness id ``rlkit_verifiers`` (its one exported ``Harness``), loaded
lazily so that rlkit's plugin discovery does not import verifiers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InProcessChatHarness"]


def __getattr__(name: str) -> Any:
    if name == "InProcessChatHarness":
        from rlkit_verifiers.harness import InProcessChatHarness

        return InProcessChatHarness
    raise AttributeError(name)
