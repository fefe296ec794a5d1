"""Message delivery to the engine's handlers (``Peer._deliver``): inline when nothing is
queued or being handled before a message (no task hop to the peer's dispatcher), queued
otherwise, and in arrival order either way — app messages and chained write notifications
alike, including behind a handler that awaits, a handler that raises and a plain function
that returns an awaitable.

In-process pair of engines (one asyncio loop, real UCX on loopback, host memory): A sends
to B. Waits are bounded; "arrived" is read from B's peer (its inbox), never from a sleep."""

import asyncio

import numpy as np
import pytest

from kvxfer.engine import ItemWrite
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)

SECRET = b"deliver-secret"
ITEM, ITEMS = 64, 16


class Pair:
    """Engines A and B over UCX loopback; B's handlers are the test's."""

    def __init__(self, *handlers):
        self.handlers = handlers

    async def __aenter__(self):
        from kvxfer.engine import EngineConfig, TransferEngine

        self.bufs = {s: np.full(ITEMS * ITEM, i + 1, np.uint8) for i, s in enumerate("ab")}
        self.engines = {}
        for side in "ab":
            e = TransferEngine(
                EngineConfig(
                    secret=SECRET,
                    name=f"deliver-{side}",
                    error_mode="none",
                    warn_slow_lanes=False,
                    connect_timeout_s=30.0,
                    transfer_timeout_s=10.0,
                )
            )
            e.register("kv", [self.bufs[side].ctypes.data], [ITEMS * ITEM], [ITEM])
            await e.start()
            self.engines[side] = e
        for h in self.handlers:
            self.engines["b"].on_message(h)
        got = asyncio.get_running_loop().create_future()
        self.engines["b"].on_peer(lambda p: got.done() or got.set_result(p))
        self.a = await self.engines["a"].connect(*self.engines["b"].address)
        self.b = await asyncio.wait_for(got, 10)
        return self

    async def __aexit__(self, *exc):
        for e in self.engines.values():
            await e.close()

    async def notify(self, payload: bytes) -> None:
        """A write of one page with ``payload`` as its (chained) notification."""
        await self.a.write([ItemWrite("kv", [1], [2])], notify=payload, timeout=10)


async def until(cond, what: str, timeout: float = 10.0) -> None:
    """Poll ``cond()`` once per loop iteration, bounded."""
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0)


def test_inline_when_idle_and_in_order():
    """Messages and notifications one at a time are handled without the dispatcher task
    (inline: in the reader task or the transport's completion callback), in order."""

    async def main():
        seen = []

        def h(peer, payload):
            task = asyncio.current_task()
            seen.append((payload, None if task is None else task.get_name()))

        async with Pair(h) as p:
            for i in range(5):  # one at a time: a message and a notification travel on
                # different endpoints, so their relative order is that of arrival
                await p.a.send(b"m%d" % i)
                await until(lambda n=2 * i + 1: len(seen) == n, "message delivery")
                await p.notify(b"n%d" % i)
                await until(lambda n=2 * (i + 1): len(seen) == n, "delivery")
        assert [x for x, _ in seen] == [b"%s%d" % (k, i) for i in range(5) for k in (b"m", b"n")]
        assert not any(t and "dispatch" in t for _, t in seen), seen

    asyncio.run(main())


def test_later_messages_wait_behind_an_awaiting_handler():
    """A handler that awaits holds every later message and notification back (they queue
    while it waits, inline delivery or not); the order is arrival order."""

    async def main():
        gate, log = asyncio.Event(), []

        async def h(peer, payload):
            log.append(("start", payload))
            if payload == b"m0":
                await gate.wait()
            log.append(("end", payload))

        async with Pair(h) as p:
            await p.a.send(b"m0")
            await until(lambda: ("start", b"m0") in log, "m0 handled")
            # each queued before the next goes: a message and a notification travel on
            # different endpoints, so their relative order is that of arrival
            await p.a.send(b"m1")
            await until(lambda: p.b._inbox.qsize() == 1, "m1 queued behind m0")
            await p.notify(b"n2")
            await until(lambda: p.b._inbox.qsize() == 2, "n2 queued behind m1")
            await p.a.send(b"m3")
            await until(lambda: p.b._inbox.qsize() == 3, "three queued behind m0")
            assert log == [("start", b"m0")]
            gate.set()
            await until(lambda: len(log) == 8, "all handled")
        assert log == [(k, m) for m in (b"m0", b"m1", b"n2", b"m3") for k in ("start", "end")]

    asyncio.run(main())


