"""The evaluation metrics, shared by in-training validation (``rlkit.step.validation``) and ``rlkit eval``.

One table of samples (one row per generated response: ``Samples``) → metrics per data_source:

- ``val-core/<src>/<var>/mean@n``: the mean of ``var`` (``score`` and every numeric extra the score function
  returned, e.g. ``acc``) over every sample; ``best@n`` (n > 1): the mean over prompts of each prompt's best.
  These two are what training's validation logs (``core_metrics``), computed by the same lines.
- ``val-core/<src>/pass@k`` (``eval_metrics`` only): the unbiased estimator of Chen et al. 2021,
  ``1 - C(n - c, k) / C(n, k)`` per prompt (``c`` correct of ``n``), averaged over prompts, for
  k = 1, 2, 4 … ≤ n and n. A sample is correct when the score function's ``acc`` extra is true, or (no
  ``acc``) when its score is ≥ 1.
- ``val-core/<src>/maj@k``: each prompt's first ``k`` answers vote; the prompt counts as solved when a sample
  giving the most frequent answer (ties: the one given first) is correct. The answer is the score function's
  extracted answer (an extra named ``pred``, ``answer`` or ``extracted_answer``), else the response's last
  number; samples without one do not vote. Reported when at least one sample of the data_source has one.
- ``val-aux/<src>/response_length/{mean,max,min}`` (tokens) and ``val-aux/<src>/truncation_rate``
  (responses that reached ``max_new_tokens`` without an end-of-sequence token).

Every ``eval_metrics`` value that is a mean over prompts carries a 95% bootstrap interval: prompts resampled
with replacement ``bootstrap`` times (numpy ``default_rng(seed)``), the 2.5th and 97.5th percentiles of the
means, and the bootstrap standard error (``se``) that ``compare`` uses for the interval of a difference.

Shapes: ``S`` samples (prompts × n), ``Q`` prompts of one data_source.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Samples",
    "Estimate",
    "core_metrics",
    "eval_metrics",
    "pass_at_k",
    "majority_correct",
    "answer_of",
    "ks_for",
    "samples_from",
    "ANSWER_KEYS",
]

ANSWER_KEYS = ("pred", "answer", "extracted_answer")  # a score function's extracted answer, in this order
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


@dataclass
class Samples:
    """One row per generated response [S]; ``group`` names the prompt (its n responses share it)."""

    data_source: list[str]
    group: list[str]
    score: list[float]
    extra: dict[str, list[Any]] = field(default_factory=dict)  # the score functions' extras, each of length S
    length: list[int] = field(default_factory=list)  # response tokens
    truncated: list[bool] = field(default_factory=list)  # reached max_new_tokens without eos
    response: list[str] = field(default_factory=list)  # decoded response (for the last-number answer)

    def extend(self, other: Samples) -> None:
        """Append ``other``'s rows (an extra missing on either side is dropped: it no longer covers every
        row)."""
        before = len(self.score)
        for key in set(self.extra) | set(other.extra):
            if (key in self.extra or before == 0) and key in other.extra:
                self.extra.setdefault(key, []).extend(other.extra[key])
            else:
                self.extra.pop(key, None)
        self.data_source += other.data_source
        self.group += other.group
        self.score += other.score
        self.length += other.length
        self.truncated += other.truncated
        self.response += other.response

    def correct(self) -> list[bool]:
        """``acc`` when the score function returned it for every sample, else ``score >= 1``."""
        acc = self.extra.get("acc")
        if acc is not None and all(isinstance(v, (bool, int, float, np.bool_)) for v in acc):
            return [bool(v) for v in acc]
        return [s >= 1.0 for s in self.score]

    def answers(self) -> list[str | None]:
        out = []
        for i in range(len(self.score)):
            given = next(
                (self.extra[k][i] for k in ANSWER_KEYS if k in self.extra and self.extra[k][i] is not None),
                None,
            )
            out.append(
                str(given) if given is not None else answer_of(self.response[i] if self.response else "")
            )
        return out


@dataclass(frozen=True)
class Estimate:
    value: float
    ci_low: float | None = None
    ci_high: float | None = None
    se: float | None = None


def samples_from(
    batch: Any, result: Any, eos_token_ids: list[int], responses: list[str] | None = None
) -> Samples:
    """The rows of one scored generation: ``batch`` (per-sample ``data_source``, ``uid``; ``responses``
    [S, T], ``response_mask`` [S, T]) and its reward step's ``RewardResult``. A response is truncated when it
    fills all ``T`` columns and its last token is no end-of-sequence token."""
    mask = batch["response_mask"]  # [S, T]
    lengths = mask.sum(-1)  # [S]
    width = mask.shape[1]
    last = batch["responses"].gather(1, (lengths.clamp(min=1) - 1)[:, None])[:, 0]  # [S]
    ended = sum((last == e) for e in eos_token_ids) if eos_token_ids else last < 0  # [S] bool
    truncated = (lengths >= width) & ~ended.bool()
    extra = {k: list(v) for k, v in result.extra.items() if len(v) == len(batch)}
    return Samples(
        [str(s) for s in batch["data_source"]],
        [str(u) for u in batch["uid"]],
        result.token_level_scores.sum(-1).tolist(),
        extra,
        lengths.tolist(),
        truncated.tolist(),
        list(responses) if responses is not None else [],
    )


def answer_of(text: str) -> str | None:
    """The last number in ``text`` (thousands separators dropped, ``12.0`` → ``12``), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    number = found[-1].replace(",", "")
    return number.rstrip("0").rstrip(".") if "." in number else number


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the chance that k of n samples drawn without replacement hold at least one of the c
    correct ones, ``1 - C(n - c, k) / C(n, k)``, as the stable product ``1 - prod_{i=n-c+1}^{n} (1 - k /
    i)``."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: list[str | None], correct: list[bool]) -> float:
    """1.0 when the most frequent answer (ties: the first given) is a correct one, else 0.0; no answer:
    0.0."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return float(any(c for a, c in zip(answers, correct) if a == winner))


def ks_for(n: int) -> list[int]:
    """1, 2, 4 … up to n, and n itself."""
    return sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})


def _variables(samples: Samples) -> dict[str, list[float]]:
    variables: dict[str, list[float]] = {"score": list(samples.score)}
    for key, values in samples.extra.items():
        if len(values) == len(samples.score) and all(isinstance(v, (int, float, bool)) for v in values):
            variables[key] = [float(v) for v in values]
    return variables


def _by_source(samples: Samples) -> dict[str, list[int]]:
    rows: dict[str, list[int]] = {}
    for i, source in enumerate(samples.data_source):
        rows.setdefault(source, []).append(i)
    return dict(sorted(rows.items()))


def core_metrics(samples: Samples, n: int) -> dict[str, float]:
    """``val-core/<src>/<var>/mean@n`` and ``best@n`` (n > 1): what training's validation logs."""
    variables = _variables(samples)
    metrics: dict[str, float] = {}
    for source, rows in _by_source(samples).items():
        for var, values in variables.items():
            picked = np.array([values[i] for i in rows], dtype=float)
            metrics[f"val-core/{source}/{var}/mean@{n}"] = float(picked.mean())
            if n > 1:
                by_prompt: dict[Any, float] = {}
                for i in rows:
                    by_prompt[samples.group[i]] = max(by_prompt.get(samples.group[i], -np.inf), values[i])
                metrics[f"val-core/{source}/{var}/best@{n}"] = float(np.mean(list(by_prompt.values())))
    return metrics


