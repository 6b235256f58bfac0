"""Conformance check for reward managers (``rlkit.plugin.protocols.RewardManager``).

The check builds a batch of responses with planted scores and hands the manager
``conformance_score``, a score function that returns the planted score of each sample (its
``ground_truth``) or misbehaves on purpose (raises, returns NaN). So the expected scores are known
whatever the tokenizer, and the placement, the default score and the error count can be checked.
Shapes: ``B`` samples, ``T`` response tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from rlkit.testing._common import ContractError, resolve_component, who

__all__ = ["check_reward_manager", "check_compute_score", "conformance_score", "conformance_score_batch"]

_CONTRACT = (
    "cls(tokenizer, score_fn, *, num_examine, default_score, timeout_s[, params]); manager(batch) -> "
    "RewardResult(token_level_scores [B, T], extra, metrics)  (rlkit.plugin.protocols.RewardManager)"
)

DEFAULT_SCORE = -1.0
# (planted ground truth, valid response tokens, mask holes): "raise" / "nan" misbehave, "dict:x" returns
# {"score": x, "acc": 1.0}; the last row has no valid token (its score goes to position 0).
_ROWS = [
    ("0.5", 8, ()),
    ("1.0", 3, ()),
    ("0.25", 5, (2,)),
    ("dict:2.0", 1, ()),
    ("raise", 6, ()),
    ("nan", 4, ()),
    ("0.75", 0, ()),
]
_WIDTH = 8


def conformance_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Any:
    """The planted score: ``float(ground_truth)``; ``"raise"`` raises, ``"nan"`` returns NaN,
    ``"dict:x"`` returns ``{"score": x, "acc": 1.0}``. Importable by name (spawned processes)."""
    if not isinstance(solution_str, str):
        raise TypeError(
            f"solution_str must be the decoded response (a str), got {type(solution_str).__name__}"
        )
    if ground_truth == "raise":
        raise ValueError("conformance_score raises on purpose")
    if ground_truth == "nan":
        return math.nan
    if str(ground_truth).startswith("dict:"):
        return {"score": float(str(ground_truth)[5:]), "acc": 1.0}
    return float(ground_truth)


def conformance_score_batch(
    data_sources: list[str],
    solution_strs: list[str],
    ground_truths: list[Any],
    extra_infos: list[dict | None],
) -> list[Any]:
    """The batched form (``RewardManagerSpec.batched_scores``): one value per sample; a sample that
    would raise returns a string instead (a bad value), since a raising batched call fails the batch."""
    out: list[Any] = []
    for args in zip(data_sources, solution_strs, ground_truths, extra_infos):
        try:
            out.append(conformance_score(*args))
        except ValueError:
            out.append("not a number")
    return out


def _batch(tokenizer: Any) -> tuple[Any, torch.Tensor, list[float]]:
    """The batch, each row's last valid index [B], and the expected scores [B]."""
    from rlkit.batch import Batch

    ids = list(tokenizer("1 2 3 4 5 6 7 8 9 10 11 12", add_special_tokens=False)["input_ids"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    b = len(_ROWS)
    responses = torch.full((b, _WIDTH), int(pad), dtype=torch.long)  # [B, T]
    mask = torch.zeros((b, _WIDTH), dtype=torch.long)
    last, expected = [], []
    for i, (truth, length, holes) in enumerate(_ROWS):
        for t in range(length):
            responses[i, t] = ids[(i + t) % len(ids)]
            mask[i, t] = 0 if t in holes else 1
        last.append(max(length - 1, 0))
        score = DEFAULT_SCORE if truth in ("raise", "nan") else float(truth.removeprefix("dict:"))
        expected.append(score)
    batch = Batch(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": ["rlkit/conformance"] * b,
            "reward_model": [{"style": "rule", "ground_truth": row[0]} for row in _ROWS],
            "extra_info": [{"index": i} for i in range(b)],
            "uid": [f"0-{i // 2}" for i in range(b)],
        },
    )
    return batch, torch.tensor(last), expected


def check_reward_manager(
    cls_or_spec: Any, tokenizer: Any, *, registries: Any = None, uses_score_fn: bool = True, **params: Any
) -> None:
    """Check a reward manager against ``rlkit.plugin.protocols.RewardManager``; raise ``ContractError``.

    ``cls_or_spec``: the class, a ``RewardManagerSpec`` (its ``batched_scores`` decides how the score
    function is handed over) or a registered name; ``tokenizer``: any HF tokenizer; ``params``: the
    manager's parameters (validated against the spec's params model, passed as ``params=``).
    ``uses_score_fn=False`` for a manager that scores by other means (a judge model): only the shape
    and placement are checked then. Checked:

    - ``token_level_scores`` is a floating ``[B, T]`` tensor, non-zero only on each response's last
      valid token (a masked hole does not move it; an empty response scores at position 0);
    - with ``conformance_score`` (``conformance_score_batch`` for a ``batched_scores`` manager): each
      sample gets its planted score; one whose score raises (batched: is not a number) and one that
      returns NaN get ``default_score``, and ``reward/errors`` counts exactly 2, ``reward/timeouts`` 0;
    - ``extra`` holds lists of length B (the ``acc`` a dict score returned); ``metrics`` finite floats;
    - ``close()``, when there is one, runs.
    """
    manager_c = resolve_component("reward_managers", cls_or_spec, params, registries)
    name = who(manager_c)
    score_fn = conformance_score_batch if manager_c.spec.batched_scores else conformance_score
    try:
        manager = manager_c.build(
            tokenizer, score_fn, num_examine=0, default_score=DEFAULT_SCORE, timeout_s=10.0
        )
    except TypeError as exc:
        raise ContractError(
            f"{name}: the constructor refused rlkit's arguments: {exc}\nContract: {_CONTRACT}"
        ) from exc
    batch, last, expected = _batch(tokenizer)
    try:
        result = manager(batch)
        _check_result(name, result, batch, last, expected, uses_score_fn)
    finally:
        close = getattr(manager, "close", None)
        if callable(close):
            close()


def _check_result(
    name: str, result: Any, batch: Any, last: torch.Tensor, expected: list[float], uses_score_fn: bool
) -> None:
    def fail(problem: str) -> ContractError:
        return ContractError(f"{name}: {problem}\nContract: {_CONTRACT}")

    scores = getattr(result, "token_level_scores", None)
    b, t = batch["responses"].shape
    if (
        not isinstance(scores, torch.Tensor)
        or tuple(scores.shape) != (b, t)
        or not scores.is_floating_point()
    ):
        got = (
            f"{scores.dtype} {tuple(scores.shape)}"
            if isinstance(scores, torch.Tensor)
            else type(scores).__name__
        )
        raise fail(
            f"token_level_scores is {got}; expected a floating tensor [B, T] = {(b, t)} (a RewardResult)."
        )
    if not torch.isfinite(scores).all():
        raise fail("token_level_scores has NaN/inf; a bad score must become default_score.")
    rows = torch.arange(b)
    off = scores.clone()
    off[rows, last] = 0
    if off.abs().max() != 0:
        bad = sorted({int(r) for r in off.nonzero()[:, 0]})
        raise fail(
            f"rows {bad} have scores away from their last valid token (positions {last.tolist()}): put each "
            "sequence score on the last 1 of response_mask (RewardManager.last_valid_index)."
        )
    metrics = getattr(result, "metrics", None)
    if not isinstance(metrics, dict) or not {"reward/errors", "reward/timeouts"} <= set(metrics):
        raise fail(f"metrics must be a dict with reward/errors and reward/timeouts, got {metrics!r}.")
    for key, value in metrics.items():
        if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise fail(f"metric {key!r} = {value!r} is not a finite float.")
    extra = getattr(result, "extra", None)
    if not isinstance(extra, dict) or any(len(list(v)) != b for v in extra.values()):
        raise fail(f"extra must map names to per-sample lists of length {b}, got {extra!r}.")
    if not uses_score_fn:
        return
    got = scores[rows, last].tolist()
    wrong = [i for i in range(b) if abs(got[i] - expected[i]) > 1e-6]
    if wrong:
        raise fail(
            f"scores {got} differ from the expected {expected} in rows {wrong} (planted ground truths "
            f"{[batch['reward_model'][i]['ground_truth'] for i in range(b)]}; raise/nan → default_score "
            f"{DEFAULT_SCORE})."
        )
    if metrics["reward/errors"] != 2 or metrics["reward/timeouts"] != 0:
        raise fail(
            "one sample's score raised and one returned NaN: expected reward/errors 2 and reward/timeouts "
            f"0, got {metrics['reward/errors']} and {metrics['reward/timeouts']}."
        )
    acc = extra.get("acc")
    if acc is None or acc[3] != 1.0:
        raise fail(f"the dict score's extra key 'acc' is missing from extra (got keys {sorted(extra)}).")


def check_compute_score(
    spec_or_name: Any,
    examples: list[tuple[str, Any, float]],
    *,
    extra_info: dict | None = None,
    registries: Any = None,
) -> None:
    """Check a ``compute_score`` function (registry ``compute_scores``); raise ``ContractError``.

    ``examples``: ``(solution_str, ground_truth, expected_score)`` triples. For the spec's data_source
    and each alias, each example must score ``expected_score`` (a finite number, or a dict whose
    ``score`` is one; the check reward managers apply), the same on a second call, with
    ``extra_info`` as given and as None; an empty response must score too (no exception).
    """
    from rlkit.rewards.managers import normalize_score

    score_c = resolve_component("compute_scores", spec_or_name, {}, registries)
    name = who(score_c)
    contract = (
        "compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {'score': "
        "float, ...}"
    )
    fn = score_c.fn
    cases = [(s, truth, expected) for s, truth, expected in examples] + [
        ("", examples[0][1] if examples else "", None)
    ]
    for source in (score_c.spec.name, *score_c.spec.aliases):
        for solution, truth, expected in cases:
            for info in (extra_info, None):
                try:
                    first, second = fn(source, solution, truth, info), fn(source, solution, truth, info)
                except Exception as exc:
                    raise ContractError(
                        f"{name}: ({source!r}, {solution!r}, {truth!r}, {info!r}) raised "
                        f"{type(exc).__name__}: {exc}\nContract: {contract}"
                    ) from exc
                outcome = normalize_score(first, math.nan)
                if outcome.error:
                    raise ContractError(
                        f"{name}: ({source!r}, {solution!r}, {truth!r}) {outcome.error}.\nContract: "
                        f"{contract}"
                    )
                if normalize_score(second, math.nan).score != outcome.score:
                    raise ContractError(f"{name}: two calls on ({solution!r}, {truth!r}) scored differently.")
                if expected is not None and abs(outcome.score - expected) > 1e-6:
                    raise ContractError(
                        f"{name}: ({source!r}, {solution!r}, {truth!r}) scored {outcome.score}, expected "
                        f"{expected}."
                    )
