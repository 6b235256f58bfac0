"""One decode step's attention: SDPA over every row's copy of its prompt against the shared-prompt attention
(``rlkit.rollout.shared_prompt``), which reads a group's prompt K/V once for its rows.

    OMP_NUM_THREADS=1 python benchmarks/shared_prompt_attention.py [--reps 10]

SmolLM2's heads (9 query, 3 KV, 64 wide), fp32 (the attention of the CPU decode copies), one thread. Every
shape runs 30 layers with distinct K/V buffers, so a layer's cache is cold as in a real step (one
layer's K/V hot in cache reads ~2x faster). Shapes ``g × n, P, t``: g prompts × n rows each, P prompt
positions, t response positions so far; ``saved`` is the share of the K/V bytes the shared path does not
read, (A − g) · P / (A · (P + t)), which ``worth_sharing`` compares with ``MIN_SAVED_FRACTION``.

Two more variants of the shared path, not rlkit's (a lead for a bf16 KV cache; docs/benchmarks.md,
session 28):
``two_sdpa`` computes it as two SDPA calls — the group's queries over its prompt, each row's over its own
positions — merged by the log-sum-exps the CPU flash kernel returns
(``aten::_scaled_dot_product_flash_attention_for_cpu``), its scores fp32 inside SDPA; ``two_sdpa_bf16`` the
same over a bf16 copy of the K/V (the queries cast to bf16, the output back to fp32). Prints and writes
``benchmarks/results/<stamp>-shared-prompt-attention.{json,md}``.
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


def two_sdpa(q, keys, values, prompt_keys, prompt_values, prompt_bias, response_bias, scale) -> torch.Tensor:
    """``shared_prompt_attention``'s output (same arguments) from two SDPA calls merged by their log-sum-exps,
    computed in the K/V's dtype (the queries and masks cast to it) and returned in fp32 ``[A, H, 1, D]``."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    a, heads, _, d = q.shape
    g, kv_heads, p, _ = prompt_keys.shape
    n, per, dtype = a // g, heads // kv_heads, prompt_keys.dtype
    by_row = q.reshape(a, kv_heads, per, d).to(dtype)  # [A, Hkv, per, D]
    by_group = by_row.view(g, n, kv_heads, per, d).transpose(1, 2).reshape(g, kv_heads, n * per, d)
    prompt_out, prompt_lse = flash(
        by_group, prompt_keys, prompt_values, 0.0, False, attn_mask=prompt_bias.to(dtype), scale=scale
    )
    prompt_out = prompt_out.view(g, kv_heads, n, per, d).transpose(1, 2).reshape(a, kv_heads, per, d)
    prompt_lse = prompt_lse.view(g, kv_heads, n, per).transpose(1, 2).reshape(a, kv_heads, per)
    own_out, own_lse = flash(
        by_row, keys[:, :, p:], values[:, :, p:], 0.0, False, attn_mask=response_bias.to(dtype), scale=scale
    )
    lse = torch.logaddexp(prompt_lse, own_lse)  # [A, Hkv, per], fp32
    out = (
        prompt_out.float() * (prompt_lse - lse).exp()[..., None]
        + own_out.float() * (own_lse - lse).exp()[..., None]
    )
    return out.reshape(a, heads, 1, d)


def measure(groups: int, n: int, p: int, t: int, reps: int) -> dict:
    """Per-layer µs of every path at one shape, and each one's largest output difference from SDPA's."""
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
        return two_sdpa(q, keys, values, prompt_keys, prompt_values, prompt_bias, response_bias, scale)

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
        "| two SDPA µs/layer | two SDPA, bf16 K/V µs/layer | bf16 / shared | bf16 max abs diff |"
    )
    report("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for shape in SHAPES:
        r = measure(*shape, args.reps)
        rows.append(r)
        report(
            f"| {r['groups']} × {r['n']} | {r['P']} | {r['t']} | {r['saved']:.2f} | {r['sdpa_us']:.0f} | "
            f"{r['shared_us']:.0f} | {r['shared_us'] / r['sdpa_us']:.2f} | {r['max_abs_diff']:.1e} | "
            f"{r['two_sdpa_us']:.0f} | {r['two_sdpa_bf16_us']:.0f} | "
            f"{r['two_sdpa_bf16_us'] / r['shared_us']:.2f} | {r['two_sdpa_bf16_max_abs_diff']:.1e} |"
        )
    report.save({"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
