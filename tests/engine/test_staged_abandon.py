"""Staged writes given up half-way (cancelled, timed out, failed) give their landing slots
back, and the target never scatters an abandoned chunk (kvxfer.engine.landing,
kvxfer.engine.peer_staged).

In-process pairs of engines (one asyncio loop, real UCX on loopback, host memory): A writes
to B. The staged path's test hook (``StagedPath.hook``) parks a chunk, or raises, at a named
point of its life (no sleeps): A's "landing" (slot taken), "put" (PUT posted), "plan"
(flushed, no plan), "sending" (plan send started), "sent" (plan sent), "reclaim" (before
the flush that returns a given-up PUT's slot); B's "scatter" (its dispatcher, before a
plan is scattered) and "abandon" (its reader handled a SlotAbandon). With one landing slot
per peer a slot that never came back stalls the next write until its deadline."""

import asyncio
import collections

import numpy as np
import pytest

from kvxfer.engine import ItemWrite, SliceWrite
from kvxfer.errors import TransferTimeout

pytestmark = pytest.mark.timeout(120)

SECRET = b"abandon-secret"
DESCS, PS, HEADS, HB = 2, 4, 4, 8  # 2 descriptors; page of 4 rows x 4 heads x 8 bytes
ITEM, ITEMS = PS * HEADS * HB, 32
POINTS = ("landing", "put", "plan", "sending", "sent")


def _rows(first_head, n_heads):
    o = np.arange(PS, dtype=np.int64) * HEADS * HB + first_head * HB
    return [(o, np.full(PS, n_heads * HB, dtype=np.int64))] * DESCS


class Hooks:
    """A test hook: ``park[point]`` parks the first chunk that reaches ``point`` until
    released; ``raise_at[point]`` raises an exception there once; ``reached[point]`` is set
    when a chunk got there."""

    def __init__(self):
        self.park = set()
        self.raise_at = {}
        self.reached = collections.defaultdict(asyncio.Event)
        self.release = collections.defaultdict(asyncio.Event)
        self.count = collections.Counter()

    async def __call__(self, point):
        self.count[point] += 1
        exc = self.raise_at.pop(point, None)
        if exc is not None:
            raise exc
        first = not self.reached[point].is_set()
        self.reached[point].set()
        if point in self.park and first:
            await self.release[point].wait()

    async def until(self, point, n):
        """Until ``point`` was reached ``n`` times (bound it)."""
        while self.count[point] < n:
            self.reached[point].clear()
            await self.reached[point].wait()

    def free(self):
        for p in list(self.park) + list(self.release):
            self.release[p].set()


class Pair:
    """Engines A and B over UCX loopback; A's pages random, B's zero."""

    def __init__(self, peer_slots=1, slot_items=3):
        self.peer_slots, self.slot_items = peer_slots, slot_items

    async def __aenter__(self):
        from kvxfer.engine import EngineConfig, TransferEngine

        rng = np.random.default_rng(5)
        n = ITEMS * ITEM
        self.bufs = {
            "a": [rng.integers(1, 255, n, dtype=np.uint8) for _ in range(DESCS)],
            "b": [np.zeros(n, np.uint8) for _ in range(DESCS)],
        }
        self.engines = {}
        for side in "ab":
            e = TransferEngine(
                EngineConfig(
                    secret=SECRET,
                    name=f"abandon-{side}",
                    stage_min_ops=1,
                    stage_host_memory=True,
                    stage_slice_min_ops=1,
                    stage_slot_bytes=self.slot_items * DESCS * ITEM,
                    stage_slots=4,
                    stage_peer_slots=self.peer_slots,
                    warn_slow_lanes=False,
                    connect_timeout_s=30.0,
                    transfer_timeout_s=10.0,
                )
            )
            ptrs = [b.ctypes.data for b in self.bufs[side]]
            e.register("kv", ptrs, [n] * DESCS, [ITEM] * DESCS)
            await e.start()
            self.engines[side] = e
        self.msg = asyncio.Queue()

        async def on_msg(peer, payload):
            self.msg.put_nowait(payload)

        self.engines["b"].on_message(on_msg)
        loop = asyncio.get_running_loop()
        got = loop.create_future()
        self.engines["b"].on_peer(lambda p: got.done() or got.set_result(p))
        self.a = await self.engines["a"].connect(*self.engines["b"].address)
        self.b = await asyncio.wait_for(got, 10)
        self.ha, self.hb = Hooks(), Hooks()
        self.a._staged.hook, self.b._staged.hook = self.ha, self.hb
        self.land = self.a._staged.landing["kv"]
        return self

    async def __aexit__(self, *exc):
        self.ha.free()
        self.hb.free()
        for e in self.engines.values():
            await e.close()

    def items(self, side, ids):
        return [b.reshape(ITEMS, ITEM)[np.asarray(ids)].copy() for b in self.bufs[side]]

    def writes(self, kind, src, dst, key):
        """An ItemWrite, or a SliceWrite of heads [1, 3) into heads [0, 2) (registered)."""
        if kind == "item":
            return [ItemWrite("kv", src, dst)]
        self.b.expect_slices(key, "kv", dst, _rows(0, 2))
        return [SliceWrite("kv", src, dst, _rows(1, 2), key)]

    def check(self, kind, src, dst):
        """B's items ``dst`` hold what ``kind`` wrote from A's ``src``."""
        for a, b in zip(self.items("a", src), self.items("b", dst)):
            if kind == "item":
                assert (a == b).all()
            else:
                a4, b4 = a.reshape(-1, PS, HEADS, HB), b.reshape(-1, PS, HEADS, HB)
                assert (b4[:, :, 0:2] == a4[:, :, 1:3]).all() and not b4[:, :, 2:].any()

    def zero(self, ids):
        return not any(x.any() for x in self.items("b", ids))

    async def ring_full(self):
        await asyncio.wait_for(self.land.idle(), 10)
        assert self.land.free.qsize() == self.peer_slots
        assert not (self.land.out or self.land.abandoning or self.land.reclaiming)
        assert not self.land.waiters
        assert not self.b._staged.busy and not self.b._staged.dropped


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def _then_clean_write(p, kind, abandoned_dst, key):
    """The next staged write to the same peer completes byte-exact (a slot that never came
    back would stall it: one landing slot), and the abandoned chunk's destinations hold
    none of its bytes."""
    src, dst = [20, 21, 22], [10, 11, 12]
    st = await p.a.write(p.writes(kind, src, dst, key + 100), notify=b"clean", timeout=5.0)
    assert st.staged
    assert await asyncio.wait_for(p.msg.get(), 10) == b"clean"
    p.check(kind, src, dst)
    assert p.zero(abandoned_dst), "an abandoned chunk reached B's items"
    await p.ring_full()


