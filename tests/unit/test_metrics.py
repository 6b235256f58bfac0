"""Step metrics against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlkit.batch import Batch
from rlkit.step.metrics import Timer, data_metrics, throughput_metrics, timing_metrics, validation_metrics


def make_batch() -> Batch:
    # two samples, prompt width 3 (left-padded), response width 4
    attention = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    scores = torch.tensor([[0.0, 1.0, 0, 0], [0, 0, 0, 0.5]])
    return Batch({
        "attention_mask": attention, "response_mask": response_mask,
        "token_level_scores": scores, "token_level_rewards": scores - 0.1 * response_mask,
        "advantages": torch.tensor([[1.0, 1.0, 9.0, 9.0], [-1.0, -1.0, -1.0, -2.0]]),
    })


def test_data_metrics_by_hand():
    m = data_metrics(make_batch(), max_prompt_length=3, max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx(0.75)  # scores 1.0 and 0.5
    assert m["critic/rewards/mean"] == pytest.approx((0.8 + 0.1) / 2)  # 1.0-0.2, 0.5-0.4
    assert m["critic/advantages/max"] == 1.0  # the 9.0s sit under the mask and are ignored
    assert m["critic/advantages/min"] == -2.0
    assert m["response_length/mean"] == 3.0 and m["response_length/clip_ratio"] == 0.5  # lengths 2 and 4
    assert m["prompt_length/min"] == 2.0 and m["prompt_length/clip_ratio"] == 0.5  # lengths 2 and 3


def test_timing_per_token():
    batch = make_batch()  # 6 response tokens, 11 tokens in all
    m = timing_metrics({"gen": 0.6, "update_actor": 1.1, "step": 2.0}, batch)
    assert m["timing_per_token_ms/gen"] == pytest.approx(100.0)
    assert m["timing_per_token_ms/update_actor"] == pytest.approx(100.0)
    assert "timing_per_token_ms/step" not in m and m["timing_s/step"] == 2.0
    t = throughput_metrics(batch, step_time=2.0, num_ranks=2)
    assert t["perf/total_num_tokens"] == 11 and t["perf/throughput"] == pytest.approx(2.75)


def test_validation_mean_and_best_at_n():
    sources = np.array(["a", "a", "a", "a", "b", "b"], dtype=object)
    uids = np.array(["p0", "p0", "p1", "p1", "q0", "q0"], dtype=object)
    scores = [1.0, 0.0, 0.0, 0.0, 0.5, 1.0]
    m = validation_metrics(sources, uids, scores, n=2, extra={"acc": [True, False, False, False, True, True]})
    assert m["val-core/a/score/mean@2"] == 0.25 and m["val-core/a/score/best@2"] == 0.5  # best: p0→1, p1→0
    assert m["val-core/b/score/best@2"] == 1.0 and m["val-core/b/acc/mean@2"] == 1.0


def test_timer_accumulates():
    timer = Timer()
    for _ in range(2):
        with timer("x"):
            pass
    assert set(timer.times) == {"x"} and timer.times["x"] >= 0


def test_mfu_counts_each_distinct_prompt_once_and_every_response_token():
    """perf/mfu/actor's token count: a GRPO group's shared prompt is run once by the actor, so it counts once."""
    from rlkit.runtime.build import update_tokens

    # two prompts (3 and 2 real tokens, left-padded to 3), each with two responses of 2 and 1 tokens
    prompts = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 8, 9], [0, 8, 9]])
    prompt_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    response_mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    batch = Batch({"prompts": prompts, "response_mask": response_mask,
                   "attention_mask": torch.cat([prompt_mask, response_mask], dim=1)})
    assert update_tokens(batch) == (3 + 2) + (2 + 1 + 2 + 1)
    # four distinct prompts: every row's prompt counts
    distinct = Batch({"prompts": torch.arange(12).view(4, 3), "response_mask": response_mask,
                      "attention_mask": torch.cat([torch.ones(4, 3, dtype=torch.long), response_mask], dim=1)})
    assert update_tokens(distinct) == 4 * 3 + 6
