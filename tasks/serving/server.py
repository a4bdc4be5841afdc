"""``grpoflow serve`` put together: the base model the alias's versions were trained on, the engine, the alias
follower (its first poll before the port opens, then one every ``serving.poll_interval_s`` in a thread), the HTTP
front, and an MLflow run of the server that carries its metrics while it runs.
Must not import: Prefect, the stages; torch and transformers only through the engine.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import UserError

logger = logging.getLogger(__name__)


def serving_target(target: str | None, registered_model: str, alias: str) -> tuple[str, str]:
    """What to serve: ``NAME@ALIAS``, ``NAME`` (the config's alias) or nothing (the config's model and alias).

    >>> serving_target("demo@challenger", "x", "champion"), serving_target(None, "x", "champion")
    (('demo', 'challenger'), ('x', 'champion'))
    """
    if not target:
        return registered_model, alias
    name, _, named_alias = target.removeprefix("models:/").partition("@")
    if not name or "/" in name:
        raise UserError(f"serve NAME@ALIAS or NAME, got {target!r} (a version number is not followed: give an alias)")
    return name, named_alias or alias


def check_listening(host: str, api_key: str | None) -> None:
    """Beyond loopback a key is required, as for ``vllm-serve`` and the judges: the endpoint answers anyone who
    reaches it, with the compute it holds."""
    from reward_fns.judges.settings import is_loopback

    if api_key is None and not is_loopback(host):
        raise UserError(
            f"serve on {host} answers other hosts: give it an API key with GRPOFLOW_SERVE_API_KEY, "
            "GRPOFLOW_SERVE_API_KEY_FILE or --api-key-file (clients send it as Authorization: Bearer ...)"
        )


def api_key_from(environ: dict[str, str], key_file: Path | None) -> str | None:
    """The serving key: ``key_file``, else the file ``GRPOFLOW_SERVE_API_KEY_FILE`` names, else
    ``GRPOFLOW_SERVE_API_KEY``; never a command-line value.

    >>> api_key_from({"GRPOFLOW_SERVE_API_KEY": "k"}, None), api_key_from({}, None)
    ('k', None)
    """
    path = key_file or (
        Path(environ["GRPOFLOW_SERVE_API_KEY_FILE"]) if environ.get("GRPOFLOW_SERVE_API_KEY_FILE") else None
    )
    if path is not None:
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            raise UserError(f"serving API key file {path}: {exc.strerror}") from exc
    return environ.get("GRPOFLOW_SERVE_API_KEY") or None


@dataclass
class ServerRun:
    """The MLflow run of one server: its settings as params, its metrics at every tick, its switches as tags."""

    client: Any
    run_id: str
    step: int = 0

    @classmethod
    def start(cls, client: Any, experiment: str, name: str, alias: str, params: dict[str, Any]) -> ServerRun:
        found = client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else client.create_experiment(experiment)
        run = client.create_run(experiment_id, run_name=f"serve {name}@{alias}", tags={"grpoflow.stage": "serve"})
        for key, value in params.items():
            client.log_param(run.info.run_id, key, value)
        return cls(client, run.info.run_id)

    def log(self, summary: dict[str, float], serving: str | None) -> None:
        self.step += 1
        for key, value in summary.items():
            self.client.log_metric(self.run_id, key, value, step=self.step)
        if serving:
            self.client.set_tag(self.run_id, "serving_version", serving)

    def end(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


class _Stop(Exception):
    """SIGINT or SIGTERM after uvicorn shut down."""


def _stopped(signum: int, frame: Any) -> None:
    raise _Stop


def serve(
    config: Any,
    tracking_uri: str,
    name: str,
    alias: str,
    host: str,
    port: int,
    api_key: str | None,
    engine_name: str,
    workdir: Path,
) -> None:
    """Serve ``name@alias`` on ``host:port`` until stopped (Ctrl-C, SIGTERM)."""
    import uvicorn

    from tasks.models import resolve_model_source
    from tasks.registry import alias_version, client_for, registered_model
    from tasks.registry.packaging import base_fingerprint
    from tasks.serving.app import build_app
    from tasks.serving.engines import start_engine
    from tasks.serving.follower import AliasFollower
    from tasks.serving.metrics import ServingMetrics

    check_listening(host, api_key)
    client = client_for(tracking_uri)
    registered_model(client, name)  # a wrong name is said before any model loads
    current = alias_version(client, name, alias)
    base = (current.tags.get("base_model") if current is not None else None) or config.model.source
    base_dir = resolve_model_source(base, config.model.revision)
    workdir.mkdir(parents=True, exist_ok=True)
    engine = start_engine(config, base_dir, engine_name, workdir / "logs")
    metrics = ServingMetrics()
    follower = AliasFollower(
        client,
        name,
        alias,
        engine,
        config.serving,
        workdir / "versions",
        metrics,
        base_fingerprint=base_fingerprint(base_dir),
        default_system_prompt=config.data.system_prompt,
    )
    stop = threading.Event()
    run = None
    try:
        follower.poll()
        if follower.current is None:
            logger.warning(
                "serve: no version of %s@%s passes its checks yet; /health answers 503 until one does", name, alias
            )
        params = {"registered_model": name, "alias": alias, "engine": engine.name, "precision": engine.precision}
        run = ServerRun.start(client, config.tracking.experiment_name, name, alias, params | {"base_model": base})

        def report() -> None:
            run.log(metrics.summary(), follower.current.version if follower.current else None)

        thread = threading.Thread(target=follower.follow, args=(stop, report, 30.0), daemon=True, name="alias-follower")
        thread.start()
        app = build_app(follower, engine, metrics, config.serving.max_tokens_limit, api_key)
        print(
            f"serving {name}@{alias} on http://{host}:{port}/v1 ({engine.name}, {engine.precision}); Ctrl-C stops it",
            flush=True,
        )
        # uvicorn stops on SIGINT/SIGTERM and then raises the signal again for the handler it found: these, so the
        # teardown below runs and a stopped server exits 0.
        signal.signal(signal.SIGTERM, _stopped)
        signal.signal(signal.SIGINT, _stopped)
        with contextlib.suppress(_Stop):
            uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False)).run()
    finally:
        stop.set()
        engine.close()
        if run is not None:
            try:
                report()
                run.end()
                logger.info("serve: stopped; its MLflow run is %s", run.run_id)
            except Exception as exc:  # a stopped server never fails at teardown
                logger.warning("serve: the server's MLflow run was not closed: %s", exc)
