"""Numerical blow-ups, a full disk and a broken MLflow store, each in a real `rlkit run`.

A "gate" score file (``GATE_SCORE``) holds the run at step 2's reward until the test has set the fault up
(the limit on the file size, the database lock): no timing race with steps that take 0.2 s.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psutil
import pytest
from rlkit_harness import (
    check_checkpoints,
    finish,
    last_record_per_step,
    ray_session,
    run,
    same_weights,
    start,
    wait_until_reaped,
)

GATE_SCORE = """\
import time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # step 2 (checkpoint 1 exists) waits until the test opens the gate
    while Path({ckpt!r}).exists() and not Path({gate!r}).exists():
        time.sleep(0.05)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""


def gated(tmp_path: Path, out: Path) -> tuple[str, Path]:
    """Recipe lines for the gate score, and the gate file to create."""
    gate = tmp_path / "gate"
    score = tmp_path / "gate_score.py"
    score.write_text(
        GATE_SCORE.format(ckpt=str(out / "checkpoints" / "global_step_1" / "COMPLETE"), gate=str(gate))
    )
    return f"reward: {{custom_score: {{path: {score}}}}}\n", gate


def wait_for(path: Path, proc, timeout: float = 240) -> None:
    import time

    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None and time.time() < deadline, f"{path} did not appear (rc={proc.poll()})"
        time.sleep(0.05)


def test_nan_and_inf_updates_are_skipped_counted_then_stop_the_run(recipe, tmp_path):
    """NaN advantages at step 2, inf at 4 and NaN at 5, with actor.max_nonfinite_in_row=2: steps 2 and 4 are
    skipped (weights unchanged, counted), step 3 trains, step 5 is the 2nd in a row and stops the run."""
    out = tmp_path / "out"
    path = recipe(out, steps=5)
    result = run("run", str(path), "actor.max_nonfinite_in_row=2", fault="nan_adv:2,inf_adv:4,nan_adv:5")
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error: ") :]
    assert "2 non-finite losses or gradient norms in a row (actor.max_nonfinite_in_row = 2)" in error
    assert "role 'actor_rollout_ref', rank 0, method 'update_actor'" in error
    assert f"the last good checkpoint is {out / 'checkpoints' / 'global_step_4'}" in error
    skips = {step: r["actor/nonfinite_skips"] for step, r in last_record_per_step(out).items()}
    assert skips == {1: 0.0, 2: 1.0, 3: 1.0, 4: 2.0}
    ckpt = out / "checkpoints"
    assert check_checkpoints(out) == [1, 2, 3, 4]
    assert same_weights(ckpt / "global_step_1", ckpt / "global_step_2")  # the NaN update was not applied
    assert not same_weights(ckpt / "global_step_2", ckpt / "global_step_3")  # a finite one was
    assert same_weights(ckpt / "global_step_3", ckpt / "global_step_4")  # the inf one was not
    wait_until_reaped(ray_session(out))


# 53 s quiet (two checkpoints, a gated worker); `nox -s slow`: the default run keeps its 20-min budget
@pytest.mark.slow
def test_disk_full_during_a_checkpoint_keeps_the_previous_one_and_says_so(recipe, tmp_path):
    """RLIMIT_FSIZE = 1 MiB on the driver and the worker (prlimit, after Ray started: Ray's object store
    file must stay unlimited) makes the 2.2 MB model shard of checkpoint 2 fail as a full disk would."""
    out = tmp_path / "out"
    extra, gate = gated(tmp_path, out)
    path = recipe(out, steps=2, extra=extra)
    proc = start("run", str(path))
    wait_for(out / "checkpoints" / "global_step_1" / "COMPLETE", proc)
    session = ray_session(out)
    limit = 1 << 20
    for pid in [proc.pid, *session["worker_pids"]["actor_rollout_ref"]]:
        psutil.Process(pid).rlimit(psutil.RLIMIT_FSIZE, (limit, limit))
    gate.touch()
    result = finish(proc)
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error: ") :]
    assert f"could not write the checkpoint of step 2 under {out / 'checkpoints'}" in error
    assert f"the previous checkpoint {out / 'checkpoints' / 'global_step_1'} is intact" in error
    assert "Free disk space" in error and "Traceback" not in error
    assert check_checkpoints(out) == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["global_step_1"]  # no partial folder
    wait_until_reaped(session)
    # space freed: the same command resumes from step 1 and finishes
    result = run("run", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert check_checkpoints(out) == [1, 2]


def test_unwritable_mlflow_store_training_goes_on_errors_reported_once_and_counted(recipe, tmp_path):
    out = tmp_path / "out"
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the store's folder should be")
    path = recipe(out, steps=3, backends="jsonl, mlflow")
    result = run("run", str(path), f"tracking.mlflow_uri=sqlite:///{blocker}/mlflow.db")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("tracker 'mlflow' failed") == 1, result.stderr[-3000:]
    errors = [r.get("tracking/errors") for _, r in sorted(last_record_per_step(out).items())]
    assert errors[0] >= 1 and errors == sorted(errors) and errors[-1] > errors[0]  # counted, every step
    assert check_checkpoints(out) == [1, 2, 3]


@pytest.mark.slow  # each failing MLflow call waits out SQLite's busy timeout
def test_locked_mlflow_store_mid_run_training_goes_on(recipe, tmp_path):
    out = tmp_path / "out"
    extra, gate = gated(tmp_path, out)
    path = recipe(out, steps=3, backends="jsonl, mlflow", extra=extra)
    proc = start("run", str(path))
    wait_for(out / "checkpoints" / "global_step_1" / "COMPLETE", proc)
    lock = sqlite3.connect(out.parent / "mlflow.db", timeout=30)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # every other writer (and reader) now gets "database is locked"
        gate.touch()
        result = finish(proc)
    finally:
        lock.rollback()
        lock.close()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("tracker 'mlflow' failed") == 1, result.stderr[-3000:]
    records = last_record_per_step(out)
    # step 2's log is the first to fail (its jsonl record is written first); step 3's record carries the count
    assert "tracking/errors" not in records[2] and records[3]["tracking/errors"] >= 1
    assert check_checkpoints(out) == [1, 2, 3]


def test_fault_plans_are_armed_only_by_the_test_entry(capsys):
    """The kill and poison hooks live in rlkit.testing.faults; production modules read no fault variable and
    import no test machinery; a typo in a plan is refused (exit 2) instead of silently testing nothing."""
    from rlkit.testing.faults import FaultHooks, main

    src = Path(__import__("rlkit").__file__).parent
    for path in src.rglob("*.py"):
        if "testing" in path.relative_to(src).parts:
            continue
        text = path.read_text()
        assert "RLKIT_FAULT" not in text and "from rlkit.testing" not in text, path
    assert main(["gen:1,update_actr:2", "--", "run", "recipe.yaml"]) == 2
    assert (
        "bad entry 'update_actr:2'; use <phase>:<step> with a phase of gen, reward" in capsys.readouterr().err
    )
    assert main(["gen:1", "run", "recipe.yaml"]) == 2 and "usage:" in capsys.readouterr().err
    import torch

    hooks = FaultHooks("nan_adv:2,inf_adv:5")
    assert torch.isnan(hooks.advantages(torch.zeros(2), 2)).all()
    assert torch.isinf(hooks.advantages(torch.zeros(2), 5)).all()
    assert torch.equal(hooks.advantages(torch.zeros(2), 3), torch.zeros(2))
