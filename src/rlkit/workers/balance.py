"""Token-balanced partitioning of a batch across ranks (veRL's ``balance_batch``).

Every rank of a worker group should receive about the same number of tokens, because the step waits
for the slowest rank. ``balanced_partitions`` splits sample lengths into ``k`` parts with equal sample
counts (counts differ by at most one when ``k`` does not divide ``n``) and near-equal token sums, using
the balanced largest differencing method (Karmarkar–Karp for equal-size parts):

1. sort the lengths, pad with zero-length dummies to a multiple of ``k``, and cut into rows of ``k``
   consecutive lengths; each row is a partial solution that puts one sample in each part;
2. repeatedly merge the two partial solutions with the largest spread (max part sum − min part sum),
   pairing the heaviest part of one with the lightest part of the other;
3. polish with pairwise swaps between the heaviest and the lightest part while that narrows them.

Step 2 never widens the spread beyond the larger of the two merged spreads, so the final spread is at
most the largest spread of a row (which is at most the longest sample): tested against brute force.

Standard library only: callers pass plain ints (``attention_mask.sum(-1).tolist()``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["balanced_partitions", "contiguous_partitions", "seqlen_balance_metrics"]


def contiguous_partitions(n: int, k: int) -> list[list[int]]:
    """``k`` runs of consecutive indices, sizes differing by at most one (earlier runs are longer)."""
    if k < 1:
        raise ValueError(f"the number of parts must be >= 1, got {k}.")
    base, extra = divmod(n, k)
    parts, start = [], 0
    for i in range(k):
        size = base + (1 if i < extra else 0)
        parts.append(list(range(start, start + size)))
        start += size
    return parts


def _spread(sums: list[int]) -> int:
    return max(sums) - min(sums)


def balanced_partitions(seqlens: Sequence[int], k: int) -> list[list[int]]:
    """Indices of ``seqlens`` split into ``k`` parts of equal size and near-equal sum.

    Each part is sorted ascending; part sizes are ``n // k`` or ``n // k + 1``. Deterministic.
    """
    if k < 1:
        raise ValueError(f"the number of parts must be >= 1, got {k}.")
    lens = [int(x) for x in seqlens]
    n = len(lens)
    if n == 0:
        return [[] for _ in range(k)]
    order = sorted(range(n), key=lambda i: (lens[i], i))
    order = [-1] * (-n % k) + order  # dummies (length 0) first, one per row at most

    # A partial solution: per part, (sum, members); `heap` orders by largest spread first.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for row_id, start in enumerate(range(0, len(order), k)):
        row = order[start : start + k]
        parts = [(lens[i] if i >= 0 else 0, [i] if i >= 0 else []) for i in row]
        parts.sort(key=lambda p: p[0], reverse=True)
        heapq.heappush(heap, (-_spread([p[0] for p in parts]), row_id, parts))
    next_id = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)  # parts sorted by sum, heaviest first
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ma + mb) for (sa, ma), (sb, mb) in zip(a, reversed(b))]
        merged.sort(key=lambda p: p[0], reverse=True)
        heapq.heappush(heap, (-_spread([p[0] for p in merged]), next_id, merged))
        next_id += 1
    parts = [list(members) for _, members in heap[0][2]]
    _polish(parts, lens)
    return [sorted(p) for p in sorted(parts, key=lambda p: min(p) if p else n)]


def _polish(parts: list[list[int]], lens: list[int], max_rounds: int = 1000) -> None:
    """Swap one sample between the heaviest and the lightest part while that narrows their gap."""
    for _ in range(max_rounds):
        sums = [sum(lens[i] for i in p) for p in parts]
        hi = max(range(len(parts)), key=lambda j: sums[j])
        lo = min(range(len(parts)), key=lambda j: sums[j])
        gap = sums[hi] - sums[lo]
        best, best_gap = None, gap
        for x in parts[hi]:
            for y in parts[lo]:
                d = lens[x] - lens[y]
                if 0 < d < gap and abs(gap - 2 * d) < best_gap:
                    best, best_gap = (x, y), abs(gap - 2 * d)
        if best is None:
            return
        x, y = best
        parts[hi].remove(x)
        parts[lo].remove(y)
        parts[hi].append(y)
        parts[lo].append(x)


def seqlen_balance_metrics(
    seqlens: Sequence[int], balanced: Sequence[Sequence[int]], prefix: str = "global_seqlen"
) -> dict[str, float]:
    """veRL's ``global_seqlen/*`` metrics: token sums per rank without and with balancing.

    ``min``/``max``/``minmax_diff`` describe the plain contiguous split; ``balanced_min``/
    ``balanced_max`` the balanced one; ``mean`` is total tokens / ranks.
    """
    lens = [int(x) for x in seqlens]
    k = len(balanced)
    plain = [sum(lens[i] for i in p) for p in contiguous_partitions(len(lens), k)]
    bal = [sum(lens[i] for i in p) for p in balanced]
    return {
        f"{prefix}/min": float(min(plain)),
        f"{prefix}/max": float(max(plain)),
        f"{prefix}/minmax_diff": float(max(plain) - min(plain)),
        f"{prefix}/balanced_min": float(min(bal)),
        f"{prefix}/balanced_max": float(max(bal)),
        f"{prefix}/mean": sum(lens) / k,
    }
