"""A local sandbox for model-written Python: namespaces, an unprivileged user, limits, and a pass the child cannot fake.

Each run starts ``sandbox_harness.py`` under bubblewrap (or ``unshare`` when bubblewrap is missing) with new
network, PID, IPC and UTS namespaces and a private root holding only the system's ``/usr``, the Python interpreter
and a size-capped tmpfs working directory (under ``unshare``, ``sandbox_root.py`` builds it and pivots into it).
Inside, the harness sets resource limits, switches to a user id of its own (root ignores ``RLIMIT_NPROC``) and
runs the program and its tests. Around it the parent puts the run in a cgroup with a pids limit where the machine
has one, kills everything at the wall-clock deadline, keeps at most ``output_bytes`` of stdout/stderr, and accepts
a pass only from the harness's final record carrying the run's random nonce.

Must not import: anything outside the standard library and its sibling ``sandbox_*`` modules.

>>> sandbox = Sandbox()
>>> sandbox.run(SandboxJob(program="def add(a, b):\\n    return a + b", tests="assert add(2, 2) == 4")).status
'passed'
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

from reward_fns.sandbox_harness import complete_frame, encode_frame
from reward_fns.sandbox_isolation import (
    Isolation,
    PidsCgroup,
    SandboxUnavailable,
    bwrap_command,
    cgroup_available,
    claim_uid,
    detect_isolation,
    release_uid,
    unshare_command,
)

logger = logging.getLogger(__name__)

Status = Literal[
    "passed",
    "failed",
    "syntax_error",
    "runtime_error",
    "timeout",
    "memory",
    "limit",
    "killed",
    "tampering",
    "invalid_tests",
    "infrastructure",
]


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. ``wall_seconds`` bounds the whole run, startup included."""

    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    processes: int = 16
    file_size_mb: int = 8
    workdir_mb: int = 32
    open_files: int = 64
    output_bytes: int = 16_384


@dataclass(frozen=True)
class SandboxJob:
    """One program and its tests. ``entry_point`` selects the HumanEval form ``check(<entry_point>)``."""

    program: str
    tests: str
    entry_point: str | None = None


@dataclass
class SandboxResult:
    """What happened to one job; ``status`` names the reason for anything but a pass."""

    status: Status
    tests_passed: int = 0
    tests_total: int = 0
    detail: str = ""
    failures: list[str] = field(default_factory=list)
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    attempts: int = 1

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def ran(self) -> bool:
        """The program loaded and the tests ran to the end (some may have failed)."""
        return self.status in ("passed", "failed")


class _Worker:
    """One long-lived sandbox (namespaces + cgroup) whose supervisor forks a child per job.

    Jobs on one worker run one at a time, each in its own process group, directory and under the worker's own
    user id; the supervisor kills every process of that user after each job, so nothing outlives its run."""

    def __init__(self, sandbox: Sandbox, slot: int) -> None:
        self.slot = slot
        self.uid, self._uid_claim = claim_uid() if os.geteuid() == 0 else (None, None)
        self.cgroup = PidsCgroup.create(sandbox.limits.processes + 8) if sandbox.use_cgroup else None
        self.workdir = None
        reply_read, reply_write = os.pipe()
        if sandbox.isolation == "bwrap":
            command, cwd = bwrap_command(sandbox.limits.workdir_mb << 20, reply_write), None
        else:
            self.workdir = tempfile.mkdtemp(prefix="grpoflow-sandbox-")  # the private root's (empty) mount point
            command, cwd = unshare_command(self.workdir, sandbox.limits.workdir_mb << 20, reply_write), "/"
        if self.cgroup is not None:  # join the cgroup before bwrap starts, so every descendant is counted
            command = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', self.cgroup.procs_file, *command]
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the worker; closed in close()
        try:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=self.log,
                stderr=self.log,
                pass_fds=(reply_write,),
                cwd=cwd,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},  # nothing from the parent's environment
                start_new_session=True,
            )
        except OSError:
            os.close(reply_read)
            self.close()
            raise
        finally:
            os.close(reply_write)
        self.replies = reply_read

    def run(self, payload: dict, timeout: float) -> dict | None:
        """Send one job and wait for its reply; None when the worker died or did not answer in time."""
        try:
            self.process.stdin.write(encode_frame(payload))
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        deadline = time.monotonic() + timeout
        received = b""
        while (reply := complete_frame(received)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.replies], [], [], remaining)[0]:
                return None
            chunk = os.read(self.replies, 1 << 20)
            if not chunk:
                return None
            received += chunk
        return reply

    def diagnostics(self) -> str:
        self.log.seek(0)
        return self.log.read()[-500:].decode("utf-8", "replace")

    def close(self) -> None:
        process = getattr(self, "process", None)
        if process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                process.stdin.close()
            process.wait()
            os.close(self.replies)
        if self.cgroup is not None:
            self.cgroup.kill_and_remove()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if hasattr(self, "log"):
            self.log.close()
        if self.uid is not None:  # after its processes are gone: the id is free for another worker
            release_uid(self.uid, self._uid_claim)


