"""The verdict cache: a judge's or reward model's verdicts kept by content, shared across runs and processes.

A verdict is keyed by everything that decides it — the judge's identity (its model's digest), its prompt
template, its sampling settings, the prompt, the completion and the reference — so ``rescore`` with the same judge,
a resumed run and a rerun with the same seed read the verdicts the first run got instead of asking a server that
samples (and would answer differently) again. Only verdicts are kept: a ``None`` (a judge that was down, slow or
unreadable) is asked again next time. One SQLite file, safe for several processes (WAL, a busy timeout); on a
network filesystem, where WAL is unsafe across hosts, one file per host without WAL (``verdict_cache_file``).
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import hashlib
import json
import socket
import sqlite3
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Bump when what a key covers changes: old verdicts are then never read.
CACHE_VERSION = "v1"


def verdict_key(judge: Mapping[str, Any], prompt: Any, completion: Any, reference: Any = None) -> str:
    """The content key of one verdict: ``judge`` holds the judge's identity and every setting that changes its
    answer (model digest, template, sampling); prompt, completion and reference are text or chat messages.

    >>> judge = {"model": "judge-7b", "digest": "abc", "template": "Score {completion}", "temperature": 1.0}
    >>> key = verdict_key(judge, "Sum 2+2", "4", "4")
    >>> key == verdict_key(dict(judge), "Sum 2+2", "4", "4"), key == verdict_key(judge, "Sum 2+2", "5", "4")
    (True, False)
    >>> key == verdict_key({**judge, "temperature": 0.0}, "Sum 2+2", "4", "4"), len(key)
    (False, 32)
    """
    payload = json.dumps(
        {"v": CACHE_VERSION, "judge": judge, "prompt": prompt, "completion": completion, "reference": reference},
        sort_keys=True,
        ensure_ascii=False,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


@dataclass
class CacheStats:
    """What the cache answered in this process: ``hits`` read back, ``misses`` asked of the judge, ``stored``."""

    hits: int = 0
    misses: int = 0
    stored: int = 0


# Filesystems where several hosts may open one file: SQLite's WAL (shared memory beside the database) and its
# POSIX locks are documented unsafe there (https://www.sqlite.org/wal.html, "WAL does not work over a network
# filesystem").
NETWORK_FILESYSTEMS = frozenset(
    {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "glusterfs", "ceph", "9p", "fuse.sshfs"}
    | {"fuse.glusterfs", "fuse.cephfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.juicefs", "afs", "ocfs2", "gfs2"}
)


def filesystem_of(path: str | Path, mountinfo: str | None = None) -> str:
    """The type of the filesystem holding ``path`` (its nearest existing folder), from ``/proc/self/mountinfo``;
    ``""`` where that cannot be read.

    >>> info = "36 1 0:30 / / rw - ext4 /dev/sda1 rw\\n40 36 0:41 / /home rw - nfs4 srv:/home rw\\n"
    >>> filesystem_of("/home/ann/.cache/grpoflow", info), filesystem_of("/tmp/x", info)
    ('nfs4', 'ext4')
    """
    target = Path(path).absolute()
    if mountinfo is None:  # this machine: the nearest folder that exists, its links resolved
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return ""
        while not target.exists() and target != target.parent:
            target = target.parent
        target = target.resolve()
    best, kind = "", ""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = str(target) == point or str(target).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def verdict_cache_file(folder: str | Path, mountinfo: str | None = None) -> tuple[Path, bool]:
    """Where this host keeps its verdicts under ``folder``, and whether it may use WAL: ``verdicts.sqlite3`` on a
    local disk; on a network filesystem (a cluster's shared home) a file of this host's own,
    ``verdicts-<host>.sqlite3``, without WAL, so no two nodes ever open one SQLite file.

    >>> info = "36 1 0:30 / / rw - ext4 /dev/sda1 rw\\n40 36 0:41 / /home rw - nfs4 srv:/home rw\\n"
    >>> verdict_cache_file("/tmp/c", info)
    (PosixPath('/tmp/c/verdicts.sqlite3'), True)
    >>> path, wal = verdict_cache_file("/home/ann/c", info); path.name.startswith("verdicts-"), wal
    (True, False)
    """
    folder = Path(folder)
    if filesystem_of(folder, mountinfo) in NETWORK_FILESYSTEMS:
        host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname()) or "host"
        return folder / f"verdicts-{host}.sqlite3", False
    return folder / "verdicts.sqlite3", True


class VerdictCache:
    """Verdicts by key, in one SQLite file (``path``) or in memory (``path=None``: kept for this object only).

    >>> cache = VerdictCache(None)
    >>> cache.put_many({"k1": 0.75, "k2": None}); cache.get_many(["k1", "k2", "k3"])
    {'k1': 0.75}
    >>> cache.stats
    CacheStats(hits=1, misses=2, stored=1)
    """

    def __init__(self, path: str | Path | None, wal: bool = True) -> None:
        self.path = None if path is None else Path(path)
        self.wal = wal
        self.stats = CacheStats()
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection per object, used under the lock (a reward may be called from a worker thread).
        self._db = sqlite3.connect(":memory:" if self.path is None else self.path, timeout=60, check_same_thread=False)
        with self._lock:
            if self.path is not None:  # WAL lets readers and a writer overlap; only on a disk of this host's own
                self._db.execute(f"PRAGMA journal_mode={'WAL' if wal else 'DELETE'}")
            self._db.execute("CREATE TABLE IF NOT EXISTS verdicts (key TEXT PRIMARY KEY, verdict REAL NOT NULL)")
            self._db.commit()

    def get_many(self, keys: Iterable[str]) -> dict[str, float]:
        """The cached verdicts among ``keys`` (absent keys are left out)."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, float] = {}
        with self._lock:
            for start in range(0, len(wanted), 500):  # SQLite's bound on parameters per statement
                chunk = wanted[start : start + 500]
                marks = ",".join("?" * len(chunk))
                rows = self._db.execute(f"SELECT key, verdict FROM verdicts WHERE key IN ({marks})", chunk)
                found.update({key: float(verdict) for key, verdict in rows})
        self.stats.hits += len(found)
        self.stats.misses += len(wanted) - len(found)
        return found

    def put_many(self, verdicts: Mapping[str, float | None]) -> None:
        """Keep the verdicts that are numbers; a None is no verdict and is asked again next time."""
        rows = [(key, float(value)) for key, value in verdicts.items() if value is not None]
        if not rows:
            return
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO verdicts (key, verdict) VALUES (?, ?)", rows)
            self._db.commit()
        self.stats.stored += len(rows)

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __getstate__(self) -> dict[str, Any]:  # a reward is pickled to other processes: it reopens the file there
        return {"path": self.path, "wal": self.wal}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state.get("wal", True))
