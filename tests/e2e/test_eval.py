"""``rlkit eval`` of an rlkit checkpoint agrees with the training run's own validation of that checkpoint.

The e2e recipe's run (``straight_run``: 4 steps, validation before training and at the end, greedy n=1, a
checkpoint per step) validates the final weights at step 4; ``rlkit eval`` of
``checkpoints/global_step_4`` with the run's recipe samples the same way. Its mean score equals the run's
last ``val-core`` metric, and its responses are the ones in the run's generations table of step 4.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
from rlkit_harness import records
from rlkit_harness import run as run_rlkit

KEY = "val-core/rlkit/arithmetic/score/mean@1"


def _table_responses(text: str) -> list[str]:
    """The response column of a generations table (``| prompt | response | score |``)."""
    rows = [line for line in text.splitlines()[2:] if line.startswith("| ")]
    return [line.rsplit(" | ", 2)[1] for line in rows]


def test_eval_of_a_checkpoint_matches_the_runs_last_validation(straight_run, tiny_assets, tmp_path):
    result, out = straight_run
    assert result.returncode == 0, result.stderr[-3000:]
    _, data = tiny_assets
    last = [r for r in records(out) if KEY in r][-1]
    assert last["step"] == 4

    target = tmp_path / "eval"
    checkpoint = out / "checkpoints" / "global_step_4"
    evaluated = run_rlkit(
        "eval",
        str(checkpoint),
        "--data",
        str(data / "test.parquet"),
        "--recipe",
        str(out.parent / "recipe.yaml"),
        "--out",
        str(target),
        "--no-progress",
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads((target / "results.json").read_text())
    assert results["model_kind"] == "checkpoint" and results["sampling"]["do_sample"] is False
    assert results["metrics"][KEY]["value"] == last[KEY]
    assert (target / "merged" / "config.json").is_file()

    from mlflow.tracking import MlflowClient

    info = json.loads((out / "run_info.json").read_text())
    client = MlflowClient(info["mlflow_uri"])
    local = client.download_artifacts(info["run_ids"]["mlflow"], "generations/step_4.md", str(tmp_path))
    logged = _table_responses(open(local).read())
    generated = pq.read_table(target / "generations.parquet").column("response").to_pylist()
    assert len(logged) == 8
    assert logged == [r.replace("|", "\\|").replace("\n", "<br>") for r in generated[: len(logged)]]
