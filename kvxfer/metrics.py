"""Transfer metrics a serving engine's operators can scrape.

:class:`TransferMetrics` counts, per component (``role``: e.g. ``"prefill"``/``"decode"``):
bytes moved, requests by outcome, failures by cause (the exception type name) and a latency
histogram of completed requests. The numbers are always kept in-process (:meth:`snapshot`);
when ``prometheus-client`` is installed (``pip install kvxfer[metrics]``) they are also
exported through its default registry, so a process that already serves ``/metrics``
(SGLang does, multiprocess mode included) exports them with no further setup:

* ``kvxfer_transfer_bytes_total{role}``
* ``kvxfer_requests_total{role, outcome}`` (``success`` | ``failed``)
* ``kvxfer_failures_total{role, cause}``
* ``kvxfer_transfer_latency_seconds{role}`` (histogram)

Thread-safe; the Prometheus families are created once per process.
"""

from __future__ import annotations

import bisect
import threading
from typing import Dict, Optional, Tuple

from kvxfer.errors import InvalidArgument

#: latency histogram bucket bounds (seconds)
BUCKETS: Tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)

_PROM = None
_PROM_LOCK = threading.Lock()


def _prometheus():
    """The four metric families, or None when prometheus_client is not installed."""
    global _PROM
    with _PROM_LOCK:
        if _PROM is None:
            try:
                import prometheus_client as pc
            except ImportError:
                _PROM = False
            else:
                _PROM = (
                    pc.Counter(
                        "kvxfer_transfer_bytes", "Bytes moved by kvxfer transfers", ["role"]
                    ),
                    pc.Counter(
                        "kvxfer_requests", "Requests that finished, by outcome", ["role", "outcome"]
                    ),
                    pc.Counter("kvxfer_failures", "Failed requests, by cause", ["role", "cause"]),
                    pc.Histogram(
                        "kvxfer_transfer_latency_seconds",
                        "Transfer latency of completed requests",
                        ["role"],
                        buckets=BUCKETS,
                    ),
                )
        return _PROM or None


def prometheus_available() -> bool:
    return _prometheus() is not None


class TransferMetrics:
    """Counters of one component; see the module docstring."""

    def __init__(self, role: str) -> None:
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"metrics role must be a non-empty str, got {role!r}")
        self.role = role
        self._lock = threading.Lock()
        self._bytes = 0
        self._outcomes: Dict[str, int] = {"success": 0, "failed": 0}
        self._causes: Dict[str, int] = {}
        self._latency_counts = [0] * (len(BUCKETS) + 1)  # last: +Inf
        self._latency_sum = 0.0
        self._prom = _prometheus()

    def __repr__(self) -> str:
        return f"TransferMetrics({self.role}, {self.snapshot()['requests']})"

    def add_bytes(self, nbytes: int) -> None:
        nbytes = int(nbytes)
        if nbytes < 0:
            raise InvalidArgument(f"negative byte count {nbytes}")
        with self._lock:
            self._bytes += nbytes
        if self._prom:
            self._prom[0].labels(self.role).inc(nbytes)

    def succeeded(self, latency_s: Optional[float] = None) -> None:
        """One request completed; ``latency_s`` (if known) goes into the histogram."""
        with self._lock:
            self._outcomes["success"] += 1
            if latency_s is not None:
                self._latency_counts[bisect.bisect_left(BUCKETS, latency_s)] += 1
                self._latency_sum += latency_s
        if self._prom:
            self._prom[1].labels(self.role, "success").inc()
            if latency_s is not None:
                self._prom[3].labels(self.role).observe(latency_s)

    def failed(self, cause) -> None:
        """One request failed; ``cause`` is an exception (its type name is used) or a str."""
        name = cause if isinstance(cause, str) else type(cause).__name__
        with self._lock:
            self._outcomes["failed"] += 1
            self._causes[name] = self._causes.get(name, 0) + 1
        if self._prom:
            self._prom[1].labels(self.role, "failed").inc()
            self._prom[2].labels(self.role, name).inc()

    def snapshot(self) -> dict:
        """Plain dict of everything counted so far (JSON-able)."""
        with self._lock:
            buckets = {}
            acc = 0
            for bound, n in zip(BUCKETS + (float("inf"),), self._latency_counts):
                acc += n
                buckets["+Inf" if bound == float("inf") else f"{bound:g}"] = acc
            return {
                "role": self.role,
                "bytes": self._bytes,
                "requests": dict(self._outcomes),
                "failures": dict(self._causes),
                "latency_s": {"count": acc, "sum": self._latency_sum, "buckets": buckets},
            }


__all__ = ["BUCKETS", "TransferMetrics", "prometheus_available"]