class Sandbox:
    """Runs jobs isolated and in parallel on ``workers`` long-lived sandboxes (default: the machine's cores);
    thread-safe. ``close()`` (or the end of the process) tears them down."""

    def __init__(
        self, limits: SandboxLimits | None = None, workers: int | None = None, isolation: Isolation | None = None
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.isolation = isolation or detect_isolation()
        self.use_cgroup = cgroup_available()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._free_slots = list(range(self.workers))
        self._lock = threading.Lock()
        self._available = threading.Semaphore(self.workers)
        self._all: set[_Worker] = set()
        atexit.register(self.close)
        logger.debug("sandbox: %s, %d workers", self.describe(), self.workers)

    def describe(self) -> str:
        """One line for logs and run tags, e.g. ``bwrap private root + cgroup pids + uid drop``."""
        parts = [f"{self.isolation} private root"]
        parts.append("cgroup pids" if self.use_cgroup else "no cgroup (RLIMIT_NPROC only)")
        if os.geteuid() == 0:
            parts.append("uid drop")
        else:  # bubblewrap keeps the caller's id in its user namespace; unshare maps it to that namespace's root
            parts.append(
                f"uid {os.geteuid()} in a user namespace" if self.isolation == "bwrap" else "user namespace root"
            )
        return " + ".join(parts)

    def run(self, job: SandboxJob) -> SandboxResult:
        """Run one job; an infrastructure failure is retried once (on a fresh worker) before it is reported."""
        result = self._run_once(job)
        if result.status == "infrastructure":
            logger.warning("sandbox infrastructure failure, retrying once: %s", result.detail)
            result = self._run_once(job)
            result.attempts = 2
        return result

    def run_many(self, jobs: Sequence[SandboxJob]) -> list[SandboxResult]:
        """Run jobs in parallel (``workers`` at a time); results in the jobs' order."""
        if len(jobs) <= 1:
            return [self.run(job) for job in jobs]
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.run, jobs))

    def close(self) -> None:
        """Stop every worker (their processes, cgroups and directories go with them)."""
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.close()

    def _acquire(self) -> _Worker:
        self._available.acquire()
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            with self._lock:
                slot = self._free_slots.pop(0)
            try:
                worker = _Worker(self, slot)
            except BaseException:
                with self._lock:
                    self._free_slots.append(slot)
                self._available.release()
                raise
            with self._lock:
                self._all.add(worker)
            return worker

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if healthy:
            self._idle.put(worker)
        else:
            worker.close()
            with self._lock:
                self._all.discard(worker)
                self._free_slots.append(worker.slot)
        self._available.release()

    def _run_once(self, job: SandboxJob) -> SandboxResult:
        limits = self.limits
        nonce = secrets.token_hex(16)
        try:
            worker = self._acquire()
        except OSError as exc:
            return SandboxResult("infrastructure", detail=f"cannot start the sandbox: {exc}")
        started = time.monotonic()  # the run's own time: not the wait for a free worker (calls run side by side)
        payload = {
            "nonce": nonce,
            "program": job.program,
            "tests": job.tests,
            "entry_point": job.entry_point,
            "uid": worker.uid,
            "limits": {
                "cpu_seconds": limits.cpu_seconds,
                "wall_seconds": limits.wall_seconds,
                "memory_bytes": limits.memory_mb << 20,
                "processes": limits.processes,
                "file_size_bytes": limits.file_size_mb << 20,
                "open_files": limits.open_files,
                "output_bytes": limits.output_bytes,
            },
        }
        reply = worker.run(payload, timeout=limits.wall_seconds + 10)
        if reply is None:
            result = SandboxResult("infrastructure", detail=f"the sandbox stopped answering: {worker.diagnostics()}")
        else:
            result = _classify(reply, nonce)
        self._release(worker, healthy=reply is not None)
        result.seconds = time.monotonic() - started
        return result


