"""The copied MLflow store template (rlkit.runtime.mlflow_store): the same schema MLflow makes, never over an
existing store."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rlkit.runtime.mlflow_store import prepare_sqlite_store, template_path
from rlkit.runtime.tracking import MlflowTracker, TrackerConfig


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One template for the module (building it runs MLflow's migrations once)."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("rlkit-cache")
    mp.setenv("RLKIT_CACHE", str(root))
    yield root
    mp.undo()


def _clauses(sql: str | None) -> tuple:
    """A CREATE statement as its head and its top-level clauses, sorted.

    MLflow's batch migrations rebuild tables and may write the same constraints in another
    order from one run to the next (seen on CI), so the order of clauses is not compared.
    """
    if sql is None or "(" not in sql:
        return (sql,)
    head, body = sql.split("(", 1)
    body = body.rsplit(")", 1)[0]
    clauses, depth, current = [], 0, ""
    for char in body:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            clauses.append(current.strip())
            current = ""
        else:
            current += char
    clauses.append(current.strip())
    return (head.strip(), *sorted(clauses))


def _schema(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        version = conn.execute("SELECT version_num FROM alembic_version").fetchall()
    conn.close()
    return [(kind, name, _clauses(sql)) for kind, name, sql in rows] + version


def test_copied_store_has_mlflows_own_schema_and_default_experiment(cache, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    own = tmp_path / "own.db"
    MlflowClient(tracking_uri=f"sqlite:///{own}").search_experiments()  # MLflow migrates a new store itself
    copied = tmp_path / "run" / "mlflow.db"
    assert prepare_sqlite_store(copied)
    assert template_path().is_file() and str(template_path()).startswith(str(cache))
    assert _schema(copied) == _schema(own)
    default = MlflowClient(tracking_uri=f"sqlite:///{copied}").get_experiment("0")
    assert default.name == "Default" and default.artifact_location == str(tmp_path / "mlruns" / "0")
    assert not list(copied.parent.glob(".*partial"))  # the temporary copy is gone


def test_an_existing_store_is_never_replaced(cache, tmp_path):
    config = TrackerConfig(project="p", experiment="e", output_dir=tmp_path / "out", total_steps=1)
    first = MlflowTracker(config)
    first.log({"x": 1.0}, 1)
    store = tmp_path / "mlflow.db"
    before = store.read_bytes()
    assert not prepare_sqlite_store(store)
    assert store.read_bytes() == before
    second = MlflowTracker(
        TrackerConfig(project="p", experiment="e2", output_dir=tmp_path / "out2", total_steps=1)
    )
    assert second.client.get_run(first.run_id).data.metrics == {"x": 1.0}  # same store, first run kept


def test_without_a_usable_cache_mlflow_makes_the_store_itself(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("RLKIT_CACHE", str(blocker))  # the template cannot be written under a file
    assert not prepare_sqlite_store(tmp_path / "a" / "mlflow.db")
    tracker = MlflowTracker(
        TrackerConfig(project="p", experiment="e", output_dir=tmp_path / "a" / "out", total_steps=1)
    )
    tracker.log({"y": 2.0}, 1)
    assert tracker.client.get_run(tracker.run_id).data.metrics == {"y": 2.0}
