"""Engine robustness scenarios run inside one spawned process: two engines (A: target,
B: initiator) on one event loop over real UCX loopback endpoints, host-memory groups.
``tests/engine/test_robustness.py`` drives them through a :class:`RobustNode` worker
(:mod:`kvxfer.procs`)."""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np

SECRET = b"robust-secret"
L, ITEM, ITEMS = 2, 256, 64


def _groups():
    """kv: per-layer (2*L descriptors), state: one slot table, aux: one metadata table."""
    return {"kv": [ITEM] * (2 * L), "state": [512], "aux": [64]}


class _Pair:
    def __init__(self, **cfg):
        from kvxfer.config import EngineConfig
        from kvxfer.engine import TransferEngine

        self.bufs = {}
        self.engines = {}
        for key in ("A", "B"):
            eng = TransferEngine(
                EngineConfig(
                    secret=SECRET, name=key, connect_timeout_s=10.0, transfer_timeout_s=10.0, **cfg
                )
            )
            self.bufs[key] = {}
            for g, ils in _groups().items():
                bufs = [np.zeros(ITEMS * il, dtype=np.uint8) for il in ils]
                self.bufs[key][g] = bufs
                eng.register(g, [b.ctypes.data for b in bufs], [b.nbytes for b in bufs], ils)
            self.engines[key] = eng
        self.inbox = asyncio.Queue()
        self.engines["A"].on_message(lambda peer, payload: self.inbox.put_nowait(payload))

    async def start(self):
        for e in self.engines.values():
            await e.start()
        return await self.connect()

    async def connect(self):
        """B connects to A; returns (B's peer, A's peer) once both sides are ready."""
        a = self.engines["A"]
        accepted = asyncio.get_running_loop().create_future()
        a._peer_handlers[:] = [lambda p: accepted.done() or accepted.set_result(p)]
        pb = await self.engines["B"].connect(*a.address)
        pa = await asyncio.wait_for(accepted, 10.0)
        return pb, pa

    async def close(self):
        for e in self.engines.values():
            await e.close()


class Scenarios:
    @staticmethod
    async def many_waits(n: int) -> dict:
        """``n`` bounded waits in flight on one peer; then the peer closes them all."""
        from kvxfer.errors import PeerClosed

        pair = _Pair()
        pb, pa = await pair.start()
        ev = asyncio.Event()
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(pb._bounded(ev.wait(), 30.0, "wait")) for _ in range(n)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        out = {"dead_callbacks": len(pb._dead._callbacks), "in_flight": n}
        # half complete normally (their bookkeeping is removed), then the peer dies
        ev.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        out["completed"] = sum(r is True for r in done)
        out["complete_s"] = time.perf_counter() - t0
        ev2 = asyncio.Event()
        tasks = [asyncio.ensure_future(pb._bounded(ev2.wait(), 30.0, "wait")) for _ in range(n)]
        await asyncio.sleep(0)
        t1 = time.perf_counter()
        await pa.close()  # Bye -> B marks the peer dead
        res = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20.0)
        out["dead_s"] = time.perf_counter() - t1
        out["peer_closed"] = sum(isinstance(r, PeerClosed) for r in res)
        await pair.close()
        return out

    @staticmethod
    async def abandoned_task(mode: str) -> dict:
        """A bounded wait ends first (timeout or peer death) and the abandoned inner task
        then fails: its exception must be retrieved (no "never retrieved" report)."""
        from kvxfer.errors import PeerClosed

        loop = asyncio.get_running_loop()
        reports = []
        loop.set_exception_handler(lambda lp, ctx: reports.append(ctx.get("message", "")))
        pair = _Pair()
        pb, pa = await pair.start()

        async def fails_when_cancelled():
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise PeerClosed("the send failed while being abandoned") from None

        try:
            if mode == "timeout":
                await pb._bounded(fails_when_cancelled(), 0.05, "send")
            else:
                fut = asyncio.ensure_future(pb._bounded(fails_when_cancelled(), 30.0, "send"))
                await asyncio.sleep(0)
                await pa.close()
                await asyncio.wait_for(fut, 10.0)
            outcome = "returned"
        except Exception as exc:
            outcome = type(exc).__name__
        await pair.close()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()
        for _ in range(3):
            await asyncio.sleep(0)
        loop.set_exception_handler(None)
        return {"outcome": outcome, "reports": reports}


class Reconnects:
    @staticmethod
    async def rounds(n: int) -> dict:
        """``n`` times: a fresh engine pair connects, exchanges a message, closes. UCP reuses
        the endpoint handles of closed connections."""
        out = {"ok": 0, "errors": []}
        for i in range(n):
            pair = _Pair()
            try:
                pb, pa = await pair.start()
                await pb.send(b"round-%d" % i)
                got = await asyncio.wait_for(pair.inbox.get(), 10.0)
                out["ok"] += got == b"round-%d" % i
            except Exception as exc:
                out["errors"].append(f"round {i}: {type(exc).__name__}: {exc}")
            finally:
                await pair.close()
        return out

    @staticmethod
    async def after_protocol_error(rounds: int, burst: int) -> dict:
        """B sends a burst of app messages with a bad message in the middle: A closes the
        connection (ProtocolError) with the rest of the burst unread. B then reconnects
        (same engines) and talks again: the handshake must succeed and only the new
        connection's messages may reach A's handlers."""
        import numpy as np

        from kvxfer.engine import messages as m

        pair = _Pair()
        out = {"reconnected": 0, "errors": [], "stale_delivered": 0, "fresh": 0}
        try:
            await pair.engines["A"].start()
            await pair.engines["B"].start()
            for r in range(rounds):
                try:
                    pb, pa = await pair.connect()
                except Exception as exc:
                    out["errors"].append(f"round {r} connect: {type(exc).__name__}: {exc}")
                    continue
                out["reconnected"] += 1
                while not pair.inbox.empty():  # what the previous round delivered in time
                    pair.inbox.get_nowait()
                await pb.send(b"fresh-%d" % r)
                got = await asyncio.wait_for(pair.inbox.get(), 10.0)
                if got == b"fresh-%d" % r:
                    out["fresh"] += 1
                else:
                    out["stale_delivered"] += 1
                closed = asyncio.get_running_loop().create_future()
                pair.engines["B"]._closed_handlers[:] = [
                    lambda p, e, closed=closed: closed.done() or closed.set_result(type(e).__name__)
                ]
                bad = m.StagedWrite(
                    group="kv", slot=0, offset=0, nbytes=ITEM, dst=np.zeros(1, "<i8").tobytes()
                ).encode()
                sends = [
                    pb._channel.send(m.AppMessage(payload=b"old-%d-%d" % (r, k)).encode(), 5.0)
                    for k in range(burst)
                ]
                sends.insert(burst // 4, pb._channel.send(bad, 5.0))
                await asyncio.gather(*sends, return_exceptions=True)
                await asyncio.wait_for(closed, 10.0)
        finally:
            await pair.close()
        return out


class RobustNode:
    """Hosted in a worker: each method runs one scenario on this process's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def many_waits(self, n: int) -> dict:
        return self.loop.run_until_complete(Scenarios.many_waits(n))

    def abandoned_task(self, mode: str) -> dict:
        return self.loop.run_until_complete(Scenarios.abandoned_task(mode))

    def reconnect_rounds(self, n: int) -> dict:
        return self.loop.run_until_complete(Reconnects.rounds(n))

    def reconnect_after_protocol_error(self, rounds: int, burst: int) -> dict:
        return self.loop.run_until_complete(Reconnects.after_protocol_error(rounds, burst))

    def close(self) -> None:
        self.loop.close()
