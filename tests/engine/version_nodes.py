"""One TransferEngine per spawned process (:class:`VersionNode`), so that two engines of one
test can differ in what a deployment must keep equal: the channel wait mode
(``KVXFER_CHANNEL_WAIT``, from the worker's environment) and the protocol version (the
transport's ``test_opening`` hook: what its channels announce). ``tests/engine/test_version.py``
drives them."""

from __future__ import annotations

import threading
import time

import numpy as np

SECRET = b"version-secret"


class VersionNode:
    def __init__(self, name: str) -> None:
        from kvxfer.config import EngineConfig
        from kvxfer.sync import SyncEngine

        self.buf = np.zeros(1 << 16, dtype=np.uint8)
        self.eng = SyncEngine(EngineConfig(secret=SECRET, name=name, connect_timeout_s=20.0))
        self.eng.register("kv", [self.buf.ctypes.data], [self.buf.nbytes], [256])
        self.eng.start()
        self._refused: list = []
        self._refusal = threading.Event()
        t = self.eng.engine._transport

        def refused(exc):  # Runs on: the engine's loop thread
            self._refused.append(exc)
            self._refusal.set()

        t.on_refused = refused

    def address(self):
        return tuple(self.eng.address)

    def announce(self, version) -> None:
        """Channels of this engine (either role) announce ``version`` (None: the real one)."""
        over = {} if version is None else {"version": version}
        self.eng.engine._transport.test_opening = {"connect": over, "accept": over}

    def connect(self, host: str, port: int) -> dict:
        """Connect to another node's engine: the error (type, message, versions) or
        ``connected`` (the peer is closed again), and how long it took."""
        t0 = time.monotonic()
        try:
            peer = self.eng.connect(host, port)
        except Exception as exc:
            return {
                "error": type(exc).__name__,
                "msg": str(exc),
                "versions": [getattr(exc, "ours", None), getattr(exc, "theirs", None)],
                "s": time.monotonic() - t0,
            }
        out = {"error": "connected", "s": time.monotonic() - t0}
        peer.close()
        return out

    def refusal(self, timeout: float) -> dict:
        """The accepting side's refusal (the listener's typed error), once it is logged."""
        if not self._refusal.wait(timeout):
            return {"error": "not refused"}
        self._refusal.clear()
        exc = self._refused.pop(0)
        return {
            "error": type(exc).__name__,
            "msg": str(exc),
            "versions": [getattr(exc, "ours", None), getattr(exc, "theirs", None)],
            "peers": len(self.eng.engine.peers),
        }

    def state(self) -> dict:
        t = self.eng.engine._transport
        return {"peers": len(self.eng.engine.peers), "notes": len(t._notes)}

    def close(self) -> None:
        self.eng.close()
