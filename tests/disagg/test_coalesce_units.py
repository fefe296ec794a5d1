"""kvxfer.disagg.coalesce without processes: when a last chunk waits (every condition of
``Coalescer.wants``), the outbox's accounting (withdraw, drain on completion, at most
MAX_ROOMS per write) and the DoneMany message (the ``coalesce_after`` setting:
test_direct_calls.py). The interleavings with real UCX are in test_pd_coalesce.py."""

import asyncio
import time
import types

import numpy as np
import pytest

from kvxfer import wire
from kvxfer.disagg import bursts, coalesce
from kvxfer.disagg import messages as m
from kvxfer.disagg.decode_side import DecodeSide
from kvxfer.disagg.link import Link
from kvxfer.disagg.outbox import Outboxes
from kvxfer.disagg.poll import KVPoll
from kvxfer.disagg.rooms import Room
from kvxfer.errors import ProtocolError

pytestmark = pytest.mark.timeout(60)


class _Item:
    """Stands in for ItemWrite (the real one pulls in UCX)."""

    def __init__(self, src, dst):
        self.src_items, self.dst_items = src, dst


def _coalescer(after=1, integrity=None):
    mgr = types.SimpleNamespace(integrity=integrity, spawn=lambda coro: _spawn(coro))
    # a minute's max wait: the rooms go only on completions (the timer: its own test)
    c = coalesce.Coalescer(mgr, after, write_alone=lambda *a: None, max_wait_s=60.0)
    c._item_cls = _Item
    return c


def _spawn(coro):
    return asyncio.get_running_loop().create_task(coro)


def _room(link, aux=3, room=1):
    r = Room(room, "sender")
    r.link, r.aux_index = link, aux
    return r


def _link(**kw):
    link = Link("peer", object(), "decode")
    link.done_many = True
    for k, v in kw.items():
        setattr(link, k, v)
    return link


def test_wants_every_condition():
    """A last chunk waits only when every condition holds; each one false alone keeps the
    room's own write."""
    loop = asyncio.new_event_loop()
    try:
        done = loop.create_future()
        done.set_result(None)
        pending = loop.create_future()

        def busy(c, n=1, **kw):
            link = _link(**kw)
            for _ in range(n):
                c.boxes.track(link, loop.create_future())  # a write in flight, never done
            return link

        c = _coalescer()
        link = busy(c)
        kv = _Item([1], [2])
        assert c.wants(_room(link), kv, None)
        assert c.wants(_room(link), None, done)  # no kv pages, earlier chunk done
        assert not c.wants(_room(link), kv, pending)  # an earlier chunk still in flight
        assert not c.wants(_room(link), [kv], None)  # a list of PatternWrites
        assert not c.wants(_room(link), object(), None)  # a RawWrite, say
        assert not c.wants(_room(link, aux=None), kv, None)
        assert not c.wants(_room(None), kv, None)
        assert not c.wants(_room(_link()), kv, None)  # the link is idle
        assert not c.wants(_room(busy(c, done_many=False)), kv, None)
        assert not c.wants(_room(busy(c, tp=object())), kv, None)
        assert not c.wants(_room(busy(c, dead=True)), kv, None)
        c2 = _coalescer(integrity=object())
        assert not c2.wants(_room(busy(c2)), kv, None)
        c0 = _coalescer(after=0)
        assert not c0.wants(_room(busy(c0, 5)), kv, None)
        c2 = _coalescer(after=2)
        assert not c2.wants(_room(busy(c2, 1)), kv, None)
        assert c2.wants(_room(busy(c2, 2)), kv, None)
    finally:
        loop.close()


def test_outbox_drains_on_completion_in_batches():
    """Rooms wait while a write is in flight; its completion sends them all as one write
    (at most MAX_ROOMS; the rest when that one completes); a withdrawn room's chain ends
    at once and it is never written; ``inflight`` returns to 0 and every chain ends."""

    async def main():
        c = _coalescer()
        link = _link()
        batches, gates = [], []

        async def write_rooms(lk, live, ticket):
            assert lk is link
            batches.append([p.room.room for p in live])
            gate = asyncio.get_running_loop().create_future()
            gates.append(gate)
            await gate

        c._write_rooms = write_rooms
        first = asyncio.get_running_loop().create_future()
        c.boxes.track(link, first)
        boxes = c.boxes
        assert boxes.inflight == {link: 1}
        n = coalesce.MAX_ROOMS + 5
        rooms = [_room(link, room=i) for i in range(n)]
        futs = [c.add(r, np.arange(1), _Item([i], [i]), None) for i, r in enumerate(rooms)]
        c.withdraw(rooms[3])
        assert futs[3].done() and len(boxes.waiting[link]) == n - 1
        c.withdraw(_room(link, room=-1))  # not waiting: nothing happens
        first.set_result(None)
        await asyncio.sleep(0)  # the done callback: drains the first MAX_ROOMS
        assert len(batches) == 1 and len(batches[0]) == coalesce.MAX_ROOMS
        assert 3 not in batches[0] and boxes.inflight == {link: 1}
        assert len(boxes.waiting[link]) == n - 1 - coalesce.MAX_ROOMS
        gates[0].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert len(batches) == 2 and batches[1] == list(range(coalesce.MAX_ROOMS + 1, n))
        gates[1].set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert boxes.inflight == {} and boxes.waiting == {}
        assert all(f.done() for f in futs)

    asyncio.run(main())


