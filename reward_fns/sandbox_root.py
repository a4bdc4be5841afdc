"""The ``unshare`` path's private root: run inside fresh mount, PID, network, IPC and UTS namespaces (as their root),
it builds the same filesystem bubblewrap gives a sandbox — the interpreter and ``/usr`` read-only, a private
``/dev`` and ``/proc``, a size-capped writable ``/work`` and nothing else of the host — pivots into it, detaches the
host's tree, keeps only the supervisor's capabilities and execs the command it was given.

Usage: ``python -I -S -B sandbox_root.py NEW_ROOT WORKDIR_BYTES PYTHON_PREFIX|- COMMAND...`` where ``NEW_ROOT`` is
an empty host folder to mount the root's tmpfs on and ``COMMAND`` is run inside (paths as the sandbox sees them).
Must not import: anything outside the standard library (it runs before the sandbox exists).
"""

import ctypes
import os
import platform
import socket
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
# statvfs's ST_* flags share the MS_* values; these must be kept on a read-only remount inside a user namespace.
_LOCKED_FLAGS = 2 | 4 | 8 | 1024 | 2048 | 4096  # nosuid, nodev, noexec, noatime, nodiratime, relatime
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
PR_CAPBSET_DROP = 24
# What the harness's supervisor keeps (as ``bwrap --cap-add`` does): switch users, clean up after them.
KEPT_CAPS = {0, 1, 3, 5, 6, 7}  # CHOWN, DAC_OVERRIDE, FOWNER, KILL, SETGID, SETUID
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {target}")


def bind_read_only(source: str, target: str) -> None:
    """Bind ``source`` (recursively) on ``target``, then make it read-only, keeping the flags a user namespace
    may not drop."""
    mount(source, target, None, MS_BIND | MS_REC)
    kept = os.statvfs(source).f_flag & _LOCKED_FLAGS
    mount("none", target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def _place(path: str, directory: bool) -> None:
    if directory:
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        with open(path, "a"):
            pass


def build_root(root: str, workdir_bytes: int, python_prefix: str | None) -> None:
    """Mount a tmpfs on ``root`` and fill it with what a sandbox sees; nothing of the host is writable there."""
    mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64"):
        host = "/" + name
        if os.path.islink(host):  # merged-/usr systems link these into /usr
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _place(os.path.join(root, name), True)
            bind_read_only(host, os.path.join(root, name))
    if python_prefix:
        _place(os.path.join(root, "opt/python"), True)
        bind_read_only(python_prefix, os.path.join(root, "opt/python"))
    harness = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
    _place(os.path.join(root, "opt/grpoflow/harness.py"), False)
    bind_read_only(harness, os.path.join(root, "opt/grpoflow/harness.py"))
    dev = os.path.join(root, "dev")
    _place(dev, True)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID, "mode=0755,size=64k")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            _place(os.path.join(dev, name), False)
            mount("/dev/" + name, os.path.join(dev, name), None, MS_BIND)
    _place(os.path.join(dev, "shm"), True)
    mount("tmpfs", os.path.join(dev, "shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=16m")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1")):
        os.symlink(target, os.path.join(dev, name))
    os.symlink("/proc/self/fd/2", os.path.join(dev, "stderr"))
    _place(os.path.join(root, "proc"), True)
    mount("proc", os.path.join(root, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _place(os.path.join(root, "work"), True)
    mount("tmpfs", os.path.join(root, "work"), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={workdir_bytes}")
    _place(os.path.join(root, "oldroot"), True)


def enter_root(root: str) -> None:
    """``pivot_root`` into ``root`` and detach the host's tree: no path leads back to a host file."""
    number = _SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: unknown system call number on {platform.machine()}")
    os.chdir(root)
    _check(_libc.syscall(number, b".", b"oldroot"), "pivot_root")
    os.chdir("/")
    _check(_libc.umount2(b"/oldroot", MNT_DETACH), "umount /oldroot")
    os.rmdir("/oldroot")
    mount("none", "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_capabilities() -> None:
    """Leave only the supervisor's capabilities in the bounding set (the exec that follows keeps no others)."""
    for cap in range(64):
        if cap not in KEPT_CAPS and _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # past the kernel's last capability


def main(argv: list[str]) -> None:
    root, workdir_bytes, prefix, *command = argv
    build_root(root, int(workdir_bytes), None if prefix == "-" else prefix)
    enter_root(root)
    socket.sethostname("sandbox")
    drop_capabilities()
    os.chdir("/work")
    os.execve(command[0], command, {"PATH": "/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8"})


if __name__ == "__main__":
    main(sys.argv[1:])
