"""A pipeline run in MLflow and Prefect: the MLflow client and runs of each stage, Prefect artifacts and
events, hand-off of files between workers, the store lock, and the stages' Prefect task decorator (cache keys).
Must not import: torch, transformers, a stage.

Callers import from this package; the modules behind it may move (``_EXPORTS`` maps each name to its module).
"""

from tasks import lazy_surface

# name -> the module behind this package that defines it
_EXPORTS = {
    "RegistryError": "client",
    "client_for": "client",
    "announce_skipped": "events",
    "emit_champion_event": "events",
    "emit_pipeline_event": "events",
    "runs_closed_on_termination": "events",
    "handoff_download": "handoff",
    "handoff_upload": "handoff",
    "LockTimeout": "locks",
    "file_lock": "locks",
    "local_store_path": "locks",
    "lock_file_for": "locks",
    "bar_safe_console": "progress",
    "work_bar": "progress",
    "publish_markdown": "reporting",
    "publish_table": "reporting",
    "tracked_stage": "reporting",
    "RUN_ID_TAG": "runs",
    "STAGE_TAG": "runs",
    "StageRun": "runs",
    "Tracker": "runs",
    "close_pipeline": "runs",
    "experiment_for": "runs",
    "finish_pipeline": "runs",
    "finished_parent_run": "runs",
    "last_completed_run": "runs",
    "run_page": "runs",
    "start_pipeline": "runs",
    "record_validated_data": "runs",
    "DataSplit": "lineage",
    "log_splits": "lineage",
    "validated_splits": "lineage",
    "prefect_task": "stage_task",
    "stage_cache_key": "stage_task",
}
__getattr__, __dir__, __all__ = lazy_surface(__name__, _EXPORTS)
