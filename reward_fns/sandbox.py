"""A local sandbox for model-written Python: namespaces, an unprivileged user, limits, and a pass the child cannot fake.

Each run starts ``sandbox_harness.py`` under bubblewrap (or ``unshare`` when bubblewrap is missing) with new
network, PID, IPC and UTS namespaces and, under bubblewrap, a mount view holding only the system's ``/usr``, the
Python interpreter and a size-capped tmpfs working directory. Inside, the harness sets resource limits, switches to
a user id of its own (root ignores ``RLIMIT_NPROC``) and runs the program and its tests. Around it the parent puts
the run in a cgroup with a pids limit where the machine has one, kills everything at the wall-clock deadline, keeps
at most ``output_bytes`` of stdout/stderr, and accepts a pass only from the harness's final record carrying the
run's random nonce.

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
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("sandbox_harness.py")
Isolation = Literal["bwrap", "unshare"]
Status = Literal[
    "passed",
    "failed",
    "syntax_error",
    "runtime_error",
    "timeout",
    "memory",
    "killed",
    "tampering",
    "invalid_tests",
    "infrastructure",
]
# Dedicated user ids for sandboxed runs, one per parallel slot, far above any account on a normal machine.
SANDBOX_UID_BASE = 1_800_000_000
# The supervisor switches to the job's user and cleans up after it; everything else is dropped.
_SUPERVISOR_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
_PIDS_CGROUP_V1 = Path("/sys/fs/cgroup/pids")
_CGROUP_V2 = Path("/sys/fs/cgroup")


class SandboxUnavailable(RuntimeError):
    """Neither bubblewrap nor unshare can create the namespaces here; model code must not run unisolated."""


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


def _works(command: list[str]) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=20, env={}).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@lru_cache(maxsize=1)
def _interpreter() -> tuple[str, str | None]:
    """(path of the Python to run inside, host prefix to mount at /opt/python or None when /usr holds it)."""
    executable = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return executable, None
    return "/opt/python/" + os.path.relpath(executable, prefix), prefix


def _bwrap_command(workdir_bytes: int, reply_fd: int = 3) -> list[str]:
    python, prefix = _interpreter()
    command = ["bwrap", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):  # merged-/usr systems link these into /usr
        path = Path("/") / name
        if path.is_symlink():
            command += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            command += ["--ro-bind", str(path), str(path)]
    if prefix:
        command += ["--perms", "0755", "--dir", "/opt", "--ro-bind", prefix, "/opt/python"]
    command += ["--perms", "0755", "--dir", "/opt/grpoflow", "--ro-bind", str(HARNESS), "/opt/grpoflow/harness.py"]
    command += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--size",
        str(workdir_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        "/work",
        "--chdir",
        "/work",
    ]
    command += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if os.geteuid() != 0:
        command.append("--unshare-user")
    # No --die-with-parent: it is tied to the thread that started bwrap. The supervisor exits when its stdin closes.
    command += ["--hostname", "sandbox", "--new-session", "--clearenv"]
    command += ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8"]
    if os.geteuid() == 0:  # the supervisor keeps only what _SUPERVISOR_CAPS lists
        command += ["--cap-drop", "ALL"]
        command += [arg for cap in _SUPERVISOR_CAPS for arg in ("--cap-add", cap)]
    return [*command, python, "-I", "-S", "-B", "/opt/grpoflow/harness.py", str(reply_fd)]


def _unshare_command(reply_fd: int = 3) -> list[str]:
    command = ["unshare", "--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        command.insert(1, "--map-root-user")
    return [*command, os.path.realpath(sys.executable), "-I", "-S", "-B", str(HARNESS), str(reply_fd)]


@lru_cache(maxsize=1)
def detect_isolation() -> Isolation:
    """``bwrap`` when bubblewrap can create the namespaces here, else ``unshare``; raises SandboxUnavailable."""
    if shutil.which("bwrap") and _works([*_bwrap_command(1 << 20)[:-6], "/usr/bin/true"]):
        return "bwrap"
    if shutil.which("unshare") and _works(["unshare", "--net", "--pid", "--fork", "--mount-proc", "/usr/bin/true"]):
        return "unshare"
    raise SandboxUnavailable(
        "cannot isolate model-written code: bubblewrap is not installed (apt-get install bubblewrap) and unshare "
        "cannot create network/PID namespaces here; code rewards refuse to run it unisolated"
    )


class _PidsCgroup:
    """A per-run cgroup capping the number of processes; ``None`` from ``create`` where cgroups are not writable."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, limit: int) -> _PidsCgroup | None:
        name = f"grpoflow-sandbox-{uuid.uuid4().hex[:12]}"
        for parent in (_PIDS_CGROUP_V1, _CGROUP_V2):
            if not (parent / "cgroup.procs").exists() or (
                parent == _CGROUP_V2 and not (parent / "cgroup.subtree_control").exists()
            ):
                continue
            try:
                path = parent / name
                path.mkdir()
            except OSError:
                continue
            try:
                (path / "pids.max").write_text(str(limit))
                return cls(path)
            except OSError:
                path.rmdir()
        return None

    @property
    def procs_file(self) -> str:
        return str(self.path / "cgroup.procs")

    def kill_and_remove(self) -> None:
        for _ in range(50):
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)
        try:
            self.path.rmdir()
        except OSError as exc:
            logger.warning("sandbox cgroup %s not removed: %s", self.path, exc)


