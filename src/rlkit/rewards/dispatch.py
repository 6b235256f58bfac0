"""Find the score function for a ``data_source``; load custom scores from a file.

A run's score functions come resolved from the driver's pipeline (``Pipeline.score_fns``: data_source
→ function); ``ScoreDispatcher`` picks one per sample. ``compute_score(...)`` is a convenience for
scripts: it builds the registries on each call unless given ``registries=`` (nothing is cached
process-wide).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlkit.errors import RlkitError, UnknownNameError
from rlkit.plugin.registry import Registries, build_registries, load_object, suggest

__all__ = [
    "UnknownDataSourceError",
    "ScoreLoadError",
    "compute_score",
    "get_score_fn",
    "load_custom_score",
    "ScoreDispatcher",
    "batched",
    "make_score_fn",
    "score_functions",
]

ScoreFn = Callable[..., Any]


class UnknownDataSourceError(UnknownNameError):
    """No score function is registered for a ``data_source``."""


class ScoreLoadError(RlkitError):
    """A custom score file or function could not be loaded."""


def score_functions(registries: Registries) -> dict[str, ScoreFn]:
    """data_source (and every alias) → its registered ``compute_score``."""
    return {
        source: entry.spec.fn
        for entry in registries.compute_scores
        for source in (entry.spec.name, *entry.spec.aliases)
    }


def get_score_fn(data_source: str, sources: Mapping[str, ScoreFn] | Registries | None = None) -> ScoreFn:
    """The ``compute_score`` for ``data_source`` from a data_source → function map (or registries)."""
    if sources is None:
        sources = build_registries()
    if isinstance(sources, Registries):
        sources = score_functions(sources)
    if data_source not in sources:
        known = sorted(sources)
        raise UnknownDataSourceError(
            f"no compute_score is registered for data_source '{data_source}'. "
            f"Known data sources: {', '.join(known) or '(none)'}.{suggest(str(data_source), known)} "
            "Fix the data_source column, register a function in the 'rlkit.compute_score' "
            "entry-point group, or set reward.custom_score: {path: my_score.py, name: compute_score}."
        )
    return load_object(sources[data_source])


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    registries: Registries | None = None,
) -> Any:
    """Score one response with the function registered for ``data_source``: a float or a dict with
    ``score``."""
    fn = get_score_fn(data_source, registries)
    return fn(data_source, solution_str, ground_truth, extra_info)


def load_custom_score(path: str | Path, name: str = "compute_score") -> ScoreFn:
    """Import the Python file at ``path`` and return its function ``name`` (``reward.custom_score``)."""
    path = Path(path)
    if not path.is_file():
        raise ScoreLoadError(
            f"reward.custom_score.path: file '{path}' does not exist (resolved to '{path.resolve()}'). "
            "Give the path of a .py file that defines the score function."
        )
    module_name = f"rlkit_custom_score_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ScoreLoadError(
            f"reward.custom_score.path: '{path}' cannot be imported as a Python module (is it a .py file?)."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # lets pickling find the function by module name
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ScoreLoadError(
            f"reward.custom_score.path: importing '{path}' raised {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        functions = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ScoreLoadError(
            f"reward.custom_score.name: '{path}' defines no '{name}'. "
            f"Callables it defines: {', '.join(functions) or '(none)'}.{suggest(name, functions)}"
        )
    if not callable(fn):
        raise ScoreLoadError(
            f"reward.custom_score.name: '{name}' in '{path}' is a {type(fn).__name__}, not a function."
        )
    return fn


class ScoreDispatcher:
    """A per-sample score function: the custom one if given, else the registered one for each data_source.

    ``unknown_score``: what a data_source without a function scores (None = raise, so the manager counts
    an error; a number when another reward — the reward model — covers those samples).
    """

    def __init__(
        self,
        sources: Mapping[str, ScoreFn] | Registries,
        custom: ScoreFn | None = None,
        unknown_score: float | None = None,
    ):
        self.sources = score_functions(sources) if isinstance(sources, Registries) else dict(sources)
        self.custom = custom
        self.unknown_score = unknown_score

    def has_rule(self, data_source: str) -> bool:
        return self.custom is not None or data_source in self.sources

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> Any:
        if self.unknown_score is not None and not self.has_rule(data_source):
            return self.unknown_score
        fn = self.custom or get_score_fn(data_source, self.sources)
        return fn(data_source, solution_str, ground_truth, extra_info)


def batched(score_fn: ScoreFn) -> Callable[..., list[Any]]:
    """Adapt a per-sample score function to the ``batch`` manager's batched call."""

    def score_batch(
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[dict | None],
    ) -> list[Any]:
        return [score_fn(*args) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    score_batch.has_rule = getattr(score_fn, "has_rule", None)  # type: ignore[attr-defined]
    return score_batch


def make_score_fn(
    sources: Mapping[str, ScoreFn] | Registries,
    custom_score: dict[str, str] | None = None,
    *,
    batch_call: bool = False,
    unknown_score: float | None = None,
) -> Callable[..., Any]:
    """The score function a reward manager gets: ``reward.custom_score`` (``{path, name}``) if set,
    else dispatch by data_source; wrapped with ``batched`` when the manager's spec declares
    ``batched_scores``.

    A custom file used with a batched manager must itself be batched (keyword arguments
    ``data_sources, solution_strs, ground_truths, extra_infos``), so it is not wrapped.
    """
    if custom_score:
        fn = load_custom_score(custom_score["path"], custom_score.get("name", "compute_score"))
        return fn if batch_call else ScoreDispatcher(sources, custom=fn)
    dispatcher = ScoreDispatcher(sources, unknown_score=unknown_score)
    return batched(dispatcher) if batch_call else dispatcher
