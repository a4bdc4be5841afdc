"""The verdict cache: a judge's or reward model's verdicts kept by content, shared across runs and processes.

A verdict is keyed by everything that decides it — the judge's identity (its model's digest), its prompt
template, its sampling settings, the prompt, the completion and the reference — so ``rescore`` with the same judge,
a resumed run and a rerun with the same seed read the verdicts the first run got instead of asking a server that
samples (and would answer differently) again. Only verdicts are kept: a ``None`` (a judge that was down, slow or
unreadable) is asked again next time. One SQLite file, safe for several processes (WAL, a busy timeout).
Must not import: ``tasks``, ``flows``, Prefect, MLflow.
"""

from __future__ import annotations

import hashlib
import json
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


class VerdictCache:
    """Verdicts by key, in one SQLite file (``path``) or in memory (``path=None``: kept for this object only).

    >>> cache = VerdictCache(None)
    >>> cache.put_many({"k1": 0.75, "k2": None}); cache.get_many(["k1", "k2", "k3"])
    {'k1': 0.75}
    >>> cache.stats
    CacheStats(hits=1, misses=2, stored=1)
    """

    def __init__(self, path: str | Path | None) -> None:
        self.path = None if path is None else Path(path)
        self.stats = CacheStats()
        self._lock = threading.Lock()
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        # One connection per object, used under the lock (a reward may be called from a worker thread).
        self._db = sqlite3.connect(":memory:" if self.path is None else self.path, timeout=60, check_same_thread=False)
        with self._lock:
            if self.path is not None:
                self._db.execute("PRAGMA journal_mode=WAL")
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
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])
