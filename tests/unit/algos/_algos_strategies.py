"""Shared strategies for the algorithm tests: small random batches in float64."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def batches(
    draw, min_group: int = 1, max_group: int = 4, max_groups: int = 4, max_t: int = 5, outcome: bool = False
):
    """(token_level_rewards [B, T], response_mask [B, T], index [B]) with prefix masks of >= 1 token.

    Group ids are drawn sparse and shuffled so nothing relies on contiguous or dense ids.
    """
    sizes = draw(st.lists(st.integers(min_group, max_group), min_size=1, max_size=max_groups))
    t = draw(st.integers(2, max_t))
    ids = draw(st.lists(st.integers(0, 10_000), min_size=len(sizes), max_size=len(sizes), unique=True))
    index = [gid for gid, n in zip(ids, sizes) for _ in range(n)]
    order = draw(st.permutations(range(len(index))))
    index = [index[i] for i in order]
    b = len(index)
    lengths = draw(st.lists(st.integers(1, t), min_size=b, max_size=b))
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths], dtype=torch.float64)
    small = st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0]) | st.floats(-3, 3, allow_nan=False, width=32)
    if outcome:  # one score on the last valid token, as a rule-based reward manager writes it
        scores = draw(st.lists(small, min_size=b, max_size=b))
        rewards = torch.zeros(b, t, dtype=torch.float64)
        for i, (n, s) in enumerate(zip(lengths, scores)):
            rewards[i, n - 1] = s
    else:
        vals = draw(st.lists(small, min_size=b * t, max_size=b * t))
        rewards = torch.tensor(vals, dtype=torch.float64).reshape(b, t) * mask
    return rewards, mask, torch.tensor(index, dtype=torch.long)
