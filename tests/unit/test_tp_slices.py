"""kvxfer.engine.slices: slice plans, chunking and the host gather / scatter, checked
exhaustively over small shapes against a brute force (byte masks), and against the real
head-slice plans of kvxfer.disagg.tp_plan for every layout and ratio."""

import itertools

import numpy as np
import pytest

from kvxfer.disagg import tp_plan as tp
from kvxfer.engine import slices
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(60)


def _brute_pack(buf, item_bytes, items, offs, lens):
    """Reference packing: a Python loop over items and runs."""
    out = []
    for i in items:
        for o, n in zip(offs, lens):
            out.append(buf[i * item_bytes + o : i * item_bytes + o + n])
    return np.concatenate(out) if out else np.zeros(0, np.uint8)


def _all_runs(item_bytes, max_runs=3):
    """Every non-empty, non-overlapping run list of up to ``max_runs`` runs of an item of
    ``item_bytes`` (run order: ascending and also reversed, which packs differently)."""
    cuts = range(item_bytes + 1)
    for k in range(1, max_runs + 1):
        for pts in itertools.combinations(cuts, 2 * k):
            offs = np.array(pts[0::2], dtype=np.int64)
            lens = np.array(pts[1::2], dtype=np.int64) - offs
            if (lens <= 0).any():
                continue
            yield offs, lens
            if k > 1:
                yield offs[::-1].copy(), lens[::-1].copy()


@pytest.mark.parametrize("item_bytes", [1, 2, 5, 8])
def test_gather_scatter_exhaustive(item_bytes):
    """Every run list of small items (regular and irregular): gather packs exactly the
    brute-force bytes, scatter writes exactly the run bytes of the named items and nothing
    else, for several item subsets (ordered, reversed, gapped)."""
    rng = np.random.default_rng(item_bytes)
    n_items = 5
    buf = rng.integers(1, 255, n_items * item_bytes, dtype=np.uint8)
    subsets = [np.array(s) for s in ([0], [4], [1, 2, 3], [3, 0], [4, 2, 0], [0, 1, 2, 3, 4])]
    for offs, lens in _all_runs(item_bytes, 3 if item_bytes <= 5 else 2):
        for items in subsets:
            want = _brute_pack(buf, item_bytes, items, offs, lens)
            out = np.zeros(want.size + 3, np.uint8)
            got = slices.gather_host(buf, item_bytes, items, offs, lens, out)
            assert got == want.size
            assert (out[: want.size] == want).all() and (out[want.size :] == 0).all()
            dst = np.zeros_like(buf)
            slices.scatter_host(dst, item_bytes, items, offs, lens, out)
            mask = np.zeros(buf.size, bool)
            for i in items:
                for o, n in zip(offs, lens):
                    mask[i * item_bytes + o : i * item_bytes + o + n] = True
            assert (dst[mask] == buf[mask]).all() and (dst[~mask] == 0).all()


def test_regular_detects_strided_runs():
    assert slices.regular(np.array([2, 10, 18]), np.array([4, 4, 4])) == (2, 8, 3, 4)
    assert slices.regular(np.array([5]), np.array([3])) == (5, 3, 1, 3)
    assert slices.regular(np.array([0, 4]), np.array([4, 4])) == (0, 4, 2, 4)  # touching
    assert slices.regular(np.array([0, 8, 20]), np.array([4, 4, 4])) is None  # uneven step
    assert slices.regular(np.array([0, 8]), np.array([4, 2])) is None  # uneven sizes
    assert slices.regular(np.array([8, 0]), np.array([4, 4])) is None  # descending
    assert slices.regular(np.array([0, 2]), np.array([4, 4])) is None  # overlapping
    assert slices.regular(np.zeros(0, np.int64), np.zeros(0, np.int64)) is None


