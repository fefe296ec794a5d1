"""A PUT + flush to a peer that is already dead, at the transport level, in a fixed order
(``tests/transport/test_dead_peer.py``): a :class:`RmaTarget` process registers a buffer and
hands out its worker address and key; an :class:`RmaSurvivor` process makes a bulk endpoint
(error mode NONE: shared-memory lanes) and writes to it once; the test SIGKILLs and reaps
the target; only then does the survivor write again, posting and starting the flush in one
step of its event loop, before it could have handled any report of the death. The write
must fail: cma's flush completes after a PUT before it failed (ESRCH), and the
endpoint's failure reaches the error handler only later (``_rma.c`` put_cb)."""

from __future__ import annotations

import asyncio


class RmaTarget:
    """Owns a registered host buffer on kvxfer's own worker (no event loop needs to run:
    the own worker's native thread answers UCX)."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        from kvxfer.transport.ucx import UcxTransport

        self.loop = asyncio.new_event_loop()
        self.t = UcxTransport(own_rma=True)
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.region = self.t.register(self.buf.ctypes.data, self.buf.nbytes)

    def info(self) -> dict:
        return self.loop.run_until_complete(self._info())

    async def _info(self) -> dict:
        return {
            "address": self.t.local_address(),
            "addr": self.region.addr,
            "length": self.region.length,
            "key": self.region.packed_key(),
        }

    def first(self, n: int) -> bytes:
        return bytes(self.buf[:n])

    def close(self) -> None:
        self.region.release()
        self.loop.run_until_complete(self.t.close())
        self.loop.close()


class RmaSurvivor:
    """Writes to an :class:`RmaTarget` over a bulk endpoint; each method runs on its loop."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        from kvxfer.transport.ucx import UcxTransport

        self.loop = asyncio.new_event_loop()
        self.t = UcxTransport(own_rma=True)
        self.src = np.zeros(nbytes, dtype=np.uint8)
        self.region = self.t.register(self.src.ctypes.data, self.src.nbytes)
        self.rma = None
        self.rbase = 0

    def connect(self, info: dict) -> list:
        return self.loop.run_until_complete(self._connect(info))

    async def _connect(self, info: dict) -> list:
        self.rma = await self.t.rma_endpoint(None, info["address"], 10.0)
        self.rma.add_remote_regions([info["addr"]], [info["length"]], [info["key"]])
        self.rbase = info["addr"]
        return self.rma.lanes()

    def write(self, fill: int, how: str) -> dict:
        """Fill the source with ``fill``, PUT all of it in 1 MiB ops, then end the write by
        ``how``: "chain" (``flush_future``, as ``Peer.write``) or "flush" (``flush``, as
        the staged path). Returns what happened: "ok" or the error's type and text."""
        return self.loop.run_until_complete(self._write(fill, how))

    async def _write(self, fill: int, how: str) -> dict:
        import numpy as np

        assert self.rma is not None
        u = np.uint64
        chunk = 1 << 20
        n = self.src.nbytes // chunk
        off = np.arange(n, dtype=u) * u(chunk)
        self.src[:] = fill
        out: dict = {}
        try:
            # no await between the PUTs and the start of the flush: a death report queued
            # meanwhile cannot be handled first
            out["posted"] = self.rma.put(
                self.src.ctypes.data + off,
                self.rbase + off,
                np.full(n, chunk, u),
                np.full(n, self.region.handle, u),
                np.zeros(n, u),
            )
            if how == "chain":
                await asyncio.wait_for(self.rma.flush_future(False), 10.0)
            else:
                await self.rma.flush(10.0)
            out["result"] = "ok"
        except Exception as exc:
            out["result"] = type(exc).__name__
            out["text"] = str(exc)
        return out

    def after(self) -> dict:
        """Once the endpoint's error handler has reported the death (bounded): a next
        write fails before posting anything."""
        return self.loop.run_until_complete(self._after())

    async def _after(self) -> dict:
        from kvxfer.errors import PeerClosed

        assert self.rma is not None
        seen = self.loop.create_future()
        self.rma.on_failed(lambda exc: seen.done() or seen.set_result(type(exc).__name__))
        if self.rma._failed is not None:
            seen.set_result(type(self.rma._failed).__name__)
        out = {"reported": await asyncio.wait_for(seen, 10.0)}
        try:
            self.rma.flush_future(False)
            out["next"] = "started"
        except PeerClosed:
            out["next"] = "PeerClosed"
        return out

    def close(self) -> None:
        async def _close() -> None:
            if self.rma is not None:
                await self.rma.close(5.0)
            await self.t.close()

        self.region.release()
        self.loop.run_until_complete(_close())
        self.loop.close()
