"""A reasoning-gym task, or a weighted mix of tasks, as an rlkit environment.

Rows are the dataset's entries (``reasoning_gym.create_dataset``; a mix through its composite dataset),
generated from ``seed`` for training and from ``seed + 1`` for validation, so the two never share a
seed. A row keeps the entry's index in ``extra_info``; the score rebuilds the same dataset (in the
reward manager's scoring child) and asks the task's own ``score_answer(answer, entry)``. The answer is
the text inside the last ``<answer>...</answer>`` (reasoning-gym's format, asked for in the system
prompt); without the tags the whole response is the answer (``answer_tags: optional``), nothing
(``required``), or the response's last number (``last_number``: veRL's gsm8k ``flexible`` extraction, for
numeric tasks and small models that answer in a sentence). Each row also carries its parameters
(``extra_info.params``, JSON), so rows written to parquet by ``rlkit data reasoning-gym`` are scored by the
registered ``compute_score`` for ``reasoning_gym`` without ``data.environment``. The rubric: ``correct``
(score_answer, 0..1) and ``format`` (1 when the tags are there),
``score = correct_weight · correct + format_weight · format``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from rlkit.errors import RlkitError
from rlkit.rewards.scores import gsm8k
from rlkit.rewards.scores.gsm8k import parse_number

__all__ = ["ReasoningGymParams", "ReasoningGymEnv", "make_dataset", "rows_of", "compute_score"]

SYSTEM_PROMPT = (
    "Answer the question. Put your final answer between <answer> and </answer>, "
    "for example <answer>42</answer>."
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: str | None = Field(None, description="one reasoning-gym task (e.g. leg_counting, basic_arithmetic)")
    mix: dict[str, float] = Field(
        default_factory=dict, description="task -> weight: a weighted mix instead of task"
    )
    config: dict[str, Any] = Field(default_factory=dict, description="the task's own options (one task only)")
    size: PositiveInt = Field(256, description="training rows")
    val_size: int = Field(32, ge=0, description="validation rows (0 = no validation)")
    seed: int = Field(1, description="seed of the training rows; validation uses seed + 1")
    system_prompt: str = Field(SYSTEM_PROMPT, description="system message of every row ('' = none)")
    answer_tags: Literal["optional", "required", "last_number"] = Field(
        "optional",
        description="without <answer> tags: the whole response is the answer (optional), there is no answer "
        "(required), or the response's last number is (last_number)",
    )
    correct_weight: float = Field(1.0, ge=0, description="weight of the task's score_answer in the score")
    format_weight: float = Field(0.0, ge=0, description="weight of the <answer> tags being there")

    @model_validator(mode="after")
    def _one_source(self) -> ReasoningGymParams:
        if (self.task is None) == (not self.mix):
            raise ValueError(
                "set exactly one of task (a reasoning-gym task name) or mix ({task: weight, ...})"
            )
        if self.mix and self.config:
            raise ValueError("config applies to one task; with mix, give each task's defaults")
        return self


def _tasks() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def make_dataset(params: ReasoningGymParams, size: int, seed: int) -> Any:
    """The reasoning-gym dataset the params describe (unknown task names refused with the valid ones)."""
    import reasoning_gym

    names = [params.task] if params.task else list(params.mix)
    unknown = [n for n in names if n not in _tasks()]
    if unknown:
        import difflib

        hints = {n: difflib.get_close_matches(n, _tasks(), n=3) for n in unknown}
        raise RlkitError(
            f"data.environment (reasoning_gym): unknown task(s) {unknown} (close: {hints}); "
            f'reasoning-gym 0.1.25 has {len(_tasks())} tasks: `python -c "from reasoning_gym.factory '
            'import DATASETS; print(sorted(DATASETS))"` lists them.'
        )
    if params.task:
        return reasoning_gym.create_dataset(params.task, size=size, seed=seed, **params.config)
    from reasoning_gym.composite import DatasetSpec

    specs = [DatasetSpec(name=n, weight=w, config={}) for n, w in params.mix.items()]
    return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)


def rows_of(
    params: ReasoningGymParams, split: str, data_source: str = "reasoning_gym"
) -> list[dict[str, Any]]:
    """veRL rows of one split: the entry's question as the user turn, its answer as the ground truth."""
    size, seed = (params.size, params.seed) if split == "train" else (params.val_size, params.seed + 1)
    if size == 0:
        return []
    dataset = make_dataset(params, size, seed)
    rows = []
    for i in range(size):
        entry = dataset[i]
        prompt = ([{"role": "system", "content": params.system_prompt}] if params.system_prompt else []) + [
            {"role": "user", "content": entry["question"]}
        ]
        task = (entry.get("metadata") or {}).get("source_dataset") or params.task or "composite"
        rows.append(
            {
                "data_source": data_source,
                "prompt": prompt,
                "ability": "reasoning",
                "reward_model": {"style": "rule", "ground_truth": str(entry["answer"])},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "task": str(task),
                    "params": params.model_dump_json(),
                },
            }
        )
    return rows


