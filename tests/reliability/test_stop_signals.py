"""Stop means stop: SIGINT / SIGTERM in each phase of a real `rlkit run`, and a second Ctrl-C.

What must hold after every stop: exit code 130 (SIGINT) or 143 (SIGTERM); no checkpoint folder of the
interrupted step (every ``global_step_*`` left is complete and loads); a message naming the checkpoint
a resume will use; the MLflow run marked KILLED; no process of the run's Ray session left (every pid in
ray_session.json, the Ray agents included). Seconds are measured and printed (docs/reliability.md); the
asserted bounds are only hang guards.

How a phase is held: a gate score file blocks the first scoring call it sees until the test opens the
gate. Meanwhile the test SIGSTOPs the actor's worker process, so the driver's next worker call (the
training rollout after validation, or the update after the reward) waits on a rank that never answers:
a hung-but-alive worker, which the watchdog must report by role and rank.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from rlkit_harness import check_checkpoints, ray_session, rlkit_env, wait_until_reaped

EXIT_GUARD_S = 30.0  # hang guard only; the measured times are printed
REAP_GUARD_S = 30.0

GATE_SCORE = """\
import time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the first call after {after!r} exists (or the first call at all) waits for the gate
    if Path({after!r}).exists() and not Path({gate!r}).exists():
        Path({waiting!r}).touch()
        while not Path({gate!r}).exists():
            time.sleep(0.05)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0
"""

WATCHDOG = "  watchdog: {first_slow_s: 2.0, ping_after_s: 1.0, ping_timeout_s: 1.0}\n"


class Run:
    """`python -m rlkit run` with its stderr in a file the test can read while it runs."""

    def __init__(self, recipe: Path, out: Path, tmp_path: Path, *overrides: str):
        self.out = out
        self.log = tmp_path / "stderr.txt"
        self.gate, self.waiting = tmp_path / "gate", tmp_path / "waiting"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlkit", "run", str(recipe), *overrides],
            env=rlkit_env(),
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
        )

    def stderr(self) -> str:
        return self.log.read_text()

    def wait_for(self, what, description: str, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while not what():
            assert self.proc.poll() is None, (
                f"the run ended (rc={self.proc.returncode}) before {description}:\n{self.stderr()[-3000:]}"
            )
            assert time.time() < deadline, f"no {description} within {timeout} s:\n{self.stderr()[-3000:]}"
            time.sleep(0.05)

    def hold_worker(self) -> list[int]:
        """Once the gate holds the driver: SIGSTOP the actor's worker, then open the gate."""
        self.wait_for(self.waiting.exists, "scoring call at the gate")
        pids = ray_session(self.out)["worker_pids"]["actor_rollout_ref"]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self.gate.touch()
        return pids

    def stop(self, *signums: int, gap_s: float = 0.0) -> tuple[int, float]:
        """Send the signal(s); returns (exit code, seconds from the first signal to the exit)."""
        t0 = time.monotonic()
        for i, signum in enumerate(signums):
            if i:
                time.sleep(gap_s)
            self.proc.send_signal(signum)
        try:
            rc = self.proc.wait(EXIT_GUARD_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"rlkit did not stop within {EXIT_GUARD_S} s:\n{self.stderr()[-3000:]}"
            ) from None
        return rc, time.monotonic() - t0


def gated_recipe(
    recipe, assets, tmp_path: Path, out: Path, *, after: Path | None = None, val: bool = False, **kw
) -> Path:
    """The tiny recipe with the gate score (``after``: a file that arms the gate; default: armed at once),
    MLflow tracking and a watchdog with short limits; ``val``: validate before training."""
    score = tmp_path / "gate_score.py"
    score.write_text(
        GATE_SCORE.format(
            after=str(after or tmp_path), gate=str(tmp_path / "gate"), waiting=str(tmp_path / "waiting")
        )
    )
    path = recipe(out, backends="jsonl, mlflow", extra=f"reward: {{custom_score: {{path: {score}}}}}\n", **kw)
    text = path.read_text().replace("trainer:\n", "trainer:\n" + WATCHDOG)
    if val:
        text = text.replace(
            "  train_batch_size: 2\n", f"  train_batch_size: 2\n  val_files: [{assets[1] / 'test.parquet'}]\n"
        )
        text = text.replace("val_before_train: false", "val_before_train: true")
    path.write_text(text)
    return path


def mlflow_status(out: Path) -> list[str]:
    with sqlite3.connect(out.parent / "mlflow.db") as db:
        return [row[0] for row in db.execute("SELECT status FROM runs")]


def check_stopped(run: Run, rc: int, seconds: float, signum: int, session: dict, label: str) -> float:
    """The common promises; returns the seconds until the session's last process was gone."""
    err = run.stderr()
    assert rc == 128 + signum, f"rc={rc}:\n{err[-3000:]}"
    assert f"{signal.Signals(signum).name} received" in err, err[-3000:]
    assert "Traceback" not in err.split(f"{signal.Signals(signum).name} received", 1)[1], err[-3000:]
    t0 = time.monotonic()
    reap_s = wait_until_reaped(session, REAP_GUARD_S)
    assert mlflow_status(run.out) == ["KILLED"]
    print(
        f"\n{label}: exit {seconds:.2f} s after the signal; Ray session empty {seconds + reap_s:.2f} s after "
        f"it (measured {time.monotonic() - t0:.2f} s after the exit)"
    )
    return reap_s


