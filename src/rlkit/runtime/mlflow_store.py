"""A new embedded MLflow store (SQLite) in a fraction of a second: copied from a migrated, empty template.

MLflow builds a new SQLite store by running every one of its schema migrations (Alembic), which takes
seconds (docs/benchmarks.md, "Numbers moved out of the code"), and a run pays it again in every new output
folder (each test, each quickstart run).
``prepare_sqlite_store(path)`` copies an empty store that was migrated once per MLflow version and kept in
``$RLKIT_CACHE/mlflow-template/`` instead; the copy is byte for byte what MLflow would have made, except that
its ``Default`` experiment (id 0, which rlkit never logs to) gets the artifact location MLflow would give it
here (``./mlruns/0`` of the working folder).

Safety: an existing store is never touched; the copy lands under a temporary name and is linked into place
only if no store appeared meanwhile (two runs sharing a folder cannot overwrite each other); any failure
(no cache folder, a read-only disk, an MLflow without SQLAlchemy) leaves the path alone, and MLflow then
creates the store itself as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from pathlib import Path

__all__ = ["prepare_sqlite_store", "template_path"]

logger = logging.getLogger(__name__)


def template_path() -> Path:
    """Where this MLflow version's empty, migrated store is kept."""
    import mlflow

    cache = Path(os.environ.get("RLKIT_CACHE", Path.home() / ".cache" / "rlkit"))
    return cache / "mlflow-template" / f"mlflow-{mlflow.__version__}.db"


def _build_template(template: Path) -> None:
    """Let MLflow create and migrate a store in a temporary folder, then move it to ``template``
    atomically."""
    from mlflow.tracking import MlflowClient

    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        db = Path(tmp) / "store.db"
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments(max_results=1)
        os.replace(db, template)


def prepare_sqlite_store(path: Path) -> bool:
    """Put an empty, migrated MLflow store at ``path`` unless one exists; True when it was copied."""
    if path.exists():
        return False
    try:
        template = template_path()
        if not template.is_file():
            _build_template(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        shutil.copyfile(template, partial)
        # the Default experiment's artifacts as MLflow would place them
        with sqlite3.connect(partial) as conn:
            conn.execute(
                "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                (str(Path.cwd() / "mlruns" / "0"),),
            )
        conn.close()
        try:
            os.link(partial, path)  # fails if a store appeared meanwhile: that one is kept
        finally:
            partial.unlink(missing_ok=True)
        return True
    except Exception as err:  # noqa: BLE001 - MLflow creates the store itself, as without a template
        logger.debug("MLflow store template not used for %s: %s", path, err)
        return False