@lru_cache(maxsize=1)
def _cgroup_available() -> bool:
    cgroup = _PidsCgroup.create(4)
    if cgroup is None:
        return False
    cgroup.kill_and_remove()
    return True


class _Worker:
    """One long-lived sandbox (namespaces + cgroup) whose supervisor forks a child per job.

    Jobs on one worker run one at a time, each in its own process group, directory and under the worker's own
    user id; the supervisor kills every process of that user after each job, so nothing outlives its run."""

    def __init__(self, sandbox: Sandbox, slot: int) -> None:
        self.slot = slot
        self.uid = SANDBOX_UID_BASE + slot if os.geteuid() == 0 else None
        self.cgroup = _PidsCgroup.create(sandbox.limits.processes + 8) if sandbox.use_cgroup else None
        self.workdir = None
        reply_read, reply_write = os.pipe()
        if sandbox.isolation == "bwrap":
            command, cwd = _bwrap_command(sandbox.limits.workdir_mb << 20, reply_write), None
        else:
            self.workdir = tempfile.mkdtemp(prefix="grpoflow-sandbox-")
            command, cwd = _unshare_command(reply_write), self.workdir
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
        data = json.dumps(payload).encode()
        try:
            self.process.stdin.write(len(data).to_bytes(8, "big") + data)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        deadline = time.monotonic() + timeout
        received = b""
        while True:
            needed = 8 if len(received) < 8 else 8 + int.from_bytes(received[:8], "big")
            if len(received) >= needed and len(received) > 8:
                return json.loads(received[8:needed])
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.replies], [], [], remaining)[0]:
                return None
            chunk = os.read(self.replies, 1 << 20)
            if not chunk:
                return None
            received += chunk

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


class Sandbox:
    """Runs jobs isolated and in parallel on ``workers`` long-lived sandboxes (default: the machine's cores);
    thread-safe. ``close()`` (or the end of the process) tears them down."""

    def __init__(
        self, limits: SandboxLimits | None = None, workers: int | None = None, isolation: Isolation | None = None
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.isolation = isolation or detect_isolation()
        self.use_cgroup = _cgroup_available()
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._free_slots = list(range(self.workers))
        self._lock = threading.Lock()
        self._available = threading.Semaphore(self.workers)
        self._all: set[_Worker] = set()
        atexit.register(self.close)
        logger.info("sandbox: %s, %d workers", self.describe(), self.workers)

    def describe(self) -> str:
        """One line for logs and run tags, e.g. ``bwrap + cgroup pids + uid drop``."""
        parts = [self.isolation]
        parts.append("cgroup pids" if self.use_cgroup else "no cgroup (RLIMIT_NPROC only)")
        parts.append("uid drop" if os.geteuid() == 0 else f"uid {os.geteuid()} (no uid drop)")
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
        started = time.monotonic()
        limits = self.limits
        nonce = secrets.token_hex(16)
        try:
            worker = self._acquire()
        except OSError as exc:
            return SandboxResult("infrastructure", detail=f"cannot start the sandbox: {exc}")
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
