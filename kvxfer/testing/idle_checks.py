"""Idle CPU of connected engines and managers (``tests/engine/test_idle_cpu.py``): a loop
with a connected peer must sleep in epoll between events, not poll (kvxfer issue 15:
UCXX's ``wait_yield`` made every such loop spin). :class:`IdleNode` runs in a spawned
process so that the process CPU it reports is that of the engines alone."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Dict


def cpu_over(clocks: Dict[str, Callable[[], float]], window_s: float) -> Dict[str, float]:
    """Cores used over ``window_s`` (the calling thread sleeps through it: it is the
    measurement window, not a synchronisation): the process (``process``) and each of
    ``clocks`` (name -> CPU seconds so far, e.g. ``LoopThread.cpu_seconds``)."""
    c0 = {k: f() for k, f in clocks.items()}
    p0, w0 = time.process_time(), time.monotonic()
    time.sleep(window_s)
    p1, w1 = time.process_time(), time.monotonic()
    out = {k: (f() - c0[k]) / (w1 - w0) for k, f in clocks.items()}
    out["process"] = (p1 - p0) / (w1 - w0)
    return out


class IdleNode:
    """Two SyncEngines in this process, connected (A -> B), with a message each way."""

    def __init__(self, error_mode: str = "peer") -> None:
        import numpy as np

        from kvxfer.config import EngineConfig
        from kvxfer.sync import SyncEngine

        self.bufs = [np.zeros(1 << 16, np.uint8) for _ in range(2)]
        self.engines = []
        for name, buf in zip("ab", self.bufs):
            e = SyncEngine(
                EngineConfig(
                    secret=b"idle-secret",
                    name=f"idle-{name}",
                    error_mode=error_mode,
                    warn_slow_lanes=False,
                    connect_timeout_s=20.0,
                    transfer_timeout_s=10.0,
                )
            )
            e.register("kv", [buf.ctypes.data], [buf.nbytes], [256])
            self.engines.append(e)
        a, b = self.engines
        host, port = b.start()
        a.start()
        self.peer = a.connect(host, port)

    def ping(self, timeout: float = 10.0) -> bool:
        """A message A -> B and back (B answers on its loop): the channel carries both
        ways; returns once A has the answer (bounded)."""
        a, b = self.engines

        def answer(peer, payload: bytes) -> None:  # Runs on: B's loop thread
            asyncio.ensure_future(peer.send(b"pong:" + payload, timeout))

        b.engine.on_message(answer)
        self.peer.send(b"ping")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if any(p == b"pong:ping" for _, p in a.poll_messages()):
                return True
            time.sleep(0.005)  # polling a result with a deadline; not the measurement
        return False

    def idle_cpu(self, window_s: float) -> Dict[str, float]:
        a, b = self.engines
        return cpu_over({"loop_a": a._lt.cpu_seconds, "loop_b": b._lt.cpu_seconds}, window_s)

    def close(self) -> None:
        for e in self.engines:
            e.close()