def test_terminal_rooms_are_skipped():
    """A room that ended while waiting (its failure did not withdraw it) is not written."""

    async def main():
        c = _coalescer()
        link = _link()
        seen = []

        async def write_rooms(lk, live, ticket):
            seen.append([p.room.room for p in live])

        c._write_rooms = write_rooms
        first = asyncio.get_running_loop().create_future()
        c.boxes.track(link, first)
        rooms = [_room(link, room=i) for i in range(3)]
        futs = [c.add(r, np.arange(1), None, None) for r in rooms]
        rooms[1].state = KVPoll.Failed
        first.set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen == [[0, 2]] and all(f.done() for f in futs) and c.boxes.inflight == {}

    asyncio.run(main())


def _recording_box(loop, after=1):
    """Outboxes whose started batches are recorded (their writes never complete)."""
    started = []

    def start(key, batch, ticket):
        started.append(list(batch))
        return loop.create_future()

    return Outboxes(after, start, 8, max_wait_s=60.0), started


def test_a_ticket_ended_by_its_writer_counts_once():
    """A write's ticket ended by its writer (the write returned) stops counting at once and
    sends what waits, before the write's future is done; the future's completion later
    changes nothing (counted once); an unknown or repeated end is a no-op."""

    async def main():
        loop = asyncio.get_running_loop()
        box, started = _recording_box(loop)
        fut = loop.create_future()
        ticket = box.track("a", fut)
        box.add("a", "x")
        box.add("a", "y")
        box.end(ticket)  # on the writer's stack: no loop iteration in between
        assert started == [["x", "y"]] and box.waiting == {} and box.inflight == {"a": 1}
        fut.set_result(None)
        await asyncio.sleep(0)
        assert box.inflight == {"a": 1}  # only the batch's own write is left
        box.end(ticket)
        box.end(None)
        assert box.inflight == {"a": 1}
        assert Outboxes(0, box._start, 8).begin("a") is None

    asyncio.run(main())


def test_a_burst_of_returned_but_unsettled_writes_is_busy():
    """Writes that returned (tickets ended) but whose futures' callbacks have not run yet
    count towards ``after`` x BACKLOG: a burst finishing inline still batches, while fewer
    of them (a scheduler sending its next request on the last one's completion) do not."""
    from kvxfer.disagg.outbox import BACKLOG

    async def main():
        loop = asyncio.get_running_loop()
        box, started = _recording_box(loop)
        futs = []
        for i in range(BACKLOG):
            assert not box.busy("a"), i
            fut = loop.create_future()
            box.end(box.track("a", fut))  # returned at once: only unsettled
            futs.append(fut)
        assert box.inflight == {} and box.unsettled == {"a": BACKLOG} and box.busy("a")
        box.add("a", "x")
        futs[0].set_result(None)
        await asyncio.sleep(0)  # one settles: below the backlog, the item goes
        assert started == [["x"]] and box.waiting == {}
        for f in futs[1:]:
            f.set_result(None)
        await asyncio.sleep(0)
        assert box.unsettled == {"a": 1} and box.inflight == {"a": 1}  # the batch's write

    asyncio.run(main())


def test_inline_wait_left_out_only_in_a_polling_schedulers_burst():
    """``Coalescer.inline_ok``: a write may wait inline for its flush unless the last write
    started was another room's and the scheduler, which polls, has not polled since; a
    scheduler that never polls, or not for ``POLLER_S`` (``on_done`` only), keeps it."""
    c = _coalescer()
    mgr = c.mgr
    link = _link()
    a, b, c2 = (_room(link, room=n) for n in (1, 2, 3))
    mgr.polled_at = 0.0  # never polled: every write waits inline, back to back or not
    assert [c.inline_ok(r) for r in (a, b, c2, a)] == [True] * 4
    mgr.polled_at = time.monotonic()  # a poll since the last write
    assert c.inline_ok(a)
    assert c.inline_ok(a)  # the same room again (its next chunk, another decode leg)
    assert not c.inline_ok(b)  # another room, no poll between: a burst
    assert not c.inline_ok(c2)
    mgr.polled_at += 1e-6  # the scheduler looked at its rooms
    assert c.inline_ok(a)
    assert not c.inline_ok(b)
    mgr.polled_at += 1e-6
    assert c.inline_ok(b)
    mgr.polled_at = time.monotonic() - bursts.POLLER_S - 0.1  # polled long ago
    assert c.inline_ok(a)
    assert c.inline_ok(b) and c.inline_ok(c2)  # no longer a poller: back to back is fine


