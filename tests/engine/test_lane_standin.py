"""``Peer.write``'s device-lane branch on CPU, with a stand-in lane.

The device lane needs two CUDA processes on one host (tests/engine/test_engine.py runs it with
KVXFER_TEST_DEVICE=cuda). Here an in-process pair of engines (one asyncio loop, real UCX on
loopback, host memory) gets a :class:`~kvxfer.engine.devcopy.DeviceLane` whose only stand-in
part is the copy itself: ``launch`` moves each op with ``memmove`` (both buffers live in this
process) and returns an event that completes after a chosen number of queries. Selection,
masking, the inline poll, the awaited wait, the chained notification and the stats are the
real code."""

import asyncio
import ctypes

import numpy as np
import pytest

from kvxfer.engine import ItemWrite, RawWrite, devcopy

pytestmark = pytest.mark.timeout(120)

SECRET = b"lane-standin"
ITEM, ITEMS = 64, 32


class StandInEvent:
    """Completes at its ``after``-th query; ``synchronize`` completes it."""

    def __init__(self, after: int) -> None:
        self.after, self.queries = after, 0

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.after

    def synchronize(self) -> None:
        self.queries = max(self.queries, self.after)


class StandInLane(devcopy.DeviceLane):
    """A DeviceLane over every local registration and remote region, copying in process."""

    def __init__(
        self, peer, after: int, first_only: bool = False, emulated=()
    ) -> None:  # no IPC, no torch
        """``emulated``: remote regions standing for the peer's VMM memory (mapped by the
        lane, PUTs into them emulated by UCX)."""
        self.after = after
        self.closed = False
        memh = peer._groups.desc_memh["kv"]  # one registration per descriptor (buffer)
        self._local = np.unique(memh[:1] if first_only else memh)
        self._usable = np.ones(len(peer._remote.bases), dtype=bool)
        self.emulated = np.zeros(len(peer._remote.bases), dtype=bool)
        self.emulated[list(emulated)] = True
        self._any_emulated = bool(self.emulated.any())
        self.launched: list = []
        self.waits = 0

    def launch(self, laddr, raddr, nbytes, ridx):
        for s, d, n in zip(laddr.tolist(), raddr.tolist(), nbytes.tolist()):
            ctypes.memmove(d, s, n)
        ev = StandInEvent(self.after)
        self.launched.append((int(laddr.size), ev))
        return ev

    async def wait(self, ev, spin_s=devcopy.WAIT_SPIN_S, poll_s=devcopy.WAIT_POLL_S):
        self.waits += 1
        await devcopy.DeviceLane.wait(ev, spin_s, poll_s)

    # the pattern launches (PatternWrites): each part's runs moved with memmove
    profile = None

    def launch_patterns(self, parts, bases):
        self.launched.append((_move(parts, bases), ev := StandInEvent(self.after)))
        return ev

    def joins(self, main, extra, bases) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


def _move(parts, bases) -> int:
    """Copy PatternWrite parts ``(pattern, src, dst, group)`` between the descriptors of
    ``bases[group]`` (both sides in this process); the runs moved."""
    n = 0
    for pattern, src, dst, group in parts:
        lptrs, rptrs, _ = bases[group]
        for d, so, do, nb in zip(*(a.tolist() for a in pattern.expand(src, dst))):
            ctypes.memmove(rptrs[d] + do, lptrs[d] + so, nb)
            n += 1
    return n


async def _pair(device_min_ops: int, state: bool = False):
    """Engine ``a`` connected to engine ``b``: ``(engines, peer, bufs, b's notifications)``."""
    engines, peers, bufs, notes = await _engines(device_min_ops, state)
    return engines, peers["b"], bufs, notes["b"]


