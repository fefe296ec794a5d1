"""Checks of the native put -> flush -> notify chain (``_rma`` ``flush_notify`` and the
notification receiver), inside one spawned process: listener and connector share the UCX
worker, so the notification goes out on a real endpoint and comes back through the
worker's active-message handler. ``tests/transport/test_chain.py`` calls a
:class:`ChainNode` through a typed proxy."""

from __future__ import annotations

import asyncio


class ChainNode:
    """Each method runs one check on this process's event loop and returns what it saw."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def ordering(self, error_mode: str, rounds: int, mib: int, spin: bool) -> dict:
        return self.loop.run_until_complete(_ordering(error_mode, rounds, mib, spin))

    def many(
        self, error_mode: str, n: int, inline_us: float = -1.0, yield_idle: bool = False
    ) -> dict:
        return self.loop.run_until_complete(_many(error_mode, n, inline_us, yield_idle))

    def cancelled_by_close(self, mib: int) -> dict:
        return self.loop.run_until_complete(_cancelled_by_close(mib))

    def unknown_token(self) -> dict:
        return self.loop.run_until_complete(_unknown_token())

    def native_deliver(self, error_mode: str, n: int, how: str) -> dict:
        return self.loop.run_until_complete(_native_deliver(error_mode, n, how))

    def close(self) -> None:
        self.loop.close()


async def _setup(error_mode: str, nbytes: int):
    import numpy as np

    from kvxfer.testing.transport_checks import _TransportChecks

    t, client, server, rma = await _TransportChecks._pair(error_mode)
    src = np.zeros(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    rs, rd = t.register(src.ctypes.data, src.nbytes), t.register(dst.ctypes.data, dst.nbytes)
    rma.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
    return t, client, server, rma, src, dst, rs, rd


async def _teardown(t, client, server, rma, rs, rd) -> None:
    await rma.close(5.0)
    await asyncio.gather(client.close(1.0), server.close(1.0))
    rs.release(), rd.release()
    await t.close()


def _put_all(rma, src, rs, rd, chunk: int) -> int:
    import numpy as np

    u = np.uint64
    n = src.nbytes // chunk
    off = np.arange(n, dtype=u) * u(chunk)
    return rma.put(
        src.ctypes.data + off,
        rd.addr + off,
        np.full(n, chunk, u),
        np.full(n, rs.handle, u),
        np.zeros(n, u),
    )


async def _ordering(error_mode: str, rounds: int, mib: int, spin: bool) -> dict:
    """Each round: fill the source with a new pattern, PUT all of it (``mib`` MiB), chain a
    notification; the receiver compares the whole destination with the source when the
    notification is handed to it (on the loop, before anything else can run)."""
    import numpy as np

    nbytes = mib << 20
    t, client, server, rma, src, dst, rs, rd = await _setup(error_mode, nbytes)
    seen: list = []
    arrived: asyncio.Queue = asyncio.Queue()

    def on_note(payload: bytes) -> None:
        seen.append((payload, bool(np.array_equal(src, dst))))
        arrived.put_nowait(payload)

    token = t.note_listen(on_note)
    rng = np.random.default_rng(5)
    ends = []
    for i in range(rounds):
        src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
        _put_all(rma, src, rs, rd, 1 << 20)
        fut = rma.flush_notify_future(token, b"round-%d" % i, spin)
        assert fut is not None
        ends.append(await asyncio.wait_for(fut, 10.0))
        assert await asyncio.wait_for(arrived.get(), 10.0) == b"round-%d" % i
    out = {
        "seen": [p.decode() for p, _ in seen],
        "visible": [ok for _, ok in seen],
        "lanes": rma.lanes(),
        "times_ok": all(isinstance(x, float) for x in ends),
        "flushes_left": len(t._flushes),
    }
    t.note_unlisten(token)
    await _teardown(t, client, server, rma, rs, rd)
    return out


async def _many(error_mode: str, n: int, inline_us: float = -1.0, yield_idle: bool = False) -> dict:
    """``n`` chains started back to back on one endpoint before any is awaited: every one
    completes, the notifications arrive each once and in order, nothing is left behind.
    ``inline_us`` >= 0: the starters' inline wait (``UcxTransport.chain_inline_us``; a short
    one leaves most chains to the worker's thread, woken only after the starting call);
    ``yield_idle``: the inline wait yields the CPU after idle progress calls
    (``UcxTransport.inline_yield``)."""
    t, client, server, rma, src, dst, rs, rd = await _setup(error_mode, 1 << 20)
    if inline_us >= 0:
        t.chain_inline_us = inline_us
    t.inline_yield = yield_idle
    got: list = []
    done = asyncio.get_running_loop().create_future()

    def on_note(payload: bytes) -> None:
        got.append(int(payload))
        if len(got) == n and not done.done():
            done.set_result(None)

    token = t.note_listen(on_note)
    base = t._cq.pending
    src[:] = 7
    futs = []
    for i in range(n):
        _put_all(rma, src, rs, rd, 1 << 16)
        futs.append(rma.flush_notify_future(token, b"%d" % i, i % 2 == 1))
    res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30.0)
    await asyncio.wait_for(done, 10.0)
    await t.flush_worker(5.0)
    out = {
        "errors": [repr(r) for r in res if isinstance(r, BaseException)],
        "order_ok": got == list(range(n)),
        "count": len(got),
        "pending_delta": t._cq.pending - base,
        "spinning": t._cq.spinning,
        "flushes_left": len(t._flushes),
        "bytes_ok": bool((dst == 7).all()),
    }
    t.note_unlisten(token)
    await _teardown(t, client, server, rma, rs, rd)
    return out


async def _cancelled_by_close(mib: int) -> dict:
    """An owned (error mode "none") endpoint closed while its chain's flush is pending: the
    chain fails (typed) and its notification is never sent; a later chain on another
    endpoint is received (so the receiver was listening all along)."""
    from kvxfer.errors import KvxferError
    from kvxfer.testing.transport_checks import _TransportChecks

    nbytes = mib << 20
    t, client, server, rma, src, dst, rs, rd = await _setup("none", nbytes)
    got: list = []
    arrived: asyncio.Queue = asyncio.Queue()
    token = t.note_listen(lambda p: (got.append(p), arrived.put_nowait(p)))
    src[:] = 3
    _put_all(rma, src, rs, rd, 1 << 20)
    fut = rma.flush_notify_future(token, b"never", False)
    closing = asyncio.ensure_future(rma.close(30.0))  # marks the endpoint closing at once
    try:
        await asyncio.wait_for(fut, 30.0)
        first = "completed"
    except KvxferError as exc:
        first = type(exc).__name__
    await closing
    # a second endpoint proves the receiver still listens
    addr2 = t.local_address() if t.own_rma else None
    rma2 = await t.rma_endpoint(client, addr2, 10.0)
    rma2.add_remote_regions([rd.addr], [rd.length], [rd.packed_key()])
    _put_all(rma2, src, rs, rd, 1 << 20)
    await asyncio.wait_for(rma2.flush_notify_future(token, b"later", False), 10.0)
    await asyncio.wait_for(arrived.get(), 10.0)
    try:
        rma.flush_notify_future(token, b"x", False)
        after = "not raised"
    except KvxferError as exc:
        after = type(exc).__name__
    out = {"first": first, "got": [p.decode() for p in got], "after_close": after}
    # less the note registry entries (our token, the channels' frame tokens) and rma2's
    # endpoint context (an owned endpoint: kvxfer's own worker)
    owned = 1 if addr2 is not None else 0
    out["pending"] = t._cq.pending - len(t._notes) - owned
    t.note_unlisten(token)
    out["pending_after_unlisten"] = t._cq.pending - len(t._notes) - owned
    await rma2.close(5.0)
    await asyncio.gather(client.close(1.0), server.close(1.0))
    rs.release(), rd.release()
    await t.close()
    del _TransportChecks
    return out


async def _unknown_token() -> dict:
    """A notification to a token nobody listens to (or no longer) is dropped natively;
    the chain itself completes (the sender cannot tell)."""
    t, client, server, rma, src, dst, rs, rd = await _setup("none", 1 << 20)
    got: list = []
    arrived: asyncio.Queue = asyncio.Queue()
    token = t.note_listen(lambda p: (got.append(p), arrived.put_nowait(p)))
    t.note_unlisten(token)
    token2 = t.note_listen(lambda p: (got.append(b"2:" + p), arrived.put_nowait(p)))
    _put_all(rma, src, rs, rd, 1 << 20)
    r1 = await asyncio.wait_for(rma.flush_notify_future(token, b"stale", False), 10.0)
    r2 = await asyncio.wait_for(rma.flush_notify_future(token2, b"live", False), 10.0)
    await asyncio.wait_for(arrived.get(), 10.0)  # same endpoint: "stale" went first
    out = {"got": [p.decode() for p in got], "ok": isinstance(r1, float) and isinstance(r2, float)}
    t.note_unlisten(token2)
    await _teardown(t, client, server, rma, rs, rd)
    return out


async def _native_deliver(error_mode: str, n: int, how: str) -> dict:
    """The own worker's thread hands what it queued to a deliver callable
    (``UcxTransport.take_natively``, ``_rma`` ``set_deliver``) instead of signalling the
    eventfd. ``how="raise"``: the callable raises every time (reported as unraisable), and
    the eventfd is signalled for what it left, so the loop still takes every notification,
    once and in order. ``how="close"``: the callable closes the completion queue from the
    own worker's thread (which then is not joined but ends after the call), and nothing
    hangs or crashes. The chains end on the own worker's thread (no inline wait), so their
    notifications are queued there."""
    import sys
    import threading

    t, client, server, rma, src, dst, rs, rd = await _setup(error_mode, 1 << 20)
    t.chain_inline_us = 0.0  # chains (and their notifications) end on the own worker's thread
    calls: list = []
    raised: list = []
    got: list = []
    threads: set = set()
    done = asyncio.get_running_loop().create_future()
    cq = t._cq

    def deliver() -> None:
        calls.append(threading.current_thread().ident)
        if how == "raise":
            raise RuntimeError("deliver failed")
        cq.close()

    def on_note(payload: bytes) -> None:
        got.append(int(payload))
        threads.add(threading.current_thread().ident)
        if len(got) == n and not done.done():
            done.set_result(None)

    hook, sys.unraisablehook = sys.unraisablehook, lambda u: raised.append(repr(u.exc_value))
    try:
        token = t.note_listen(on_note)
        assert t.take_natively(deliver)
        src[:] = 3
        futs = []
        for i in range(n):
            _put_all(rma, src, rs, rd, 1 << 16)
            futs.append(rma.flush_notify_future(token, b"%d" % i, False))
        if how == "raise":
            res = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 30.0)
            await asyncio.wait_for(done, 10.0)
        else:
            end = asyncio.get_running_loop().time() + 10.0
            while not calls and asyncio.get_running_loop().time() < end:
                await asyncio.sleep(0.001)
            res = []
    finally:
        sys.unraisablehook = hook
    me = threading.get_ident()
    out = {
        "calls": len(calls),
        "native_thread": bool(calls) and me not in calls,
        "raised": raised[:1],
        "errors": [repr(r) for r in res if isinstance(r, BaseException)],
        "order_ok": got == list(range(len(got))),
        "count": len(got),
        "notes_on_loop": threads <= {me},
    }
    if how == "raise":
        t.take_natively(None)
        t.note_unlisten(token)
        await _teardown(t, client, server, rma, rs, rd)
    return out
