"""One decode step's attention: SDPA over every row's copy of its prompt against the shared-prompt attention
(``rlkit.rollout.shared_prompt``), which reads a group's prompt K/V once for its rows.

    OMP_NUM_THREADS=1 python benchmarks/shared_prompt_attention.py [--reps 10]

SmolLM2's heads (9 query, 3 KV, 64 wide), fp32 (the attention of the CPU decode copies), one thread. Every
shape runs 30 layers with distinct K/V buffers, so a layer's cache is cold as in a real step (one
layer's K/V hot in cache reads ~2x faster). Shapes ``g × n, P, t``: g prompts × n rows each, P prompt
positions, t response positions so far; ``saved`` is the share of the K/V bytes the shared path does not
read, (A − g) · P / (A · (P + t)), which ``worth_sharing`` compares with ``MIN_SAVED_FRACTION``.

The bf16 KV cache's paths (``rlkit.rollout.bf16_kv``): ``two_sdpa`` is its shared path
(``shared_prompt_sdpa``: two SDPA calls — the group's queries over its prompt, each row's over its own
positions — merged by the log-sum-exps the CPU flash kernel returns), timed over the fp32 K/V and over a
bf16 copy (``two_sdpa_bf16``: the queries cast to bf16, the output back to fp32); ``sdpa_bf16`` its
unshared path (``kv_attention``) over the bf16 copy, against which ``two_sdpa_bf16`` decides whether sharing
pays over a bf16 cache. Prints and writes ``benchmarks/results/<stamp>-shared-prompt-attention.{json,md}``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [  # (groups, rows per group, prompt positions, response positions)
    (4, 4, 44, 16),
    (4, 4, 44, 40),
    (4, 4, 44, 100),
    (2, 4, 44, 16),
    (2, 4, 44, 64),
    (2, 8, 44, 64),
    (8, 2, 44, 128),
    (2, 4, 526, 32),
    (2, 4, 526, 200),
    (2, 8, 526, 32),
    (1, 16, 300, 64),
    (2, 8, 100, 900),
]
LAYERS, HEADS, KV_HEADS, DIM = 30, 9, 3, 64


def per_layer_us(step, reps: int) -> float:
    for _ in range(2):
        step()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    return (time.perf_counter() - start) / reps / LAYERS * 1e6


def measure(groups: int, n: int, p: int, t: int, reps: int) -> dict:
    """Per-layer µs of every path at one shape, and each one's largest output difference from SDPA's."""
    from rlkit.rollout.bf16_kv import kv_attention, shared_prompt_sdpa
    from rlkit.rollout.shared_prompt import shared_prompt_attention

    torch.manual_seed(0)
    a, length = groups * n, p + t
    prompt_kv = [torch.randn(2, groups, KV_HEADS, p, DIM) for _ in range(LAYERS)]
    own_kv = [torch.randn(2, a, KV_HEADS, t, DIM) for _ in range(LAYERS)]
    rows_kv = [torch.cat([pk.repeat_interleave(n, 1), ok], dim=3) for pk, ok in zip(prompt_kv, own_kv)]
    prompt_kv16, rows_kv16 = [x.bfloat16() for x in prompt_kv], [x.bfloat16() for x in rows_kv]
    q = torch.randn(a, HEADS, 1, DIM)
    mask = torch.ones(a, length, dtype=torch.bool)
    for g in range(groups):
        mask[g * n : (g + 1) * n, : 3 * g] = False  # left padding, per prompt
    bias = torch.zeros(a, length).masked_fill_(~mask, float("-inf"))
    prompt_bias, response_bias = bias[::n, None, None, :p], bias[:, None, None, p:]
    scale = DIM**-0.5

    def sdpa(layer: int) -> torch.Tensor:
        keys, values = rows_kv[layer]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )

    def shared(layer: int) -> torch.Tensor:
        (keys, values), (prompt_keys, prompt_values) = rows_kv[layer], prompt_kv[layer]
        return shared_prompt_attention(
            q, keys, values, prompt_keys, prompt_values, prompt_bias, response_bias, scale
        )

    def split(layer: int, bf16: bool = False) -> torch.Tensor:
        (keys, values), (prompt_keys, prompt_values) = (
            (rows_kv16[layer], prompt_kv16[layer]) if bf16 else (rows_kv[layer], prompt_kv[layer])
        )
        return shared_prompt_sdpa(
            q, keys, values, prompt_keys, prompt_values, prompt_bias, response_bias, scale
        )

    def sdpa_bf16(layer: int) -> torch.Tensor:
        keys, values = rows_kv16[layer]
        return kv_attention(q, keys, values, mask[:, None, None, :], scale)

    reference = sdpa(0)
    return {
        "groups": groups,
        "n": n,
        "P": p,
        "t": t,
        "saved": (a - groups) * p / (a * length),
        "max_abs_diff": float((reference - shared(0)).abs().max()),
        "two_sdpa_max_abs_diff": float((reference - split(0)).abs().max()),
        "two_sdpa_bf16_max_abs_diff": float((reference - split(0, True)).abs().max()),
        "sdpa_us": per_layer_us(lambda: [sdpa(i) for i in range(LAYERS)], reps),
        "shared_us": per_layer_us(lambda: [shared(i) for i in range(LAYERS)], reps),
        "two_sdpa_us": per_layer_us(lambda: [split(i) for i in range(LAYERS)], reps),
        "two_sdpa_bf16_us": per_layer_us(lambda: [split(i, True) for i in range(LAYERS)], reps),
        "sdpa_bf16_us": per_layer_us(lambda: [sdpa_bf16(i) for i in range(LAYERS)], reps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from common import Report, hardware_line

    from rlkit.rollout.shared_prompt import MIN_SAVED_FRACTION

    report = Report("shared-prompt-attention")
    report(hardware_line(), f"| MIN_SAVED_FRACTION {MIN_SAVED_FRACTION}")
    report(
        "| g × n | P | t | saved | SDPA µs/layer | shared µs/layer | shared / SDPA | max abs diff "
        "| two SDPA µs/layer | two SDPA, bf16 K/V µs/layer | bf16 / shared | bf16 max abs diff "
        "| SDPA, bf16 K/V µs/layer | two SDPA / SDPA, both bf16 |"
    )
    report("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for shape in SHAPES:
        r = measure(*shape, args.reps)
        rows.append(r)
        report(
            f"| {r['groups']} × {r['n']} | {r['P']} | {r['t']} | {r['saved']:.2f} | {r['sdpa_us']:.0f} | "
            f"{r['shared_us']:.0f} | {r['shared_us'] / r['sdpa_us']:.2f} | {r['max_abs_diff']:.1e} | "
            f"{r['two_sdpa_us']:.0f} | {r['two_sdpa_bf16_us']:.0f} | "
            f"{r['two_sdpa_bf16_us'] / r['shared_us']:.2f} | {r['two_sdpa_bf16_max_abs_diff']:.1e} | "
            f"{r['sdpa_bf16_us']:.0f} | {r['two_sdpa_bf16_us'] / r['sdpa_bf16_us']:.2f} |"
        )
    report.save({"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