def _per_prompt(samples: Samples, rows: list[int], n: int) -> dict[str, np.ndarray]:
    """Each metric's value per prompt [Q] (its mean over prompts is the metric) for one data_source."""
    groups: dict[str, list[int]] = {}
    for i in rows:
        groups.setdefault(samples.group[i], []).append(i)
    members = list(groups.values())
    out: dict[str, np.ndarray] = {}
    for var, values in _variables(samples).items():
        out[f"{var}/mean@{n}"] = np.array([np.mean([values[i] for i in g]) for g in members])
        if n > 1:
            out[f"{var}/best@{n}"] = np.array([max(values[i] for i in g) for g in members])
    correct, answers = samples.correct(), samples.answers()
    for k in ks_for(n):
        out[f"pass@{k}"] = np.array(
            [pass_at_k(len(g), sum(correct[i] for i in g), min(k, len(g))) for g in members]
        )
    if any(answers[i] is not None for i in rows):
        for k in ks_for(n):
            out[f"maj@{k}"] = np.array(
                [majority_correct([answers[i] for i in g[:k]], [correct[i] for i in g[:k]]) for g in members]
            )
    if samples.length:
        out["response_length/mean"] = np.array([np.mean([samples.length[i] for i in g]) for g in members])
    if samples.truncated:
        out["truncation_rate"] = np.array([np.mean([samples.truncated[i] for i in g]) for g in members])
    return out


def _bootstrap(values: np.ndarray, rng: np.random.Generator, reps: int) -> Estimate:
    """The mean of ``values`` [Q] with a percentile interval over ``reps`` resamples of the prompts."""
    if len(values) == 0:
        return Estimate(float("nan"))
    means = values[rng.integers(0, len(values), size=(reps, len(values)))].mean(axis=1)  # [reps]
    low, high = np.percentile(means, [2.5, 97.5])
    return Estimate(float(values.mean()), float(low), float(high), float(means.std()))


def eval_metrics(samples: Samples, n: int, *, seed: int = 0, bootstrap: int = 1000) -> dict[str, Estimate]:
    """Every metric of the module docstring, per data_source, each with its bootstrap interval.

    The ``val-core/<src>/<var>/mean@n`` and ``best@n`` values are ``core_metrics``' own (so they equal
    training's validation for the same samples); their intervals come from the per-prompt values."""
    rng = np.random.default_rng(seed)
    core = core_metrics(samples, n)
    out: dict[str, Estimate] = {}
    for source, rows in _by_source(samples).items():
        for name, values in _per_prompt(samples, rows, n).items():
            prefix = "val-aux" if name.startswith(("response_length", "truncation")) else "val-core"
            key = f"{prefix}/{source}/{name}"
            est = _bootstrap(values, rng, bootstrap)
            if key in core:  # the value exactly as validation computes it
                est = Estimate(core[key], est.ci_low, est.ci_high, est.se)
            out[key] = est
        if samples.length:
            lengths = [samples.length[i] for i in rows]
            out[f"val-aux/{source}/response_length/max"] = Estimate(float(max(lengths)))
            out[f"val-aux/{source}/response_length/min"] = Estimate(float(min(lengths)))
    return out
