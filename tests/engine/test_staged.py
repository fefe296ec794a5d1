"""Staged path (gather → one PUT per landing slot → scatter at the target) over real UCX
loopback, in spawned processes (A: target, B: initiators). Slots are tiny (4 items) and
each peer is granted 2, so every staged write here moves in several chunks and recycles
landing slots. Same tests on CUDA with KVXFER_TEST_DEVICE=cuda."""

import numpy as np
import pytest
from staged_nodes import StagedNode
from testenv import DEVICE

from kvxfer import plan
from kvxfer.procs import Worker

pytestmark = pytest.mark.timeout(90)

SECRET = b"staged-secret"
L, ITEM = 3, 256
A_ITEMS, B_ITEMS = 64, 48
PER_SLOT = 4  # items per landing slot
PEER_SLOTS = 2


def groups(items):
    return {
        "kv": {"item_lens": [ITEM] * (2 * L), "items": items, "contiguous": True},
        "pm": {"item_lens": [2 * L * ITEM], "items": items},
        "state": {"item_lens": [96, 32], "items": 8},
    }


def eng(name, min_ops=8, slots=6):
    cfg = dict(
        secret=SECRET,
        name=name,
        connect_timeout_s=10.0,
        transfer_timeout_s=10.0,
        stage_min_ops=min_ops,
        stage_slot_bytes=PER_SLOT * 2 * L * ITEM,
        stage_slots=slots,
        stage_peer_slots=PEER_SLOTS,
        stage_host_memory=True,
    )
    return {"config": cfg, "groups": groups(A_ITEMS if name == "A" else B_ITEMS), "device": DEVICE}


@pytest.fixture(scope="module")
def nodes():
    a = Worker(StagedNode, {"engines": {"main": eng("A")}}, name="A")
    b = Worker(
        StagedNode,
        {
            "engines": {
                "main": eng("B"),
                "evil": eng("B-evil"),
                "nostage": eng("B-nostage", min_ops=0),
            }
        },
        name="B",
    )
    try:
        port = a.start().proxy(StagedNode).ports()["main"]
        b.start()
        pid = b.proxy(StagedNode).connect("main", "127.0.0.1", port)
        assert "ok" in pid, pid
        yield {"A": a.proxy(StagedNode), "B": b.proxy(StagedNode), "port": port, "B->A": pid["ok"]}
    finally:
        b.close()
        a.close()


def _pages(seed, n, lo=0):
    rng = np.random.default_rng(seed)
    return (
        rng.choice(B_ITEMS, n, replace=False).tolist(),
        (lo + rng.choice(A_ITEMS - lo, n, replace=False)).tolist(),
    )


def _untouched_zero(a, group, dst, n_items=A_ITEMS):
    rest = sorted(set(range(n_items)) - set(dst))
    assert not any(a.items("main", group, rest)), "bytes outside dst written"


