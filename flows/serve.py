"""The serving flow (deployment ``grpoflow-serve/champion``): ``grpoflow serve`` kept up under Prefect, health
checked and restarted on failure, each restart a line in the flow run's log. Must not hold logic:
``tasks/serving/supervise.py`` watches the server.
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from prefect import flow

from tasks.config import load_config
from tasks.serving.supervise import Supervision, supervise

logger = logging.getLogger(__name__)


@flow(name="grpoflow-serve", flow_run_name="serve-{alias}", retries=2, retry_delay_seconds=30)
def serve_flow(
    config_path: str = "configs/demo.yaml",
    alias: str = "champion",
    host: str | None = None,
    port: int | None = None,
    check_every_s: float = 10.0,
) -> int:
    """Serve the config's registered model at ``alias`` until the flow run is cancelled; returns the restarts.
    Beyond loopback the server needs its key in the worker's environment (GRPOFLOW_SERVE_API_KEY[_FILE])."""
    config = load_config(config_path)
    host, port = host or config.serving.host, port or config.serving.port
    name = config.tracking.registered_model_name
    command = [sys.executable, "-m", "flows.cli", "serve", f"{name}@{alias}", "--config", config_path]
    command += ["--host", host, "--port", str(port)]
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    watch = Supervision(f"http://{reachable}:{port}/health", check_every_s=check_every_s)
    log = Path(config.output_dir) / "serve" / f"{name}-{alias}.log"
    logger.info("serving %s@%s on http://%s:%s/v1 (its log: %s)", name, alias, host, port, log)
    return supervise(command, watch, log, threading.Event(), lambda n, why: logger.warning("restart %d: %s", n, why))
