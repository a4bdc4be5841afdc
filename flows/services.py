"""Local Prefect and MLflow servers (``grpoflow up``) and deployment registration (``grpoflow deploy``).

Both servers bind 127.0.0.1 and keep their data under one folder (default: the config's output dir /
``services``), so a laptop gets the same UIs a team gets from the compose stack in ``infra/``.
Must not import: torch, transformers, the stages (it starts servers and registers deployments).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks import TELEMETRY_OFF
from tasks.errors import InfrastructureError

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = PROJECT_ROOT / "infra" / "prefect.yaml"
CPU_POOL = "grpoflow-cpu"
GPU_POOL = "grpoflow-gpu"
# What the servers and workers started here get on top of this process's environment.
SERVICE_ENV = {**TELEMETRY_OFF, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}


class ServiceError(InfrastructureError, RuntimeError):
    """A server did not come up (the message names which, its URL and the tail of its log)."""


@dataclass
class Services:
    """The servers ``start_services`` launched; ``stop`` ends them all."""

    prefect_url: str
    mlflow_url: str
    home: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def prefect_api_url(self) -> str:
        return f"{self.prefect_url}/api"

    def env(self) -> dict[str, str]:
        """Environment for clients and workers of these servers."""
        return {
            **SERVICE_ENV,
            "PREFECT_API_URL": self.prefect_api_url,
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "GRPOFLOW_HOME": str(PROJECT_ROOT),
        }

    def serve_until_stopped(self) -> str:
        """Wait until Ctrl-C, ``kill`` or a supervisor stops us, or a server exits; then stop both. Returns what
        happened. SIGINT is handled explicitly too: a shell's background job starts with it ignored."""

        def stop(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, stop)
        signal.signal(signal.SIGTERM, stop)
        ended = "stopped: both servers stopped"
        try:
            while all(p.poll() is None for p in self.processes.values()):
                time.sleep(1)
            ended = "a server exited; both servers stopped"
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
        return ended

    def stop(self, timeout: float = 20.0) -> None:
        """SIGINT each server (what Ctrl-C sends), then SIGKILL what is still running after ``timeout``."""
        for process in self.processes.values():
            if process.poll() is None:
                _signal_group(process, signal.SIGINT)
        deadline = time.monotonic() + timeout
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop on SIGINT; killing it", name)
                _signal_group(process, signal.SIGKILL)
                process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def stop_group(process: subprocess.Popen, timeout: float = 20.0) -> None:
    """Stop a process started with ``start_new_session=True`` and everything it started (its process group,
    e.g. a server's workers): SIGTERM, then SIGKILL after ``timeout``."""
    _signal_group(process, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
    _signal_group(process, signal.SIGKILL)
    process.wait()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_healthy(name: str, url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise ServiceError(f"{name} did not become healthy at {url} within {timeout:.0f} s; log {log}:\n{tail}")


def _bin(name: str) -> str:
    """A console script of this environment (the venv's prefect / mlflow), not whatever PATH finds first."""
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else name


def start_services(
    home: Path,
    prefect_port: int = 4200,
    mlflow_port: int = 5000,
    startup_timeout: float = 120.0,
    mlflow_store: tuple[Path, Path] | None = None,
    prefect_home: Path | None = None,
) -> Services:
    """Start a Prefect server and an MLflow server (SQLite store) on 127.0.0.1.

    Data: by default ``home/prefect`` (Prefect's database) and ``home/mlflow`` (runs, registry, served
    artifacts). ``mlflow_store``: serve this (SQLite file, artifact folder) instead — the local store
    ``grpoflow run`` writes when no tracking server is configured;
    ``prefect_home``: the Prefect home whose database to serve (where ``grpoflow run``'s temporary servers kept
    their runs). Logs go to ``home``. Raises ServiceError naming the server that failed; anything already
    started is stopped first.
    """
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    prefect_home = (prefect_home or home / "prefect").resolve()
    prefect_home.mkdir(parents=True, exist_ok=True)
    if mlflow_store is None:
        (home / "mlflow" / "artifacts").mkdir(parents=True, exist_ok=True)
        store = [
            "--backend-store-uri",
            f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
            "--artifacts-destination",
            str(home / "mlflow" / "artifacts"),
        ]
    else:
        database, artifacts = (path.resolve() for path in mlflow_store)
        database.parent.mkdir(parents=True, exist_ok=True)
        artifacts.mkdir(parents=True, exist_ok=True)
        store = local_store_arguments(database, artifacts)
    services = Services(f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}", home)
    base_env = {**os.environ, **SERVICE_ENV}
    commands = {
        "prefect": (
            [_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
            {**base_env, "PREFECT_HOME": str(prefect_home), "PREFECT_UI_API_URL": services.prefect_api_url},
            f"{services.prefect_url}/api/health",
        ),
        "mlflow": (
            [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port), *store, "--workers", "1"],
            # MLflow's server-side job workers (GenAI jobs, which grpoflow does not use): 7 processes and 1.1 GB,
            # and 2.6 s more to start (11.6 → 9.0 s for both servers); a user's own setting wins.
            {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **base_env},
            f"{services.mlflow_url}/health",
        ),
    }
    try:
        for name, (command, env, _) in commands.items():
            log = home / f"{name}.log"
            with log.open("ab") as handle:
                services.processes[name] = subprocess.Popen(
                    command, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
                )
        for name, (_, _, health) in commands.items():
            _wait_healthy(name, health, services.processes[name], home / f"{name}.log", startup_timeout)
    except BaseException:
        services.stop()
        raise
    return services


def local_store_arguments(database: Path, artifacts: Path) -> list[str]:
    """``mlflow server``'s options to serve a store ``grpoflow run`` wrote without a server: the SQLite file, and
    runs' ``file://`` artifact locations read (and written) on disk by every client, as ``mlflow ui`` does.

    >>> local_store_arguments(Path("/o/mlflow.db"), Path("/o/mlartifacts"))[:2]
    ['--backend-store-uri', 'sqlite:////o/mlflow.db']
    """
    return [
        "--backend-store-uri",
        f"sqlite:///{database}",
        "--default-artifact-root",
        artifacts.as_uri(),
        "--no-serve-artifacts",
    ]


@contextlib.contextmanager
def local_store_server(database: Path, artifacts: Path, log: Path, timeout: float = 120.0) -> Iterator[str]:
    """An MLflow server on 127.0.0.1 over a local SQLite store for as long as the block runs; yields its URL.
    While it runs it is the store's one writer: everything in the block tracks through it. Stopped (with its
    workers) when the block ends, however it ends.
    """
    database, artifacts = database.resolve(), artifacts.resolve()
    database.parent.mkdir(parents=True, exist_ok=True)
    artifacts.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    with log.open("ab") as handle:
        process = subprocess.Popen(
            [*command, *local_store_arguments(database, artifacts)],
            env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, **SERVICE_ENV},
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_healthy("mlflow", f"{url}/health", process, log, timeout)
        yield url
    finally:
        stop_group(process)


def _up_state_file() -> Path:
    from tasks.models import cache_dir

    return cache_dir() / "up.json"


def record_up(services: Services, store: str) -> None:
    """Note where ``grpoflow up`` serves, so ``grpoflow run`` on this machine uses that Prefect server."""
    state = {
        "prefect_api_url": services.prefect_api_url,
        "mlflow_url": services.mlflow_url,
        "store": store,
        "pid": os.getpid(),
    }
    _up_state_file().parent.mkdir(parents=True, exist_ok=True)
    _up_state_file().write_text(json.dumps(state))


def forget_up() -> None:
    with contextlib.suppress(OSError):
        _up_state_file().unlink()


def running_up() -> dict[str, Any] | None:
    """What a running ``grpoflow up`` serves (``prefect_api_url``, ``mlflow_url``, ``store``), or None."""
    try:
        state = json.loads(_up_state_file().read_text())
        os.kill(int(state["pid"]), 0)
        with urllib.request.urlopen(f"{state['prefect_api_url']}/health", timeout=2) as response:
            return state if response.status == 200 else None
    except (OSError, ValueError, KeyError, urllib.error.URLError):
        return None


def ensure_work_pool(name: str = CPU_POOL, pool_type: str = "process", env: dict[str, str] | None = None) -> None:
    """Create the work pool if the Prefect server at ``PREFECT_API_URL`` does not have it."""
    result = subprocess.run(
        [_bin("prefect"), "work-pool", "inspect", name], env={**os.environ, **(env or {})}, capture_output=True
    )
    if result.returncode == 0:
        return
    created = subprocess.run(
        [_bin("prefect"), "work-pool", "create", name, "--type", pool_type],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    if created.returncode != 0:
        raise ServiceError(f"cannot create work pool {name!r}: {created.stdout[-500:]} {created.stderr[-500:]}")


def schedule_file(
    config_path: Path, cron: str, name: str | None = None, pool: str = CPU_POOL, timezone: str = "UTC"
) -> str:
    """A Prefect deployment file with one deployment: the pipeline on ``config_path`` on a cron schedule
    (``grpoflow deploy CONFIG``), named ``nightly-<config name>`` unless ``name`` is given. The config path is kept
    relative to the project (workers find it under GRPOFLOW_HOME) where it lies inside it.

    >>> import yaml
    >>> spec = yaml.safe_load(schedule_file(PROJECT_ROOT / "configs/tiny.yaml", "0 3 * * *"))
    >>> spec["deployments"][0]["name"], spec["deployments"][0]["parameters"]["config_path"]
    ('nightly-tiny', 'configs/tiny.yaml')
    """
    import yaml

    from tasks.config import ConfigError, load_config

    config_path = Path(config_path).resolve()
    config = load_config(config_path)  # a config that does not load is said here, not at 2 a.m.
    if len(cron.split()) != 5:
        raise ConfigError(f"--cron takes five fields (minute hour day month weekday), got {cron!r}")
    shown = config_path.relative_to(PROJECT_ROOT) if config_path.is_relative_to(PROJECT_ROOT) else config_path
    deployment = {
        "name": name or f"nightly-{config.name}",
        "entrypoint": "flows/deploy.py:scheduled_pipeline",
        "description": f"The pipeline on {shown.as_posix()} on the schedule {cron} ({timezone}); skips training when "
        "the config and data are unchanged since the last completed run.",
        "parameters": {"config_path": shown.as_posix(), "skip_unchanged": True},
        "work_pool": {"name": pool},
        "schedules": [{"cron": cron, "timezone": timezone}],
    }
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    return yaml.safe_dump({**{k: spec[k] for k in ("name", "prefect-version", "pull")}, "deployments": [deployment]})


def deploy(prefect_file: Path = PREFECT_FILE, env: dict[str, str] | None = None) -> list[str]:
    """Register every deployment of ``prefect_file`` (the pipeline on its schedule, rollback, GRPO) with the
    Prefect server at ``PREFECT_API_URL``, creating the CPU work pool first; returns their names."""
    environment = {**os.environ, **SERVICE_ENV, "GRPOFLOW_HOME": str(PROJECT_ROOT), **(env or {})}
    if not environment.get("PREFECT_API_URL"):
        raise ServiceError("no Prefect server to deploy to: start one with `grpoflow up` and set PREFECT_API_URL")
    for pool in (CPU_POOL, GPU_POOL):  # an existing pool (e.g. a Kubernetes GPU pool) is left as it is
        ensure_work_pool(pool, env=environment)
    result = subprocess.run(
        [_bin("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file)],
        cwd=PROJECT_ROOT,
        env=environment,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ServiceError(f"prefect deploy failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return deployment_names(environment["PREFECT_API_URL"])


def _post_json(url: str, body: dict) -> object:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def deployment_names(api_url: str) -> list[str]:
    """``flow/deployment`` names registered on the Prefect server at ``api_url``."""
    flows = {f["id"]: f["name"] for f in _post_json(f"{api_url}/flows/filter", {})}
    return sorted(
        f"{flows.get(d['flow_id'], '?')}/{d['name']}" for d in _post_json(f"{api_url}/deployments/filter", {})
    )
