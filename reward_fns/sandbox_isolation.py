"""How a sandbox worker is isolated: the bubblewrap (or ``unshare``) command line that starts the harness in new
namespaces, which of the two works here, and a per-worker cgroup that caps its processes.

Must not import: anything outside the standard library (the parent side of the sandbox stays light).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path
from typing import IO, Literal

logger = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("sandbox_harness.py")
ROOT_BUILDER = Path(__file__).with_name("sandbox_root.py")
Isolation = Literal["bwrap", "unshare"]
# The supervisor switches to the job's user and cleans up after it; everything else is dropped.
_SUPERVISOR_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_FOWNER")
_PIDS_CGROUP_V1 = Path("/sys/fs/cgroup/pids")
_CGROUP_V2 = Path("/sys/fs/cgroup")


class SandboxUnavailable(RuntimeError):
    """Neither bubblewrap nor unshare can create the namespaces here; model code must not run unisolated."""


# Dedicated user ids for sandboxed runs, far above any account on a normal machine: one per live sandbox worker on
# the machine. Root's sandboxes share the host's user namespace, where the per-user process limit counts every
# process of a user: two workers with one user id (two ranks, two pipelines, two sandboxes in one process) would
# take a correct program's processes away when the other runs a greedy one. Each worker claims its id by holding
# a lock file; closing it, or the end of the process, frees the id.
SANDBOX_UID_BASE = 1_800_000_000
SANDBOX_UID_COUNT = 4096
UID_CLAIMS = Path("/tmp/grpoflow-sandbox-uids")  # one folder for every process on the machine, whatever its TMPDIR
_CLAIMED_HERE: set[int] = set()  # the ids this process's workers hold


def _try_lock(folder: Path, uid: int) -> IO[str] | None:
    handle = (folder / str(uid - SANDBOX_UID_BASE)).open("a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def claim_uid(folder: Path = UID_CLAIMS) -> tuple[int, IO[str]]:
    """A sandbox user id that no other live worker on this machine holds, and the open lock file that holds it
    (``release_uid`` frees it; so does the end of the process).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> (first, held), (second, _) = claim_uid(folder), claim_uid(folder)
    >>> second - first
    1
    >>> release_uid(first, held); claim_uid(folder)[0] == first  # freed, so claimed again
    True
    """
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for uid in range(SANDBOX_UID_BASE, SANDBOX_UID_BASE + SANDBOX_UID_COUNT):
        handle = _try_lock(folder, uid)
        if handle is not None:
            _CLAIMED_HERE.add(uid)
            return uid, handle
    raise SandboxUnavailable(f"all {SANDBOX_UID_COUNT} sandbox user ids are held by live sandboxes on this machine")


def release_uid(uid: int, handle: IO[str]) -> None:
    """Free an id ``claim_uid`` gave (once its worker's processes are gone)."""
    _CLAIMED_HERE.discard(uid)
    handle.close()


def held_elsewhere(uid: int, folder: Path = UID_CLAIMS) -> bool:
    """Whether a live sandbox worker of another process holds ``uid`` (its processes are that sandbox's business).

    >>> held_elsewhere(SANDBOX_UID_BASE + SANDBOX_UID_COUNT - 1, Path(__import__("tempfile").mkdtemp()))
    False
    """
    if uid in _CLAIMED_HERE or not SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_UID_COUNT:
        return False
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    handle = _try_lock(folder, uid)
    if handle is None:
        return True
    handle.close()
    return False


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


def bwrap_command(workdir_bytes: int, reply_fd: int = 3) -> list[str]:
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


def unshare_command(new_root: str, workdir_bytes: int, reply_fd: int = 3) -> list[str]:
    """``unshare`` into new namespaces, where ``sandbox_root.py`` mounts a private root on the empty host folder
    ``new_root`` (what bubblewrap builds: read-only interpreter, private ``/dev``, ``/proc`` and ``/work``), pivots
    into it and execs the harness there."""
    command = ["unshare", "--net", "--pid", "--ipc", "--uts", "--mount", "--fork", "--kill-child"]
    if os.geteuid() != 0:
        command.insert(1, "--map-root-user")
    python, prefix = _interpreter()
    builder = [os.path.realpath(sys.executable), "-I", "-S", "-B", str(ROOT_BUILDER), new_root, str(workdir_bytes)]
    return [*command, *builder, prefix or "-", python, "-I", "-S", "-B", "/opt/grpoflow/harness.py", str(reply_fd)]


@lru_cache(maxsize=1)
def _unshare_works() -> bool:
    """Whether ``unshare`` can build the private root here (it needs a mount namespace it may mount in)."""
    if not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory(prefix="grpoflow-sandbox-") as new_root:
        return _works([*unshare_command(new_root, 1 << 20)[:-6], "/usr/bin/true"])


@lru_cache(maxsize=1)
def _bwrap_works() -> bool:
    return bool(shutil.which("bwrap")) and _works([*bwrap_command(1 << 20)[:-6], "/usr/bin/true"])


ISOLATION_ENV = "GRPOFLOW_SANDBOX"  # bwrap | unshare | auto (the default): which isolation model code runs in
_INSTALL_BWRAP = "install bubblewrap (apt-get install bubblewrap; dnf install bubblewrap)"


def detect_isolation() -> Isolation:
    """``bwrap`` when bubblewrap can create the namespaces here, else ``unshare`` when it can build the sandbox's
    private root; ``GRPOFLOW_SANDBOX=bwrap|unshare`` asks for one. Raises SandboxUnavailable (never a sandbox that
    sees the host's files)."""
    wanted = os.environ.get(ISOLATION_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "bwrap", "unshare"):
        raise SandboxUnavailable(f"{ISOLATION_ENV}={wanted!r}: expected bwrap, unshare or auto")
    if wanted in ("auto", "bwrap") and _bwrap_works():
        return "bwrap"
    if wanted == "bwrap":
        raise SandboxUnavailable(
            f"{ISOLATION_ENV}=bwrap but bubblewrap cannot create namespaces here: {_INSTALL_BWRAP}"
        )
    if _unshare_works():
        return "unshare"
    raise SandboxUnavailable(
        f"cannot isolate model-written code: {_INSTALL_BWRAP}; unshare cannot build a private root here (no mount "
        "namespace). Model code never runs unisolated"
    )


class PidsCgroup:
    """A per-run cgroup capping the number of processes; ``None`` from ``create`` where cgroups are not writable."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, limit: int) -> PidsCgroup | None:
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
def cgroup_available() -> bool:
    cgroup = PidsCgroup.create(4)
    if cgroup is None:
        return False
    cgroup.kill_and_remove()
    return True
