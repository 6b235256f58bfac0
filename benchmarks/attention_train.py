"""The actor's attention, forward and backward, at the harness workloads' shapes: transformers' eager and SDPA
against rlkit's grouped eager attention (``rlkit.model.attention``), with its causal blocks and without.

    python benchmarks/attention_train.py [--reps 3] [--rounds 2]

SmolLM2-135M's attention (9 query heads over 3 KV heads of 64; 30 layers, each its own tensors) on the
response pass of the shared-prefix layout: the smollm2 workload (16 rows × 32 response tokens over 44 prompt
tokens: T 32, L 76), the smollm2-256 one (8 × 256 over 44: T 256, L 300) and smollm2-long's (8 × 64 over
526: T 64, L 590), and smollm2-long's prompt pass (2 prompts of 526 tokens: T = L = 526), with the additive
mask of the prompt prefix and the causal tokens. ``grouped`` runs the queries in causal blocks where it
would (``rlkit.model.attention.causal_blocks``: T ≥ 256), ``grouped, one block`` never does. One step is
the 30 layers' attention forward, then backward of a weighted sum of the outputs; the median of ``--reps``
steps per variant, the variants alternated A B C … C B A over ``--rounds``; one torch thread. Also reports
each variant's largest difference from eager (outputs and query gradients; a query that sees no key, a
padded prompt position, is left out). Writes ``benchmarks/results/<stamp>-attention-train.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, one_thread  # noqa: E402

SHAPES = {
    "smollm2 (16 × 32)": (16, 32, 76),
    "smollm2-256 (8 × 256)": (8, 256, 300),
    "smollm2-long responses (8 × 64)": (8, 64, 590),
    "smollm2-long prompts (2 × 526)": (2, 526, 526),
}
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


class _Attention:
    """The attributes transformers' attention functions read from the calling module."""

    num_key_value_groups, is_causal, training = HEADS // KV_HEADS, True, True


class _NotCausal(_Attention):
    """A module that does not say it is causal: the grouped attention runs the queries in one block."""

    is_causal = False


def _layers(rows: int, t: int, length: int, dtype):
    import torch

    torch.manual_seed(0)
    out = []
    for _ in range(LAYERS):
        q = torch.randn(rows, t, HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2).requires_grad_()
        k = torch.randn(rows, KV_HEADS, length, HEAD_DIM, dtype=dtype, requires_grad=True)
        v = torch.randn(rows, KV_HEADS, length, HEAD_DIM, dtype=dtype, requires_grad=True)
        out.append((q, k, v))
    mask = torch.zeros(rows, 1, t, length, dtype=dtype)
    low = torch.finfo(dtype).min
    mask[:, :, :, length - t :] = torch.triu(torch.full((t, t), low), 1).to(dtype)  # causal queries
    mask[0, :, :, :3] = low  # a left-padded prompt
    return out, mask


def _step(fn, layers, mask) -> tuple[float, object, object]:
    import torch

    for q, k, v in layers:
        q.grad = k.grad = v.grad = None
    module = _NotCausal() if fn is _one_block else _Attention()
    start = time.perf_counter()
    outs = [fn(module, q, k, v, mask, scaling=HEAD_DIM**-0.5, dropout=0.0)[0] for q, k, v in layers]
    # [B, T, 1, 1]: the queries that see a key (a padded prompt's first positions see none)
    seen = (mask[:, 0] > torch.finfo(mask.dtype).min).any(-1)[:, :, None, None]
    weights = torch.linspace(-1, 1, outs[0].numel()).view(outs[0].shape) * seen
    torch.stack([(o.float() * weights).sum() for o in outs]).sum().backward()
    return time.perf_counter() - start, (outs[0].detach().float() * seen), layers[0][0].grad.float()


def _one_block(module, *args, **kwargs):
    from rlkit.model.attention import grouped_eager_attention

    return grouped_eager_attention(module, *args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--dtypes",
        default="fp32,bf16",
        help="of fp32, bf16 (machine_sweep.sh drops bf16 where the CPU has no native bf16)",
    )
    args = parser.parse_args()
    one_thread()
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from rlkit.model.attention import grouped_eager_attention

    variants = {
        "eager": eager_attention_forward,
        "sdpa": sdpa_attention_forward,
        "grouped": grouped_eager_attention,
        "grouped, one block": _one_block,
    }
    report = Report("attention-train")
    record: dict = {"args": vars(args), "ms": {}, "max_diff": {}}
    table = [
        "| shape | dtype | eager ms | SDPA ms | grouped ms | grouped, one block ms | grouped / eager | "
        "grouped / SDPA | grouped / one block |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape, (rows, t, length) in SHAPES.items():
        for dtype in [{"fp32": torch.float32, "bf16": torch.bfloat16}[d] for d in args.dtypes.split(",")]:
            layers, mask = _layers(rows, t, length, dtype)
            times: dict[str, list[float]] = {name: [] for name in variants}
            reference = None
            for r in range(args.rounds):
                for name in variants if r % 2 == 0 else list(variants)[::-1]:
                    for _ in range(args.reps):
                        seconds, out, grad = _step(variants[name], layers, mask)
                        times[name].append(seconds)
                    if name == "eager" and reference is None:
                        reference = (out, grad)
                    elif name != "eager":
                        diff = max(
                            float((out - reference[0]).abs().max()), float((grad - reference[1]).abs().max())
                        )
                        key = f"{shape} {dtype} {name}"
                        record["max_diff"][key] = max(diff, record["max_diff"].get(key, 0.0))
            ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
            record["ms"][f"{shape} {dtype}"] = ms
            dtype_name = str(dtype).removeprefix("torch.")
            table.append(
                f"| {shape} | {dtype_name} | {ms['eager']:.1f} | {ms['sdpa']:.1f} | {ms['grouped']:.1f} | "
                f"{ms['grouped, one block']:.1f} | {ms['grouped'] / ms['eager']:.2f} | "
                f"{ms['grouped'] / ms['sdpa']:.2f} | {ms['grouped'] / ms['grouped, one block']:.2f} |"
            )
            print(table[-1], flush=True)
    report("\n".join(table))
    report(f"largest difference from eager (output, query gradient): {record['max_diff']}")
    report.save(record)


if __name__ == "__main__":
    main()
