"""The six GPU recipes as shipped, with their own rollout backend (SGLang) on CPU: `rlkit run RECIPE --smoke
--keep-backend` plus the SGLang venv's Python and a log folder, nothing else (marker ``engines``).

`--smoke` shrinks the sizes (tiny model, 4 prompts, 16 tokens, 2 steps, one CPU per pool) and keeps the
algorithm; `--keep-backend` keeps ``rollout.backend: sglang`` (one replica, tp 1). Each run's worker launches
a real SGLang server (``launch.python``: ``RLKIT_SGLANG_PYTHON``, default /work/engines/sglang/bin/python),
generates through it, pushes the weights into it after each update (``/update_weights_from_tensor``), and
stops it. Steps, seconds per step and scores go to the JUnit report (``record_property``) and docs/recipes.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from rlkit_harness import rlkit_env

pytestmark = pytest.mark.engines

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = ("ppo", "grpo", "dapo", "grpo_reward_model", "grpo_separate_ref", "grpo_tool_agent")
DEFAULT_PYTHON = "/work/engines/sglang/bin/python"


@pytest.fixture(scope="module")
def sglang_python() -> str:
    python = os.environ.get("RLKIT_SGLANG_PYTHON", DEFAULT_PYTHON)
    if not Path(python).exists():
        pytest.fail(
            f"no SGLang Python at {python} (RLKIT_SGLANG_PYTHON): build it with "
            "bash plugins/rlkit-sglang/scripts/sglang-cpu.sh VENV"
        )
    return python


def _server_pids(port: str) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", f"sglang.launch_server.*--port {port}"], capture_output=True, text=True
    )
    return [int(p) for p in out.stdout.split()]


def _run_folders() -> set[str]:
    """The temp dir's run weights folders (``rlkit-sglang-<pid>-*``; other processes on a shared machine may
    make folders of other names there, e.g. an older rlkit-sglang's ``rlkit-sglang-weights-*``)."""
    pattern = re.compile(r"rlkit-sglang-\d+-")
    return {e for e in os.listdir(tempfile.gettempdir()) if pattern.match(e)}


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipe_runs_with_its_sglang_rollout(name, sglang_python, tmp_path, record_property):
    logs = tmp_path / "sglang-logs"
    tmp_before = _run_folders()
    cmd = [
        sys.executable,
        "-m",
        "rlkit",
        "run",
        str(REPO / "recipes" / f"{name}.yaml"),
        "--smoke",
        "--keep-backend",
        f"rollout.backend.launch.python={sglang_python}",
        f"rollout.backend.launch.log_dir={logs}",
        "rollout.backend.launch.startup_timeout_s=900",
    ]
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        env={**rlkit_env(), "RLKIT_CACHE": str(tmp_path.parent / "rlkit-cache")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "kept: sglang (--keep-backend)" in proc.stderr  # the smoke table says what it kept
    rows = [
        json.loads(line)
        for line in (tmp_path / "outputs" / "smoke" / name / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    for r in steps:  # generation came from the server; the update ran on its samples
        assert r["response_length/mean"] > 0 and "actor/pg_loss" in r and "critic/score/mean" in r
    (log,) = logs.glob("sglang-*.log")
    text = log.read_text(errors="replace")
    generates = len(re.findall(r"POST /generate HTTP/1.1\" 200", text))
    syncs = len(re.findall(r"POST /update_weights_from_tensor HTTP/1.1\" 200", text))
    assert generates >= 2 and syncs >= 2, (generates, syncs)  # served the rollouts; a sync per step
    port = log.stem.split("-")[1]
    deadline = time.monotonic() + 30
    while _server_pids(port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _server_pids(port), "the run left its SGLang server running"
    tmp_after = _run_folders()
    assert not tmp_after - tmp_before and not list(tmp_path.glob("**/rlkit-sglang-*")), (
        "a weights folder was left"
    )
    for key, value in {
        "wall_s": round(wall, 1),
        "steps": len(steps),
        "generate_requests": generates,
        "tensor_syncs": syncs,
        "s_per_step": [round(r["timing_s/step"], 1) for r in steps],
        "score": [round(r["critic/score/mean"], 3) for r in steps],
    }.items():
        record_property(key, json.dumps(value))


def test_verifiers_episodes_run_on_the_sglang_rollout(sglang_python, tmp_path, record_property):
    """recipes/verifiers.yaml with ``rollout.backend: sglang``: verifiers plays each episode against rlkit's
    token-in endpoint, whose generation is the SGLang server's (``generate_ids``, one turn per request);
    the episodes are multi-turn and scored by the rubric, none failed, the update had a gradient, and the
    actor's recomputed log-probs agree with the ones the server returned."""
    logs = tmp_path / "sglang-logs"
    cmd = [
        sys.executable,
        "-m",
        "rlkit",
        "run",
        str(REPO / "recipes" / "verifiers.yaml"),
        "--smoke",
        "rollout.backend.name=sglang",
        f"rollout.backend.launch.python={sglang_python}",
        f"rollout.backend.launch.log_dir={logs}",
        "rollout.backend.launch.startup_timeout_s=900",
        "data.max_response_length=128",
        "data.environment.max_tokens_per_turn=12",
        "data.environment.args={size: 264, high: 1000000, max_turns: 3, seed: 1}",
    ]
    start = time.monotonic()
    proc = subprocess.run(
        cmd,
        env={**rlkit_env(), "RLKIT_CACHE": str(tmp_path.parent / "rlkit-cache")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [
        json.loads(line)
        for line in (tmp_path / "outputs" / "smoke" / "verifiers" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [r for r in rows if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    for s in steps:
        assert s["env/errors"] == 0.0 and s["env/timeouts"] == 0.0 and s["reward/errors"] == 0.0, s
        assert s["num_turns/min"] == 3, s  # a number the tiny model never guesses: every game runs 3 turns
        assert 0.0 <= s["critic/score/min"] <= s["critic/score/max"] <= 1.5, s
        # a step whose episodes all scored alike has no advantage and no gradient (GRPO): seen once locally
        assert s["actor/grad_norm"] > 0 or s["critic/advantages/max"] == s["critic/advantages/min"] == 0, s
        # the server decodes in float32 on the CPU, as the actor: rounding apart (3.5e-7 and 4.0e-7 measured)
        assert (
            s["training/rollout_probs_diff_valid"] == 1.0 and s["training/rollout_probs_diff_max"] < 1e-4
        ), s
    assert any(s["actor/grad_norm"] > 0 for s in steps), steps
    (log,) = logs.glob("sglang-*.log")
    generates = len(re.findall(r"POST /generate HTTP/1.1\" 200", log.read_text(errors="replace")))
    # one request per turn: 4 prompts x 4 episodes x 3 turns per step (validation adds its own)
    assert generates >= 2 * 16 * 3, generates
    for key, value in {
        "wall_s": round(wall, 1),
        "generate_requests": generates,
        "rollout_probs_diff_max": [r["training/rollout_probs_diff_max"] for r in steps],
        "score": [round(r["critic/score/mean"], 3) for r in steps],
    }.items():
        record_property(key, json.dumps(value))