async def _engines(device_min_ops: int, state: bool = False, sides: str = "ab"):
    """Engine ``a`` connected to each other side's: ``(engines, peers, bufs, notes)``, the
    last two keyed by side."""
    from kvxfer.engine import EngineConfig, TransferEngine

    # two descriptors per side, two separate allocations (two registrations): an item is
    # one ITEM-byte row in each
    bufs = {
        s: [np.full((ITEMS, ITEM), i + 1, np.uint8) for _ in range(2)] for i, s in enumerate(sides)
    }
    for k, buf in enumerate(bufs["a"]):
        buf[:] = (np.arange(ITEMS * ITEM) * (k + 3) % 251).reshape(ITEMS, ITEM)
    engines, notes, peers = {}, {s: [] for s in sides[1:]}, {}
    for side in sides:
        e = TransferEngine(
            EngineConfig(
                secret=SECRET,
                name=f"lane-{side}",
                error_mode="none",
                warn_slow_lanes=False,
                connect_timeout_s=30.0,
                transfer_timeout_s=10.0,
                device_min_ops=device_min_ops,
            )
        )
        b = bufs[side]
        e.register("kv", [b[0].ctypes.data, b[1].ctypes.data], [ITEMS * ITEM] * 2, [ITEM] * 2)
        if state:  # a second group: one descriptor of ITEMS rows
            bufs[f"{side}-state"] = st = np.full((ITEMS, ITEM), 5 + (side != "a"), np.uint8)
            if side == "a":
                st[:] = (np.arange(ITEMS * ITEM) * 7 % 253).reshape(ITEMS, ITEM)
            e.register("state", [st.ctypes.data], [ITEMS * ITEM], [ITEM])
        await e.start()
        engines[side] = e
    for side in sides[1:]:
        engines[side].on_message(lambda p, payload, got=notes[side]: got.append(bytes(payload)))
        peers[side] = await engines["a"].connect(*engines[side].address)
    return engines, peers, bufs, notes


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0)


@pytest.mark.parametrize("after,first_only", [(1, False), (10**9, False), (1, True)])
def test_lane_write_moves_every_byte_then_notifies(after, first_only):
    """Scattered items go to the lane (selected; with ``first_only`` only the first buffer's
    ops, the rest masked off to UCX PUTs), every byte lands, the notification follows, the
    stats count device ops. A copy already done at the inline poll (after=1) needs no awaited
    wait; one that is not (after=1e9: only the executor's synchronize ends it) goes through
    the bounded wait."""

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=1)
        try:
            assert peer._dev is None  # host memory: no real lane
            lane = peer._dev = StandInLane(peer, after, first_only)
            src, dst = [3, 9, 10, 11, 30], [0, 7, 8, 20, 31]
            stats = await peer.write([ItemWrite("kv", src, dst)], notify=b"done", timeout=10)
            runs = 4  # 3->0, 9..10->7..8, 11->20, 30->31
            on_lane = runs if first_only else 2 * runs
            assert len(lane.launched) == 1 and lane.launched[0][0] == stats.device_ops == on_lane
            assert stats.ops == 2 * runs  # the rest went as UCX PUTs
            # stage stamps: the launch ended, then the PUTs were posted (one clock)
            assert 0 < stats.launched_ns <= stats.put_ns <= stats.posted_ns, stats
            assert lane.waits == (0 if after == 1 else 1)
            a, b = np.stack(bufs["a"]), np.stack(bufs["b"])
            for s, d in zip(src, dst):
                assert np.array_equal(b[:, d], a[:, s])
            untouched = sorted(set(range(ITEMS)) - set(dst))
            assert (b[:, untouched] == 2).all()
            await _until(lambda: notes == [b"done"], "the notification")
        finally:
            for e in engines.values():
                await e.close()
        assert lane.closed

    asyncio.run(main())


def test_lane_not_wanted_below_device_min_ops():
    """Fewer runs than device_min_ops stay on UCX: the lane launches nothing."""

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=128)
        try:
            lane = peer._dev = StandInLane(peer, 1)
            stats = await peer.write([ItemWrite("kv", [1, 5], [2, 6])], notify=b"x", timeout=10)
            assert lane.launched == [] and stats.device_ops == 0 and stats.ops == 4
            assert np.array_equal(np.stack(bufs["b"])[:, 2], np.stack(bufs["a"])[:, 1])
            await _until(lambda: notes == [b"x"], "the notification")
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


