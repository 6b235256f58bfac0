"""Trackers against a real MLflow SQLite store and real files."""

from __future__ import annotations

import json

import pytest

from rlkit.runtime.tracking import JsonlTracker, MlflowTracker, TrackerConfig, Tracking, flatten


@pytest.fixture
def config(tmp_path):
    return TrackerConfig(
        project="proj", experiment="exp", output_dir=tmp_path / "proj" / "exp", total_steps=3
    )


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": None}) == {"a.b": 1, "a.c.d": [1], "e": None}


def test_mlflow_records_params_metrics_text_and_resumes(config):
    tracker = MlflowTracker(config)
    tracker.log_params({"actor": {"optim": {"lr": 1e-6}}})
    tracker.log({"critic/score/mean": 0.5, "val-core/x/acc/mean@4": 0.25}, step=1)
    tracker.log_text("a table", "generations/step_1.txt")
    tracker.finish()
    assert tracker.uri.startswith("sqlite:///")

    config.run_ids = {"mlflow": tracker.run_id}
    resumed = MlflowTracker(config)
    assert resumed.run_id == tracker.run_id
    resumed.log_params({"actor": {"optim": {"lr": 1e-6}}})  # already there: not an error
    resumed.log({"critic/score/mean": 0.75}, step=2)
    resumed.finish()

    run = resumed.client.get_run(tracker.run_id)
    assert run.data.params["actor.optim.lr"] == "1e-06"
    history = resumed.client.get_metric_history(tracker.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert run.data.metrics["val-core/x/acc/mean_4"] == 0.25  # '@' is not allowed by MLflow
    assert [a.path for a in resumed.client.list_artifacts(tracker.run_id, "generations")] == [
        "generations/step_1.txt"
    ]


def test_jsonl_appends_records(config):
    tracker = JsonlTracker(config)
    tracker.log({"a": 1.0}, 1)
    tracker.log({"a": float("nan")}, 2)
    lines = [json.loads(line) for line in tracker.path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["a"] == "nan"


def test_jsonl_params_of_later_calls_join_the_earlier_ones(config):
    """The run logs its recipe and resolved settings first and, once the workers are up, what they started
    with (``resolved.allocator_in_workers``): params.json holds both, nested keys merged, a later value
    winning."""
    tracker = JsonlTracker(config)
    tracker.log_params(
        {"rollout": {"n": 4}, "resolved": {"allocator": "keep_freed", "decode_dtype": "float32"}}
    )
    tracker.log_params({"resolved": {"allocator_in_workers": "yes", "decode_dtype": "float16"}})
    params = json.loads((tracker.path.parent / "params.json").read_text())
    assert params == {
        "rollout": {"n": 4},
        "resolved": {"allocator": "keep_freed", "decode_dtype": "float16", "allocator_in_workers": "yes"},
    }


def test_failing_tracker_is_reported_once_and_counted(config, caplog):
    good = JsonlTracker(config)
    store = config.output_dir.parent / "mlflow.db"
    broken = MlflowTracker(config)
    store.unlink()  # the store disappears under a live run
    store.mkdir()  # and a folder takes its place: every write fails
    tracking = Tracking([broken, good])
    with caplog.at_level("WARNING"):
        tracking.log({"x": 1.0}, 1)
        tracking.log({"x": 2.0}, 2)
    assert tracking.errors == {"mlflow": 2}
    assert sum("tracker 'mlflow' failed" in r.message for r in caplog.records) == 1
    lines = [json.loads(line) for line in good.path.read_text().splitlines()]
    assert lines[-1]["tracking/errors"] == 1.0 and lines[-1]["x"] == 2.0
