"""Shared by both sides of the benchmark: the workload, the matmul peak, the FLOP count, result files.

Imports only the standard library and torch, because it runs in two virtual environments: rlkit's
(``benchmarks/rlkit_grpo.py``) and TRL's (``benchmarks/trl_grpo.py``, ``benchmarks/.venv-trl``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["Workload", "matmul_peak_flops", "memory_bandwidth", "update_flops", "write_result", "workload_args", "arithmetic_reward",
           "one_thread", "hardware", "hardware_line", "machine_line", "ModelShape", "model_shape", "decode_roofline",
           "executed_update_flops"]

_HARDWARE_PY = Path(__file__).resolve().parent.parent / "src" / "rlkit" / "hardware.py"


def hardware() -> dict:
    """CPU model, relevant flags, torch version and fp32/bf16 matmul GFLOP/s (rlkit.hardware's cached probe).

    ``rlkit/hardware.py`` is loaded by file path: it needs only torch, and TRL's environment has no rlkit."""
    import importlib.util
    import sys

    module = sys.modules.get("rlkit.hardware") or sys.modules.get("_rlkit_hardware")
    if module is None:
        spec = importlib.util.spec_from_file_location("_rlkit_hardware", _HARDWARE_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_rlkit_hardware"] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return module.hardware_summary()


def hardware_line(info: dict | None = None) -> str:
    """One line to print beside every result."""
    h = info or hardware()
    return (f"machine: {h['cpu_model']} ({h['cores']} usable cores), flags {' '.join(h['cpu_flags']) or '-'}, "
            f"torch {h['torch']}, matmul {h['matmul_probe']}: fp32 {h['matmul_gflops_fp32']:.1f} GFLOP/s, "
            f"bf16 {h['matmul_gflops_bf16']:.1f} GFLOP/s")


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work, identical in both toolkits.

    ``prompts`` × ``group`` completions of exactly ``tokens`` tokens each (eos never ends a completion),
    token-mean loss, no KL term (no reference model), one PPO epoch over one mini-batch (one optimizer
    step), one micro-batch (all samples in one forward/backward), AdamW at ``lr``, temperature 1.
    """

    model: str  # HF folder
    model_name: str  # label in the report: tiny | smollm2
    dtype: str  # fp32 | bf16 (autocast over fp32 weights in both toolkits) | fp16w (rlkit: fp16 decode weights)
    data: str  # parquet file with veRL rows (prompt = chat messages, reward_model.ground_truth)
    prompts: int = 8
    group: int = 8
    tokens: int = 32
    max_prompt_length: int = 64
    steps: int = 3  # measured steps
    warmup: int = 1  # steps run before the measured ones (first-call costs: allocations, lazy init)
    lr: float = 1e-6
    seed: int = 1

    @property
    def completions(self) -> int:
        return self.prompts * self.group


def workload_args(description: str) -> tuple[Workload, Path]:
    """Parse the common command line of ``rlkit_grpo.py`` / ``trl_grpo.py``; returns (workload, --out)."""
    parser = argparse.ArgumentParser(description=description)
    for name, kind in (("model", str), ("model-name", str), ("dtype", str), ("data", str), ("prompts", int),
                       ("group", int), ("tokens", int), ("max-prompt-length", int), ("steps", int),
                       ("warmup", int), ("lr", float), ("seed", int)):
        required = name in ("model", "model-name", "dtype", "data")
        default = None if required else Workload.__dataclass_fields__[name.replace("-", "_")].default
        parser.add_argument(f"--{name}", type=kind, required=required, default=default)
    parser.add_argument("--out", required=True, help="JSON result file")
    args = vars(parser.parse_args())
    out = Path(args.pop("out"))
    return Workload(**{k.replace("-", "_"): v for k, v in args.items()}), out


def one_thread() -> None:
    """One torch thread (the machine is shared; two threads are unstable). Call before any torch work."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def matmul_peak_flops(dtype: str, size: int = 1024, reps: int = 5) -> float:
    """Best-of-``reps`` FLOP/s of one ``size``² matmul in ``dtype`` on the current thread count."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dt), torch.randn(size, size, dtype=dt)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def memory_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Best-of-``reps`` bytes/s of reading one buffer of ``mib`` MiB (fp32, far larger than the caches) with
    a reduction on the current thread count: the rate at which a decode step can stream the weights.
    A sum reads each byte once and writes nothing, the access pattern of a matrix-vector product."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # warm-up: pages touched
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def update_flops(n_params: int, tokens: int) -> float:
    """Forward + backward of a dense decoder: 6 · parameters · tokens (attention's own FLOPs left out:
    sequences here are under 100 tokens). ``n_params`` counts tied embeddings once (the head matmul)."""
    return 6.0 * n_params * tokens


_NUMBER = re.compile(r"-?\d+")


def arithmetic_reward(text: str, ground_truth: str) -> float:
    """1.0 when the last integer in ``text`` equals the answer (both toolkits score with this rule)."""
    numbers = _NUMBER.findall(text)
    return float(bool(numbers) and numbers[-1] == str(ground_truth).strip())


def write_result(out: Path, workload: Workload, framework: str, steps: list[dict[str, float]],
                 extra: dict) -> dict:
    """Write per-step phase times plus medians to ``out`` (JSON); returns the record."""
    keys = sorted({k for s in steps for k in s})
    medians = {k: statistics.median(s[k] for s in steps if k in s) for k in keys}
    record = {"framework": framework, "workload": asdict(workload), "steps": steps, "median": medians,
              "hardware": hardware(), **extra}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return record


def machine_line(peak_fp32: float, bandwidth: float, info: dict | None = None) -> str:
    """``hardware_line`` plus the 1024² fp32 matmul peak and the memory read bandwidth this process measured
    (the two roofline inputs), printed beside every result."""
    return (hardware_line(info) + f"; matmul 1024² fp32 peak {peak_fp32 / 1e9:.1f} GFLOP/s; "
            f"memory read {bandwidth / 1e9:.1f} GB/s (256 MiB sum, 1 thread)")


@dataclass(frozen=True)
class ModelShape:
    """What the rooflines need from an HF ``config.json``."""

    params: int  # parameters, a tied head counted once
    embed: int  # input-embedding parameters (no matmul FLOPs)
    head: int  # LM-head parameters (= embed when tied)
    layers: int
    kv_width: int  # key/value heads × head dim (one of K or V, per layer and token)

    @property
    def body(self) -> int:
        """Parameters of the decoder layers and final norm: their FLOPs are paid on every token the layers run."""
        tied = self.head == self.embed
        return self.params - self.embed - (0 if tied else self.head)


def model_shape(model_dir: str | Path, params: int) -> ModelShape:
    """``ModelShape`` of the HF folder ``model_dir`` whose model has ``params`` parameters."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    embed = vocab * hidden
    return ModelShape(params=params, embed=embed, head=embed, layers=cfg["num_hidden_layers"], kv_width=kv * head_dim)


def decode_roofline(shape: ModelShape, rows: int, prompt_tokens: float, tokens: int, value_bytes: int,
                    bandwidth: float) -> dict[str, float]:
    """Memory-bandwidth bound of decoding ``tokens`` tokens for ``rows`` rows at once: each step reads every
    weight once (``value_bytes`` each: 4 fp32, 2 bf16) and each row's KV cache (K and V of every layer for the
    ``prompt_tokens`` + tokens so far; fp32 cache). Returns bytes per step and per generated token (averaged
    over the steps) and the time bound for the whole generation at ``bandwidth`` bytes/s."""
    weights = shape.params * value_bytes
    mean_context = prompt_tokens + (tokens + 1) / 2
    kv = 2 * shape.layers * shape.kv_width * 4 * rows * mean_context
    per_step = weights + kv
    return {"bytes_per_step": per_step, "bytes_per_token": per_step / rows, "weight_bytes": weights,
            "kv_bytes_per_step": kv, "gen_bound_s": tokens * per_step / bandwidth}


def executed_update_flops(shape: ModelShape, body_tokens: float, head_rows: float) -> float:
    """6 · (body parameters · tokens the decoder layers run + head parameters · rows the head runs): forward +
    backward FLOPs a toolkit executes (a shared prompt pass runs fewer body tokens; a head on response
    positions only, fewer head rows). Attention's own FLOPs are left out."""
    return 6.0 * (shape.body * body_tokens + shape.head * head_rows)