@pytest.mark.parametrize("into", ["vmm", "plain", "both"])
def test_writes_into_vmm_regions_take_the_lane_whatever_their_size(into):
    """A write into a region the lane mapped from the peer's CUDA VMM memory (UCX would
    emulate PUTs into it: ``DeviceLane.pick``) takes the lane below device_min_ops; a
    write of the same size into the other buffer (another region) stays on UCX, and so do
    the ops of a mixed write that go to it."""

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=128)
        try:
            info = engines["b"].group_info["kv"]  # host memory: nothing to offer
            assert info["ipc_capable"] is None and info["vmm_shared"] is False
            vmm_region = int(peer._remote.desc_region["kv"][0])
            lane = peer._dev = StandInLane(peer, 1, emulated=[vmm_region])
            descs = {"vmm": [0], "plain": [1], "both": [0, 1]}[into]
            ws = [RawWrite("kv", [ITEM], [2 * ITEM], [ITEM], d) for d in descs]
            stats = await peer.write(ws, notify=b"x", timeout=10)
            if 0 in descs:  # the op into the VMM region alone on the lane
                assert [n for n, _ in lane.launched] == [1] and stats.device_ops == 1
            else:
                assert lane.launched == [] and stats.device_ops == 0
            assert stats.ops == len(descs)
            for d in descs:
                assert np.array_equal(bufs["b"][d][2], bufs["a"][d][1])
            await _until(lambda: notes == [b"x"], "the notification")
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


def test_member_is_isin_for_sorted_tables():
    """devcopy.member against np.isin: every small table and every value around it."""
    rng = np.random.default_rng(5)
    for size in range(6):
        for _ in range(20):
            table = np.unique(rng.integers(0, 12, size).astype(np.uint64))
            values = rng.integers(0, 14, int(rng.integers(0, 9))).astype(np.uint64)
            got = devcopy.member(values, table)
            assert got.dtype == bool and got.shape == values.shape
            assert np.array_equal(got, np.isin(values, table))


def test_settled_polls_inline_then_gives_up():
    ev = StandInEvent(3)
    assert devcopy.DeviceLane.settled(ev, spin_s=1.0) and ev.queries == 3
    never = StandInEvent(10**9)
    assert not devcopy.DeviceLane.settled(never, spin_s=0.0) and never.queries == 1


@pytest.mark.parametrize("inline", [True, False])
def test_write_not_inline_suspends_at_the_copy(inline):
    """``Peer.write(inline=False)`` (a room's decode legs but the last): launched and posted
    on the caller's stack, then the copy's event is polled once, not spun on — the write
    suspends there and its caller goes on; ``inline=True`` spins and finds the copy done
    (it completes at the third poll) with no awaited wait. Either way every byte lands and
    the notification follows."""
    from kvxfer import eager

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=1)
        try:
            lane = peer._dev = StandInLane(peer, after=3)
            src, dst = [1, 2, 5], [4, 9, 12]
            loop = asyncio.get_running_loop()
            fut = eager.start(
                loop.create_task,
                peer.write([ItemWrite("kv", src, dst)], notify=b"legs", timeout=10, inline=inline),
            )
            assert len(lane.launched) == 1  # launched before start() returned
            ev = lane.launched[0][1]
            if not inline:
                assert not fut.done() and ev.queries == 1  # one poll, then it suspended
            await asyncio.wait_for(fut, 10)
            assert lane.waits == (0 if inline else 1)
            a, b = np.stack(bufs["a"]), np.stack(bufs["b"])
            for s, d in zip(src, dst):
                assert np.array_equal(b[:, d], a[:, s])
            await _until(lambda: notes == [b"legs"], "the notification")
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


