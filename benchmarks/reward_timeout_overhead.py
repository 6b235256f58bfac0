"""What the reward timeout costs: scoring a batch in the driver vs through the scoring child process.

    python benchmarks/reward_timeout_overhead.py [--batch 64] [--repeats 200]

Every reward manager now runs ``score_all`` in a child process (``rlkit.rewards.pool.ScorePool``) so
that ``reward.timeout_s`` can stop a hanging scorer. This measures, on the built-in arithmetic scorer
(``rlkit/arithmetic``), the seconds per batch of ``--batch`` samples: inline (``score_all`` in this
process, what ``naive`` did before) against ``naive`` (one child, a round trip per sample),
``parallel`` with 2 children, and ``batch`` (one round trip per batch). Decoding and score
placement are the same on every path and not timed. Prints the CPU model, its flags of interest and
the load average beside the result.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Report  # noqa: E402


def cpu_facts() -> str:
    model, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    return f"{model}; {os.cpu_count()} CPUs; flags {shown}; load average {os.getloadavg()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    report = Report("reward-timeout-overhead")  # printed lines, written to benchmarks/results/ at the end

    from rlkit.builtin.params import ParallelManagerParams
    from rlkit.plugin.manager import make_plugin_manager
    from rlkit.plugin.registry import build_registries
    from rlkit.rewards.dispatch import ScoreDispatcher, batched
    from rlkit.rewards.managers import BatchRewardManager, NaiveRewardManager
    from rlkit.rewards.parallel import ParallelRewardManager

    score = ScoreDispatcher(build_registries(make_plugin_manager(entry_points=False)))
    items = [("rlkit/arithmetic", f"The answer is {i % 17}.", str(i % 13), None) for i in range(args.batch)]
    managers = {
        "inline (driver, no timeout)": (NaiveRewardManager(None, score), lambda m: m.score_all(items)),
        "naive (1 child, per-sample timeout)": (
            NaiveRewardManager(None, score),
            lambda m: m._score_with_timeout(items),
        ),
        "parallel (2 children)": (
            ParallelRewardManager(None, score, params=ParallelManagerParams(num_workers=2)),
            lambda m: m._score_with_timeout(items),
        ),
        "batch (1 child, one call)": (
            BatchRewardManager(None, batched(score)),
            lambda m: m._score_with_timeout(items),
        ),
    }
    report(cpu_facts())
    report(f"batch of {args.batch} samples, {args.repeats} repeats (after 5 warm-up calls); ms per batch:")
    base = None
    for name, (manager, call) in managers.items():
        for _ in range(5):
            outcomes = call(manager)
        assert [o.score for o in outcomes] == [
            o.score
            for o in managers["inline (driver, no timeout)"][1](managers["inline (driver, no timeout)"][0])
        ]
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call(manager)
            times.append((time.perf_counter() - t0) * 1e3)
        manager.close()
        median = statistics.median(times)
        base = median if base is None else base
        extra = (
            ""
            if median == base
            else f"   (+{median - base:.2f} ms, +{(median - base) / args.batch * 1e3:.0f} µs/sample)"
        )
        report(f"  {name:38s} median {median:7.2f}  p90 {sorted(times)[int(0.9 * len(times))]:7.2f}{extra}")
    report.save({"args": vars(args)})


if __name__ == "__main__":
    main()