@pytest.mark.parametrize("n", range(0, 12))
@pytest.mark.parametrize("per_item", [1, 3, 7])
@pytest.mark.parametrize("cap", [7, 8, 21, 100])
def test_chunks_cover_once_within_cap(n, per_item, cap):
    cs = slices.chunks(n, per_item, cap)
    covered = [i for a, b in cs for i in range(a, b)]
    assert covered == list(range(n))
    assert all((b - a) * per_item <= cap and b > a for a, b in cs)
    assert len(cs) == -(-n // (cap // per_item))  # as few as fit


def test_chunks_refuse_an_item_larger_than_a_slot():
    with pytest.raises(InvalidArgument, match="exceed"):
        slices.chunks(3, 9, 8)
    with pytest.raises(InvalidArgument):
        slices.chunks(3, 0, 8)


def test_slice_runs_validation():
    ok = slices.SliceRuns.make([([0, 8], [4, 4]), ([], [])], [16, 16])
    assert ok.per_item == 8 and ok.ops_per_item == 2 and ok.desc_bytes == (8, 0)
    assert ok.offs[0].flags.writeable is False
    bad = [
        ([([0], [4])], [16, 16]),  # descriptor count
        ([([0, 8], [4])], [16]),  # offsets vs lengths
        ([([14], [4])], [16]),  # leaves the item
        ([([-1], [2])], [16]),  # negative
        ([([0], [0])], [16]),  # empty run
        ([([], [])], [16]),  # moves nothing
    ]
    for runs, il in bad:
        with pytest.raises(InvalidArgument):
            slices.SliceRuns.make(runs, il)
    # overlapping runs: fine to read from, refused for a target (a byte written twice)
    slices.SliceRuns.make([([0, 2], [4, 4])], [16])
    with pytest.raises(InvalidArgument, match="overlap"):
        slices.SliceRuns.make([([0, 2], [4, 4])], [16], exclusive=True)
    with pytest.raises(InvalidArgument, match="overlap"):
        slices.SliceRuns.make([([8, 0], [4, 10])], [16], exclusive=True)
    assert ok.matches(slices.SliceRuns.make([([1, 9], [4, 4]), ([], [])], [16, 16]))
    assert not ok.matches(slices.SliceRuns.make([([0], [8]), ([], [])], [16, 16]))


def test_direct_ops_merges_touching_runs():
    runs = slices.SliceRuns.make([([0], [16])], [16])  # whole items
    assert slices.direct_ops(runs, [16], np.array([3, 4, 5, 9])) == 2
    runs = slices.SliceRuns.make([([0, 8], [4, 4])], [16])
    assert slices.direct_ops(runs, [16], np.array([3, 4])) == 4
    runs = slices.SliceRuns.make([([0, 8], [8, 8])], [16])  # whole item in two runs
    assert slices.direct_ops(runs, [16], np.array([3, 4])) == 1


#: (layout, total kv heads, prefill tp, decode tp)
SHAPES = [
    (lay, heads, a, b)
    for lay in ("nhd", "hnd", "pm")
    for heads in (1, 2, 4, 8)
    for a, b in ((1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 2))
]


def _geom(lay, ps, hb, heads, t):
    if lay == "nhd":
        return tp.nhd_item(ps, hb, heads, t)
    if lay == "hnd":
        return tp.hnd_item(ps, hb, heads, t)
    return tp.page_major_item(2, ps, hb, hb, heads, t)


@pytest.mark.parametrize("lay,heads,tp_p,tp_d", SHAPES)
def test_head_slices_through_stream_match_direct_runs(lay, heads, tp_p, tp_d):
    """The real head-slice plans (tp_plan.item_runs): gather with the prefill side's runs,
    scatter with decode's own, for every rank pair — decode's pages end up exactly as the
    direct runs (tp_plan.plan_pages) would leave them."""
    ps, hb, n = 4, 2, 6
    rng = np.random.default_rng(heads * 100 + tp_p * 10 + tp_d)
    src_items = np.array([5, 1, 2, 3])
    dst_items = np.array([0, 4, 3, 5])
    for p in range(tp_p):
        for d in range(tp_d):
            s, t = _geom(lay, ps, hb, heads, tp_p), _geom(lay, ps, hb, heads, tp_d)
            ro, rd, rn = tp.item_runs(s, t, p, d, tp_p, tp_d)
            if not rn.size:
                continue
            src = rng.integers(1, 255, n * s.item_bytes, dtype=np.uint8)
            want = np.zeros(n * t.item_bytes, np.uint8)
            runs = tp.plan_pages([s], [t], p, d, tp_p, tp_d, src_items, dst_items)
            for so, do, nb in zip(runs.src_off, runs.dst_off, runs.nbytes):
                want[do : do + nb] = src[so : so + nb]
            stream = np.zeros(src_items.size * int(rn.sum()), np.uint8)
            slices.gather_host(src, s.item_bytes, src_items, ro, rn, stream)
            got = np.zeros_like(want)
            slices.scatter_host(got, t.item_bytes, dst_items, rd, rn, stream)
            assert (got == want).all(), (lay, heads, tp_p, tp_d, p, d)
            sr = slices.SliceRuns.make([(rd, rn)], [t.item_bytes], exclusive=True)
            assert sr.per_item * src_items.size == stream.size


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
def test_tp_pair_write_picks_the_staged_path(tp_p, tp_d):
    """TpPair.write: head slices inside token rows (NHD, page-major) past the threshold go
    as a SliceWrite whose runs pair with decode's own (dst_slice_sides); HND only with
    stage_blocks (device memory); replicated MLA pages never; below the threshold or with 0,
    the direct RawWrite."""
    from kvxfer.disagg.tp_rooms import TpPair
    from kvxfer.engine.types import ItemWrite, RawWrite, SliceWrite

    def pair(make, heads=8):
        p, d = (0, 0)
        return TpPair(
            p, tp_p, d, tp_d, {"kv": [make(heads, tp_p)] * 2}, {"kv": [make(heads, tp_d)] * 2}
        )

    src, dst = list(range(10)), list(range(20, 30))
    for make in (
        lambda h, t: tp.nhd_item(4, 2, h, t),
        lambda h, t: tp.page_major_item(2, 4, 2, 2, h, t),
    ):
        pr = pair(make)
        w = pr.write("kv", src, dst, 3, stage_min_ops=1)
        assert isinstance(w, SliceWrite) and w.key == 3
        mine = slices.SliceRuns.make(w.runs, [g.item_bytes for g in pr.src["kv"]])
        theirs = slices.SliceRuns.make(
            pr.dst_slice_sides("kv", 3), [g.item_bytes for g in pr.dst["kv"]], exclusive=True
        )
        assert mine.matches(theirs)
        assert isinstance(pr.write("kv", src, dst, 3, stage_min_ops=10**6), RawWrite)
        assert isinstance(pr.write("kv", src, dst, 3), RawWrite)
    hnd = pair(lambda h, t: tp.hnd_item(4, 2, h, t))
    assert isinstance(hnd.write("kv", src, dst, 0, stage_min_ops=1), RawWrite)
    assert isinstance(hnd.write("kv", src, dst, 0, stage_min_ops=1, stage_blocks=True), SliceWrite)
    mla = pair(lambda h, t: tp.replicated_item(64), heads=1)
    w = mla.write("kv", src, dst, 0, stage_min_ops=1, stage_blocks=True)
    assert isinstance(w, ItemWrite) and (w.src_items, w.dst_items) == (src, dst)


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 1), (2, 4)])
@pytest.mark.parametrize("salt", [0, 1, 3])
def test_tp_pair_pattern_moves_what_the_direct_plan_moves(tp_p, tp_d, salt):
    """TpPair.write(pattern=True): every layout whose share is not whole pages is one
    PatternWrite whose expanded runs are exactly the direct plan's, for every rank pair;
    replicated MLA pages stay ItemWrite-like (RawWrite/None); the pattern object is cached."""
    from kvxfer.disagg.tp_rooms import TpPair
    from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite

    src, dst = np.array([4, 0, 7, 8, 9]), np.array([1, 2, 3, 30, 12])
    makes = {
        "nhd": lambda h, t: tp.nhd_item(4, 2, h, t),
        "hnd": lambda h, t: tp.hnd_item(4, 2, h, t),
        "page_major": lambda h, t: tp.page_major_item(2, 4, 2, 2, h, t),
    }
    for name, make in makes.items():
        for p in range(tp_p):
            for d in range(tp_d):
                pr = TpPair(
                    p, tp_p, d, tp_d, {"kv": [make(8, tp_p)] * 2}, {"kv": [make(8, tp_d)] * 2}
                )
                direct = pr.write("kv", src, dst, salt)
                w = pr.write("kv", src, dst, salt, pattern=True)
                if direct is None:
                    assert w is None, (name, p, d)
                    continue
                assert isinstance(w, PatternWrite), (name, p, d)
                assert pr.write("kv", src, dst, salt + tp_p, pattern=True).runs is w.runs
                desc, so, do, nb = w.runs.expand(src, dst)
                assert isinstance(direct, RawWrite)
                for x, y in (
                    (desc, direct.desc),
                    (so, direct.src_off),
                    (do, direct.dst_off),
                    (nb, direct.nbytes),
                ):
                    assert np.array_equal(x, y), (name, p, d)
    for p in range(tp_p):  # replicated pages: the sending replica's ItemWrite, else None
        mla = TpPair(
            p,
            tp_p,
            0,
            tp_d,
            {"kv": [tp.replicated_item(64)] * 2},
            {"kv": [tp.replicated_item(64)] * 2},
        )
        w = mla.write("kv", src, dst, salt, pattern=True)
        sends = mla.page_plan("kv", salt).runs(src, dst)
        assert (w is None) == (len(sends) == 0)
        assert w is None or isinstance(w, ItemWrite)