def test_joins_launch_asks_the_lane_only_for_two_launchable_patterns():
    """``Peer.joins_launch``: False without a lane for both groups or for plans that are
    not validated PatternRuns; else the lane's answer, given both groups' descriptors."""
    from kvxfer.engine.slices import PatternRuns
    from kvxfer.engine.types import PatternWrite

    async def main():
        engines, peer, bufs, _ = await _pair(device_min_ops=10**6, state=True)
        try:
            half = ITEM // 2
            runs = PatternRuns.make([([half], [0], [half])] * 2, [ITEM] * 2, [ITEM] * 2)
            st_runs = PatternRuns.make([([0], [16], [16])], [ITEM], [ITEM])
            kv, st = PatternWrite("kv", [1], [2], runs), PatternWrite("state", [3], [4], st_runs)
            assert not peer.joins_launch([kv], st)  # no lane
            lane = peer._dev = StandInLane(peer, after=1)
            asked = []
            lane.joins = lambda main, extra, bases: asked.append((main, extra, bases)) or True
            assert not peer.joins_launch([kv], st)  # the lane does not cover the groups
            peer._pattern_ok.update(kv=True, state=True)
            assert peer.joins_launch([kv], st)
            raw = PatternWrite("state", [3], [4], [([0], [16], [16])])
            assert not peer.joins_launch([kv], raw) and not peer.joins_launch([], st)
            ((main, extra, bases),) = asked
            assert main == [("kv", runs)] and extra == ("state", st_runs)
            assert bases["state"][0] == (bufs["a-state"].ctypes.data,)
            assert bases["kv"][1] == tuple(b.ctypes.data for b in bufs["b"])
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


class StuckEvent:
    """A copy that does not complete: never done when queried; ``synchronize`` returns
    after ``hold`` seconds without completing it (a wedged copy seen from the executor)."""

    def __init__(self, hold: float) -> None:
        self.hold, self.queries = hold, 0

    def query(self) -> bool:
        self.queries += 1
        return False

    def synchronize(self) -> None:
        import threading

        threading.Event().wait(self.hold)


@pytest.mark.parametrize("copy", ["completes", "stuck"])
def test_a_write_failing_after_its_lane_copy_waits_for_the_copy(copy):
    """The write's device-lane copy is launched, then the PUT of its host-memory rest finds
    the endpoint gone: the failure is raised only once the copy completed (its bytes can no
    longer land after the room's failure is reported and its pages are released); a copy
    still running at the write's deadline turns the failure into a TransferTimeout (the
    disagg layer fences the pages, as for any timed-out write), from the PUT's error."""
    from kvxfer.errors import PeerClosed, TransferTimeout

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=1, state=True)
        try:
            lane = peer._dev = StandInLane(peer, after=5)
            if copy == "stuck":
                stuck = StuckEvent(hold=0.5)
                lane.launch = lambda *a: (lane.launched.append((len(a[0]), stuck)), stuck)[1]

            def gone(*_):
                raise PeerClosed("stand-in: endpoint gone")

            peer._rma.put = gone  # the state rows (host memory, not the lane's) go as PUTs
            writes = [ItemWrite("kv", [1, 2], [4, 9]), ItemWrite("state", [3], [4])]
            if copy == "completes":
                with pytest.raises(PeerClosed, match="endpoint gone"):
                    await peer.write(writes, notify=b"x", timeout=10)
                ((_, ev),) = lane.launched
                assert ev.queries >= 5  # polled until it completed, then the failure
            else:
                with pytest.raises(TransferTimeout, match="device copy still running") as ei:
                    await peer.write(writes, notify=b"x", timeout=0.2)
                assert isinstance(ei.value.__cause__, PeerClosed)
                assert stuck.queries >= 1
            assert notes == []
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


class StandInHostLane:
    """A host lane taking every op of a write (both sides host memory, in this process):
    ``start`` records the runs and returns a pending future; :meth:`finish` copies them
    (memmove) and resolves it — a host-lane copy still running until the test says."""

    shm = False  # (the lane then takes a write of any run count: Peer.write's rule)
    closed = False

    def __init__(self) -> None:
        self.jobs: list = []

    def select(self, lmemh, ridx):
        return np.ones(ridx.size, dtype=bool)

    def start(self, laddr, raddr, nbytes, ridx, name):
        fut = asyncio.get_running_loop().create_future()
        self.jobs.append((laddr.copy(), raddr.copy(), nbytes.copy(), fut))
        return fut

    def finish(self) -> None:
        for la, ra, nb, fut in self.jobs:
            for s, d, n in zip(la.tolist(), ra.tolist(), nb.tolist()):
                ctypes.memmove(d, s, n)
            fut.set_result(None)

    async def close(self, timeout: float) -> None:  # (the teardown's; the copy goes on)
        self.closed = True


