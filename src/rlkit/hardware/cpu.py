"""What this CPU computes fast: its model and flags, a timed bf16/fp32 matmul probe (cached on disk), and
the ``auto`` precision decision drawn from them.

* CUDA: bf16 when ``torch.cuda.is_bf16_supported()``, else fp32.
* CPU (``decide_cpu``), the same choice on every run of one machine and on identical machines:
  1. no native bf16 flag (``amx_bf16``, ``avx512_bf16``; ``bf16`` on Arm) → fp32, from the flags alone;
  2. otherwise a timed probe: ``PROBE_ROUNDS`` rounds, each multiplying two 256² matrices on one thread in
     fp32 then in bf16; the ratio is the best bf16 rate over the best fp32 rate (other work on the machine
     only slows a round down, so the best rates are the steadiest). At or above the band's top
     (``BF16_BAND``: ``BF16_MIN_SPEEDUP`` / 1.5 … × 1.5 = 1.33 … 3.0) → bf16; below its bottom → fp32;
     inside the band → the flags decide: x86 bf16 instructions (``amx_bf16`` or ``avx512_bf16``) → bf16,
     else (Arm's ``bf16``, not measured) fp32.
  The band exists because one machine's ratio can sit near a single threshold and flip between runs (an AMD
  EPYC Zen 4 read 1.88× and 2.00×), and autocast adds casts around every op, so a matmul merely as fast as
  fp32 makes a slower step. Where x86's bf16 instructions are there, the band's ratios pay: on Zen 4 (≈ 2×)
  the SmolLM2 update ran 1.74–1.87× faster in bf16 than in fp32 and the quickstart learned as well
  (docs/concepts.md). The inputs (flags, ratios, rule) go into the run's
  ``resolved.*`` parameters and ``run_info.json``.
* The probe's numbers are cached per machine in ``$RLKIT_CACHE/hardware.json`` (default
  ``~/.cache/rlkit``), keyed by CPU model, flags and torch version; a corrupt file is ignored and rewritten.

This module imports only the standard library and torch (``benchmarks/common.py`` loads it by file path
in an environment without rlkit's dependencies).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BF16_MIN_SPEEDUP",
    "BF16_BAND",
    "PROBE_ROUNDS",
    "NATIVE_BF16_FLAGS",
    "RELEVANT_FLAGS",
    "CpuInfo",
    "cpu_flags",
    "cpu_info",
    "MatmulProbe",
    "matmul_flops",
    "probe_matmul",
    "default_cache_path",
    "cached_entry",
    "cached_probe",
    "PrecisionDecision",
    "bf16_rule",
    "decide_cpu",
    "decide_cuda",
    "precision_decision",
    "hardware_summary",
    "usable_cpus",
    "device_type",
]

log = logging.getLogger("rlkit.hardware")


BF16_MIN_SPEEDUP = 2.0  # the band's centre: bf16 matmul / fp32 matmul speed about where bf16 starts to pay


BF16_BAND = (BF16_MIN_SPEEDUP / 1.5, BF16_MIN_SPEEDUP * 1.5)  # probe readings inside: the flags decide


PROBE_ROUNDS = 5


NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")  # x86 AMX, x86 AVX-512 BF16, Arm (``Features: bf16``)
# inside the band: bf16 (measured on AMX and on Zen 4's AVX-512 BF16)
X86_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


RELEVANT_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)


_CACHE_VERSION = 1


# Entries of several probe rounds (``ratios``) get keys of their own: a file shared with an older rlkit (one
# home folder, several checkouts) keeps both kinds instead of each version discarding the other's.
_PROBE_FORMAT = "rounds"


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C", ...
    flags: tuple[str, ...]  # the RELEVANT_FLAGS this CPU reports, in that order

    @property
    def native_bf16(self) -> tuple[str, ...]:
        return tuple(f for f in NATIVE_BF16_FLAGS if f in self.flags)


def _cpuinfo_fields(cpuinfo: str | Path) -> dict[str, str] | None:
    """The first processor's ``key: value`` fields of ``/proc/cpuinfo`` (None where it cannot be read)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:  # the first processor's values
            fields[key.strip()] = value.strip()
    return fields


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """Every flag the CPU reports (x86 ``flags``, Arm ``Features``), not only the ``RELEVANT_FLAGS``; empty
    where ``/proc/cpuinfo`` cannot be read."""
    return _flags_of(_cpuinfo_fields(cpuinfo) or {})


def _flags_of(fields: dict[str, str]) -> frozenset[str]:
    return frozenset((fields.get("flags") or fields.get("Features") or "").split())


