"""Endurance: 200 steps of the tiny recipe with the driver's and the worker's memory sampled at every step.

`pytest -m slow tests/reliability/test_endurance.py -s` prints the numbers recorded in docs/reliability.md.
Bound: a least-squares slope of (driver + worker) RSS over the last 150 steps below 0.2 MiB/step (30 MiB
over those 150 steps); the first 50 steps are warm-up (allocator pools, lazily built kernels, caches).
"""

from __future__ import annotations

import json
import time

import psutil
import pytest
from rlkit_harness import check_checkpoints, finish, ray_session, start, wait_until_reaped

STEPS = 200
SLOPE_BOUND_MIB_PER_STEP = 0.2


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def slope(ys: list[float]) -> float:
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


@pytest.mark.slow
def test_200_steps_memory_flat_and_ray_gone(recipe, tmp_path):
    out = tmp_path / "out"
    path = recipe(out, steps=STEPS, keep=2)
    proc = start("run", str(path), "trainer.save_freq=50")
    metrics = out / "metrics.jsonl"
    samples: list[tuple[int, float, float, float]] = []  # step, driver MiB, worker MiB, Ray's own MiB
    seen = 0
    t0 = time.time()
    while proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if len(lines) > seen and (out / "ray_session.json").exists():
            session = ray_session(out)
            workers = [p for pids in session["worker_pids"].values() for p in pids]
            ray_own = [p for pids in session["pids"].values() for p in pids]
            for line in lines[seen:]:
                step = json.loads(line)["step"]
                samples.append((step, rss_mib([proc.pid]), rss_mib(workers), rss_mib(ray_own)))
            seen = len(lines)
        time.sleep(0.02)
    result = finish(proc)
    elapsed = time.time() - t0
    assert result.returncode == 0, result.stderr[-3000:]
    reap_s = wait_until_reaped(ray_session(out))
    assert check_checkpoints(out) == [150, 200]
    steps = [s for s in samples if s[0] > 50]
    total = [d + w for _, d, w, _ in steps]
    report = {
        "steps": len(samples),
        "seconds": round(elapsed, 1),
        "driver_mib_first_last": (round(samples[0][1], 1), round(samples[-1][1], 1)),
        "worker_mib_first_last": (round(samples[0][2], 1), round(samples[-1][2], 1)),
        "ray_own_mib_first_last": (round(samples[0][3], 1), round(samples[-1][3], 1)),
        "slope_mib_per_step_last150": round(slope(total), 4),
        "driver_slope": round(slope([d for _, d, _, _ in steps]), 4),
        "worker_slope": round(slope([w for _, _, w, _ in steps]), 4),
        "reap_s": round(reap_s, 2),
    }
    print("\nendurance:", json.dumps(report))
    (tmp_path.parent / "endurance.json").write_text(json.dumps({"report": report, "samples": samples}))
    assert len(samples) >= STEPS
    assert slope(total) < SLOPE_BOUND_MIB_PER_STEP, report
