"""No silent hang in scoring: a score function that never returns, in a real `rlkit run`, under the default
``naive`` manager (a per-sample timeout) and under ``batch`` (one timeout for the batch's call).

The hung worker and the slow-phase report are shown in test_stop_signals.py (a SIGSTOPped worker is reported
by role and rank while the run waits on it).
"""

from __future__ import annotations

import pytest
from rlkit_harness import check_checkpoints, last_record_per_step, ray_session, run, wait_until_reaped

HANG_ONCE = """\
import time
from pathlib import Path

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    marker = Path({marker!r})
    if not marker.exists():  # the run's first scoring call hangs (as a stuck network judge would)
        marker.touch()
        time.sleep(3600)
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.0


def compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos):  # the batch manager's form
    return [compute_score(*args) for args in zip(data_sources, solution_strs, ground_truths, extra_infos)]
"""


# the batch half (same scoring pool, a whole call timed out) runs in the slow suite to keep the default run
# short
@pytest.mark.parametrize(
    ("manager", "timeouts"), [("naive", 1.0), pytest.param("batch", 4.0, marks=pytest.mark.slow)]
)
def test_a_hanging_scorer_costs_one_timeout_and_is_counted(recipe, tmp_path, manager, timeouts):
    """Step 1's first call hangs: ``naive`` gives that one sample the default score, ``batch`` all 4 samples
    of the call (2 prompts × 2 responses); both finish the step, count it in reward/timeouts and run on."""
    out = tmp_path / "out"
    score = tmp_path / "hang_once.py"
    score.write_text(HANG_ONCE.format(marker=str(tmp_path / "hung")))
    name = "compute_score_batch" if manager == "batch" else "compute_score"
    # a whole batch timed out is 100% failed scores: past the default reward.max_error_fraction (0.5), so the
    # batch case opts out of the stop to show the timeout alone; naive's 1 of 4 stays under the default
    fraction = ", max_error_fraction: 1.0" if manager == "batch" else ""
    path = recipe(
        out,
        steps=2,
        extra=f"reward: {{custom_score: {{path: {score}, name: {name}}}, manager: {manager}, "
        f"timeout_s: 1.0, default_score: -1.0{fraction}}}\n",
    )
    result = run("run", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    records = last_record_per_step(out)
    assert records[1]["reward/timeouts"] == timeouts and records[2]["reward/timeouts"] == 0.0, records
    assert records[1]["reward/errors"] == 0.0
    assert "did not return within reward.timeout_s=1 s" in result.stderr
    assert check_checkpoints(out) == [1, 2]
    wait_until_reaped(ray_session(out))