def test_sigint_during_generation_with_a_hung_worker(recipe, assets, tmp_path):
    """Validation's scoring holds the run, the worker is SIGSTOPped, the training rollout waits on it: the
    watchdog names the slow phase and the rank that does not answer a ping; Ctrl-C stops the run."""
    out = tmp_path / "out"
    path = gated_recipe(recipe, assets, tmp_path, out, val=True)
    run = Run(path, out, tmp_path)
    run.hold_worker()
    run.wait_for(lambda: "does not answer a liveness ping" in run.stderr(), "hung-worker report")
    run.wait_for(lambda: "phase 'gen' of step 1 has run" in run.stderr(), "slow-phase report")
    session = ray_session(out)
    rc, seconds = run.stop(signal.SIGINT)
    err = run.stderr()
    assert "role 'actor_rollout_ref', rank 0 does not answer a liveness ping within 1 s (pid" in err
    assert (
        "role 'actor_rollout_ref', method 'generate_sequences'" in err and "rank(s) [0] still working" in err
    )
    assert "SIGINT received during phase 'gen' of step 1" in err
    assert (
        f"no checkpoint exists under {out / 'checkpoints'}: running the same command starts from the "
        "beginning" in err
    )
    check_stopped(run, rc, seconds, signal.SIGINT, session, "SIGINT in gen (hung worker)")
    assert check_checkpoints(out) == []


def test_sigint_during_the_update_names_the_resume_checkpoint(recipe, assets, tmp_path):
    out = tmp_path / "out"
    ckpt1 = out / "checkpoints" / "global_step_1" / "COMPLETE"
    path = gated_recipe(recipe, assets, tmp_path, out, after=ckpt1, steps=3)
    run = Run(path, out, tmp_path)
    run.hold_worker()  # step 2's reward holds; the update of step 2 then waits on the stopped worker
    run.wait_for(lambda: "phase 'update_actor' of step 2 has run" in run.stderr(), "slow-phase report")
    session = ray_session(out)
    rc, seconds = run.stop(signal.SIGINT)
    assert "SIGINT received during phase 'update_actor' of step 2" in run.stderr()
    assert f"running the same command resumes from {out / 'checkpoints' / 'global_step_1'}" in run.stderr()
    check_stopped(run, rc, seconds, signal.SIGINT, session, "SIGINT in update_actor (hung worker)")
    assert check_checkpoints(out) == [1]


def test_sigterm_during_reward_scoring(recipe, assets, tmp_path):
    """Step 4's scoring hangs (the worker is fine). The reward phase has 3 earlier runs, so the watchdog
    compares it with their median (limit max(1 s, 5 × median)); SIGTERM then stops the run: exit 143."""
    out = tmp_path / "out"
    ckpt3 = out / "checkpoints" / "global_step_3" / "COMPLETE"
    path = gated_recipe(recipe, assets, tmp_path, out, after=ckpt3, steps=5)
    path.write_text(
        path.read_text().replace("first_slow_s: 2.0", "first_slow_s: 2.0, slow_min_s: 1.0, slow_factor: 5.0")
    )
    run = Run(path, out, tmp_path)
    run.wait_for(run.waiting.exists, "scoring call at the gate")
    run.wait_for(lambda: "phase 'reward' of step 4 has run" in run.stderr(), "slow-phase report")
    assert "= max(1 s, 5 × its median" in run.stderr() and "of the last 3 runs" in run.stderr()
    assert "The driver is not waiting on any worker (it is working itself)." in run.stderr()
    session = ray_session(out)
    rc, seconds = run.stop(signal.SIGTERM)
    assert "SIGTERM received during phase 'reward' of step 4" in run.stderr()
    assert f"running the same command resumes from {out / 'checkpoints' / 'global_step_3'}" in run.stderr()
    check_stopped(run, rc, seconds, signal.SIGTERM, session, "SIGTERM in reward")
    assert check_checkpoints(out) == [1, 2, 3]


def test_second_sigint_kills_at_once(recipe, assets, tmp_path):
    out = tmp_path / "out"
    ckpt1 = out / "checkpoints" / "global_step_1" / "COMPLETE"
    path = gated_recipe(recipe, assets, tmp_path, out, after=ckpt1, steps=3)
    run = Run(path, out, tmp_path)
    run.hold_worker()
    session = ray_session(out)
    rc, seconds = run.stop(signal.SIGINT, signal.SIGINT, gap_s=0.2)
    assert "SIGINT received again; killing the run's processes and exiting" in run.stderr()
    assert f"running the same command resumes from {out / 'checkpoints' / 'global_step_1'}" in run.stderr()
    check_stopped(run, rc, seconds, signal.SIGINT, session, "double SIGINT")
    assert check_checkpoints(out) == [1]
