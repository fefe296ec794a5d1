"""How fast a machine runs the host steps of kvxfer's path, and what its vCPUs did meanwhile:
so that a per-request figure from one machine can be read against another's.

* ``micro``: small operations of the kind the request path is made of, each the median µs
  of many: a NumPy fancy-index of 1000 ids, a small array built and filled, a msgpack
  encode of a Done-sized message, a ctypes call into libc, a dict lookup of a tuple key,
  ``time.perf_counter``, each warm (in a loop) and alone right after 2 ms asleep (as a request
  after idle); and a thread wake-up (a ``threading.Event`` set by another thread
  that sleeps in between: the set → the waiter running).
* ``snap FILE``: write ``/proc/stat``'s cpu line; ``diff FILE``: the share of each state
  (user, system, idle, iowait, steal, ...) since that snapshot, over every vCPU — steal is
  time a vCPU was runnable but the hypervisor ran something else.

    python3 bench/host_cost.py micro
    python3 bench/host_cost.py snap /tmp/stat0; <work>; python3 bench/host_cost.py diff /tmp/stat0
"""

from __future__ import annotations

import ctypes
import statistics
import sys
import threading
import time
from typing import Callable, List

import msgpack
import numpy as np

FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _time(fn: Callable[[], object], n: int = 2000, rounds: int = 7) -> float:
    """Median over ``rounds`` of the mean µs of ``n`` calls."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def _cold(fn: Callable[[], object], n: int = 200) -> float:
    """Median µs of ONE call made right after 2 ms asleep (as a request after idle)."""
    out = []
    for _ in range(n):
        time.sleep(0.002)
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def _wake(n: int = 200) -> float:
    """Median µs from ``Event.set()`` to the waiting thread running, after 2 ms idle each."""
    ev, stamps = threading.Event(), []
    got: List[float] = []

    def waiter() -> None:
        for _ in range(n):
            ev.wait()
            got.append(time.perf_counter())
            ev.clear()

    th = threading.Thread(target=waiter)
    th.start()
    for _ in range(n):
        time.sleep(0.002)
        while ev.is_set():
            time.sleep(0.0005)
        stamps.append(time.perf_counter())
        ev.set()
    th.join()
    return statistics.median((b - a) * 1e6 for a, b in zip(stamps, got))


def micro() -> None:
    rng = np.random.default_rng(0)
    table = rng.integers(0, 1 << 30, 16000)
    ids = rng.integers(0, 16000, 1000)
    src, dst = np.arange(1000), np.arange(1000)
    done = {"room": 123456, "pages": 1000, "sums": None, "kind": "done"}
    libc = ctypes.CDLL(None)
    d = {(i, i + 1, "kv"): i for i in range(64)}
    k = (7, 8, "kv")

    def fill() -> None:
        p = np.empty((1000, 2), dtype=np.int64)
        p[:, 0], p[:, 1] = src, dst

    rows = [
        ("numpy fancy index, 1000 of 16000", lambda: table[ids]),
        ("numpy [1000, 2] array built and filled", fill),
        ("msgpack encode of a Done-sized dict", lambda: msgpack.packb(done)),
        ("ctypes call (libc getpid)", libc.getpid),
        ("dict lookup, tuple key", lambda: d[k]),
        ("time.perf_counter()", time.perf_counter),
    ]
    print(f"{'operation':45s} {'warm µs':>9s} {'after 2 ms idle µs':>19s}")
    for name, fn in rows:
        print(f"{name:45s} {_time(fn):9.3f} {_cold(fn):19.3f}")
    print(f"{'thread wake-up after 2 ms idle (p50)':45s} {_wake():8.1f} µs")


def _read() -> List[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main(argv: List[str]) -> None:
    if argv[:1] == ["micro"]:
        micro()
    elif argv[:1] == ["snap"]:
        with open(argv[1], "w") as f:
            f.write(" ".join(map(str, _read())))
    elif argv[:1] == ["diff"]:
        with open(argv[1]) as f:
            before = [int(x) for x in f.read().split()]
        delta = [b - a for a, b in zip(before, _read())]
        total = sum(delta) or 1
        print(
            "cpu time shares since the snapshot: "
            + ", ".join(f"{n} {100 * v / total:.1f} %" for n, v in zip(FIELDS, delta))
        )
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
