"""Rollout batches of different widths concatenate in the layout of rlkit.rollout.base (DAPO's refills)."""

from __future__ import annotations

import pytest
import torch

from rlkit.batch import Batch
from rlkit.errors import BatchError
from rlkit.rollout.base import assemble_rollout, concat_rollouts, pad_rollout

PAD = 0


def rollout(prompts: list[list[int]], responses: list[list[int]], t: int, uid: str) -> Batch:
    """A rollout batch built by hand: prompts left-padded to their longest, responses right-padded to
    ``t``."""
    p = max(len(x) for x in prompts)
    prompt_ids = torch.tensor([[PAD] * (p - len(x)) + x for x in prompts])  # [B, P]
    prompt_mask = torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts])
    resp = torch.tensor([x + [PAD] * (t - len(x)) for x in responses])  # [B, T]
    resp_mask = torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in responses])
    log_probs = -torch.rand(len(prompts), t)
    batch = assemble_rollout(prompt_ids, prompt_mask, resp, resp_mask, log_probs, {"temperature": 1.0})
    batch["token_level_scores"] = resp_mask.float()  # [B, T]
    batch["uid"] = [uid] * len(prompts)
    return batch


def test_concat_pads_prompts_left_and_responses_right():
    a = rollout([[5, 6, 7], [8]], [[9], [10, 11]], t=2, uid="a")  # P=3, T=2
    b = rollout([[12, 13, 14, 15, 16]], [[17, 18, 19]], t=3, uid="b")  # P=5, T=3
    with pytest.raises(BatchError, match="concat_rollouts"):
        Batch.concat([a, b])  # plain concat refuses, naming the fix
    full = concat_rollouts([a, b], pad_token_id=PAD)
    assert (
        full["prompts"].shape == (3, 5)
        and full["responses"].shape == (3, 3)
        and full["input_ids"].shape == (3, 8)
    )
    # row 1 of a: prompt [8] gets 4 left pads; response [10, 11] one right pad
    assert full["prompts"][1].tolist() == [0, 0, 0, 0, 8]
    assert full["input_ids"][1].tolist() == [0, 0, 0, 0, 8, 10, 11, 0]
    assert full["attention_mask"][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 0]
    assert full["response_mask"][0].tolist() == [1, 0, 0]
    assert full["token_level_scores"][1].tolist() == [1.0, 1.0, 0.0]
    assert full["rollout_log_probs"][1, 2].item() == 0.0
    # positions: 0 under left pads, prompt counts from 0, response counts on through padding columns
    assert full["position_ids"][1].tolist() == [0, 0, 0, 0, 0, 1, 2, 3]
    assert full["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5]
    # row of b unchanged
    assert torch.equal(full["input_ids"][2], b["input_ids"][0])
    assert list(full["uid"]) == ["a", "a", "b"]


def test_padding_equals_the_layout_built_at_the_wider_width():
    """Re-padding a rollout gives exactly what assemble_rollout builds from the wider inputs."""
    narrow = rollout([[3, 4], [5]], [[6, 7], [8]], t=2, uid="x")
    wide = rollout([[0, 0, 3, 4], [0, 0, 0, 5]], [[6, 7], [8]], t=4, uid="x")  # same rows, 2 more left pads
    wide_mask_fix = wide["attention_mask"].clone()
    wide_mask_fix[:, :4] = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 1]])  # the pads are padding, not tokens
    padded = pad_rollout(narrow, prompt_width=4, response_width=4, pad_token_id=PAD)
    assert torch.equal(padded["input_ids"], wide["input_ids"])
    assert torch.equal(padded["attention_mask"], wide_mask_fix)
    positions = (wide_mask_fix[:, :4].cumsum(-1) - 1).clamp(min=0)
    expected = torch.cat([positions, positions[:, -1:] + torch.arange(1, 5)], dim=1)
    assert torch.equal(padded["position_ids"], expected)


def test_empty_pieces_and_unknown_fields():
    a = rollout([[1, 2, 9]], [[3]], t=2, uid="a")
    empty = rollout([[1, 2, 3]], [[4]], t=2, uid="b")[torch.tensor([False])]  # a refill that kept nothing
    assert len(concat_rollouts([a, empty], pad_token_id=PAD)) == 1
    a["values"] = torch.zeros(1, 2)  # unknown response-width field: padded with 0 by its width
    b = rollout([[1, 2, 3, 4]], [[5, 6, 7]], t=3, uid="b")
    b["values"] = torch.ones(1, 3)
    assert concat_rollouts([a, b], pad_token_id=PAD)["values"][0].tolist() == [0.0, 0.0, 0.0]
    square = rollout([[1, 2]], [[3]], t=2, uid="c")  # P == T: a field of that width is ambiguous
    square["values"] = torch.zeros(1, 2)
    with pytest.raises(BatchError, match="ROLLOUT_PADDING"):
        concat_rollouts([square, b], pad_token_id=PAD)
    with pytest.raises(BatchError, match="shrink"):
        pad_rollout(b, prompt_width=2, response_width=3, pad_token_id=PAD)
