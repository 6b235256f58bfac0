"""Helpers for tests that run `rlkit run` in a subprocess (tests/e2e, tests/reliability): a tiny recipe, the
run, checks on what it leaves.

Every run here is a real `python -m rlkit run` (real Ray cluster, real FSDP worker, real files). A run's
own Ray processes are known from ``<output_dir>/ray_session.json`` (written by the product once the workers
are up): the session folder, the pid of every Ray process the driver started, and the worker pids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import yaml

if TYPE_CHECKING:
    import torch


def tiny_recipe(model: Path | str, data: Path, out: Path, overrides: Mapping[str, Any] | None = None) -> dict:
    """The one base recipe of the tests that run ``rlkit``, with ``overrides`` on top: the tiny model, 2
    prompts x 2 samples of at most 6 tokens, one step, one colocated worker, jsonl only, no validation.

    ``overrides`` maps a dotted key path to its value, which replaces what the base has there (a dict value
    replaces the whole section: ``{"resources": {...}}`` drops the base's ``object_store_memory_mb``), e.g.
    ``{"trainer.total_steps": 3, "actor.lora": {"rank": 8, "alpha": 16}}``.
    """
    recipe: dict[str, Any] = {
        "model": {"path": str(model)},
        "data": {
            "train_files": [f"{data}/train.parquet"],
            "max_prompt_length": 64,
            "max_response_length": 6,
            "train_batch_size": 2,
        },
        "algorithm": {"estimator": "grpo"},
        "actor": {"optim": {"lr": 1.0e-3}, "ppo_micro_batch_size_per_rank": 4},
        "rollout": {"n": 2},
        "resources": {
            "object_store_memory_mb": 128,
            "pools": {"global": {"nodes": 1, "bundles_per_node": 1}},
        },
        "trainer": {
            "total_steps": 1,
            "val_before_train": False,
            "output_dir": str(out),
            "experiment_name": "tiny",
        },
        "tracking": {"backends": ["jsonl"]},
    }
    for dotted, value in (overrides or {}).items():
        *parents, key = dotted.split(".")
        section = recipe
        for name in parents:
            section = section.setdefault(name, {})
        section[key] = value
    return recipe


def recipe_text(model: Path | str, data: Path, out: Path, overrides: Mapping[str, Any] | None = None) -> str:
    """``tiny_recipe`` as block-style YAML (what ``rlkit run`` reads)."""
    return yaml.safe_dump(tiny_recipe(model, data, out, overrides), sort_keys=False)


def reliability_overrides(steps: int = 4, keep: int = 10, backends: str = "jsonl") -> dict[str, Any]:
    """What the reliability runs change in the base: ``steps`` steps, a checkpoint each (``keep`` kept),
    ``backends`` a comma-separated list of trackers."""
    return {
        "trainer.total_steps": steps,
        "trainer.save_freq": 1,
        "trainer.max_ckpt_to_keep": keep,
        "trainer.experiment_name": "reliability",
        "tracking.backends": [b.strip() for b in backends.split(",")],
    }


# A graded reward (tests/fixtures/graded_score.py): the tiny model's rewards vary within groups from step 1,
# so the update moves the weights and Adam's moments are non-zero (the arithmetic score of the tiny model is
# 0).
GRADED_SCORE = Path(__file__).resolve().parent / "fixtures" / "graded_score.py"
GRADED_REWARD = f"reward: {{custom_score: {{path: {GRADED_SCORE}}}}}\n"
# recipe_text overrides of a short run with a real gradient: 2 steps, 2 prompts × 4 samples, 12 tokens, graded
TWO_GRADED_STEPS = {
    "data.max_response_length": 12,
    "data.train_batch_size": 2,
    "rollout.n": 4,
    "trainer.total_steps": 2,
    "reward": {"custom_score": {"path": str(GRADED_SCORE)}},
}

# Metrics that differ between two identical runs (wall-clock timings, memory, throughput).
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "time")


def write_recipe(
    path: Path,
    model: Path,
    data: Path,
    out: Path,
    *,
    steps: int = 4,
    keep: int = 10,
    backends: str = "jsonl",
    extra: str = "",
) -> Path:
    """The reliability recipe (``reliability_overrides``) at ``path``; ``extra``: YAML sections appended."""
    path.write_text(recipe_text(model, data, out, reliability_overrides(steps, keep, backends)) + extra)
    return path


def rlkit_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra}


def start(
    *args: str,
    env: dict[str, str] | None = None,
    preexec_fn=None,
    cwd: Path | None = None,
    fault: str | None = None,
) -> subprocess.Popen:
    """`python -m rlkit ARGS` in the background (in ``cwd``); stdout and stderr are read by ``finish``.

    ``fault``: a fault plan (``gen:3,nan_adv:2``; src/rlkit/testing/faults.py), run through the test-only
    entry ``python -m rlkit.testing.faults PLAN -- ARGS``."""
    entry = ["rlkit.testing.faults", fault, "--"] if fault else ["rlkit"]
    return subprocess.Popen(
        [sys.executable, "-m", *entry, *args],
        env=env or rlkit_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=preexec_fn,
        cwd=cwd,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(
            f"rlkit did not finish within {timeout} s; stderr tail:\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    preexec_fn=None,
    cwd: Path | None = None,
    fault: str | None = None,
) -> subprocess.CompletedProcess:
    return finish(start(*args, env=env, preexec_fn=preexec_fn, cwd=cwd, fault=fault), timeout)


# ----- what a run leaves behind ------------------------------------------------------------------
def records(out: Path) -> list[dict]:
    """metrics.jsonl without the volatile keys, in file order (a resumed run appends re-run steps)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def two_graded_steps(
    model: Path | str, data: Path, out: Path, cache: Path, overrides: Mapping[str, Any]
) -> list[dict]:
    """``rlkit run`` of ``TWO_GRADED_STEPS`` with ``overrides`` (recipe ``out``.yaml beside ``out``) under
    the hardware cache ``cache`` (``RLKIT_CACHE``); asserts it ran both steps and returns their records."""
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(recipe_text(model, data, out, TWO_GRADED_STEPS | dict(overrides)))
    result = run("run", str(recipe), env=rlkit_env(RLKIT_CACHE=str(cache)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in records(out) if "training/global_step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    return steps


def last_record_per_step(out: Path) -> dict[int, dict]:
    """The newest record of each step: what a resumed run finally reported for it."""
    return {r["step"]: r for r in records(out)}


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    """Block until metrics.jsonl holds ``step`` (or the process ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= step and "training/global_step" in r for r in records(out)):
            return
        time.sleep(0.05)
    rc = proc.poll()
    tail = proc.stderr.read()[-3000:] if rc is not None and proc.stderr is not None else ""
    raise AssertionError(f"step {step} was not logged within {timeout} s (rc={rc}); stderr tail:\n{tail}")


def optimizer_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The actor's optimizer state in ``checkpoint/actor/dcp`` (CPU tensors): ``optim.state.<param>.<exp_avg |
    exp_avg_sq | step>`` and the other ``optim.*`` tensors, read without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(checkpoint / "actor" / "dcp"))
    entries = reader.read_metadata().state_dict_metadata
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith("optim.") and isinstance(meta, TensorStorageMetadata)
    }
    assert state, f"{checkpoint}: no optimizer state in the actor's checkpoint"
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def moment_norms(state: dict) -> dict[str, float]:
    """L2 norms of Adam's first and second moments over every parameter (``optimizer_state``)."""
    return {
        moment: sum(float(v.double().pow(2).sum()) for k, v in state.items() if k.endswith("." + moment))
        ** 0.5
        for moment in ("exp_avg", "exp_avg_sq")
    }


def differing_tensors(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (bitwise) or exist on one side only."""
    import torch

    return sorted(set(a) ^ set(b)) + [k for k in sorted(set(a) & set(b)) if not torch.equal(a[k], b[k])]


def ray_session(out: Path) -> dict:
    return json.loads((out / "ray_session.json").read_text())


def sessions_started_by(pid: int, ray_tmp: Path = Path("/tmp/ray"), since: float | None = None) -> list[str]:
    """Ray names a session ``session_<date>_<time>_<pid of the driver that started it>``. ``since``: only
    folders made at or after this ``time.time()`` — pids are reused, and an earlier run's driver (another
    test session on this machine) may have had this pid (seen: a refused run's pid matched a session left by
    the previous suite run)."""
    if not ray_tmp.is_dir():
        return []
    found = ray_tmp.glob(f"session_*_{pid}")
    return [p.name for p in found if since is None or p.stat().st_mtime >= since - 1]


def session_processes(session: dict) -> list[psutil.Process]:
    """Live processes of one run's Ray cluster: recorded pids, plus anything naming its session folder.

    ``session`` is a ray_session.json dict, or ``{"session_dir": name}`` for a run killed before it wrote one
    (its Ray workers name no session on their command line, but they die with its raylet).
    """
    name = Path(session["session_dir"]).name
    pids = {pid for pids in session.get("pids", {}).values() for pid in pids}
    pids |= {pid for pids in session.get("worker_pids", {}).values() for pid in pids}
    alive = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if proc.info["pid"] in pids or any(name in part for part in proc.info["cmdline"] or ()):
                alive.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return alive


def wait_until_reaped(session: dict, timeout: float = 30.0) -> float:
    """Seconds until no process of the run's Ray session is left; fails (naming them) after ``timeout``."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if not session_processes(session):
            return time.time() - t0
        time.sleep(0.1)
    left = [(p.pid, " ".join(p.cmdline())[:120]) for p in session_processes(session)]
    raise AssertionError(f"Ray processes of {session['session_dir']} still alive after {timeout} s: {left}")


def check_checkpoints(out: Path) -> list[int]:
    """Every checkpoint folder is complete and loads (trainer state + actor weights); returns the steps.

    A ``.tmp-*`` folder may be left by a kill (the next start removes it) but no ``global_step_*``
    folder without COMPLETE may exist.
    """
    import torch

    from rlkit.runtime.checkpoint import COMPLETE
    from rlkit.runtime.merge import load_actor_state_dict

    steps = []
    root = out / "checkpoints"
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        if child.name.startswith(".tmp-"):
            continue
        assert (child / COMPLETE).is_file(), f"{child} has no {COMPLETE} marker: a corrupted checkpoint"
        state = torch.load(child / "trainer_state.pt", weights_only=False)
        step = int(child.name.rsplit("_", 1)[1])
        assert state["global_step"] == step, child
        weights = load_actor_state_dict(child)
        assert weights and all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point()), (
            child
        )
        steps.append(step)
    return sorted(steps)


def same_weights(a: Path, b: Path) -> bool:
    import torch

    from rlkit.runtime.merge import load_actor_state_dict

    wa, wb = load_actor_state_dict(a), load_actor_state_dict(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
