"""What ``grpoflow serve`` counts: requests by version and status, their latency, switches and failed checks; shown
on ``/metrics`` (Prometheus' text format) and logged to the server's MLflow run.
Must not import: torch, transformers, Prefect, MLflow.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by the nearest rank (0.0 when empty).

    >>> quantile([0.1, 0.2, 0.3, 0.4], 0.5), quantile([0.1, 0.2, 0.3, 0.4], 0.95), quantile([], 0.5)
    (0.2, 0.4, 0.0)
    """
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 1))))
    return ordered[rank - 1]


@dataclass
class ServingMetrics:
    """Counters and recent latencies (the last ``window`` requests), safe to update from many threads."""

    window: int = 1000
    requests: Counter = field(default_factory=Counter)  # (version, status code) -> count
    switches: int = 0
    failed_checks: int = 0
    latency_sum_s: float = 0.0
    _latencies: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, version: str, status: int, seconds: float) -> None:
        with self._lock:
            self.requests[(version, status)] += 1
            self.latency_sum_s += seconds
            self._latencies.append(seconds)
            while len(self._latencies) > self.window:
                self._latencies.popleft()

    def count_switch(self) -> None:
        with self._lock:
            self.switches += 1

    def count_failed_check(self) -> None:
        with self._lock:
            self.failed_checks += 1

    def summary(self) -> dict[str, float]:
        """The numbers logged to MLflow: totals, and latency p50/p95 over the window."""
        with self._lock:
            latencies = list(self._latencies)
            total = sum(self.requests.values())
            failed = sum(count for (_, status), count in self.requests.items() if status >= 500)
            return {
                "requests": float(total),
                "failed_requests": float(failed),
                "switches": float(self.switches),
                "failed_checks": float(self.failed_checks),
                "latency_p50_s": quantile(latencies, 0.5),
                "latency_p95_s": quantile(latencies, 0.95),
            }

    def prometheus(self, serving_version: str | None, in_flight: int) -> str:
        """The counters in Prometheus' text exposition format.

        >>> metrics = ServingMetrics(); metrics.observe("2", 200, 0.5)
        >>> print(metrics.prometheus("2", 0).splitlines()[2])
        grpoflow_serve_requests_total{version="2",status="200"} 1
        """
        with self._lock:
            latencies = list(self._latencies)
            lines = [
                "# HELP grpoflow_serve_requests_total Requests answered, by version and status.",
                "# TYPE grpoflow_serve_requests_total counter",
            ]
            lines += [
                f'grpoflow_serve_requests_total{{version="{version}",status="{status}"}} {count}'
                for (version, status), count in sorted(self.requests.items())
            ]
            lines += [
                "# TYPE grpoflow_serve_request_seconds summary",
                *(
                    f'grpoflow_serve_request_seconds{{quantile="{q}"}} {quantile(latencies, q):.6f}'
                    for q in (0.5, 0.95)
                ),
                f"grpoflow_serve_request_seconds_sum {self.latency_sum_s:.6f}",
                f"grpoflow_serve_request_seconds_count {sum(self.requests.values())}",
                "# TYPE grpoflow_serve_switches_total counter",
                f"grpoflow_serve_switches_total {self.switches}",
                "# TYPE grpoflow_serve_failed_checks_total counter",
                f"grpoflow_serve_failed_checks_total {self.failed_checks}",
                "# TYPE grpoflow_serve_in_flight gauge",
                f"grpoflow_serve_in_flight {in_flight}",
                "# TYPE grpoflow_serve_version gauge",
                f"grpoflow_serve_version {serving_version or 0}",
            ]
        return "\n".join(lines) + "\n"
