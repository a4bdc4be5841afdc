"""Pipeline stages: plain functions plus thin Prefect task wrappers, and the shared pieces below them.

Importing the package sets the process's environment defaults, before Prefect, MLflow or transformers load:
this is the one place they are written (``flows.services`` hands the same ones to the servers it starts).
"""

import logging
import os

# The network may be closed and users' data is theirs: no telemetry unless a user turns it back on.
TELEMETRY_OFF = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}
RUNTIME_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    # Stage progress (generation batches, evaluation) goes to the Prefect UI's run logs too.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "tasks,reward_fns,flows",
    # MLflow's HTTP client retries for minutes when a server is gone; a run should fail in seconds and say so.
    # tracking.http_retries / tracking.http_timeout_s set these per run.
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
for _name, _value in {**TELEMETRY_OFF, **RUNTIME_DEFAULTS}.items():
    os.environ.setdefault(_name, _value)

# Stage progress is INFO; Prefect's root logger is at WARNING, so grpoflow's own loggers say their level.
for _package in ("tasks", "reward_fns", "flows"):
    if logging.getLogger(_package).level == logging.NOTSET:
        logging.getLogger(_package).setLevel(logging.INFO)
