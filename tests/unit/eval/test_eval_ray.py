"""``rlkit eval`` generating on a real Ray cluster with 2 rollout ranks (a subprocess, the tiny model): the
same generations as the in-process path for the same seed (sampled, so the per-chunk seeding is what makes
them agree), and resume after SIGKILL of the driver (nothing written is generated or scored again)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
from rlkit_harness import rlkit_env, start
from rlkit_harness import run as run_rlkit

TWO_RANKS = "resources.pools={global: {nodes: 1, bundles_per_node: 2, cpus_per_bundle: 1}}"


def env() -> dict[str, str]:
    return rlkit_env(RLKIT_CACHE=str(Path.home() / ".cache" / "rlkit"))


def test_eval_on_two_ray_ranks_matches_in_process_and_resumes_after_sigkill(tiny_model_dir, tmp_path):
    from rlkit.data import generate_arithmetic

    generate_arithmetic(tmp_path / "data", train_size=4, test_size=9, seed=3)
    common = ["eval", str(tiny_model_dir), "--data", str(tmp_path / "data" / "test.parquet")]
    common += ["--n", "2", "--temperature", "1.0", "--max-new-tokens", "24", "--batch-size", "1"]
    common += ["--bootstrap", "20", "--no-progress", "--seed", "5"]

    local = run_rlkit(*common, "--out", str(tmp_path / "local"), env=env())
    assert local.returncode == 0, local.stderr[-3000:]
    assert "generating in-process, 1 rank" in local.stderr

    out = tmp_path / "ray"
    ray_args = [*common, "--out", str(out), TWO_RANKS, "resources.object_store_memory_mb=256"]
    proc = start(*ray_args, env=env())
    parts, deadline = out / "parts", time.time() + 300
    while time.time() < deadline and proc.poll() is None and len(list(parts.glob("chunk-*.parquet"))) < 2:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in parts.glob("chunk-*.parquet")}
    assert 2 <= len(before) < 9, f"the kill should land mid-eval: {len(before)} chunks"

    again = run_rlkit(*ray_args, env=env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "generating Ray pool 'global', 2 ranks" in again.stderr
    assert f"resuming, {len(before)} of 9 prompts already done" in again.stderr
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in parts.glob("chunk-*.parquet")}
    assert len(after) == 9 and all(after[name] == kept for name, kept in before.items())  # not redone

    on_ray = pq.read_table(out / "generations.parquet").to_pydict()
    in_process = pq.read_table(tmp_path / "local" / "generations.parquet").to_pydict()
    assert len(set(zip(on_ray["prompt_id"], on_ray["sample"]))) == 18  # each sample once
    assert on_ray == in_process  # same prompts, order, responses and scores
    assert len(set(on_ray["response"])) > 9  # sampled: the agreement is the seeding's, not greedy's