def _classify(reply: dict, nonce: str) -> SandboxResult:
    """Turn a supervisor's reply into a result. Only a record carrying this run's nonce can say "passed"."""
    stdout, stderr = reply["stdout"], reply["stderr"]
    returncode, timed_out = int(reply["returncode"]), bool(reply["timed_out"])
    started = record = None
    for line in reply["result"].splitlines():
        if line == f"{nonce} started":
            started = True
        elif line.startswith(f"{nonce} result ") and record is None:
            with contextlib.suppress(json.JSONDecodeError):
                record = json.loads(line[len(nonce) + 8 :])
    output = {"stdout": stdout, "stderr": stderr}
    if reply.get("limit_hit") and (record is None or record.get("status") in ("passed", "failed")):
        return SandboxResult("limit", detail=f"resource limit: {reply['limit_hit']}", **output)
    if record is not None:
        return SandboxResult(
            status=record["status"],
            tests_passed=int(record.get("tests_passed", 0)),
            tests_total=int(record.get("tests_total", 0)),
            detail=str(record.get("detail", "")),
            failures=list(record.get("failures", [])),
            **output,
        )
    if not started:
        detail = f"the job's process failed before the program ran (exit {returncode}): {stderr[-300:]}"
        return SandboxResult("infrastructure", detail=detail, **output)
    if timed_out:
        return SandboxResult("timeout", detail="wall-clock limit; its processes were killed", **output)
    if returncode < 0:
        number = -returncode
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else str(number)
        if number == signal.SIGXCPU:
            return SandboxResult("timeout", detail="CPU-time limit (SIGXCPU)", **output)
        if "MemoryError" in stderr:
            return SandboxResult("memory", detail=f"MemoryError, then {name}", **output)
        return SandboxResult("killed", detail=f"killed by {name}", **output)
    if "MemoryError" in stderr:
        return SandboxResult("memory", detail="MemoryError", **output)
    return SandboxResult("runtime_error", detail=f"exited with status {returncode} before the tests finished", **output)


@lru_cache(maxsize=4)
def verified_isolation(isolation: Isolation | None = None) -> str:
    """The sandbox model-written code will run in (``Sandbox.describe()``), once it proved it sees no host file: a
    canary file planted in a fresh host folder must be neither there nor listable from inside. Raises
    SandboxUnavailable naming what the sandbox saw (or why it could not run the check).

    >>> verified_isolation().split(" + ")[0] in ("bwrap private root", "unshare private root")
    True
    """
    chosen = isolation or detect_isolation()
    # /tmp, not TMPDIR: a private TMPDIR would hide the canary from the sandbox user whatever the mount view
    with tempfile.TemporaryDirectory(
        prefix="grpoflow-canary-", dir="/tmp" if os.path.isdir("/tmp") else None
    ) as folder:
        canary = Path(folder) / "canary.txt"
        canary.write_text(secrets.token_hex(8))
        os.chmod(folder, 0o755)  # readable by anyone on the host: only the mount view may hide it
        canary.chmod(0o644)
        program = f"import os\nseen = [p for p in ({folder!r}, {str(canary)!r}) if os.path.exists(p)]"
        sandbox = Sandbox(SandboxLimits(wall_seconds=20.0), workers=1, isolation=chosen)
        try:
            result = sandbox.run(SandboxJob(program=program, tests="assert seen == [], seen"))
        finally:
            sandbox.close()
    if result.status == "failed":
        raise SandboxUnavailable(
            f"the {chosen} sandbox sees host files (a canary at {canary}): model code would read the host"
        )
    if result.status != "passed":
        raise SandboxUnavailable(f"the {chosen} sandbox failed its self-check: {result.status} {result.detail[:200]}")
    return sandbox.describe()
