"""Following a registry alias: notice a move, fetch the new version, check it (adapter digest, base model, smoke
answers), and only then switch; requests that started on the old version finish on it, and its adapter is unloaded
when the last of them ends. A version that fails a check is never served: the old one keeps answering, and the
refusal is a tag on the version, a log line and a metric.

Versions registered before serving records existed (no ``adapter_digest`` tag, no ``smoke.json``) are served with a
warning and the tag ``grpoflow.serve.unchecked`` naming what could not be checked; nothing is recorded for them
on first sight (a record taken by the server would check the server against itself).
Must not import: Prefect, the stages; torch and transformers only through the engine it is handed.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks.serving.engines import Engine, EngineError
from tasks.serving.metrics import ServingMetrics
from tasks.serving.records import DIGEST_TAG, adapter_digest, read_smoke_record, smoke_verdict

logger = logging.getLogger(__name__)

REFUSED_TAG = "grpoflow.serve.refused"
UNCHECKED_TAG = "grpoflow.serve.unchecked"


class VersionRefused(Exception):
    """A version failed a check before taking traffic."""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class ServedVersion:
    """A version the engine holds: what answers under ``key``, and how many requests it is answering."""

    registered_model: str
    alias: str
    version: str
    key: str
    system_prompt: str | None
    checks: str
    since: str = field(default_factory=now)
    in_flight: int = 0
    retired: bool = False
    unloaded: bool = False
    folder: Path | None = None  # the downloaded version, removed once the engine let go of it

    @property
    def model_id(self) -> str:
        """The ``model`` every answer of this version carries: ``NAME@ALIAS:vVERSION``."""
        return f"{self.registered_model}@{self.alias}:v{self.version}"


def model_config_of(downloaded: Path) -> dict[str, Any]:
    """The ``model_config`` a version's ``MLmodel`` carries (base model, its fingerprint, system prompt,
    precision); ``{}`` for a plain adapter folder."""
    import yaml

    mlmodel = Path(downloaded) / "MLmodel"
    if not mlmodel.is_file():
        return {}
    flavors = (yaml.safe_load(mlmodel.read_text()) or {}).get("flavors", {})
    return dict((flavors.get("python_function") or {}).get("model_config") or {})


class AliasFollower:
    """Serves ``registered_model@alias`` on ``engine``: ``poll`` reads the alias once and switches when it moved and
    the new version passes its checks; ``acquire``/``release`` bracket each request."""

    def __init__(
        self,
        client: Any,
        registered_model: str,
        alias: str,
        engine: Engine,
        settings: Any,
        workdir: Path,
        metrics: ServingMetrics,
        base_fingerprint: str | None = None,
        default_system_prompt: str | None = None,
    ) -> None:
        self.client = client
        self.registered_model = registered_model
        self.alias = alias
        self.engine = engine
        self.settings = settings
        self.workdir = Path(workdir)
        self.metrics = metrics
        self.base_fingerprint = base_fingerprint
        self.default_system_prompt = default_system_prompt
        self.current: ServedVersion | None = None
        self.last_switch: dict[str, Any] | None = None
        self.refused: dict[str, str] = {}  # version -> why; not tried again
        self._retired: list[ServedVersion] = []
        self._lock = threading.Lock()
        self._polls = threading.Lock()  # one poll at a time (the follow thread, a test, the first poll)

    # requests
    def acquire(self) -> ServedVersion | None:
        """The version a new request is answered by (counted until ``release``), or None before any is served."""
        with self._lock:
            served = self.current
            if served is not None:
                served.in_flight += 1
            return served

    def release(self, served: ServedVersion) -> None:
        with self._lock:
            served.in_flight -= 1
            unload = served.retired and served.in_flight == 0 and not served.unloaded
            if unload:
                served.unloaded = True
        if unload:
            self._unload(served)

    def in_flight(self) -> int:
        with self._lock:
            return sum(v.in_flight for v in [self.current, *self._retired] if v is not None)

    def _unload(self, served: ServedVersion) -> None:
        try:
            self.engine.unload(served.key)
        finally:
            if served.folder is not None:
                shutil.rmtree(served.folder, ignore_errors=True)
            with self._lock:
                if served in self._retired:
                    self._retired.remove(served)
            logger.info("unloaded %s (its last request ended)", served.model_id)

    # the alias
    def poll(self) -> str | None:
        """Read the alias once; switch to its version when it moved and the version passes its checks. Returns the
        version now served when it changed, else None."""
        from tasks.registry import alias_version

        with self._polls:
            target = alias_version(self.client, self.registered_model, self.alias)
            if target is None:
                return None
            number = str(target.version)
            if (self.current is not None and number == self.current.version) or number in self.refused:
                return None
            started = time.monotonic()
            try:
                served = self._prepare(target, self.workdir / f"v{number}-{uuid.uuid4().hex[:8]}")
            except VersionRefused as exc:
                self._refuse(number, str(exc))
                return None
            self._switch(served, time.monotonic() - started)
            return number

    def follow(self, stop: threading.Event, on_tick: Any = None, tick_s: float = 60.0) -> None:
        """Poll every ``serving.poll_interval_s`` until ``stop`` is set; a registry that does not answer is logged
        and tried again (the served version keeps answering). ``on_tick`` is called every ``tick_s``."""
        last_tick = time.monotonic()
        while not stop.wait(self.settings.poll_interval_s):
            try:
                self.poll()
            except Exception as exc:  # the registry unreachable, a download cut off: try again next poll
                logger.warning(
                    "serve: reading %s@%s failed (%s); still serving", self.registered_model, self.alias, exc
                )
            if on_tick is not None and time.monotonic() - last_tick >= tick_s:
                last_tick = time.monotonic()
                try:
                    on_tick()
                except Exception as exc:
                    logger.warning("serve: reporting failed: %s", exc)

    def _prepare(self, target: Any, folder: Path) -> ServedVersion:
        """Download ``target`` into ``folder``, check and load it; a failed check unloads what was loaded, removes
        the folder and raises VersionRefused."""
        self._wait_for_retired()
        try:
            return self._checked(target, folder)
        except VersionRefused:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def _checked(self, target: Any, folder: Path) -> ServedVersion:
        import mlflow.artifacts

        from tasks.registry.packaging import adapter_in

        number = str(target.version)
        try:
            local = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=target.source, dst_path=str(folder), tracking_uri=self.client.tracking_uri
                )
            )
        except Exception as exc:
            raise VersionRefused(f"its artifacts could not be downloaded: {str(exc)[:200]}") from exc
        adapter = adapter_in(local)
        notes: list[str] = []
        expected = target.tags.get(DIGEST_TAG)
        try:
            digest = adapter_digest(adapter)
        except OSError as exc:
            raise VersionRefused(f"its adapter is incomplete: {exc}") from exc
        if expected and digest != expected:
            raise VersionRefused(
                f"adapter digest mismatch: downloaded {digest[:16]}…, registered {expected[:16]}… (corrupted or "
                "replaced after registration)"
            )
        if not expected:
            notes.append(f"no {DIGEST_TAG} tag")
        config = model_config_of(local)
        recorded_base = config.get("base_fingerprint")
        if recorded_base and self.base_fingerprint and recorded_base != self.base_fingerprint:
            raise VersionRefused(
                f"trained on another base model (fingerprint {recorded_base}; this server's base is "
                f"{self.base_fingerprint})"
            )
        key = f"v{number}-{uuid.uuid4().hex[:6]}"
        try:
            self.engine.load(key, adapter)
        except EngineError as exc:
            raise VersionRefused(str(exc)) from exc
        system_prompt = config.get("system_prompt", self.default_system_prompt)
        record = read_smoke_record(local)
        if record is None:
            notes.append("no smoke record")
            checks = "unchecked: " + ", ".join(notes)
        else:
            try:
                answers = [
                    self.engine.chat(
                        key, prompt, record.system_prompt, max_tokens=record.max_tokens, threads=1, priority=True
                    )[0].text
                    for prompt in record.prompts
                ]
            except EngineError as exc:
                self.engine.unload(key)
                raise VersionRefused(f"smoke prompts failed: {exc}") from exc
            passed, said = smoke_verdict(
                record,
                answers,
                self.engine.name,
                self.engine.precision,
                self.settings.smoke_min_agreement,
                self.engine.device,
            )
            if not passed:
                self.engine.unload(key)
                raise VersionRefused(said)
            checks = ("digest verified; " if expected else "") + said + (f" ({', '.join(notes)})" if notes else "")
        if notes:
            logger.warning("serve: %s v%s is served unchecked: %s", self.registered_model, number, ", ".join(notes))
            self._tag(number, UNCHECKED_TAG, ", ".join(notes))
        return ServedVersion(self.registered_model, self.alias, number, key, system_prompt, checks, folder=folder)

    def _wait_for_retired(self, timeout_s: float = 120.0) -> None:
        """Before a third adapter is loaded, the retired one's last requests end (the engine keeps two)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._retired:
                    return
            time.sleep(0.05)

    def _switch(self, served: ServedVersion, seconds: float) -> None:
        with self._lock:
            old, self.current = self.current, served
            unload_now = False
            if old is not None:
                old.retired = True
                self._retired.append(old)
                unload_now = old.in_flight == 0 and not old.unloaded
                old.unloaded = old.unloaded or unload_now
        self.last_switch = {
            "from": old.version if old else None,
            "to": served.version,
            "at": served.since,
            "prepare_s": round(seconds, 3),
        }
        if old is not None:
            self.metrics.count_switch()
        logger.info(
            "serve: %s now answers (was %s; ready in %.1f s): %s",
            served.model_id,
            f"v{old.version}" if old else "nothing",
            seconds,
            served.checks,
        )
        if unload_now:
            self._unload(old)

    def _refuse(self, number: str, why: str) -> None:
        self.refused[number] = why
        self.metrics.count_failed_check()
        served = f"v{self.current.version} keeps answering" if self.current else "nothing is served"
        logger.error("serve: %s v%s refused: %s; %s", self.registered_model, number, why, served)
        self._tag(number, REFUSED_TAG, f"{now()}: {why}")

    def _tag(self, number: str, key: str, value: str) -> None:
        try:
            self.client.set_model_version_tag(self.registered_model, number, key, value[:4000])
        except Exception as exc:  # the refusal stands without its tag; said once
            logger.warning("serve: could not tag %s v%s: %s", self.registered_model, number, exc)

    def status(self) -> dict[str, Any]:
        """What ``/v1/models`` shows: the served version, since when, how it was checked, the last switch."""
        served = self.current
        return {
            "registered_model": self.registered_model,
            "alias": self.alias,
            "version": served.version if served else None,
            "since": served.since if served else None,
            "checks": served.checks if served else None,
            "last_switch": self.last_switch,
            "refused": dict(self.refused),
            "engine": self.engine.name,
            "precision": self.engine.precision,
            "device": self.engine.device,
        }
