"""Pipeline stages: plain functions plus thin Prefect task wrappers, and the shared pieces below them."""

import os

# The network may be closed and users' data is theirs: no telemetry unless a user turns it back on.
for _name, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "TOKENIZERS_PARALLELISM": "false",
    # Stage progress (generation batches, evaluation) goes to the Prefect UI's run logs too.
    "PREFECT_LOGGING_EXTRA_LOGGERS": "tasks,reward_fns",
}.items():
    os.environ.setdefault(_name, _value)