@pytest.mark.parametrize("kind", ["item", "slice"])
@pytest.mark.parametrize("point", POINTS)
def test_cancel_at_each_point_returns_the_slot(kind, point):
    """The write is cancelled while its only chunk is parked at ``point`` (B's dispatcher
    parked before any scatter): its slot comes back, B drops a plan it got, the next
    write to B completes byte-exact."""

    async def go():
        async with Pair() as p:
            p.ha.park.add(point)
            p.hb.park.add("scatter")
            src, dst = [1, 2, 3], [4, 5, 6]
            w = asyncio.ensure_future(p.a.write(p.writes(kind, src, dst, 1), notify=b"never"))
            await asyncio.wait_for(p.ha.reached[point].wait(), 10)
            w.cancel()
            with pytest.raises(asyncio.CancelledError):
                await w
            if point in ("sending", "sent"):  # the plan may be out: B sees the abandon
                await asyncio.wait_for(p.hb.reached["abandon"].wait(), 10)
            p.ha.free()
            p.hb.free()
            await _then_clean_write(p, kind, dst, 1)
            assert p.msg.empty()  # the cancelled write's notify never came

    _run(go())


@pytest.mark.parametrize("kind", ["item", "slice"])
@pytest.mark.parametrize("point", POINTS)
def test_failure_at_each_point_returns_the_slot(kind, point):
    """A typed failure raised right at ``point`` (the chunk does not yield first: at
    "sending" the plan's send task never ran) reaches the caller; the slot comes back."""

    async def go():
        async with Pair() as p:
            p.ha.raise_at[point] = TransferTimeout(f"injected at {point}")
            p.hb.park.add("scatter")
            src, dst = [1, 2, 3], [4, 5, 6]
            with pytest.raises(TransferTimeout, match="injected"):
                await p.a.write(p.writes(kind, src, dst, 1), notify=b"never")
            if point in ("sending", "sent"):  # sent, or never will be: B sees the abandon
                await asyncio.wait_for(p.hb.until("abandon", 1), 10)
            p.hb.free()
            await _then_clean_write(p, kind, dst, 1)
            # the plan's send task never ran at "sending": B got no plan to drop
            assert p.hb.count["scatter"] == 1 + (point == "sent")
            if point in ("landing", "put", "plan"):  # no plan: nothing to abandon
                assert p.hb.count["abandon"] == 0

    _run(go())


