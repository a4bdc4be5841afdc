"""A new local MLflow store (SQLite) seeded from an empty, migrated copy instead of MLflow running its ~60
schema migrations on every new store (about 3 s on this machine; every output folder, and every test, has one).

The copy is made once per MLflow release by MLflow itself (a store opened in a temporary folder), then emptied of
its one row, the Default experiment, so that MLflow creates that experiment when it opens the seeded store, with
the artifact location and time it would give it anyway. It reaches into MLflow's schema (the ``experiments``
tables, the Alembic revision), so it lives here: it seeds only when the copy's revision is the head revision of
the MLflow installed, and on any failure it leaves no file and MLflow creates the store the public way.
Must not import (at module import): MLflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)


def _template_path() -> Path:
    from tasks.models.sources import cache_dir

    return cache_dir() / "mlflow-stores" / f"empty-mlflow-{metadata.version('mlflow-skinny')}.db"


def _revision(db: Path) -> str | None:
    with sqlite3.connect(db) as connection:
        row = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    return row[0] if row else None


def _head_revision() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision

    return _get_latest_schema_revision()


def _make_template(path: Path) -> None:
    """MLflow creates a store in a temporary folder; its Default experiment is removed (MLflow adds it back on
    open), and the file is moved into place whole."""
    from mlflow.tracking import MlflowClient

    with tempfile.TemporaryDirectory() as folder:
        db = Path(folder) / "mlflow.db"
        client = MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)
        with sqlite3.connect(db) as connection:
            connection.execute("DELETE FROM experiment_tags WHERE experiment_id = 0")
            connection.execute("DELETE FROM experiments WHERE experiment_id = 0")
            remaining = connection.execute("SELECT COUNT(*) FROM experiments").fetchone()[0]
        if remaining:
            raise RuntimeError(f"a new store holds {remaining} experiments besides the Default one")
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f".{path.name}.{os.getpid()}")
        shutil.copyfile(db, staging)
        os.replace(staging, path)


def seed_new_store(db: Path) -> bool:
    """Put an empty, migrated store at ``db`` (which does not exist yet); False (and no file) where the copy
    cannot be made or does not match the installed MLflow: MLflow then creates the store itself."""
    if db.exists() or os.environ.get("GRPOFLOW_STORE_TEMPLATE", "1") == "0":
        return False
    try:
        template = _template_path()
        if not template.is_file():
            _make_template(template)
        if _revision(template) != _head_revision():
            logger.debug("store template %s is not at MLflow's head revision; MLflow creates the store", template)
            return False
        db.parent.mkdir(parents=True, exist_ok=True)
        staging = db.with_name(f".{db.name}.seed")
        shutil.copyfile(template, staging)
        os.replace(staging, db)
        return True
    except Exception as error:  # noqa: BLE001 - any failure: the public path creates the store
        logger.debug("store template not used (%s: %s); MLflow creates the store", type(error).__name__, error)
        db.with_name(f".{db.name}.seed").unlink(missing_ok=True)
        return False
