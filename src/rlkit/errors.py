"""One error family for everything rlkit refuses.

Every message says what failed, where (recipe file and key path, plugin and hook, data file
and row), what is valid, and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "RlkitError",
    "PluginError",
    "UnknownNameError",
    "RecipeError",
    "DataError",
    "BatchError",
    "WorkerError",
]


class RlkitError(Exception):
    """Base class of every error rlkit raises on purpose."""


class PluginError(RlkitError):
    """A plugin failed to load, or two plugins claim one name."""


class UnknownNameError(RlkitError, KeyError):
    """A registry was asked for a name it does not hold."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class RecipeError(RlkitError):
    """A recipe is invalid. ``problems`` lists every (location, message) pair found."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        lines = [f"{where}{len(problems)} problem(s) in the recipe:"]
        lines += [f"  - {loc}: {msg}" if loc else f"  - {msg}" for loc, msg in problems]
        super().__init__("\n".join(lines))


class DataError(RlkitError):
    """A data file or row is malformed."""


class BatchError(RlkitError):
    """A Batch was built or combined inconsistently."""


class WorkerError(RlkitError):
    """A remote worker raised; the message names the role, the rank and the remote traceback."""