def cpu_info(cpuinfo: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """Model name and relevant flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``); on a system
    without it, ``platform.processor()`` and no flags."""
    fields = _cpuinfo_fields(cpuinfo)
    if fields is None:
        import platform

        return CpuInfo(model=platform.processor() or platform.machine() or "unknown", flags=())
    model = (
        fields.get("model name")
        or fields.get("Model")
        or fields.get("Hardware")
        or fields.get("CPU part")
        or "unknown"
    )
    present = _flags_of(fields)
    return CpuInfo(model=re.sub(r"\s+", " ", model), flags=tuple(f for f in RELEVANT_FLAGS if f in present))


@dataclass(frozen=True)
class MatmulProbe:
    fp32_flops: float  # FLOP/s of one size² matmul, fp32, on `threads` threads (the best round)
    bf16_flops: float  # the same in bf16 (0 when bf16 matmul failed)
    size: int = 256
    threads: int = 1
    ratios: tuple[float, ...] = ()  # bf16 / fp32 of each round, for the record (the decision uses ``ratio``)

    @property
    def ratio(self) -> float:
        """bf16 speed / fp32 speed (> 1: bf16 is faster), of the best rounds."""
        return self.bf16_flops / self.fp32_flops if self.fp32_flops > 0 else 0.0


def matmul_flops(
    dtype: Any, *, size: int = 256, threads: int | None = None, budget_s: float = 0.08, max_reps: int = 200
) -> float:
    """FLOP/s of ``size``² @ ``size``² in ``dtype`` (a torch dtype): one warm-up, then repeats until
    ``budget_s`` has passed (at least one; ``budget_s=0``: exactly ``max_reps``); on ``threads`` torch
    threads (None: as set). 0 on failure."""
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        reps, start = 0, time.perf_counter()
        while reps < max_reps:
            a @ b
            reps += 1
            if budget_s > 0 and time.perf_counter() - start >= budget_s:
                break
        return 2.0 * size**3 * reps / (time.perf_counter() - start)
    except RuntimeError:
        return 0.0
    finally:
        torch.set_num_threads(previous)


def probe_matmul(size: int = 256, budget_s: float = 0.05, rounds: int = PROBE_ROUNDS) -> MatmulProbe:
    """fp32 and bf16 matmul speed on one thread, ``rounds`` times (fp32 then bf16 in each round, ≈ 2 ×
    ``budget_s`` a round): the best rate of each and each round's ratio."""
    import torch

    fp32, bf16 = [], []
    for _ in range(rounds):
        fp32.append(matmul_flops(torch.float32, size=size, threads=1, budget_s=budget_s))
        bf16.append(matmul_flops(torch.bfloat16, size=size, threads=1, budget_s=budget_s))
    ratios = tuple(round(b / f, 4) if f > 0 else 0.0 for f, b in zip(fp32, bf16, strict=True))
    return MatmulProbe(fp32_flops=max(fp32), bf16_flops=max(bf16), size=size, threads=1, ratios=ratios)


def default_cache_path() -> Path:
    return Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit")) / "hardware.json"


def _cache_key(cpu: CpuInfo, torch_version: str) -> str:
    key = [cpu.model, list(cpu.flags), torch_version, _PROBE_FORMAT]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def cached_entry(
    kind: str,
    cpu: CpuInfo,
    measure: Callable[[], dict[str, Any]],
    parse: Callable[[dict[str, Any]], Any],
    cache_path: Path | None = None,
) -> Any:
    """``parse`` of the ``kind`` measurement for this CPU and torch version from the cache, or of
    ``measure()`` now, added to the cache (with the CPU model, flags, torch version and time, for the record).

    An unreadable or malformed cache file, or an entry ``parse`` rejects (KeyError, TypeError, ValueError), is
    measured again and replaced; an unwritable file is left alone."""
    import torch

    path = cache_path or default_cache_path()
    key = _cache_key(cpu, torch.__version__) + ("" if kind == "matmul" else f"-{kind}")
    entries: dict[str, Any] = {}
    try:
        data = json.loads(path.read_text())
        entries = data["entries"] if data.get("version") == _CACHE_VERSION else {}
        hit = entries.get(key)
        if hit is not None:
            return parse(hit)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.info("ignoring the hardware cache %s (%s); measuring again", path, exc)
    result = measure()
    entries = entries if isinstance(entries, dict) else {}
    entries[key] = result | {
        "cpu_model": cpu.model,
        "flags": list(cpu.flags),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": _CACHE_VERSION, "entries": entries}, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        log.info("could not write the hardware cache %s: %s", path, exc)
    return parse(result)


def _matmul_probe(entry: dict[str, Any]) -> MatmulProbe:
    return MatmulProbe(
        fp32_flops=float(entry["fp32_flops"]),
        bf16_flops=float(entry["bf16_flops"]),
        size=int(entry["size"]),
        threads=int(entry["threads"]),
        ratios=tuple(float(r) for r in entry.get("ratios", ())),
    )


def cached_probe(cpu: CpuInfo, cache_path: Path | None = None, *, probe=probe_matmul) -> MatmulProbe:
    """The matmul probe for this CPU and torch version from the cache, or measured now and added to it."""
    return cached_entry("matmul", cpu, lambda: asdict(probe()), _matmul_probe, cache_path)


@dataclass(frozen=True)
class PrecisionDecision:
    """What ``auto`` means on one device: autocast precision, rollout decode dtype, and why."""

    mixed_precision: str  # "fp32" | "bf16"
    decode_dtype: str  # "float32" | "bfloat16"
    device: str  # "cpu" | "cuda"
    reason: str  # one line
    ratio: float | None = None  # measured bf16 / fp32 matmul speed (CPU; the median round)
    cpu: CpuInfo | None = None
    probe: MatmulProbe | None = None
    rule: str = ""  # which rule of ``decide_cpu`` decided: flags, probe above/below the band, band -> flags

    @property
    def bf16_fast(self) -> bool:
        return self.mixed_precision == "bf16"


def bf16_rule(native: tuple[str, ...], ratio: float) -> tuple[bool, str]:
    """(bf16?, rule) from the native bf16 flags and the probe's bf16/fp32 ratio (module docstring)."""
    low, high = BF16_BAND
    if not native:
        return False, "flags: no native bf16"
    if ratio >= high:
        return True, f"probe: >= {high:.3g}x"
    if ratio < low:
        return False, f"probe: < {low:.3g}x"
    x86 = [flag for flag in X86_BF16_FLAGS if flag in native]
    if x86:
        return True, f"band {low:.3g}-{high:.3g}x -> flags: {'/'.join(x86)}"
    return False, f"band {low:.3g}-{high:.3g}x -> flags: no amx_bf16/avx512_bf16"


def decide_cpu(cpu: CpuInfo, probe: MatmulProbe) -> PrecisionDecision:
    """bf16 or fp32 by ``bf16_rule``: the flags, and where the CPU has native bf16, the probe."""
    ratio = probe.ratio
    speed = (
        f"{ratio:.2f}x fp32"
        if ratio >= 1
        else (f"{1 / ratio:.0f}x slower than fp32" if ratio > 0 else "failed")
    )
    rounds = f", rounds {'/'.join(f'{r:.2f}' for r in probe.ratios)}" if len(probe.ratios) > 1 else ""
    measured = f"bf16 matmul measured {speed} ({probe.size}², {probe.threads} thread{rounds})"
    native = "/".join(cpu.native_bf16)
    has = f"has native bf16 ({native})" if native else "has no native bf16 (no amx_bf16/avx512_bf16)"
    fast, rule = bf16_rule(cpu.native_bf16, ratio)
    return PrecisionDecision(
        mixed_precision="bf16" if fast else "fp32",
        decode_dtype="bfloat16" if fast else "float32",
        device="cpu",
        reason=f"CPU {cpu.model} {has}; {measured}; rule {rule} -> {'bf16' if fast else 'fp32'}",
        ratio=ratio,
        cpu=cpu,
        probe=probe,
        rule=rule,
    )


def decide_cuda(bf16_supported: bool, name: str) -> PrecisionDecision:
    if bf16_supported:
        return PrecisionDecision("bf16", "bfloat16", "cuda", f"CUDA device {name} supports bf16 -> bf16")
    return PrecisionDecision("fp32", "float32", "cuda", f"CUDA device {name} has no bf16 -> fp32")


@functools.cache
def precision_decision(device: str = "cpu", cache_path: Path | None = None) -> PrecisionDecision:
    """The decision for ``device`` ("cpu" or "cuda[:i]") on this machine (probe cached on disk and per
    process)."""
    import torch

    if device.startswith("cuda"):
        return decide_cuda(torch.cuda.is_bf16_supported(), torch.cuda.get_device_name(torch.device(device)))
    cpu = cpu_info()
    return decide_cpu(cpu, cached_probe(cpu, cache_path))


def hardware_summary(*, fresh: bool = True) -> dict[str, Any]:
    """CPU model, relevant flags, torch version and fp32/bf16 matmul GFLOP/s (benchmarks print it beside every
    result): ``fresh`` measures now (under the current load), else the cached probe."""
    import torch

    cpu = cpu_info()
    probe = probe_matmul() if fresh else cached_probe(cpu)
    return {
        "cpu_model": cpu.model,
        "cpu_flags": list(cpu.flags),
        "torch": torch.__version__,
        "matmul_gflops_fp32": round(probe.fp32_flops / 1e9, 2),
        "matmul_gflops_bf16": round(probe.bf16_flops / 1e9, 2),
        "matmul_probe": f"{probe.size}² on {probe.threads} thread",
        "cores": usable_cpus(),
    }


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (containers)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def device_type(device: Any) -> str:
    """``"cuda"`` for a CUDA device (a ``torch.device`` or a string like ``"cuda:1"``), else ``"cpu"``."""
    return "cuda" if str(getattr(device, "type", device)).startswith("cuda") else "cpu"
