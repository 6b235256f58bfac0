"""Conformance check for environments (registry ``environments``; ``rlkit.plugin.protocols.Environment``)."""

from __future__ import annotations

import math
import numbers
from typing import Any

from rlkit.testing._common import ContractError, resolve_component, who

__all__ = ["check_environment"]

_CONTRACT = (
    "rows(split) -> veRL rows; score(solution_str, ground_truth, extra_info) -> number | dict with 'score'; "
    "multi_turn: episode(extra_info) -> Episode with step(text) -> (reply, done) and reward(); "
    "played_by: rows name that agent loop in extra_info.agent_name "
    "(rlkit.plugin.protocols.Environment, docs/environments.md)"
)


def _fail(name: str, problem: str) -> ContractError:
    return ContractError(f"{name}: {problem}. Contract: {_CONTRACT}")


def _check_score(name: str, value: Any, where: str) -> float:
    raw = value.get("score") if isinstance(value, dict) else value
    if isinstance(value, dict) and "score" not in value:
        raise _fail(name, f"{where} returned a dict without 'score' (keys {sorted(value)})")
    if isinstance(raw, bool) or not isinstance(raw, numbers.Real) or not math.isfinite(float(raw)):
        raise _fail(
            name, f"{where} returned {raw!r}; a finite number (or a dict with one under 'score') is needed"
        )
    return float(raw)


def check_environment(
    cls_or_spec: Any,
    *,
    registries: Any = None,
    answers: list[str] | None = None,
    max_turns: int = 4,
    **params: Any,
) -> dict[str, Any]:
    """Build the environment as a run does and check its rows, scores and (multi-turn) episodes; raise
    ``ContractError``. ``answers``: assistant texts to score / play (default: the empty string and
    ``"no"``); every row's ``reward_model.ground_truth`` is scored too when it is a string (it should
    score at least as high as ``"no"``). Returns what it saw (``rows``, ``scores``, ``turns``)."""
    from rlkit.data.environment import build_environment, environment_rows

    resolved = resolve_component("environments", cls_or_spec, params, registries)
    name = who(resolved)
    env = build_environment(resolved)
    rows = environment_rows(resolved, "train", env)
    if not rows:
        raise _fail(name, "rows('train') returned no rows")
    environment_rows(resolved, "val", env)  # may be empty, must be well formed
    answers = answers if answers is not None else ["", "no"]
    seen: dict[str, Any] = {"rows": len(rows), "scores": [], "turns": []}
    if resolved.spec.played_by:
        _check_played_by(name, resolved.spec.played_by, rows, registries)
        return seen
    for row in rows[:4]:
        extra, truth = row["extra_info"], row["reward_model"].get("ground_truth")
        if resolved.spec.multi_turn:
            seen["turns"].append(_play(name, env, extra, answers, max_turns, seen))
            continue
        for text in answers:
            seen["scores"].append(_check_score(name, env.score(text, truth, extra), f"score({text!r})"))
        if isinstance(truth, str) and truth:
            best = _check_score(name, env.score(truth, truth, extra), "score(ground_truth)")
            if best < _check_score(name, env.score("no", truth, extra), "score('no')"):
                raise _fail(name, f"the ground truth {truth!r} scores {best}, lower than the answer 'no'")
            seen["scores"].append(best)
    return seen


def _check_played_by(name: str, loop: str, rows: list[dict], registries: Any) -> None:
    """An environment whose episodes an agent loop plays and scores: the loop is registered and every row
    names it (its score() is never asked)."""
    if registries is None:
        from rlkit.plugin.registry import build_registries

        registries = build_registries()
    if loop not in registries.agent_loops:
        raise _fail(
            name, f"played_by names agent loop {loop!r}, which is not registered (registry agent_loops)"
        )
    wrong = [i for i, row in enumerate(rows) if (row.get("extra_info") or {}).get("agent_name") != loop]
    if wrong:
        raise _fail(
            name, f"rows {wrong[:5]} do not name their agent loop: extra_info.agent_name must be {loop!r}"
        )


def _play(name: str, env: Any, extra: dict, answers: list[str], max_turns: int, seen: dict) -> int:
    episode = env.episode(dict(extra))
    turns = 0
    for turn in range(max_turns):
        out = episode.step(answers[turn % len(answers)])
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], bool)):
            raise _fail(
                name, f"Episode.step returned {out!r}; a tuple (reply: str | None, done: bool) is needed"
            )
        turns += 1
        if out[1]:
            break
        if not isinstance(out[0], str):
            raise _fail(name, f"Episode.step returned reply {out[0]!r} while not done; a str is needed")
    seen["scores"].append(_check_score(name, episode.reward(), "Episode.reward()"))
    return turns
