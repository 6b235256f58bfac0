"""rlkit: reinforcement-learning post-training of language models.

Plugin authors need only ``hookimpl`` (and the spec classes in ``rlkit.plugin.specs``)::

    import rlkit
    from rlkit.plugin.specs import EstimatorSpec

    @rlkit.hookimpl
    def rlkit_register_estimators():
        return [EstimatorSpec(name="my_adv", fn=my_advantage)]
"""

from __future__ import annotations

from typing import Any

from rlkit.errors import RlkitError
from rlkit.plugin.hookspecs import hookimpl, hookspec

__all__ = ["hookimpl", "hookspec", "RlkitError", "compute_score", "__version__"]
__version__ = "0.1.0"


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Any:
    """Score ``solution_str`` with the function registered for ``data_source`` (built-in or plugin)."""
    from rlkit.rewards.dispatch import compute_score as _dispatch

    return _dispatch(data_source, solution_str, ground_truth, extra_info)