@pytest.mark.parametrize("heads,period", [(8, 1), (2, 2), (1, 4)])
def test_tp_pair_plans_once_per_salt_class(heads, period):
    """4 prefill ranks → 1 decode rank: with a head per rank or more every room (salt) gets
    the same pattern object, page plan and slice sides (the device lane builds its run
    table once); with replicas to pick from, one per class of salt_class, and across a
    class's salts each replica sends once."""
    from kvxfer.disagg.tp_rooms import TpPair

    senders = []
    for p in range(4):
        pr = TpPair(
            p, 4, 0, 1, {"kv": [tp.hnd_item(4, 2, heads, 4)]}, {"kv": [tp.hnd_item(4, 2, heads, 1)]}
        )
        assert [pr.salt_class("kv", r) for r in (0, 1, 5, 10**9 + 7)] == [
            r % period for r in (0, 1, 5, 10**9 + 7)
        ]
        runs = [pr.pattern_runs("kv", r) for r in range(8)]
        assert all(runs[r] is runs[r % period] for r in range(8))
        assert all(pr.page_plan("kv", r) is pr.page_plan("kv", r % period) for r in range(8))
        sides = [pr.slice_sides("kv", r, src=True) for r in range(8)]
        assert all(sides[r] is sides[r % period] for r in range(8))
        senders.append([sides[r] is not None for r in range(period)])
    # per salt class, the ranks that send cover the decode rank's heads once
    moved = [sum(s[c] for s in senders) for c in range(period)]
    assert moved == [min(4, heads)] * period


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (4, 1), (4, 2), (8, 2), (1, 2), (2, 2)])
def test_replicas_split_the_rooms_pages(tp_p, tp_d):
    """Whole replicated items (the MLA latent): with ``split`` every page of the room is sent
    by exactly one of a decode rank's peers, in contiguous blocks, however the room is cut
    into chunks; a group with heads to slice (HND) is not split (one replica per room)."""
    from kvxfer.disagg.tp_plan import decode_peers
    from kvxfer.disagg.tp_rooms import TpPair
    from kvxfer.engine.types import ItemWrite

    rng = np.random.default_rng(tp_p * 10 + tp_d)
    reps = max(1, tp_p // tp_d)
    for d in range(tp_d):
        peers = decode_peers(d, tp_p, tp_d)
        pairs = [
            TpPair(
                p, tp_p, d, tp_d, {"kv": [tp.replicated_item(64)]}, {"kv": [tp.replicated_item(64)]}
            )
            for p in peers
        ]
        assert all(pr.replicas("kv") == reps for pr in pairs)
        for salt, pages in ((0, 7), (5, 13), (10**9 + 3, 1), (2, 64)):
            src = rng.permutation(1000)[:pages]
            dst = rng.permutation(1000)[:pages]
            cuts = sorted({0, pages, *rng.integers(0, pages + 1, 3).tolist()})
            seen = np.zeros(pages, dtype=np.int64)
            senders = 0
            for pr in pairs:
                got = []
                for a, b in zip(cuts, cuts[1:]):
                    w = pr.write("kv", src[a:b], dst[a:b], salt, split=(a, pages))
                    if w is not None:
                        assert isinstance(w, ItemWrite)
                        got += [int(np.flatnonzero(dst == x)[0]) for x in w.dst_items]
                        assert [int(np.flatnonzero(src == x)[0]) for x in w.src_items] == got[
                            -len(w.src_items) :
                        ]
                seen[got] += 1
                senders += bool(got)
                if got:  # one contiguous stretch per block it sends
                    block = -(-pages // reps)
                    assert len({g // block for g in got}) * block >= len(got)
            assert (seen == 1).all(), (d, salt, pages, seen)
            assert senders == -(-pages // -(-pages // reps))  # one replica per block
    hnd = TpPair(
        0, tp_p, 0, tp_d, {"kv": [tp.hnd_item(4, 2, 8, tp_p)]}, {"kv": [tp.hnd_item(4, 2, 8, tp_d)]}
    )
    assert hnd.replicas("kv") == 1


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (4, 1), (8, 2), (8, 1)])
def test_replica_ranges_are_the_blocks_of_the_salt_rule(tp_p, tp_d):
    """``TpPair.replica_ranges`` / ``replica_blocks`` against the rule they implement, for
    every chunk of rooms of 1-12 pages and every salt class: page ``j`` of the room is this
    rank's iff ``(salt + j // ceil(pages / R)) % R`` is one of its sending classes."""
    from kvxfer.disagg.tp_plan import decode_peers
    from kvxfer.disagg.tp_rooms import TpPair

    item = [tp.replicated_item(64)]
    for d in range(tp_d):
        for p in decode_peers(d, tp_p, tp_d):
            pr = TpPair(p, tp_p, d, tp_d, {"kv": item}, {"kv": item})
            r, sends = pr.replicas("kv"), pr.sending_classes("kv")
            assert r == tp_p // tp_d and len(sends) == 1
            for salt in range(2 * r + 1):
                for pages in range(1, 13):
                    block = -(-pages // r)
                    rule = np.isin((salt + np.arange(pages) // block) % r, sends)
                    for first in range(pages):
                        for count in range(1, pages - first + 1):
                            got = pr.replica_blocks("kv", salt, first, count, pages)
                            assert np.array_equal(got, rule[first : first + count])
                            ranges = pr.replica_ranges("kv", salt, first, count, pages)
                            assert len(ranges) <= 1 and all(lo < hi for lo, hi in ranges)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("overlap", [1, 2, 0])
def test_legs_start_back_to_back_the_last_waits_inline(monkeypatch, k, overlap):
    """tp_rooms.prefill_send: every leg of a chunk gets its send, in rank order; with
    OVERLAP_LEGS=1 each but the last with ``inline=False`` (its write waits in its task, so
    the next leg's host work is not held up by it), the last inline; 2: all; 0: none."""
    from kvxfer.disagg import tp_rooms
    from kvxfer.disagg.poll import KVPoll
    from kvxfer.disagg.roles import RoomRole
    from kvxfer.disagg.rooms import Room

    monkeypatch.setattr(tp_rooms, "OVERLAP_LEGS", overlap)
    parent = Room(7, RoomRole.SENDER, None)
    parent.state = KVPoll.Transferring
    parent.legs = tp_rooms.Legs(parent, k)
    legs = [Room(7, RoomRole.SENDER, None) for _ in range(k)]
    for rank, leg in enumerate(legs):
        parent.legs.by_rank[rank] = leg
    sent = []

    class Side:
        mgr = None

        def send(self, leg, src, state, last, inline=True):
            sent.append((legs.index(leg), last, inline))

    chunk = (np.arange(3), np.array([1]), True)
    tp_rooms.prefill_send(Side(), parent, chunk)
    assert [s[:2] for s in sent] == [(i, True) for i in range(k)]
    want = {1: [i == k - 1 for i in range(k)], 2: [False] * k, 0: [True] * k}[overlap]
    assert [s[2] for s in sent] == want
    assert parent.legs.history == [chunk]  # kept for legs that attach later


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("guest", [True, False])
@pytest.mark.parametrize("settle", [True, False])
def test_a_guest_send_of_several_legs_asks_to_settle_them(monkeypatch, k, guest, settle):
    """tp_rooms.prefill_send run as the loop's guest with several legs asks the guest run to
    finish what the earlier legs left (``settle_after(the engine's transport)``, after every
    leg was sent); not for one leg, not on the loop's own thread, not with SETTLE_LEGS off."""
    from kvxfer.disagg import tp_rooms
    from kvxfer.disagg.poll import KVPoll
    from kvxfer.disagg.roles import RoomRole
    from kvxfer.disagg.rooms import Room

    asked, sent = [], []
    monkeypatch.setattr(tp_rooms, "OVERLAP_LEGS", 1)
    monkeypatch.setattr(tp_rooms, "SETTLE_LEGS", settle)
    monkeypatch.setattr(tp_rooms, "in_guest", lambda: guest)
    monkeypatch.setattr(tp_rooms, "settle_after", lambda t: asked.append((t, len(sent))))
    parent = Room(7, RoomRole.SENDER, None)
    parent.state = KVPoll.Transferring
    parent.legs = tp_rooms.Legs(parent, k)
    for rank in range(k):
        parent.legs.by_rank[rank] = Room(7, RoomRole.SENDER, None)
    transport = object()

    class Side:
        class mgr:
            class engine:
                pass

        def send(self, leg, src, state, last, inline=True):
            sent.append(leg)

    Side.mgr.engine.transport = transport
    tp_rooms.prefill_send(Side(), parent, (np.arange(3), np.array([1]), True))
    assert asked == ([(transport, k)] if guest and settle and k > 1 else [])
