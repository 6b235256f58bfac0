"""Does glibc reuse a freed tensor's pages, on the main thread and on another thread, with and without
``keep_freed_memory`` (``common.py``: no mmap'd blocks, no heap trim)?

    python benchmarks/malloc_threads.py

rlkit's worker methods run on a thread Ray starts, not the process's main thread, so a malloc setting that
helps ``benchmarks/ab.py --change malloc`` (main thread) must be checked there too. Each case runs in a fresh
process: allocate a tensor of the size, write it, free it, 5 times; the minor page faults (``ru_minflt``) of
rounds 2-5 are counted (0: the pages were reused; size / 4 KiB per round: fresh pages every time). Two more
rows allocate with glibc directly, ``malloc`` and ``posix_memalign(64)`` (how torch's CPU allocator asks for
memory), to show which call keeps its pages. Writes ``benchmarks/results/<stamp>-malloc-threads.{json,md}``.
"""

from __future__ import annotations

import ctypes
import functools
import json
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report, keep_freed_memory  # noqa: E402

SIZES_MIB = (1, 4, 16, 64)
_KINDS = ("torch", "malloc", "posix_memalign")


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc with the argument types of the calls below."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
    return libc


def _rounds(kind: str, nbytes: int) -> int:
    """Minor faults of rounds 2-5 of allocate, write, free (``kind``: torch.empty, or glibc directly)."""
    import resource

    libc = _libc()
    counts = []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if kind == "torch":
            import torch

            t = torch.empty(nbytes // 4)
            t.fill_(1.0)
            del t
        else:
            if kind == "malloc":
                ptr = libc.malloc(nbytes)
            else:
                box = ctypes.c_void_p()
                libc.posix_memalign(ctypes.byref(box), 64, nbytes)
                ptr = box.value
            libc.memset(ptr, 1, nbytes)
            libc.free(ptr)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return sum(counts[1:])


def child(kept: bool, thread: bool) -> dict:
    """One process's counts per kind and size, on the main thread or on a second thread."""
    import threading

    import torch

    torch.set_num_threads(1)
    applied = keep_freed_memory() if kept else False
    out: dict = {}

    def work() -> None:
        for kind in _KINDS:
            for mib in SIZES_MIB:
                out[f"{kind} {mib}"] = _rounds(kind, mib * 2**20)

    if thread:
        runner = threading.Thread(target=work)
        runner.start()
        runner.join()
    else:
        work()
    return {"applied": applied, "faults": out}


def main() -> None:
    if len(sys.argv) == 3:  # a child: kept, thread
        print(json.dumps(child(sys.argv[1] == "1", sys.argv[2] == "1")))
        return
    report = Report("malloc-threads")
    report(f"glibc {platform.libc_ver()[1]}, {platform.machine()}; torch allocates with posix_memalign(64)")
    record: dict = {"sizes_mib": SIZES_MIB, "cases": {}}
    header = " | ".join(f"{kind} {mib} MiB" for kind in _KINDS for mib in SIZES_MIB)
    report(f"| setting | thread | {header} |")
    report("|---|---|" + "---:|" * (len(_KINDS) * len(SIZES_MIB)))
    for kept in (False, True):
        for thread in (False, True):
            out = subprocess.run(
                [sys.executable, __file__, str(int(kept)), str(int(thread))],
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(out.stdout.strip().splitlines()[-1])
            name = ("keep_freed_memory" if got["applied"] else "not applied") if kept else "glibc default"
            where = "second thread" if thread else "main thread"
            record["cases"][f"{name}, {where}"] = got
            cells = " | ".join(str(got["faults"][f"{k} {m}"]) for k in _KINDS for m in SIZES_MIB)
            report(f"| {name} | {where} | {cells} |")
    report(
        "Minor page faults of rounds 2-5 (4 rounds; fresh pages every round = 256 per MiB per round, "
        "e.g. 4096 for 4 MiB over 4 rounds)."
    )
    report.save(record)


if __name__ == "__main__":
    main()
