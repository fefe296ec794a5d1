"""Transport checks run inside one spawned process (listener and connector on the same UCX
worker, real loopback endpoints); ``tests/transport`` hosts a :class:`TransportNode` in a
:class:`kvxfer.procs.Worker` and calls it through a typed proxy.
"""

from __future__ import annotations

import asyncio

from kvxfer.procs import scoped_env


class TransportNode:
    """Exercises :mod:`kvxfer.transport.ucx` inside one process; each method runs one check
    on this process's event loop and returns what it observed."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def put_and_bounds(self, error_mode: str, spin: bool = False) -> dict:
        return self.loop.run_until_complete(_TransportChecks.put_and_bounds(error_mode, spin))

    def close_quiesces(self, error_mode: str, mib: int = 32) -> dict:
        return self.loop.run_until_complete(_TransportChecks.close_quiesces(error_mode, mib))

    def peer_close_seen(self) -> dict:
        return self.loop.run_until_complete(_TransportChecks.peer_close_seen())

    def completion_queue(self) -> dict:
        return self.loop.run_until_complete(_TransportChecks.completion_queue())

    def channel_frames(self) -> dict:
        return self.loop.run_until_complete(_TransportChecks.channel_frames())

    def channel_flood(self, limit: int) -> dict:
        return self.loop.run_until_complete(_TransportChecks.channel_flood(limit))

    def channel_oversize(self) -> dict:
        return self.loop.run_until_complete(_TransportChecks.channel_oversize())

    def opening_mismatch(self, connect: dict, accept: dict) -> dict:
        return self.loop.run_until_complete(_TransportChecks.opening_mismatch(connect, accept))

    def opening_same(self, mode: str) -> dict:
        return self.loop.run_until_complete(_TransportChecks.opening_same(mode))

    def opening_legacy(self, kind: str) -> dict:
        return self.loop.run_until_complete(_TransportChecks.opening_legacy(kind))

    def channel_rtt(self, n: int) -> dict:
        return self.loop.run_until_complete(_TransportChecks.channel_rtt(n))

    def accept_while_spinning(self, n: int, hammer: bool = False, mode: str = "peer") -> dict:
        return self.loop.run_until_complete(_TransportChecks.accept_while_spinning(n, hammer, mode))

    def note_spin(self, error_mode: str) -> dict:
        return self.loop.run_until_complete(_TransportChecks.note_spin(error_mode))

    def spin_linger(self, linger_us: float, inline_yield: str = "1") -> dict:
        return self.loop.run_until_complete(_TransportChecks.spin_linger(linger_us, inline_yield))

    def native_gil(self, error_mode: str, value: str) -> dict:
        return self.loop.run_until_complete(_TransportChecks.native_gil(error_mode, value))

    def close(self) -> None:
        self.loop.close()


class _TransportChecks:
    @staticmethod
    async def _pair(error_mode="peer", rx=None):
        """A transport, a channel pair and an RMA endpoint: the new transport connects to
        ``rx`` (default: itself) and its endpoint writes to ``rx`` (with error mode "none",
        to ``rx``'s own worker)."""
        from kvxfer.transport.ucx import UcxTransport

        t = UcxTransport(own_rma=error_mode == "none")
        rx = t if rx is None else rx
        accepted = asyncio.get_running_loop().create_future()

        async def on_accept(ch):
            accepted.set_result(ch)

        _, port = await rx.listen("127.0.0.1", 0, on_accept)
        client = await t.connect("127.0.0.1", port, 10.0)
        await client.send(b"hello", 5.0)
        server = await asyncio.wait_for(accepted, 10.0)
        assert await server.recv(5.0) == b"hello"
        addr = rx.local_address() if error_mode == "none" else None
        rma = await t.rma_endpoint(client, addr, 10.0)
        return t, client, server, rma

    @staticmethod
    async def _pair_with_env(error_mode, name, value):
        """:meth:`_pair` made while ``$name`` is ``value``."""
        with scoped_env({name: value}):
            return await _TransportChecks._pair(error_mode)

    @staticmethod
    async def note_spin(error_mode):
        """With ``$KVXFER_NOTE_SPIN=1`` (read when the transport makes its completion
        queue): the queue counts one spinner from the start; a PUT + chained notification
        still lands, its delivery sees its native arrival time (``note_arrival``), and
        closing the transport stops the thread. The variable is restored afterwards."""
        import time

        import numpy as np

        from kvxfer.transport.base import note_arrival
        from kvxfer.transport.ucx import NOTE_SPIN_ENV

        t, client, server, rma = await _TransportChecks._pair_with_env(
            error_mode, NOTE_SPIN_ENV, "1"
        )
        out: dict = {"spinning": t._cq.spinning}
        src = np.arange(64, dtype=np.uint8)
        dst = np.zeros(64, dtype=np.uint8)
        rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        t0 = time.monotonic()
        payload, arrived, handled = await _TransportChecks._put_note(t, rma, src, rs, rd)
        out.update(
            payload=payload,
            landed=bool((dst == src).all()),
            arrival_in_order=t0 <= arrived <= handled,
            arrival_outside=note_arrival(),
        )
        q = await _TransportChecks._close_pair(t, client, server, rma, rs, rd)
        out["poller_after_close"] = q.poller_live
        return out

    @staticmethod
    async def _put_note(t, rma, src, rs, rd, payload=b"done"):
        """PUT ``src`` (registered as ``rs``) into ``rd`` and chain a notification to a
        listener of ``t``; returns what the listener saw: (payload, its native arrival
        stamp, when it ran)."""
        import time

        import numpy as np

        from kvxfer.transport.base import note_arrival

        got = asyncio.get_running_loop().create_future()

        def on_note(p):
            if not got.done():
                got.set_result((p, note_arrival(), time.monotonic()))

        token = t.note_listen(on_note)
        u = np.uint64
        rma.put(
            np.array([src.ctypes.data], u),
            np.array([rd.addr], u),
            np.array([src.nbytes], u),
            np.array([rs.handle], u),
            np.array([0], u),
        )
        fut = rma.flush_notify_future(token, payload)
        if fut is None:  # this endpoint cannot chain: flush, then send it natively
            await asyncio.wait_for(rma.flush_future(), 5.0)
            fut = rma.note_future(token, payload)
        await asyncio.wait_for(fut, 5.0)
        try:
            return await asyncio.wait_for(got, 5.0)
        finally:
            t.note_unlisten(token)

    @staticmethod
    async def _close_pair(t, client, server, rma, *regions):
        """Close what :meth:`_pair` made and release ``regions``; returns the transport's
        completion queue (closed)."""
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        for r in regions:
            r.release()
        q = t._cq
        await t.close()
        return q

    @staticmethod
    async def spin_linger(linger_us, inline_yield="1"):
        """Two transports on their own workers (error mode "none"), the receiver made with
        ``$KVXFER_SPIN_LINGER_US=linger_us`` and ``$KVXFER_INLINE_YIELD=inline_yield`` (its
        linger yields between idle progress calls, or not): its settings; how often the receiver's own
        thread (which takes the notifications) went to sleep between a first PUT +
        notification and a second one made right after it; then, with its linger set to
        1 ms, whether that thread sleeps again once traffic stops (waited for, bounded)."""
        import time

        import numpy as np

        from kvxfer.transport.ucx import SPIN_LINGER_ENV, UcxTransport

        with scoped_env({SPIN_LINGER_ENV: str(linger_us), "KVXFER_INLINE_YIELD": inline_yield}):
            rx = UcxTransport(own_rma=True)
        tx, client, server, rma = await _TransportChecks._pair("none", rx)
        out: dict = {"setting": rx.spin_linger_us, "yield": rx.inline_yield}
        src = np.arange(256, dtype=np.uint8)
        dst = np.zeros(256, dtype=np.uint8)
        rs = tx.register(src.ctypes.data, src.nbytes)
        rd = rx.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        out["first"] = (await _TransportChecks._put_note(rx, rma, src, rs, rd))[0]
        q = rx._cq
        before = q.sleeps
        src[:] = src[::-1]
        out["second"] = (await _TransportChecks._put_note(rx, rma, src, rs, rd, b"again"))[0]
        out["sleeps_between"] = q.sleeps - before
        out["landed"] = bool((dst == src).all())
        q.set_linger(1000.0)
        before, deadline = q.sleeps, time.monotonic() + 5.0
        while q.sleeps == before and time.monotonic() < deadline:
            await asyncio.sleep(0.001)  # polls a condition, bounded
        out["slept_after"] = q.sleeps > before
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        rs.release()
        rd.release()
        await asyncio.gather(tx.close(), rx.close())
        return out

    @staticmethod
    async def native_gil(error_mode, value):
        """With ``$KVXFER_NATIVE_GIL=value`` (read when the transport is made): whether its
        chains and its bulk endpoint's short PUT batches keep the GIL, and that a 64-byte PUT
        + chained notification and a batch too long to keep it both land. The variable is
        restored afterwards."""

        import numpy as np

        from kvxfer.kernels.cuda_driver import NATIVE_GIL_ENV
        from kvxfer.transport.ucx_rma import KEEP_GIL_MAX_OPS

        t, client, server, rma = await _TransportChecks._pair_with_env(
            error_mode, NATIVE_GIL_ENV, value
        )
        out: dict = {"transport": t.keep_gil, "endpoint": rma._keep_gil}
        n = KEEP_GIL_MAX_OPS + 1  # one batch that keeps it, one that is too long to
        src = (np.arange(64 * n) % 251).astype(np.uint8)
        dst = np.zeros(64 * n, dtype=np.uint8)
        rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        got = asyncio.get_running_loop().create_future()
        token = t.note_listen(lambda p: got.done() or got.set_result(p))
        u = np.uint64
        offs = np.arange(n, dtype=u) * u(64)
        for sel in (slice(0, 1), slice(1, n)):
            k = len(offs[sel])
            rma.put(
                u(src.ctypes.data) + offs[sel],
                u(rd.addr) + offs[sel],
                np.full(k, 64, u),
                np.full(k, rs.handle, u),
                np.zeros(k, u),
            )
        fut = rma.flush_notify_future(token, b"done")
        if fut is None:  # this endpoint cannot chain: flush, then send it natively
            await asyncio.wait_for(rma.flush_future(), 5.0)
            fut = rma.note_future(token, b"done")
        await asyncio.wait_for(fut, 5.0)
        out["payload"] = await asyncio.wait_for(got, 5.0)
        out["landed"] = bool((dst == src).all())
        t.note_unlisten(token)
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        rs.release()
        rd.release()
        await t.close()
        return out

    @staticmethod
    async def put_and_bounds(error_mode, spin=False):
        import time

        import numpy as np

        from kvxfer.errors import IndexOutOfRange

        t, client, server, rma = await _TransportChecks._pair(error_mode)
        src = np.arange(4096, dtype=np.uint8) % 251
        dst = np.zeros(8192, dtype=np.uint8)
        rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        u = np.uint64
        a = lambda *v: np.array(v, dtype=u)  # noqa: E731
        out = {"mem_types": [rs.mem_type, rd.mem_type], "lanes": rma.lanes()}
        # one good op + one op ending 1 byte past the region: nothing may be posted
        try:
            rma.put(
                a(src.ctypes.data, src.ctypes.data),
                a(rd.addr, rd.addr + 8192 - 15),
                a(16, 16),
                a(rs.handle, rs.handle),
                a(0, 0),
            )
            out["bounds"] = "not raised"
        except IndexOutOfRange as exc:
            out["bounds"] = str(exc)
        await rma.flush(5.0, spin)
        out["untouched_after_reject"] = int(dst.sum()) == 0
        try:
            rma.put(a(src.ctypes.data), a(rd.addr), a(16), a(0), a(1))  # region 1 of 1
            out["bad_region"] = "not raised"
        except IndexOutOfRange as exc:
            out["bad_region"] = str(exc)
        for bad, name in (
            ((np.zeros(1, np.float64),) + (a(1),) * 4, "float"),
            ((a(1, 2),) + (a(1),) * 4, "length"),
        ):
            try:
                rma.put(*bad)
                out[name] = "not raised"
            except (TypeError, ValueError) as exc:
                out[name] = type(exc).__name__
        n = rma.put(
            a(src.ctypes.data, src.ctypes.data + 100),
            a(rd.addr + 1000, rd.addr + 8192 - 50),
            a(100, 50),
            a(rs.handle, 0),
            a(0, 0),
        )
        t_done = await rma.flush(5.0, spin)
        out["t_done_ok"] = isinstance(t_done, float) and t_done <= time.monotonic()
        t_fut = await asyncio.wait_for(rma.flush_future(spin), 5.0)  # the task-free form
        out["t_done_ok"] &= isinstance(t_fut, float) and t_done <= t_fut <= time.monotonic()
        out["posted"] = n
        out["exact"] = (
            bytes(dst[1000:1100]) == bytes(src[:100])
            and bytes(dst[8142:]) == bytes(src[100:150])
            and int(dst[:1000].sum()) == 0
            and int(dst[1100:8142].sum()) == 0
        )
        await t.flush_worker(5.0, spin)
        out["spinning_after"] = t._cq.spinning
        await rma.close(1.0)
        await rma.close(1.0)  # idempotent
        await asyncio.gather(client.close(1.0), server.close(1.0))
        rs.release(), rd.release(), rd.release()
        await t.close()
        await t.close()
        try:
            await t.flush_worker(1.0)
            out["after_close"] = "not raised"
        except Exception as exc:  # Closed
            out["after_close"] = type(exc).__name__
        return out

    @staticmethod
    async def close_quiesces(error_mode, mib=32):
        """PUTs posted and never flushed, then ``RmaEndpoint.close()``: once it returns,
        every byte has landed (nothing of ours is still in flight to the peer), and a bulk
        endpoint's UCX close was accepted and confirmed (its error-handler context freed:
        the queue holds no reference for it)."""
        import numpy as np

        t, client, server, rma = await _TransportChecks._pair(error_mode)
        chunk, n = 1 << 20, mib
        src = np.random.default_rng(11).integers(0, 256, n * chunk, dtype=np.uint8)
        dst = np.zeros(n * chunk, dtype=np.uint8)
        rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        u, off = np.uint64, np.arange(n, dtype=np.uint64) * chunk
        rma.put(
            src.ctypes.data + off,
            rd.addr + off,
            np.full(n, chunk, u),
            np.full(n, rs.handle, u),
            np.zeros(n, u),
        )
        await rma.close(30.0)
        # less the note registry entries (the channels' frame tokens)
        pending = t._cq.pending - len(t._notes)
        out = {"landed": bool(np.array_equal(src, dst)), "pending": pending}
        await asyncio.gather(client.close(1.0), server.close(1.0))
        rs.release(), rd.release()
        await t.close()
        return out

    @staticmethod
    async def peer_close_seen():
        import time

        t, client, server, rma = await _TransportChecks._pair()
        seen = asyncio.get_running_loop().create_future()
        server.on_closed(lambda exc: seen.done() or seen.set_result(type(exc).__name__))
        reading = asyncio.ensure_future(server.recv(10.0))  # the close frame ends it
        closing = asyncio.ensure_future(client.close(5.0))  # waits for the server's close
        kind = await asyncio.wait_for(seen, 10.0)
        try:
            await reading
            recv = "returned"
        except Exception as exc:
            recv = type(exc).__name__
        try:
            await server.send(b"x", 1.0)
            after = "not raised"
        except Exception as exc:
            after = type(exc).__name__
        await rma.close(1.0)
        t0 = time.monotonic()
        await server.close(5.0)
        await asyncio.wait_for(closing, 10.0)
        handshake_s = time.monotonic() - t0
        await t.close()
        return {
            "kind": kind,
            "recv": recv,
            "send_after": after,
            "handshake_s": handshake_s,
            "client_saw_close": client._close_seen,
            "server_saw_close": server._close_seen,
        }

    @staticmethod
    async def channel_frames():
        """Native frames (UcxChannel): both ends exchanged hellos; large frames, many small
        ones in order, the size limit; after close no token stays registered and no UCXX
        receive stays posted."""
        import time

        from kvxfer.errors import ProtocolError

        t, client, server, rma = await _TransportChecks._pair()
        server.adopt_epoch()  # (the engine's handshake does this, and the next two)
        client.trusted(64 << 20)
        server.trusted(64 << 20)
        out: dict = {"native": bool(client._peer_token and server._peer_token)}
        big = bytes(range(256)) * (32 << 10)  # 8 MiB
        await client.send(big, 10.0)
        out["big_to_server"] = await server.recv(10.0) == big
        await server.send(big[::-1], 10.0)
        out["big_to_client"] = await client.recv(10.0) == big[::-1]
        for i in range(200):
            await client.send(b"m%d" % i, 5.0)
        got = [await server.recv(5.0) for _ in range(200)]
        out["order"] = got == [b"m%d" % i for i in range(200)]
        await client.send(bytes(100), 5.0)
        try:
            await server.recv(5.0, max_bytes=99)
            out["limit"] = "not raised"
        except ProtocolError:
            out["limit"] = "ProtocolError"
        tokens = [client._token, server._token]
        for _ in range(3):  # UCXX messages nobody reads once frames are native
            await client.ucx_endpoint.am_send(bytes(1000))
        await rma.close(1.0)
        # readers blocked without a deadline on both ends while both close: the closes do
        # not wait out their bound (a reader may take the peer's close frame), the readers end
        readers = [asyncio.ensure_future(ch.recv(None)) for ch in (client, server)]
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await asyncio.gather(client.close(5.0), server.close(5.0))
        out["close_s"] = time.monotonic() - t0
        done, _ = await asyncio.wait(readers, timeout=5.0)
        out["readers"] = [type(r.exception()).__name__ if r in done else "hung" for r in readers]
        out["saw_close"] = client._close_seen and server._close_seen
        out["ucxx_drained"] = server.ucxx_drained
        out["tokens_left"] = [tok for tok in tokens if tok in t._notes]
        out["rx_left"] = [ch._rx is not None for ch in (client, server)]
        await t.close()
        return out

    @staticmethod
    async def channel_flood(limit: int):
        """A peer pushes more frames than the receiver's bound while nobody reads: the
        receiver drops the connection (PeerClosed), holding nothing of it."""
        from kvxfer.transport import ucx_channel

        t, client, server, rma = await _TransportChecks._pair()
        seen = asyncio.get_running_loop().create_future()
        server.on_closed(lambda exc: seen.done() or seen.set_result(str(exc)))
        old, ucx_channel.MAX_QUEUED_FRAMES = ucx_channel.MAX_QUEUED_FRAMES, limit
        try:
            for i in range(limit + 8):
                await client.send(b"f%d" % i, 5.0)
            why = await asyncio.wait_for(seen, 10.0)
        finally:
            ucx_channel.MAX_QUEUED_FRAMES = old
        try:
            await server.recv(1.0)
            recv = "returned"
        except Exception as exc:
            recv = type(exc).__name__
        out = {"why": why, "recv": recv, "queued": len(server._inbox)}
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        await t.close()
        return out

    @staticmethod
    async def channel_oversize():
        """Before the handshake trusts the peer, a frame over MAX_EARLY_BYTES is dropped
        where it arrives (never copied) and ends the connection."""
        from kvxfer.transport.ucx_channel import MAX_EARLY_BYTES

        t, client, server, rma = await _TransportChecks._pair()
        seen = asyncio.get_running_loop().create_future()
        server.on_closed(lambda exc: seen.done() or seen.set_result(str(exc)))
        await client.send(bytes(MAX_EARLY_BYTES + 1), 10.0)
        why = await asyncio.wait_for(seen, 10.0)
        out = {"why": why, "queued": len(server._inbox)}
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        await t.close()
        return out

    @staticmethod
    def _recording(t) -> list:
        """Keep every channel the transport makes (to check what each left behind)."""
        made: list = []
        make = t._channel

        def record(*args):
            made.append(make(*args))
            return made[-1]

        t._channel = record
        return made

    @staticmethod
    def _leftovers(t, made) -> dict:
        return {
            "channels": len(made),
            "tokens_left": sorted(t._notes),
            "rx_left": [ch._rx is not None for ch in made],
            "eps_left": [ch._ep is not None for ch in made],
            "inbox_left": sum(len(ch._inbox) for ch in made),
            "pending": t._cq.pending if t._cq is not None else 0,
        }

    @staticmethod
    async def opening_mismatch(connect: dict, accept: dict):
        """Both ends announce what ``connect`` / ``accept`` say (``mode``, ``version``):
        the connecting side's error, the accepting side's (the listener's refusal), how
        long each took from the connect call, and what the two channels left behind."""
        import time

        from kvxfer.transport.ucx import UcxTransport

        t = UcxTransport()
        t.test_opening = {"connect": connect, "accept": accept}
        made = _TransportChecks._recording(t)
        loop = asyncio.get_running_loop()
        refused = loop.create_future()
        accepted: list = []
        t.on_refused = lambda exc: refused.done() or refused.set_result(exc)

        async def on_accept(ch):
            accepted.append(ch)
            await ch.close(1.0)

        _, port = await t.listen("127.0.0.1", 0, on_accept)
        out: dict = {}
        t0 = time.monotonic()
        try:
            ch = await t.connect("127.0.0.1", port, 10.0)
            out["client"], out["client_msg"] = "connected", ""
            await ch.close(1.0)
        except Exception as exc:
            out["client"], out["client_msg"] = type(exc).__name__, str(exc)
            out["client_versions"] = [getattr(exc, "ours", None), getattr(exc, "theirs", None)]
        out["client_s"] = time.monotonic() - t0
        try:
            exc = await asyncio.wait_for(refused, 10.0)
            out["server"], out["server_msg"] = type(exc).__name__, str(exc)
            out["server_versions"] = [getattr(exc, "ours", None), getattr(exc, "theirs", None)]
        except asyncio.TimeoutError:
            out["server"], out["server_msg"] = "not refused", ""
        out["server_s"] = time.monotonic() - t0
        out["accepted"] = len(accepted)
        out.update(_TransportChecks._leftovers(t, made))
        await t.close()
        return out

    @staticmethod
    async def opening_legacy(kind: str):
        """This build against a protocol-1 peer played frame by frame on a raw UCXX endpoint
        (``kind``: ``native-connector``, ``yield-connector``, ``yield-acceptor``,
        ``native-acceptor``, i.e. what the old build is and does). Returns this end's error,
        how long it took, what the old peer received (``padding``, ``hello``, ``close``: our
        close frame in its epoch ends its opening at once) and what our channel left."""
        import time

        import msgpack

        from kvxfer.transport.ucx import UcxTransport
        from kvxfer.transport.ucx_channel import new_epoch

        t = UcxTransport()
        made = _TransportChecks._recording(t)
        loop = asyncio.get_running_loop()
        old_epoch = new_epoch()

        def kind_of(buf, epoch) -> str:
            b = bytes(buf)
            if b == bytes(8):
                return "padding"
            if b[:8] == epoch.to_bytes(8, "little") and b[8:] == b"\xc1":
                return "close"
            if b[8:10] == b"\xc1\xc4":
                return "hello"
            return f"{len(b)}-byte frame"

        async def old_peer(ep, epoch, answer) -> list:
            """Read frames until our close frame of ``epoch`` (answering a hello with
            ``answer``, if given), then close as protocol 1 did: a close frame back, abort."""
            saw: list = []
            while True:
                buf = await asyncio.wait_for(ep.am_recv(), 5.0)
                saw.append(kind_of(buf, epoch or int.from_bytes(bytes(buf)[:8], "little")))
                if saw[-1] == "hello" and not epoch:  # accepting: its epoch is the connection's
                    epoch = int.from_bytes(bytes(buf)[:8], "little")
                if saw[-1] == "hello" and answer is not None:
                    await ep.am_send(epoch.to_bytes(8, "little") + answer)
                if saw[-1] == "close":
                    break
            await ep.am_send(epoch.to_bytes(8, "little") + b"\xc1")
            ep.abort()
            return saw

        out: dict = {}
        t0 = time.monotonic()
        if kind.endswith("connector"):
            refused = loop.create_future()
            t.on_refused = lambda exc: refused.done() or refused.set_result(exc)

            async def on_accept(ch):
                await ch.close(1.0)

            _, port = await t.listen("127.0.0.1", 0, on_accept)
            ep = await t.ucxx.create_endpoint("127.0.0.1", port, endpoint_error_handling=True)
            t0 = time.monotonic()  # from the old peer's opening (not UCX's first connect)
            await ep.am_send(bytes(8))
            first = (
                b"\xc1\xc2" + (12345).to_bytes(8, "little")
                if kind == "native-connector"
                else msgpack.packb({"t": "kx.hello", "v": 1, "name": "old"}, use_bin_type=True)
            )
            await ep.am_send(old_epoch.to_bytes(8, "little") + first)
            out["old_saw"] = await old_peer(ep, old_epoch, None)
            exc = await asyncio.wait_for(refused, 10.0)
        else:
            from kvxfer.transport import ucx_channel

            accepted = loop.create_future()

            async def handler(ep):
                await ep.am_send(bytes(8))
                reject = msgpack.packb(
                    {"t": "kx.reject", "v": 1, "kind": "protocol", "reason": "undecodable"},
                    use_bin_type=True,
                )
                answer = reject if kind == "yield-acceptor" else None
                try:
                    accepted.set_result(await old_peer(ep, 0, answer))
                except Exception as e:
                    accepted.set_exception(e)

            listener = t.ucxx.create_listener(handler, port=0, endpoint_error_handling=True)
            old, ucx_channel.HELLO_TIMEOUT_S = ucx_channel.HELLO_TIMEOUT_S, 0.5
            try:
                await t.connect("127.0.0.1", listener.port, 10.0)
                exc = None
            except Exception as e:
                exc = e
            finally:
                ucx_channel.HELLO_TIMEOUT_S = old
            out["old_saw"] = await asyncio.wait_for(accepted, 10.0)
            listener.close()
        out["s"] = time.monotonic() - t0
        out["error"] = type(exc).__name__
        out["msg"] = str(exc)
        out["versions"] = [getattr(exc, "ours", None), getattr(exc, "theirs", None)]
        out.update(_TransportChecks._leftovers(t, made))
        await t.close()
        return out

    @staticmethod
    async def opening_same(mode: str):
        """Both ends in ``mode``: the opening pairs them, a message goes each way, and the
        orderly close leaves nothing behind."""
        from kvxfer.transport.ucx import UcxTransport

        t = UcxTransport()
        t.test_opening = {"connect": {"mode": mode}, "accept": {"mode": mode}}
        made = _TransportChecks._recording(t)
        accepted = asyncio.get_running_loop().create_future()

        async def on_accept(ch):
            accepted.set_result(ch)

        _, port = await t.listen("127.0.0.1", 0, on_accept)
        client = await t.connect("127.0.0.1", port, 10.0)
        await client.send(b"ping", 5.0)
        server = await asyncio.wait_for(accepted, 10.0)
        ok = await server.recv(5.0) == b"ping"
        server.adopt_epoch()
        await server.send(b"pong", 5.0)
        ok = ok and await client.recv(5.0) == b"pong"
        out = {
            "ok": ok,
            "modes": [client.mode, server.mode],
            "native": [bool(client._peer_token), bool(server._peer_token)],
            "dropped": client.dropped + server.dropped,
        }
        await asyncio.gather(client.close(2.0), server.close(2.0))
        out["saw_close"] = client._close_seen and server._close_seen
        out.update(_TransportChecks._leftovers(t, made))
        await t.close()
        return out

    @staticmethod
    async def channel_rtt(n: int):
        """Median and p90 (µs) of ``n`` one-message round trips (client -> server -> client)
        on one loop, and the channels' mode."""
        import time

        t, client, server, rma = await _TransportChecks._pair()
        server.adopt_epoch()

        async def echo():
            while True:
                msg = await server.recv(10.0)
                if msg == b"stop":
                    return
                await server.send(msg, 5.0)

        task = asyncio.ensure_future(echo())
        rtts = []
        for _ in range(n):
            t0 = time.perf_counter()
            await client.send(b"ping", 5.0)
            await client.recv(5.0)
            rtts.append((time.perf_counter() - t0) * 1e6)
        await client.send(b"stop", 5.0)
        await asyncio.wait_for(task, 10.0)
        rtts.sort()
        out = {
            "native": bool(client._peer_token),
            "p50_us": rtts[len(rtts) // 2],
            "p90_us": rtts[int(len(rtts) * 0.9)],
        }
        await rma.close(1.0)
        await asyncio.gather(client.close(1.0), server.close(1.0))
        await t.close()
        return out

    @staticmethod
    async def accept_while_spinning(n: int, hammer: bool = False, mode: str = "peer"):
        """``n`` connections accepted while the transport's poller spins: held by
        ``spin_hold`` (as during a CUDA flush that has not completed), or, ``hammer``, by
        real PUT + spin-flush rounds back to back on a connected pair. Returns the seconds
        each connect + accept + first frame took, and the poller state. The listener's
        connection callback must never run on a thread of ours: UCXX then waits (3 x 3 s)
        for its progress thread to create the endpoint, which needs the worker lock the
        calling thread holds. ``mode``: the pair's error mode ("peer": RMA on the channel's
        endpoint, UCXX's worker; "none": a bulk endpoint on kvxfer's own worker)."""
        import time

        import numpy as np

        t, c0, s0, rma = await _TransportChecks._pair(mode)
        accepted: asyncio.Queue = asyncio.Queue()
        t._listener.close()  # the pair's listener: replaced by one feeding the queue

        async def on_accept(ch):
            await accepted.put(ch)

        _, port = await t.listen("127.0.0.1", 0, on_accept)
        src = np.arange(1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
        rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
        one = lambda v: np.array([v], dtype=np.uint64)  # noqa: E731
        stop = asyncio.Event()
        rounds = [0]

        async def flushes():
            while not stop.is_set():
                rma.put(one(src.ctypes.data), one(rd.addr), one(src.nbytes), one(rs.handle), one(0))
                await rma.flush(5.0, True)
                rounds[0] += 1
                # a flush that completed inline returns without suspending (with the own
                # worker's thread lingering, nearly all do): without this yield the pump
                # would hold the loop and no accept could run, whatever the threads do
                await asyncio.sleep(0)

        pump = asyncio.ensure_future(flushes()) if hammer else None
        if not hammer:
            t._cq.spin_hold(True)
        took, errors = [], []
        try:
            for _ in range(n):
                t0 = time.monotonic()
                try:
                    client = await t.connect("127.0.0.1", port, 12.0)
                    await client.send(b"x", 5.0)
                    server = await asyncio.wait_for(accepted.get(), 12.0)
                    assert await server.recv(5.0) == b"x"
                except Exception as exc:  # reported, not raised: the caller asserts
                    errors.append(f"{type(exc).__name__}: {exc}")
                    break
                took.append(time.monotonic() - t0)
                await asyncio.gather(client.close(2.0), server.close(2.0))
            spinning = t._cq.spinning
        finally:
            if pump is not None:
                stop.set()
                await asyncio.wait_for(pump, 10.0)
            else:
                t._cq.spin_hold(False)
        exact = bytes(dst) == bytes(src) if hammer else True
        await rma.close(1.0)
        await asyncio.gather(c0.close(1.0), s0.close(1.0))
        rs.release(), rd.release()
        await t.close()
        return {
            "took": took,
            "errors": errors,
            "spinning": spinning,
            "flush_rounds": rounds[0],
            "exact": exact,
        }

    @staticmethod
    async def completion_queue():
        import asyncio

        from kvxfer.transport.ucx_lib import load_ucx

        ucxx, rma = load_ucx()
        from ucxx import core

        worker = core._get_ctx().worker.handle
        out = {}
        try:
            rma.CompletionQueue().worker_flush(worker, 1, True)
            out["spin_without_worker"] = "not raised"
        except ValueError:
            out["spin_without_worker"] = "ValueError"
        for spin in (False, True):
            cq = rma.CompletionQueue(worker=worker)
            st = cq.worker_flush(worker, 7, spin)
            got = []
            if st is None:  # pending: wait for the eventfd
                loop = asyncio.get_running_loop()
                ev = asyncio.Event()
                loop.add_reader(cq.fileno(), ev.set)
                await asyncio.wait_for(ev.wait(), 5.0)
                loop.remove_reader(cq.fileno())
                got = [(tok, s) for tok, s, _t, _p in cq.drain()]
            res = {
                "status": st,
                "drained": got,
                "pending": cq.pending,
                "spinning": cq.spinning,
                "poller": cq.poller_live,
            }
            cq.close()
            cq.close()
            res["poller_after_close"] = cq.poller_live
            try:
                cq.drain()
                res["closed"] = "not raised"
            except ValueError:
                res["closed"] = "ValueError"
            out["spin" if spin else "event"] = res
        return out