def extract_answer(text: str, answer_tags: str) -> tuple[str | None, bool]:
    """The answer in ``text`` and whether it was inside <answer> tags (``answer_tags``: see the params)."""
    found = _ANSWER.findall(text)
    if found:
        return found[-1].strip(), True
    if answer_tags == "required":
        return None, False
    if answer_tags == "last_number":
        number = parse_number(gsm8k.extract_answer(text, method="flexible") or "")
        return (None if number is None else str(number)), False
    return text.strip(), False


class ReasoningGymEnv:
    """``rlkit.plugin.protocols.Environment`` over reasoning-gym (single-turn)."""

    def __init__(self, params: ReasoningGymParams):
        self.params = params
        self._datasets: dict[str, Any] = {}

    def rows(self, split: str) -> list[dict[str, Any]]:
        return rows_of(self.params, split)

    def _dataset(self, split: str) -> Any:
        if split not in self._datasets:
            p = self.params
            size, seed = (p.size, p.seed) if split == "train" else (p.val_size, p.seed + 1)
            self._datasets[split] = make_dataset(p, size, seed)
        return self._datasets[split]

    def score(self, solution_str: str, ground_truth: Any, extra_info: dict | None) -> dict[str, float]:
        extra = extra_info or {}
        if "index" not in extra:
            raise RlkitError(
                "reasoning_gym: a row without extra_info.index cannot be scored; make the rows "
                "with this environment (data.environment or `rlkit data reasoning-gym`)."
            )
        entry = self._dataset(str(extra.get("split", "train")))[int(extra["index"])]
        answer, tagged = extract_answer(solution_str, self.params.answer_tags)
        correct = float(self._score_answer(answer, entry, extra)) if answer is not None else 0.0
        fmt = 1.0 if tagged else 0.0
        p = self.params
        return {
            "score": p.correct_weight * correct + p.format_weight * fmt,
            "correct": correct,
            "format": fmt,
        }

    def _score_answer(self, answer: str, entry: dict, extra: dict) -> float:
        dataset = self._dataset(str(extra.get("split", "train")))
        return dataset.score_answer(answer=answer, entry=entry)


_ENVS: dict[str, ReasoningGymEnv] = {}


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> Any:
    """veRL's ``compute_score`` for rows written by ``rlkit data reasoning-gym`` (data_source
    ``reasoning_gym``): the environment is rebuilt from the row's parameters (``extra_info.params``),
    once per process."""
    raw = (extra_info or {}).get("params")
    if not raw:
        raise RlkitError(
            "reasoning_gym: the row has no extra_info.params; write the rows with "
            "`rlkit data reasoning-gym` or use data.environment: {name: reasoning_gym, ...}."
        )
    if raw not in _ENVS:
        _ENVS[raw] = ReasoningGymEnv(ReasoningGymParams.model_validate_json(raw))
    return _ENVS[raw].score(solution_str, ground_truth, extra_info)
