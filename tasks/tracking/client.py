"""The MLflow client of a tracking store, opened once per URI, and the one error for a store that failed.
Must not import: torch, transformers, Prefect; MLflow only inside functions.
"""

from __future__ import annotations

import errno
import functools
from typing import Any

from tasks.errors import InfrastructureError, is_disk_full
from tasks.layout import OutputDirError


class RegistryError(InfrastructureError, RuntimeError):
    """The MLflow store or registry could not be reached or refused a change; nothing was half-moved."""


@functools.lru_cache(maxsize=16)
def client_for(tracking_uri: str) -> Any:
    """One MlflowClient per URI: trainer callbacks log on every step, so it is not rebuilt each time. A local
    store is opened under a file lock: opening a new one creates its schema, and two processes doing that at
    once fail."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking.locks import local_store_path, store_initialisation

    if local_store_path(tracking_uri) is None:
        return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    with store_initialisation(tracking_uri):
        if tracking_uri.startswith("sqlite:"):
            from tasks.speedups.store_template import seed_new_store

            seed_new_store(local_store_path(tracking_uri))  # a new store without MLflow's migrations, or nothing
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        client.search_experiments(max_results=1)  # opens (and if new, creates) the tracking tables
        client.search_registered_models(max_results=1)  # and the registry's
    return client


def tracking_error(tracking_uri: str, doing: str, error: BaseException) -> Exception:
    """The one error for a tracking store that failed: disk full, or unreachable (named by its URI)."""
    if is_disk_full(error):
        return OutputDirError(errno.ENOSPC, f"disk full while {doing} (tracking store {tracking_uri})")
    return RegistryError(
        f"MLflow at {tracking_uri} is unavailable while {doing}: {type(error).__name__}: {str(error)[:200]}"
    )