@pytest.mark.parametrize("group", ["kv", "pm"])
def test_staged_random_pages_byte_exact(nodes, group):
    a, b = nodes["A"], nodes["B"]
    src, dst = _pages(3, 30)
    b.fill("main", group, 5)
    a.zero("main", group)
    res = b.write("main", nodes["B->A"], [(group, src, dst)], b"staged-" + group.encode())
    assert "ok" in res, res
    st = res["ok"]
    runs = len(plan.merge_runs(np.array(src), np.array(dst))[0])
    assert st["staged"] and st["staged_bytes"] == st["bytes"] == 30 * 2 * L * ITEM
    assert st["ops"] == -(-30 // PER_SLOT)  # one PUT per chunk
    assert st["staged_direct_ops"] == runs * (2 * L if group == "kv" else 1)
    assert [p for _, p in a.messages("main", 1, 10.0)] == [b"staged-" + group.encode()]
    assert a.items("main", group, dst) == b.items("main", group, src)
    _untouched_zero(a, group, dst)
    assert b.landing("main", nodes["B->A"], group) == (PEER_SLOTS, 0)


def test_many_staged_in_flight_recycle_slots(nodes):
    """6 writes of 10 pages submitted at once = 18 chunks through 2 landing slots: a slot
    is reused only after the target drained it, so every page arrives intact."""
    a, b = nodes["A"], nodes["B"]
    b.fill("main", "pm", 8)
    a.zero("main", "pm")
    rng = np.random.default_rng(11)
    dst_all = rng.permutation(A_ITEMS)[:60].reshape(6, 10)  # disjoint destinations
    pairs = [(rng.choice(B_ITEMS, 10, replace=False), dst_all[i]) for i in range(6)]
    batches = [([("pm", s.tolist(), d.tolist())], b"m%d" % i) for i, (s, d) in enumerate(pairs)]
    res = b.write_many("main", nodes["B->A"], batches)
    assert all("ok" in r for r in res), res
    msgs = a.messages("main", len(batches), 10.0)
    assert sorted(p for _, p in msgs) == sorted(n for _, n in batches)
    for src, dst in pairs:
        assert a.items("main", "pm", dst.tolist()) == b.items("main", "pm", src.tolist())
    _untouched_zero(a, "pm", dst_all.ravel().tolist())
    assert b.landing("main", nodes["B->A"], "pm") == (PEER_SLOTS, 0)
    # rounds of concurrent writes to the same destinations: the last round wins everywhere
    for seed in (1, 2, 3):
        b.fill("main", "pm", 20 + seed)
        rnd = [
            ([("pm", list(range(10 * k, 10 * k + 10)), dst_all[k].tolist())], b"r")
            for k in range(4)
        ]
        res = b.write_many("main", nodes["B->A"], rnd)
        assert all("ok" in r for r in res), res
        a.messages("main", 4, 10.0)
        for k in range(4):
            assert a.items("main", "pm", dst_all[k].tolist()) == b.items(
                "main", "pm", list(range(10 * k, 10 * k + 10))
            )


def test_mixed_staged_and_unstaged(nodes):
    a, b = nodes["A"], nodes["B"]
    for g in ("kv", "pm", "state"):
        b.fill("main", g, 40)
        a.zero("main", g)
    ksrc, kdst = _pages(9, 20)
    parts = [
        ("kv", ksrc, kdst),  # ~20 runs x 6 descriptors: staged
        ("pm", list(range(5, 15)), list(range(30, 40))),  # one run: direct
        ("state", [0, 5, 7], [7, 1, 2]),
    ]  # 3 runs x 2: direct
    res = b.write("main", nodes["B->A"], parts, b"mixed")
    assert "ok" in res, res
    st = res["ok"]
    assert st["staged"] and st["staged_bytes"] == 20 * 2 * L * ITEM
    assert st["ops"] == -(-20 // PER_SLOT) + 1 + 3 * 2
    assert st["bytes"] == 30 * 2 * L * ITEM + 3 * 128
    assert [p for _, p in a.messages("main", 1, 10.0)] == [b"mixed"]
    assert a.items("main", "kv", kdst) == b.items("main", "kv", ksrc)
    assert a.items("main", "pm", list(range(30, 40))) == b.items("main", "pm", list(range(5, 15)))
    assert a.items("main", "state", [7, 1, 2]) == b.items("main", "state", [0, 5, 7])
    # below the threshold, or staging disabled: the direct path
    small = b.write("main", nodes["B->A"], [("pm", [1, 3], [2, 4])])["ok"]
    assert not small["staged"] and small["ops"] == 2
    pid = b.connect("nostage", "127.0.0.1", nodes["port"])["ok"]
    b.fill("nostage", "kv", 41)
    off = b.write("nostage", pid, [("kv", ksrc, kdst)], b"off")["ok"]
    runs = len(plan.merge_runs(np.array(ksrc), np.array(kdst))[0])
    assert not off["staged"] and off["ops"] == runs * 2 * L
    assert [p for _, p in a.messages("main", 1, 10.0)] == [b"off"]
    assert a.items("main", "kv", kdst) == b.items("nostage", "kv", ksrc)


NB = 2 * 2 * L * ITEM  # two pm items


@pytest.mark.parametrize(
    "slot,offset,nbytes,dst,why",
    [
        (None, 0, NB, [3, A_ITEMS], "out of range"),
        (None, 0, NB, [-1, 2], "out of range"),
        (None, 0, NB, [3, 3], "duplicate"),
        (None, 0, NB + 1, [3, 4], "nbytes"),
        (None, PER_SLOT * 2 * L * ITEM - NB + 8, NB, [3, 4], "outside"),
        (99, 0, NB, [3, 4], "not granted"),
    ],
    ids=["dst-beyond", "dst-negative", "dst-duplicate", "nbytes", "offset", "slot"],
)
def test_bad_scatter_plan_rejected(nodes, slot, offset, nbytes, dst, why):
    """A bad plan is a ProtocolError at the target: the connection closes, nothing is
    scattered, no handler runs, and the landing slots granted to that peer come back."""
    a, b = nodes["A"], nodes["B"]
    a.zero("main", "pm")
    b.fill("evil", "pm", 50)
    free_before = a.granted("main", "pm")
    closed_before = a.closed("main")
    pid = b.connect("evil", "127.0.0.1", nodes["port"])["ok"]
    # a real PUT into a granted slot first, so a wrong scatter would write non-zero bytes
    good = b.write("evil", pid, [("pm", list(range(0, 24, 2)), list(range(0, 24, 2)))], b"good")
    assert good["ok"]["staged"], good
    assert [p for _, p in a.messages("main", 1, 10.0)] == [b"good"]  # scattered
    a.zero("main", "pm")
    if slot is None:  # a slot this peer really owns
        slot = b.landing_slots("evil", pid, "pm")[0]
    res = b.raw_plan("evil", pid, "pm", slot, offset, nbytes, dst)
    assert "ok" in res, res
    evil = b.engine_id("evil")
    assert _wait_closed(a, evil, closed_before) == "ProtocolError"
    assert sum(a.checksum("main", "pm")) == 0
    assert a.messages("main", 0, 0.5) == []
    # the grant comes back once the teardown closed the endpoint (bounded poll)
    assert _poll(lambda: a.granted("main", "pm") == free_before)


def _poll(cond, timeout=10.0):
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def _wait_closed(a, engine_id, before, timeout=10.0):
    """Why A closed its peer ``engine_id`` (a new entry after ``before``), or None."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        new = a.closed("main")[len(before) :]
        for p, why in new:
            if p == engine_id:
                return why
        time.sleep(0.02)
    return None


# ------------------------------------------------------------------ SliceWrite (slices)
# In-process pairs of engines (one asyncio loop, real UCX on loopback; host memory, or
# CUDA memory with KVXFER_TEST_DEVICE=cuda: the torch gather / scatter): the
# initiator gathers head slices of NHD-like pages, PUTs one op per landing-slot chunk, the
# target scatters them by the runs IT registered (Peer.expect_slices).

PS, HEADS, HB = 4, 4, 8  # page of 4 token rows of 4 heads of 8 bytes
SL_ITEM, SL_ITEMS, SL_DESCS = PS * HEADS * HB, 24, 2 * L


def _rows(first_head, n_heads):
    """Item-relative runs of heads [first_head, +n_heads) in every token row."""
    o = np.arange(PS, dtype=np.int64) * HEADS * HB + first_head * HB
    return [(o, np.full(PS, n_heads * HB, dtype=np.int64))] * SL_DESCS


class _SlicePair:
    """Engines A (initiator) and B (target), connected; B's messages with the bytes of
    its pages at delivery time."""

    def __init__(self, slot_items=3):
        self.slot_items = slot_items

    async def __aenter__(self):
        import asyncio

        from kvxfer.engine import EngineConfig, TransferEngine

        rng = np.random.default_rng(7)
        n_bytes = SL_ITEMS * SL_ITEM
        host = {
            "a": [rng.integers(1, 255, n_bytes, dtype=np.uint8) for _ in range(SL_DESCS)],
            "b": [np.zeros(n_bytes, np.uint8) for _ in range(SL_DESCS)],
        }
        if DEVICE == "cuda":
            import torch

            self.bufs = {n: [torch.from_numpy(b).cuda() for b in v] for n, v in host.items()}
            ptrs = {n: [b.data_ptr() for b in v] for n, v in self.bufs.items()}
        else:
            self.bufs = host
            ptrs = {n: [b.ctypes.data for b in v] for n, v in self.bufs.items()}
        self.engines = {}
        for n in "ab":
            e = TransferEngine(
                EngineConfig(
                    secret=SECRET,
                    name=f"slice-{n}",
                    stage_slice_min_ops=1,
                    stage_slot_bytes=self.slot_items * SL_DESCS * SL_ITEM,
                    stage_slots=4,
                    stage_peer_slots=PEER_SLOTS,
                    warn_slow_lanes=False,
                    transfer_timeout_s=10.0,
                )
            )
            e.register("kv", ptrs[n], [n_bytes] * SL_DESCS, [SL_ITEM] * SL_DESCS)
            await e.start()
            self.engines[n] = e
        self.seen = []  # (payload, copy of B's pages when the handler ran)
        self.block = None  # an asyncio.Event B's handler waits on after b"block"
        loop = asyncio.get_running_loop()
        self.msg = asyncio.Queue()

        async def on_msg(peer, payload):
            if payload == b"block" and self.block is not None:
                await self.block.wait()
            self.seen.append((payload, self.host("b")))
            self.msg.put_nowait(payload)

        self.engines["b"].on_message(on_msg)
        got = loop.create_future()
        self.engines["b"].on_peer(lambda p: got.done() or got.set_result(p))
        self.a = await self.engines["a"].connect(*self.engines["b"].address)
        self.b = await asyncio.wait_for(got, 10)
        return self

    async def __aexit__(self, *exc):
        for e in self.engines.values():
            await e.close()

    def host(self, side):
        """Copies of one side's descriptors as numpy bytes."""
        if DEVICE == "cuda":
            return [b.cpu().numpy() for b in self.bufs[side]]
        return [b.copy() for b in self.bufs[side]]

    def pages(self, side, items):
        return [b.reshape(SL_ITEMS, PS, HEADS, HB)[items] for b in self.host(side)]


def _run(coro):
    import asyncio

    return asyncio.run(asyncio.wait_for(coro, 60))


def test_slice_write_byte_exact_before_notify():
    """Heads [1, 3) of prefill-like pages land in heads [0, 2) of other pages (two chunks:
    a slot holds 3 whole items, 6 items' halves); the notify's handler already sees every byte, nothing outside
    the expected runs changed, the key is dropped once complete."""
    from kvxfer.engine import SliceWrite

    async def go():
        async with _SlicePair() as p:
            src, dst = np.array([3, 9, 1, 4, 22, 7, 8, 0]), np.array([5, 2, 11, 23, 6, 14, 15, 1])
            p.b.expect_slices(42, "kv", dst, _rows(0, 2))
            st = await p.a.write([SliceWrite("kv", src, dst, _rows(1, 2), 42)], notify=b"done")
            assert st.staged and st.ops == 2 and st.bytes == 8 * SL_DESCS * PS * 2 * HB
            assert st.staged_direct_ops == 8 * SL_DESCS * PS
            assert await p.msg.get() == b"done"
            payload, at_notify = p.seen[0]
            for d, (a, b) in enumerate(zip(p.pages("a", src), p.pages("b", dst))):
                snap = at_notify[d].reshape(SL_ITEMS, PS, HEADS, HB)
                assert (snap[dst][:, :, 0:2] == a[:, :, 1:3]).all()
                assert (b[:, :, 0:2] == a[:, :, 1:3]).all() and not b[:, :, 2:].any()
                rest = np.setdiff1d(np.arange(SL_ITEMS), dst)
                assert not p.host("b")[d].reshape(SL_ITEMS, -1)[rest].any()
            assert 42 not in p.b._staged.expected  # every item arrived: key dropped
            # irregular runs (two sizes) and a single chunk
            irr = [(np.array([0, 40, 96]), np.array([8, 16, 8]))] * SL_DESCS
            p.b.expect_slices(43, "kv", [20], irr)
            await p.a.write([SliceWrite("kv", [2], [20], irr, 43)], notify=b"irr")
            assert await p.msg.get() == b"irr"
            for a, b in zip(p.pages("a", [2]), p.pages("b", [20])):
                fa, fb = a.reshape(-1), b.reshape(-1)
                for o, n in ((0, 8), (40, 16), (96, 8)):
                    assert (fb[o : o + n] == fa[o : o + n]).all()
                assert int((fb != 0).sum()) <= 32

    _run(go())


def test_slice_write_bounds_refused():
    """The initiator refuses (before anything moves) runs outside its items, ids out of
    range and a missing grant; the target closes a peer whose chunk names items or byte
    counts it did not expect, writing nothing of it."""
    from kvxfer.engine import SliceWrite
    from kvxfer.errors import IndexOutOfRange, InvalidArgument, KvxferError

    async def go():
        async with _SlicePair() as p:
            with pytest.raises(InvalidArgument):
                await p.a.write([SliceWrite("kv", [0], [0], [([120], [16])] * SL_DESCS, 1)])
            with pytest.raises(IndexOutOfRange):
                await p.a.write([SliceWrite("kv", [SL_ITEMS], [0], _rows(0, 1), 1)])
            with pytest.raises(IndexOutOfRange):
                await p.a.write([SliceWrite("kv", [0], [SL_ITEMS], _rows(0, 1), 1)])
            with pytest.raises(InvalidArgument):
                await p.a.write([SliceWrite("kv", [0, 1], [3, 3], _rows(0, 1), 1)])
            with pytest.raises(InvalidArgument):  # target-side plans must not overlap
                p.b.expect_slices(5, "kv", [1], [([0, 4], [8, 8])] * SL_DESCS)
            # a byte count the target did not derive (3 heads vs the 2 it expects): refused
            p.b.expect_slices(9, "kv", [4, 5], _rows(0, 2))
            with pytest.raises(KvxferError):
                await p.a.write([SliceWrite("kv", [1, 2], [4, 5], _rows(0, 3), 9)], b"x")
            assert p.b.closed and not any(b.any() for b in p.host("b"))
        async with _SlicePair() as p:  # an item outside the expected ones: refused too
            p.b.expect_slices(9, "kv", [4, 5], _rows(0, 2))
            with pytest.raises(KvxferError):
                await p.a.write([SliceWrite("kv", [1, 2], [4, 6], _rows(0, 2), 9)], b"x")
            assert p.b.closed and not any(b.any() for b in p.host("b"))
        async with _SlicePair() as p:  # an unknown key
            with pytest.raises(KvxferError):
                await p.a.write([SliceWrite("kv", [1], [4], _rows(0, 2), 77)], b"x")
            assert p.b.closed and not any(b.any() for b in p.host("b"))

    _run(go())


def test_slice_write_abort_mid_write_frees_staging():
    """A write stuck mid-way (the target's dispatcher busy: no slot credit comes back) and
    cancelled gives its staging slots back at once; once the target drains, the same peer
    writes again and the bytes are exact."""
    import asyncio

    from kvxfer.engine import SliceWrite

    async def go():
        async with _SlicePair(slot_items=1) as p:
            stage = p.engines["a"]._groups.stages["kv"]
            land = p.a._staged.landing["kv"]
            p.block = asyncio.Event()
            await p.a.send(b"block")  # B's handler waits: nothing after it is drained
            items = np.arange(8)
            p.b.expect_slices(1, "kv", items, _rows(0, 2))
            w = asyncio.ensure_future(
                p.a.write([SliceWrite("kv", items, items, _rows(2, 2), 1)], b"never")
            )
            for _ in range(2000):  # bounded: until B validated both chunks' plans (its
                if len(p.b._staged.busy) == PEER_SLOTS:  # reader runs; its dispatcher waits)
                    break
                await asyncio.sleep(0.005)
            assert len(p.b._staged.busy) == PEER_SLOTS and len(land.out) == PEER_SLOTS
            assert not w.done()  # the third chunk waits for a landing slot
            w.cancel()
            with pytest.raises(asyncio.CancelledError):
                await w
            assert stage.staging_free.qsize() == PEER_SLOTS  # every staging slot back
            p.block.set()  # B drains the two chunks it got, their slots come back
            assert await p.msg.get() == b"block"
            p.b.forget_slices(1)
            p.b.expect_slices(2, "kv", [10, 11], _rows(0, 2))
            await p.a.write([SliceWrite("kv", [3, 4], [10, 11], _rows(2, 2), 2)], b"again")
            assert await p.msg.get() == b"again"
            for a, b in zip(p.pages("a", [3, 4]), p.pages("b", [10, 11])):
                assert (b[:, :, 0:2] == a[:, :, 2:4]).all() and not b[:, :, 2:].any()
            assert stage.staging_free.qsize() == PEER_SLOTS

    _run(go())