@pytest.mark.parametrize("copy", ["completes", "stuck"])
def test_a_write_failing_while_its_host_lane_copy_runs_waits_for_the_copy(copy, monkeypatch):
    """The write's runs go to the host lane (copied on its threads); the peer dies while the
    copy runs: ``PeerClosed`` is raised only once the copy ended (no byte of the write lands
    after its failure is reported); a copy still running at the write's deadline turns the
    failure into a TransferTimeout from the PeerClosed."""
    from kvxfer.engine import hostcopy
    from kvxfer.errors import PeerClosed, TransferTimeout

    monkeypatch.setattr(hostcopy, "lane_wanted", lambda *a, **k: True)

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=10**6)
        try:
            lane = peer._hostl = StandInHostLane()
            timeout = 10 if copy == "completes" else 0.3
            t = asyncio.create_task(
                peer.write([ItemWrite("kv", [1, 2, 5], [4, 9, 30])], notify=b"x", timeout=timeout)
            )
            await _until(lambda: lane.jobs, "the host-lane copy to start")
            peer._mark_dead(PeerClosed("stand-in: endpoint gone"))  # (as UCX's error handler)
            for _ in range(20):  # the write's failure path runs; it must not end yet
                await asyncio.sleep(0)
            assert not t.done()
            if copy == "completes":
                lane.finish()
                with pytest.raises(PeerClosed, match="endpoint gone"):
                    await t
                a, b = np.stack(bufs["a"]), np.stack(bufs["b"])
                assert (b[:, [4, 9, 30]] == a[:, [1, 2, 5]]).all()  # all of it, before
            else:
                with pytest.raises(TransferTimeout, match="host-lane copy still running") as ei:
                    await t
                assert isinstance(ei.value.__cause__, PeerClosed)
                lane.finish()
            assert notes == []
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())


def test_a_failed_write_with_both_lanes_still_copying_at_its_deadline_names_both(monkeypatch):
    """A write split between the device lane (the first buffer's ops) and the host lane (the
    rest); the device copy is wedged and the host copy never ends; the peer dies: the
    failure waits out the deadline for both, then is a TransferTimeout naming both copies,
    from the PeerClosed (the disagg layer fences the pages)."""
    from kvxfer.engine import hostcopy
    from kvxfer.errors import PeerClosed, TransferTimeout

    monkeypatch.setattr(hostcopy, "lane_wanted", lambda *a, **k: True)

    async def main():
        engines, peer, bufs, notes = await _pair(device_min_ops=1)
        try:
            dev = peer._dev = StandInLane(peer, after=1, first_only=True)
            stuck = StuckEvent(hold=0.8)  # (past the write's deadline)
            dev.launch = lambda *a: (dev.launched.append((len(a[0]), stuck)), stuck)[1]
            dev.close = lambda: None  # (not closed by the teardown: a closed lane's stream
            # was synchronised, its copy done; here it stays wedged)
            host = peer._hostl = StandInHostLane()
            t = asyncio.create_task(
                peer.write([ItemWrite("kv", [1, 2, 5], [4, 9, 30])], notify=b"x", timeout=0.4)
            )
            await _until(lambda: host.jobs and dev.launched, "both copies to start")
            peer._mark_dead(PeerClosed("stand-in: endpoint gone"))
            with pytest.raises(TransferTimeout, match="device copy and host-lane copy") as ei:
                await t
            assert isinstance(ei.value.__cause__, PeerClosed)
            assert notes == []
            host.finish()
        finally:
            for e in engines.values():
                await e.close()

    asyncio.run(main())
