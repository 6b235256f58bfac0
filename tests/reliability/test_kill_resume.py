"""Preemption and crashes: SIGKILL the driver at chosen or random points, kill a Ray worker mid-run.

What must hold after every kill: no checkpoint folder without COMPLETE, every checkpoint loads; no process
of the killed run's Ray session survives; and the resumed run reports, for every step, exactly what an
uninterrupted run with the same seed reported, and ends with bit-identical weights and optimizer state. The
recipe scores with a graded reward (tests/fixtures/graded_score.py): every step has a gradient and Adam's
moments are non-zero before any kill, so a resume that failed to restore them would show.

Kill points come from a fault plan ``<phase>:<step>`` given to the test-only entry
``python -m rlkit.testing.faults PLAN -- run ...`` (src/rlkit/testing/faults.py; the driver SIGKILLs itself
there) and, in the slow test, also from a timer in this process at a random moment of the run.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
from rlkit_harness import (
    GRADED_REWARD,
    check_checkpoints,
    differing_tensors,
    finish,
    last_record_per_step,
    moment_norms,
    optimizer_state,
    ray_session,
    run,
    same_weights,
    sessions_started_by,
    start,
    wait_for_step,
    wait_until_reaped,
    write_recipe,
)

from rlkit.testing.faults import KILL_PHASES

STEPS = 4
REAP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory) -> Path:
    """An uninterrupted run of the tiny recipe (keeps every checkpoint)."""
    model, data = assets
    out = tmp_path_factory.mktemp("reference") / "out"
    recipe = write_recipe(out.parent / "recipe.yaml", model, data, out, steps=STEPS, extra=GRADED_REWARD)
    result = run("run", str(recipe))
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_checkpoints(out) == list(range(1, STEPS + 1))
    # the update did something from step 1: a gradient, non-zero Adam moments
    steps = last_record_per_step(out)
    assert all(steps[s]["actor/grad_norm"] > 0 for s in steps), steps
    norms = moment_norms(optimizer_state(out / "checkpoints" / "global_step_1"))
    assert norms["exp_avg"] > 0 and norms["exp_avg_sq"] > 0, norms
    wait_until_reaped(ray_session(out), REAP_TIMEOUT_S)  # a clean exit leaves nothing either
    return out


def assert_matches_reference(out: Path, reference: Path) -> None:
    got, want = last_record_per_step(out), last_record_per_step(reference)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for step in want:
        diff = {
            k: (got[step].get(k), want[step].get(k))
            for k in set(got[step]) | set(want[step])
            if got[step].get(k) != want[step].get(k)
        }
        assert not diff, f"step {step} differs from the uninterrupted run: {diff}"
    # every checkpoint left equals the reference's, bit for bit: weights and
    for step in check_checkpoints(out):
        ours, theirs = (
            out / "checkpoints" / f"global_step_{step}",
            reference / "checkpoints" / f"global_step_{step}",
        )
        assert same_weights(ours, theirs)
        # Adam's exp_avg, exp_avg_sq, step
        differ = differing_tensors(optimizer_state(ours), optimizer_state(theirs))
        assert not differ, f"step {step}: optimizer state differs from the uninterrupted run: {differ[:10]}"


def kill_then_check(
    recipe: Path, out: Path, *, fault: str | None = None, delay_s: float | None = None
) -> dict:
    """One interrupted attempt: returns what happened (exit code, checkpoints, seconds to reap Ray)."""
    proc = start("run", str(recipe), fault=fault)
    if delay_s is not None:
        deadline = time.time() + delay_s
        while time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    result = finish(proc)
    info = {"fault": fault, "delay_s": delay_s, "rc": result.returncode}
    session_file = out / "ray_session.json"
    if session_file.exists() and ray_session(out)["driver_pid"] == proc.pid:  # the workers were up
        info["reap_s"] = round(wait_until_reaped(ray_session(out), REAP_TIMEOUT_S), 2)
    else:  # killed earlier: whatever Ray had started must be gone too
        for name in sessions_started_by(proc.pid):
            info["reap_s"] = round(wait_until_reaped({"session_dir": name}, REAP_TIMEOUT_S), 2)
    info["checkpoints"] = check_checkpoints(out)
    return info


# ~4-5 min; the default run keeps one SIGKILL + exact resume (tests/e2e/test_run.py) and the worker kill
# below
@pytest.mark.slow
def test_kill_chain_resumes_exactly(recipe, tmp_path, reference):
    """Three SIGKILLs in one run's life — mid-update, inside the checkpoint writer, mid-rollout — then a
    resume."""
    out = tmp_path / "out"
    path = recipe(out, steps=STEPS, extra=GRADED_REWARD)
    for fault, checkpoints in (("update_actor:2", [1]), ("checkpoint_write:3", [1, 2]), ("gen:4", [1, 2, 3])):
        info = kill_then_check(path, out, fault=fault)
        assert info["rc"] == -signal.SIGKILL, info
        assert info["checkpoints"] == checkpoints, info
        # the half-written step 3 is a .tmp- folder, never global_step_3
        if fault.startswith("checkpoint_write"):
            assert any(p.name.startswith(".tmp-global_step_3") for p in (out / "checkpoints").iterdir())
    result = run("run", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())  # removed at start
    assert_matches_reference(out, reference)


def next_kill_point(rng: random.Random, out: Path) -> tuple[str | None, float | None]:
    """A hook (random phase, random step after the newest checkpoint) or a timer at a random moment."""
    done = (check_checkpoints(out) or [0])[-1]
    if rng.random() < 0.5:
        return f"{rng.choice(KILL_PHASES)}:{rng.randint(done + 1, STEPS)}", None
    return None, rng.uniform(1.0, 20.0)


@pytest.mark.slow
def test_twenty_random_kill_points(recipe, tmp_path, reference):
    """`pytest -m slow tests/reliability -k random_kill`: 20 seeded kill points, zero corrupted checkpoints.

    A point is drawn after each attempt (so a hook's step is always still ahead); an attempt whose timer
    fired too late finishes the run, which then starts over from nothing. Seed: RLKIT_KILL_SEED (0).
    """
    out = tmp_path / "out"
    path = recipe(out, steps=STEPS, extra=GRADED_REWARD)
    rng = random.Random(int(os.environ.get("RLKIT_KILL_SEED", "0")))
    report: list[dict] = []
    while sum(r["rc"] == -signal.SIGKILL for r in report) < 20:
        assert len(report) < 40, report
        fault, delay = next_kill_point(rng, out)
        report.append(kill_then_check(path, out, fault=fault, delay_s=delay))
        if report[-1]["rc"] == 0:
            shutil.rmtree(out)
    result = run("run", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    (tmp_path.parent / "kill_report.txt").write_text("\n".join(map(str, report)) + "\n")
    print("\nkill report:", *report, sep="\n  ")
    assert_matches_reference(out, reference)


def test_worker_killed_mid_run_restarts_from_checkpoint(recipe, tmp_path, reference):
    """SIGKILL the actor's Ray worker after step 2: with trainer.max_restarts=1 the run restarts by itself."""
    out = tmp_path / "out"
    path = recipe(out, steps=STEPS, extra=GRADED_REWARD)
    proc = start("run", str(path), "trainer.max_restarts=1")
    wait_for_step(out, 2, proc)
    first = ray_session(out)
    os.kill(first["worker_pids"]["actor_rollout_ref"][0], signal.SIGKILL)
    result = finish(proc)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "role 'actor_rollout_ref', rank 0" in result.stderr and "worker process died" in result.stderr
    assert "restart 1 of 1 from the last good checkpoint is" in result.stderr
    wait_until_reaped(first, REAP_TIMEOUT_S)  # the dead attempt's cluster is gone ...
    wait_until_reaped(ray_session(out), REAP_TIMEOUT_S)  # ... and so is the restarted one's
    assert_matches_reference(out, reference)


@pytest.mark.slow  # the same message path is shown in the default run by the NaN test (test_faults.py)
def test_worker_killed_without_restarts_stops_naming_role_rank_and_checkpoint(recipe, tmp_path):
    out = tmp_path / "out"
    path = recipe(out, steps=STEPS, extra=GRADED_REWARD)
    proc = start("run", str(path))
    complete = out / "checkpoints" / "global_step_1" / "COMPLETE"
    while not complete.exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.02)
    session = ray_session(out)
    os.kill(session["worker_pids"]["actor_rollout_ref"][0], signal.SIGKILL)
    result = finish(proc)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" not in result.stderr.split("error: ", 1)[-1].split("---", 1)[0]
    error = result.stderr[result.stderr.index("error: ") :]
    assert "role 'actor_rollout_ref', rank 0" in error and "worker process died" in error
    latest = check_checkpoints(out)[-1]
    assert f"the last good checkpoint is {out / 'checkpoints' / f'global_step_{latest}'}" in error
    assert "Resume with trainer.resume=auto" in error
    wait_until_reaped(session, REAP_TIMEOUT_S)
