"""Two attentions of a decode step timed the way a step meets them, for the probes that choose between them
(``rlkit.rollout.bf16_kv``'s bf16 K/V, ``rlkit.rollout.attention_kernel``'s compiled kernel).

In a decode step each layer's attention reads K/V that the layer's weights have just pushed out of the caches,
so each layer's call is timed on its own after other memory is read; the two variants run in turns, the order
reversed every other rep, and each gets the median of its reps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["time_cold_layers"]


def time_cold_layers(
    first: Callable[[int], object],
    second: Callable[[int], object],
    *,
    layers: int,
    evict_bytes: int,
    reps: int,
) -> tuple[float, float]:
    """Median seconds per step of ``first(layer)`` and of ``second(layer)`` summed over ``layers`` layers,
    each call timed after ``evict_bytes`` of other memory (one buffer per layer) is read; one warm-up step of
    each, then ``reps`` reps interleaved."""
    evict = [torch.ones(evict_bytes // 4) for _ in range(layers)]

    def step(attention: Callable[[int], object]) -> float:
        spent = 0.0
        for layer in range(layers):
            evict[layer].sum()
            start = time.perf_counter()
            attention(layer)
            spent += time.perf_counter() - start
        return spent

    times: dict[int, list[float]] = {0: [], 1: []}
    variants = (first, second)
    step(first), step(second)  # warm-up
    for rep in range(reps):
        for i in (0, 1) if rep % 2 == 0 else (1, 0):
            times[i].append(step(variants[i]))
    return statistics.median(times[0]), statistics.median(times[1])