def test_plain_function_returning_an_awaitable_and_a_raising_handler():
    """A handler that raises is logged and skipped (the others still run, later messages
    still arrive); a plain function returning an awaitable holds later messages until it
    completed, and the handlers after it run after it."""

    async def main():
        gate, log = asyncio.Event(), []

        def bad(peer, payload):
            log.append(("bad", payload))
            if payload == b"x":
                raise RuntimeError("handler failure (expected by the test)")

        def returns_awaitable(peer, payload):
            async def later():
                if payload == b"x":
                    await gate.wait()
                log.append(("later", payload))

            return later()

        def after(peer, payload):
            log.append(("after", payload))

        async with Pair(bad, returns_awaitable, after) as p:
            await p.a.send(b"x")
            await until(lambda: ("bad", b"x") in log, "x reached the handlers")
            await p.notify(b"y")
            # x's rest is the dispatcher's (awaiting the gate); y waits in the inbox
            await until(lambda: p.b._inbox.qsize() == 1, "y queued behind x's rest")
            assert ("after", b"x") not in log and ("bad", b"y") not in log
            gate.set()
            await until(lambda: len(log) == 6, "all handled")
        assert log == [
            ("bad", b"x"),
            ("later", b"x"),
            ("after", b"x"),
            ("bad", b"y"),
            ("later", b"y"),
            ("after", b"y"),
        ]

    asyncio.run(main())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hammer_mixed_messages_keep_their_order(seed):
    """Many app messages and notifications from concurrent senders, with a handler that
    sometimes yields: per kind, each sender's sequence arrives complete and in order."""

    async def main():
        rng = np.random.default_rng(seed)
        pauses = set(rng.choice(200, 40, replace=False).tolist())
        got = []

        async def h(peer, payload):
            kind, n = payload[:1], int(payload[1:])
            if n in pauses:
                await asyncio.sleep(0)
            got.append((kind, n))

        async with Pair(h) as p:

            async def msgs():
                for i in range(200):
                    await p.a.send(b"m%d" % i)

            async def notes():
                for i in range(200):
                    await p.notify(b"n%d" % i)

            await asyncio.wait_for(asyncio.gather(msgs(), notes()), 60)
            await until(lambda: len(got) == 400, "all 400 handled", 30)
        for kind in (b"m", b"n"):
            assert [n for k, n in got if k == kind] == list(range(200))

    asyncio.run(main())


def test_close_waits_for_a_teardown_under_way():
    """A peer that died under us tears itself down in a background task; a close() called
    meanwhile (kvxfer.disagg fences on it before it releases the dead peer's pages) returns
    only once that teardown closed the endpoints, never while a late PUT could still land."""

    async def main():
        async with Pair(lambda peer, payload: None) as p:
            td = asyncio.ensure_future(p.b._teardown(send_bye=False))
            await until(lambda: p.b._closing, "the teardown under way")
            assert not td.done()
            await asyncio.wait_for(p.b.close(), 30)
            assert td.done() and td.exception() is None
            await p.b.close()  # idempotent once done

    asyncio.run(main())


def test_notify_without_a_write_goes_on_the_notification_lane_in_order():
    """``Peer.notify``: a notification with no write - natively on the RMA endpoint where
    the peer takes chained notifications (counted as a chained note), after the bytes of the
    writes before it, in order with write notifications; on the channel where it does not."""

    async def main():
        seen = []
        async with Pair(lambda peer, payload: seen.append(payload)) as p:
            a_buf, b_buf = p.bufs["a"], p.bufs["b"]
            notes0 = p.a._notes_sent
            for i in range(4):
                a_buf[1 * ITEM : 2 * ITEM] = 10 + i
                await p.a.write([ItemWrite("kv", [1], [3 + i])], timeout=10)
                await p.a.notify(b"done%d" % i)
                await p.notify(b"w%d" % i)
            await until(lambda: len(seen) == 8, "eight notifications")
            assert seen == [b"%s%d" % (k, i) for i in range(4) for k in (b"done", b"w")]
            assert p.a._notes_sent - notes0 == 8  # all chained: the native lane
            for i in range(4):
                assert (b_buf[(3 + i) * ITEM : (4 + i) * ITEM] == 10 + i).all()
            p.a._note_to = 0  # as a peer without chained notifications: the channel
            await p.a.notify(b"chan")
            await until(lambda: seen[-1:] == [b"chan"], "the channel's delivery")
            assert p.a._notes_sent - notes0 == 8
            with pytest.raises(InvalidArgument, match="must be bytes"):
                await p.a.notify("text")

    asyncio.run(main())


def test_notify_waits_behind_an_earlier_notifying_write():
    """A notification sent while an earlier notifying write is still in flight (started on
    this stack, not awaited) leaves after that write's: handlers see them in call order."""
    from kvxfer import eager

    async def main():
        seen = []
        pending = 0
        async with Pair(lambda peer, payload: seen.append(payload)) as p:
            p.a._rma._t.chain_inline_us = 0.0  # the chain's end comes back through the loop
            for i in range(20):
                n = 1 + i % 8
                w = eager.start(
                    asyncio.ensure_future,
                    p.a.write(
                        [ItemWrite("kv", list(range(n)), list(range(8, 8 + n)))],
                        notify=b"w%d" % i,
                        timeout=10,
                    ),
                )
                pending += not w.done()
                await p.a.notify(b"n%d" % i)
                await w
            await until(lambda: len(seen) == 40, "forty notifications")
            assert pending > 0  # some notify really had a write in flight before it
        assert seen == [b"%s%d" % (k, i) for i in range(20) for k in (b"w", b"n")]

    asyncio.run(main())