def test_done_many_message():
    msg = m.DoneMany(rooms=[5, 9], pages=[1, 3])
    assert wire.decode(msg.encode()) == msg
    with pytest.raises(ProtocolError, match="rooms"):
        wire.decode(m.DoneMany(rooms=[5, "9"], pages=[1, 3]).encode())
    side = DecodeSide.__new__(DecodeSide)  # the length check comes before any room
    with pytest.raises(ProtocolError, match="2 rooms but 1 page counts"):
        side._on_done_many(None, m.DoneMany(rooms=[5, 9], pages=[1]))
    n = m.DONE_MANY_MAX + 1
    with pytest.raises(ProtocolError, match="at most"):
        side._on_done_many(None, m.DoneMany(rooms=list(range(n)), pages=[1] * n))


def test_outboxes_bookkeeping():
    """Outboxes alone: ``after`` 0 tracks nothing and is never busy; a key is busy from
    ``after`` writes in flight; a completion below it drains at most ``max_batch`` items
    in order (the batch's own write then counts in flight); ``withdraw`` takes the first
    match only; every count returns to 0."""

    async def main():
        loop = asyncio.get_running_loop()
        off = Outboxes(0, lambda k, b, t: loop.create_future(), 2)
        off.track("a", loop.create_future())
        assert off.inflight == {} and not off.busy("a")

        started = []

        def start(key, batch, ticket):
            started.append((key, list(batch)))
            fut = loop.create_future()
            fut.set_result(None)
            return fut

        box = Outboxes(2, start, 2, max_wait_s=60.0)
        w1, w2 = loop.create_future(), loop.create_future()
        box.track("a", w1)
        assert not box.busy("a") and not box.busy("b")
        box.track("a", w2)
        assert box.busy("a") and box.inflight == {"a": 2}
        for i in range(5):
            box.add("a", i)
        assert box.withdraw("a", lambda x: x % 2 == 1) == 1
        assert box.withdraw("a", lambda x: x > 10) is None and box.withdraw("b", bool) is None
        w1.set_result(None)
        await asyncio.sleep(0)  # 1 in flight < 2: the first two go
        # that batch's write was done when it returned: settled at once (no done callback,
        # no loop iteration), so the rest went right after it, as a batch of their own
        assert started == [("a", [0, 2]), ("a", [3, 4])] and box.waiting == {}
        assert box.inflight == {"a": 1} and box.unsettled == {"a": 1}  # w2 only
        w2.set_result(None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert box.inflight == {} and box.waiting == {}

    asyncio.run(main())


def test_outboxes_send_after_max_wait_without_a_completion():
    """A write in flight that never completes (a long one) holds waiting items back for
    ``max_wait_s`` only: then they go as one batch (at most ``max_batch``, the rest after
    another ``max_wait_s``); a completion before that sends them at once and disarms it."""

    async def main():
        loop = asyncio.get_running_loop()
        started = []

        def start(key, batch, ticket):
            started.append((loop.time(), list(batch)))
            return loop.create_future()  # never completes either

        box = Outboxes(1, start, 2, max_wait_s=0.02)
        box.track("a", loop.create_future())
        t0 = loop.time()
        for i in range(3):
            box.add("a", i)
        await asyncio.sleep(0.005)
        assert started == []
        for _ in range(200):
            if len(started) == 2:
                break
            await asyncio.sleep(0.005)
        (t1, b1), (t2, b2) = started
        assert (b1, b2) == ([0, 1], [2]) and t1 - t0 >= 0.02 and t2 - t1 >= 0.02
        assert box.waiting == {} and box.inflight == {"a": 3} and box._timers == {}
        # a completion first: the waiting item goes at once, its timer is cancelled
        done = loop.create_future()
        box2 = Outboxes(1, start, 2, max_wait_s=60.0)
        box2.track("b", done)
        box2.add("b", "x")
        done.set_result(None)
        await asyncio.sleep(0)
        assert started[-1][1] == ["x"] and box2._timers == {} and box2.waiting == {}

    asyncio.run(main())
