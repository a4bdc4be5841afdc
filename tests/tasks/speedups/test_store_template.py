"""A new local store seeded from the empty template is the store MLflow would have made: same tables and
revision, the Default experiment created by MLflow where it would put it, nothing left behind on failure."""

import sqlite3
from pathlib import Path

from mlflow.tracking import MlflowClient

from tasks.speedups.store_template import _template_path, seed_new_store


def _tables(db: Path) -> dict[str, list[str]]:
    """Each table's and index's definition, its lines sorted (MLflow's own migrations order a table's
    constraints differently from one new store to the next)."""
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table', 'index')")
        return {name: sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()) for name, sql in rows}


def _experiments(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as connection:
        return connection.execute(
            "SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments"
        ).fetchall()


def test_a_seeded_store_is_the_store_mlflow_makes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow puts the Default experiment's artifacts under the working folder
    made, seeded = tmp_path / "made" / "mlflow.db", tmp_path / "seeded" / "mlflow.db"
    for db in (made, seeded):
        if db == seeded:
            assert seed_new_store(db) and db.is_file()
        client = MlflowClient(tracking_uri=f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
        client.search_experiments(max_results=1)
        client.search_registered_models(max_results=1)
        client.create_run(client.create_experiment("work"))
    assert _tables(seeded) == _tables(made)
    assert _experiments(seeded) == _experiments(made)  # Default (0, made by MLflow on open) and "work" (1)
    with sqlite3.connect(seeded) as a, sqlite3.connect(made) as b:
        assert (
            a.execute("SELECT * FROM alembic_version").fetchall()
            == b.execute("SELECT * FROM alembic_version").fetchall()
        )


def test_an_existing_store_is_never_touched_and_a_stale_template_is_not_used(tmp_path: Path, monkeypatch) -> None:
    existing = tmp_path / "mlflow.db"
    existing.write_bytes(b"not mine to replace")
    assert not seed_new_store(existing) and existing.read_bytes() == b"not mine to replace"
    monkeypatch.setenv("GRPOFLOW_CACHE", str(tmp_path / "cache"))
    seed_new_store(tmp_path / "first" / "mlflow.db")  # makes this cache's template
    with sqlite3.connect(_template_path()) as connection:
        connection.execute("UPDATE alembic_version SET version_num = 'older'")
    fresh = tmp_path / "second" / "mlflow.db"
    assert not seed_new_store(fresh) and not fresh.exists()  # MLflow will create it itself
    monkeypatch.setenv("GRPOFLOW_STORE_TEMPLATE", "0")
    assert not seed_new_store(tmp_path / "third" / "mlflow.db")