@pytest.mark.parametrize("notify", [None, b"vouched"])
@pytest.mark.parametrize("kind", ["item", "slice"])
def test_cancel_before_the_drain_reply(kind, notify):
    """Every plan is out, A waits for B's SlotFrees and B has not scattered (its dispatcher
    parked) when the write is cancelled. Without a notify the chunks are abandoned: B drops
    them, the slots come back (SlotFree, then SlotReclaimed), nothing of them lands. With a
    notify already handed over they are not: B scatters them before it delivers it."""

    async def go():
        async with Pair(peer_slots=2) as p:
            p.ha.park.add("drain")
            p.hb.park.add("scatter")
            # two chunks, one per slot (a slice chunk holds twice the items: half of each)
            n = 5 if kind == "item" else 8
            src, dst = [1, 2, 3, 7, 8, 9, 15, 16][:n], [4, 5, 6, 13, 14, 17, 18, 19][:n]
            w = asyncio.ensure_future(p.a.write(p.writes(kind, src, dst, 1), notify=notify))
            await asyncio.wait_for(p.ha.reached["drain"].wait(), 10)
            assert len(p.land.waiters) == 2 and p.land.free.qsize() == 0
            w.cancel()
            with pytest.raises(asyncio.CancelledError):
                await w
            if notify is None:
                assert p.land.abandoning == set(p.land.slots)
                await asyncio.wait_for(p.hb.until("abandon", 2), 10)
            else:
                assert not p.land.abandoning
            p.hb.free()
            if notify is None:
                await _then_clean_write(p, kind, dst, 1)
            else:
                assert await asyncio.wait_for(p.msg.get(), 10) == notify
                p.check(kind, src, dst)
                assert p.hb.count["abandon"] == 0
                await p.ring_full()

    _run(go())


def test_reclaimed_slot_waits_for_the_abandoned_put():
    """A chunk given up after its PUT was posted: its slot is not handed out again until
    the flush that covers that PUT completed (no late byte in the slot's next chunk)."""

    async def go():
        async with Pair() as p:
            p.ha.park.update(("put", "reclaim"))
            w = asyncio.ensure_future(p.a.write([ItemWrite("kv", [1, 2], [4, 5])], b"never"))
            await asyncio.wait_for(p.ha.reached["put"].wait(), 10)
            w.cancel()
            with pytest.raises(asyncio.CancelledError):
                await w
            await asyncio.wait_for(p.ha.reached["reclaim"].wait(), 10)
            slot = p.land.slots[0]
            assert p.land.free.qsize() == 0 and p.land.reclaiming == {slot}
            p.ha.free()
            await _then_clean_write(p, "item", [4, 5], 1)

    _run(go())


def test_hammer_random_cancels_then_clean_write():
    """100 staged writes (1-4 chunks over 2 slots, items and slices), each cancelled or
    failed at a random point of a random chunk, sometimes with B's dispatcher parked;
    the ring is whole after each; then a clean write is byte-exact."""

    async def go():
        rng = np.random.default_rng(2024)
        async with Pair(peer_slots=2, slot_items=2) as p:
            for it in range(100):
                p.ha, p.hb = Hooks(), Hooks()
                p.a._staged.hook, p.b._staged.hook = p.ha, p.hb
                kind = ("item", "slice")[int(rng.integers(2))]
                n = int(rng.integers(1, 9))
                src = rng.choice(ITEMS, n, replace=False).tolist()
                dst = rng.choice(ITEMS, n, replace=False).tolist()
                point = POINTS[int(rng.integers(len(POINTS)))]
                if rng.random() < 0.3:
                    p.hb.park.add("scatter")
                mode = ("park", "raise", "drain")[int(rng.integers(3))]
                w = asyncio.ensure_future(p.a.write(p.writes(kind, src, dst, it), b"x"))
                if mode == "raise":
                    p.ha.raise_at[point] = TransferTimeout("injected")
                elif mode == "park":
                    p.ha.park.add(point)
                done = asyncio.ensure_future(p.ha.reached[point].wait())
                await asyncio.wait([w, done], timeout=10, return_when=asyncio.FIRST_COMPLETED)
                done.cancel()
                w.cancel()
                try:
                    await w
                except (asyncio.CancelledError, TransferTimeout):
                    pass
                p.ha.free()
                p.hb.free()
                # (its key stays registered: a plan may still be on its way to B)
                await p.ring_full()  # every slot back before the next round
            await p.ring_full()
            p.bufs["b"][0][:] = 0
            p.bufs["b"][1][:] = 0
            src, dst = list(range(16)), list(range(16, 32))
            st = await p.a.write([ItemWrite("kv", src, dst)], b"clean", timeout=5.0)
            assert st.staged and st.ops == 8
            while (msg := await asyncio.wait_for(p.msg.get(), 10)) == b"x":
                pass  # notifies of writes that completed before their cancel
            assert msg == b"clean"
            p.check("item", src, dst)
            assert p.zero(list(range(16)))  # nothing of the abandoned writes landed late
            await p.ring_full()

    _run(go())
