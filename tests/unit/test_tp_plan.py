"""Heterogeneous-TP mapping and byte plans (kvxfer.disagg.tp_plan) against brute force:
every ratio in {1,2,4,8}^2, every head count in {1,2,4,8,16} (1 = MLA's replicated latent),
state tensors with and without split dims, multi-part conv states."""

import itertools

import numpy as np
import pytest

from kvxfer.disagg import tp_plan as tp
from kvxfer.disagg.errors import LayoutMismatch, TpShapeMismatch
from kvxfer.disagg.tp_plan import (
    ItemGeometry,
    check_tp_compatible,
    decode_peers,
    gather_runs,
    hnd_item,
    item_runs,
    nhd_item,
    page_major_item,
    plan_axis,
    plan_pages,
    prefill_peers,
    replicated_item,
    scatter_runs,
    state_geometries,
    state_item,
    tp_fingerprint,
)
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(120)

TPS = (1, 2, 4, 8)
HEADS = (1, 2, 4, 8, 16)


# ------------------------------------------------------------------ brute-force reference
def ref_heads(rank, tp, total):
    """Global units of ``rank``: SGLang's rule, written out unit by unit."""
    if tp <= total:
        per = total // tp
        return [rank * per + i for i in range(per)]
    return [rank * total // tp]  # == rank // (tp // total) when total | tp


def ref_is_peer(p, d, tp_p, tp_d):
    if tp_p >= tp_d:
        return p * tp_d // tp_p == d
    return d * tp_p // tp_d == p


@pytest.mark.parametrize("tp_p,tp_d,total", list(itertools.product(TPS, TPS, HEADS)))
def test_axis_plan_matches_brute_force(tp_p, tp_d, total):
    for salt in range(3):
        plan = plan_axis(total, tp_p, tp_d, salt)
        got = {d: [None] * len(ref_heads(d, tp_d, total)) for d in range(tp_d)}
        for p in range(tp_p):
            src_units = ref_heads(p, tp_p, total)
            for d, sl in plan.sends(p):
                assert ref_is_peer(p, d, tp_p, tp_d)
                assert sl.count == sl.dst[1] - sl.dst[0] > 0
                for k in range(sl.count):
                    assert got[d][sl.dst[0] + k] is None, "a unit written twice"
                    got[d][sl.dst[0] + k] = src_units[sl.src[0] + k]
        for d in range(tp_d):
            assert got[d] == ref_heads(d, tp_d, total)
            assert set(decode_peers(d, tp_p, tp_d)) == {
                p for p in range(tp_p) if ref_is_peer(p, d, tp_p, tp_d)
            }
        for p in range(tp_p):  # every prefill rank takes part in some decode rank's rooms
            assert prefill_peers(p, tp_p, tp_d)
            assert set(plan.targets(p)) <= set(prefill_peers(p, tp_p, tp_d))
        # one sender per (decode rank, unit); with no replication every peer sends
        if tp_p <= total:
            for d in range(tp_d):
                assert {s.prefill_rank for s in plan.receives(d)} == set(
                    decode_peers(d, tp_p, tp_d)
                )


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (4, 1), (8, 2), (4, 2), (8, 1)])
def test_replicated_senders_rotate_with_salt(tp_p, tp_d):
    """MLA (one unit) with more prefill ranks: one sender per decode rank, and over
    ``k`` salts (e.g. room ids) every prefill rank of the group sends once."""
    k = tp_p // tp_d
    for d in range(tp_d):
        senders = [plan_axis(1, tp_p, tp_d, salt).receives(d) for salt in range(k)]
        assert all(len(s) == 1 for s in senders)
        assert sorted(s[0].prefill_rank for s in senders) == list(decode_peers(d, tp_p, tp_d))
    # a room id as salt: only salt % tp_p matters (bounded caches)
    assert plan_axis(1, tp_p, tp_d, 10**12 + 1) == plan_axis(1, tp_p, tp_d, (10**12 + 1) % tp_p)


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product(TPS, TPS)))
def test_salt_period_is_exactly_when_plans_differ(tp_p, tp_d):
    """Two salts give the same plan iff they agree modulo salt_period (the raw, uncanonical
    plans compared): 1 unless a decode rank's peers hold replicas of a unit; it divides
    tp_p, and plan_axis hands every salt of a class the same object."""
    for total in HEADS:
        try:
            plan_axis(total, tp_p, tp_d)
        except TpShapeMismatch:
            continue
        period = tp.salt_period(total, tp_p, tp_d)
        assert tp_p % period == 0
        raw = [tp._plan_axis(total, tp_p, tp_d, s).by_decode for s in range(tp_p)]
        for a, b in itertools.product(range(tp_p), repeat=2):
            assert (raw[a] == raw[b]) == (a % period == b % period), (total, a, b, period)
        for salt in (0, 1, 7, 10**12 + 3):
            assert plan_axis(total, tp_p, tp_d, salt) is plan_axis(total, tp_p, tp_d, salt % period)
        if tp_p <= total or tp_p <= tp_d:
            assert period == 1


def test_item_salt_period_is_the_segments_lcm():
    """An item's period is the lcm of its segments' (state parts of different head counts);
    item_runs of salts in one class are the same arrays; a pair of items that cannot be
    joined is refused as item_runs refuses it."""
    s2, s4 = tp.Segment(0, 1, 8, 1, 8, 2), tp.Segment(8, 1, 8, 1, 8, 4)
    src = tp.ItemGeometry(16, (s2, s4))
    dst = tp.ItemGeometry(48, (tp.Segment(0, 1, 16, 2, 8, 2), tp.Segment(16, 1, 32, 4, 8, 4)))
    # prefill 8 ranks over 2 / 4 units, decode 1: replicas 4 and 2, peers 8: lcm 4
    assert [tp.salt_period(n, 8, 1) for n in (2, 4)] == [4, 2]
    assert tp.item_salt_period(src, dst, 8, 1) == 4
    for p in range(8):
        got = [tp.item_runs(src, dst, p, 0, 8, 1, salt) for salt in range(8)]
        assert all(got[salt] is got[salt % 4] for salt in range(8))
    with pytest.raises(TpShapeMismatch):
        tp.item_salt_period(src, tp.ItemGeometry(16, (s2,)), 8, 1)


@pytest.mark.parametrize(
    "total,tp_p,tp_d",
    [(6, 4, 2), (8, 3, 1), (8, 2, 3), (3, 2, 2), (12, 8, 4)],
)
def test_refusals_name_both_shapes(total, tp_p, tp_d):
    with pytest.raises(TpShapeMismatch) as ei:
        plan_axis(total, tp_p, tp_d)
    msg = str(ei.value)
    assert f"prefill tp {tp_p}" in msg and f"decode tp {tp_d}" in msg
    assert isinstance(ei.value, LayoutMismatch)


# ------------------------------------------------------------------ byte level
def side_buffers(geoms, tp, total_of_seg, pages, rng_global, rank):
    """Items of ``rank`` filled from the global content: ``rng_global[(desc, seg)]`` is a
    ``[pages, total, reps * unit_bytes]`` uint8 array (a unit's repetitions back to back, so
    either side may cut a single-unit segment differently); bytes outside segments stay 0."""
    bufs = []
    for di, g in enumerate(geoms):
        buf = np.zeros(pages * g.item_bytes, np.uint8)
        for si, s in enumerate(g.segments):
            glob = rng_global[(di, si)]
            units = ref_heads(rank, tp, s.total)
            for page in range(pages):
                for i in range(s.reps):
                    for j, u in enumerate(units):
                        o = page * g.item_bytes + s.offset + i * s.stride + j * s.unit_bytes
                        ub = s.unit_bytes
                        buf[o : o + ub] = glob[page, u, i * ub : (i + 1) * ub]
        bufs.append(buf)
    return bufs


def check_transfer(make, tp_p, tp_d, pages=3, salt=0, perm=True):
    """Move pages of every prefill rank into every decode rank by the byte plan; each
    decode item must equal what a decode rank owning those units would hold."""
    src_geoms = {p: make(tp_p) for p in range(tp_p)}
    dst_geoms = {d: make(tp_d) for d in range(tp_d)}
    rng = np.random.default_rng(tp_p * 31 + tp_d)
    glob = {}
    for di, g in enumerate(src_geoms[0]):
        for si, s in enumerate(g.segments):
            shape = (pages, s.total, s.reps * s.unit_bytes)
            glob[(di, si)] = rng.integers(1, 255, shape, np.uint8)
    src_pages = np.arange(pages)
    dst_pages = rng.permutation(pages) if perm else np.arange(pages)
    for d in range(tp_d):
        dst = [np.zeros(pages * g.item_bytes, np.uint8) for g in dst_geoms[d]]
        hits = [np.zeros(b.size, np.int32) for b in dst]
        for p in range(tp_p):
            src = side_buffers(src_geoms[p], tp_p, None, pages, glob, p)
            plan = plan_pages(
                src_geoms[p], dst_geoms[d], p, d, tp_p, tp_d, src_pages, dst_pages, salt
            )
            if p not in decode_peers(d, tp_p, tp_d):
                assert len(plan) == 0
            for k in range(len(plan)):
                di, so, do, n = (
                    int(plan.desc[k]),
                    int(plan.src_off[k]),
                    int(plan.dst_off[k]),
                    int(plan.nbytes[k]),
                )
                assert 0 <= so and so + n <= src[di].size and 0 <= do and do + n <= dst[di].size
                dst[di][do : do + n] = src[di][so : so + n]
                hits[di][do : do + n] += 1
        want_by_page = side_buffers(dst_geoms[d], tp_d, None, pages, glob, d)
        for di, g in enumerate(dst_geoms[d]):
            want = np.zeros_like(dst[di])
            for page in range(pages):  # prefill page p landed in decode page dst_pages[p]
                q = int(dst_pages[page])
                want[q * g.item_bytes : (q + 1) * g.item_bytes] = want_by_page[di][
                    page * g.item_bytes : (page + 1) * g.item_bytes
                ]
            np.testing.assert_array_equal(dst[di], want)
            assert hits[di].max() <= 1, "a byte written twice"


LAYOUTS = {
    "nhd": lambda H: lambda tp: [nhd_item(4, 6, H, tp), nhd_item(4, 2, H, tp)],
    "hnd": lambda H: lambda tp: [hnd_item(4, 6, H, tp)] * 2,
    "page_major": lambda H: lambda tp: [page_major_item(2, 4, 6, 4, H, tp)],
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize(
    "tp_p,tp_d,heads",
    [(a, b, h) for a, b in itertools.product((1, 2, 4), repeat=2) for h in (1, 2, 4, 8)]
    + [(8, 2, 8), (2, 8, 16), (1, 8, 4), (8, 1, 2)],
)
def test_kv_bytes_land_exactly_once(layout, tp_p, tp_d, heads):
    check_transfer(LAYOUTS[layout](heads), tp_p, tp_d)


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product((1, 2, 4), repeat=2)))
def test_mla_replicated_one_sender(tp_p, tp_d):
    check_transfer(lambda tp: [replicated_item(40)] * 3, tp_p, tp_d, salt=1)


def _state(tp):
    """Per-layer state descriptors for ``tp`` in {1, 2, 4}: a conv ``x | B | C`` of 16, 4, 4
    rows (over all ranks) of 6 B, a temporal tensor of 4 heads of 10 B, a tensor with no
    split dim (replicated, 24 B) and a single-part conv of 16 rows of 3 B."""
    rows = 24 // tp
    return state_geometries(
        [rows * 6, 4 // tp * 10, 24, 16 // tp * 3],
        [rows, 4 // tp, -1, 16 // tp],
        [[16 // tp, 4 // tp, 4 // tp], [], [], []],
        tp,
    )


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product((1, 2, 4), repeat=2)))
def test_state_parts_sliced_independently(tp_p, tp_d):
    check_transfer(_state, tp_p, tp_d, pages=2)


def test_state_part_rows_follow_their_part():
    """x|B|C: decode rank 1 of 2 gets x rows 8..15, B rows 2..3, C rows 2..3."""
    src = state_item(6, [16, 4, 4], 1)
    dst = state_item(6, [16, 4, 4], 2)
    so, do, nb = item_runs(src, dst, 0, 1, 1, 2)
    assert so.tolist() == [8 * 6, (16 + 2) * 6, (20 + 2) * 6]
    assert do.tolist() == [0, 8 * 6, 10 * 6]
    assert nb.tolist() == [48, 12, 12]


def _state_outer(tp):
    """Kimi-like descriptors for ``tp`` in {1, 2, 4}: a ``[3, dim]`` conv (the split dim
    second: 3 outer rows) of parts 16 | 8 | 8 channels of 2 B, a ``[3, dim]`` single-part
    one of 8 channels of 4 B, and a temporal tensor of 4 heads of 10 B."""
    return state_geometries(
        [3 * 32 // tp * 2, 3 * 8 // tp * 4, 4 // tp * 10],
        [32 // tp, 8 // tp, 4 // tp],
        [[16 // tp, 8 // tp, 8 // tp], [], []],
        tp,
        [3, 3, 1],
    )


@pytest.mark.parametrize("tp_p,tp_d", list(itertools.product((1, 2, 4), repeat=2)))
def test_state_split_dim_after_outer_rows(tp_p, tp_d):
    check_transfer(_state_outer, tp_p, tp_d, pages=2)


def test_state_outer_rows_each_carry_every_part():
    """``[2, 4 | 2 | 2]`` channels of 1 B, tp 1 -> decode rank 1 of 2: per outer row, the
    second half of each part (a run per part per row, none across parts or rows)."""
    src = state_item(1, [4, 2, 2], 1, outer=2)
    dst = state_item(1, [4, 2, 2], 2, outer=2)
    assert (src.item_bytes, dst.item_bytes) == (16, 8)
    so, do, nb = item_runs(src, dst, 0, 1, 1, 2)
    assert sorted(zip(do.tolist(), so.tolist(), nb.tolist())) == [
        (0, 2, 2),
        (2, 5, 1),
        (3, 7, 1),
        (4, 10, 2),
        (6, 13, 1),
        (7, 15, 1),
    ]
    with pytest.raises(TpShapeMismatch, match="segment 0 differs"):
        item_runs(src, state_item(1, [4, 2, 2], 2, outer=1), 0, 1, 1, 2)
    with pytest.raises(InvalidArgument, match="do not fit"):
        state_geometries([10], [4], [], 1, [3])
    with pytest.raises(InvalidArgument, match="outer counts"):
        state_geometries([12], [4], [], 1, [3, 1])


@pytest.mark.parametrize("make", [LAYOUTS["nhd"](8), LAYOUTS["hnd"](8), _state])
def test_equal_tp_is_whole_items_in_page_runs(make):
    g = make(2)
    plan = plan_pages(g, g, 1, 1, 2, 2, [3, 4, 5, 9], [0, 1, 2, 7])
    assert plan.desc.tolist() == sorted(list(range(len(g))) * 2)
    for di, geom in enumerate(g):
        k = plan.desc == di
        assert plan.nbytes[k].tolist() == [3 * geom.item_bytes, geom.item_bytes]
        assert plan.src_off[k].tolist() == [3 * geom.item_bytes, 9 * geom.item_bytes]


def test_ops_scale_with_pages_for_hnd_and_tokens_for_nhd():
    pages = np.arange(10)
    hnd = plan_pages([hnd_item(64, 256, 8, 1)], [hnd_item(64, 256, 8, 2)], 0, 1, 1, 2, pages, pages)
    nhd = plan_pages([nhd_item(64, 256, 8, 1)], [nhd_item(64, 256, 8, 2)], 0, 1, 1, 2, pages, pages)
    assert len(hnd) == 10 and len(nhd) == 10 * 64
    assert hnd.total_bytes == nhd.total_bytes == 10 * 64 * 4 * 256


def test_gather_scatter_equals_direct_runs():
    rng = np.random.default_rng(1)
    src_g, dst_g = [nhd_item(8, 6, 8, 1)], [nhd_item(8, 6, 8, 4)]
    src = rng.integers(0, 255, 16 * src_g[0].item_bytes, np.uint8)
    plan = plan_pages(src_g, dst_g, 0, 2, 1, 4, [1, 5, 6], [3, 0, 1])
    direct = np.zeros(8 * dst_g[0].item_bytes, np.uint8)
    for so, do, n in zip(plan.src_off, plan.dst_off, plan.nbytes):
        direct[do : do + n] = src[so : so + n]
    staging = np.zeros(plan.total_bytes, np.uint8)
    assert gather_runs(src, plan.src_off, plan.nbytes, staging) == plan.total_bytes
    staged = np.zeros_like(direct)
    scatter_runs(staged, plan.dst_off, plan.nbytes, staging)
    np.testing.assert_array_equal(staged, direct)
    # mixed run sizes keep the plan's order
    offs, sizes = np.array([0, 10, 3]), np.array([2, 5, 1])
    out = np.zeros(8, np.uint8)
    gather_runs(np.arange(20, dtype=np.uint8), offs, sizes, out)
    assert out.tolist() == [0, 1, 10, 11, 12, 13, 14, 3]


@pytest.mark.parametrize(
    "make",
    [
        lambda t: tp.nhd_item(8, 6, 8, t),
        lambda t: tp.hnd_item(8, 6, 8, t),
        lambda t: tp.page_major_item(2, 8, 6, 4, 8, t),  # K/V dims differ: irregular
        lambda t: tp.state_item(6, [16, 4, 4], t),
    ],
)
@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (1, 4), (4, 2)])
def test_gather_scatter_items_equal_direct_runs(make, tp_p, tp_d):
    rng = np.random.default_rng(2)
    sg, dg = make(tp_p), make(tp_d)
    src = rng.integers(0, 255, 9 * sg.item_bytes, np.uint8)
    si, di = np.array([1, 5, 6, 8]), np.array([3, 0, 1, 2])
    for d in range(tp_d):
        for p in tp.decode_peers(d, tp_p, tp_d):
            ro, rd, rn = tp.item_runs(sg, dg, p, d, tp_p, tp_d)
            plan = tp.plan_pages([sg], [dg], p, d, tp_p, tp_d, si, di)
            direct = np.zeros(4 * dg.item_bytes, np.uint8)
            for so, do, n in zip(plan.src_off, plan.dst_off, plan.nbytes):
                direct[do : do + n] = src[so : so + n]
            packed = np.zeros(plan.total_bytes + 7, np.uint8)
            assert tp.gather_items(src, sg.item_bytes, si, ro, rn, packed) == plan.total_bytes
            staged = np.zeros_like(direct)
            tp.scatter_items(staged, dg.item_bytes, di, rd, rn, packed)
            np.testing.assert_array_equal(staged, direct)


def test_handshake_check():
    fp = {
        tp: tp_fingerprint(tp, {"kv": LAYOUTS["hnd"](8)(tp), "state": _state(tp)})
        for tp in (1, 2, 4)
    }
    for a, b in itertools.product((1, 2, 4), repeat=2):
        check_tp_compatible(fp[a], fp[b])
    other = tp_fingerprint(2, {"kv": LAYOUTS["nhd"](8)(2), "state": _state(2)})
    with pytest.raises(TpShapeMismatch, match="prefill tp 1.*decode tp 2"):
        check_tp_compatible(fp[1], other)
    with pytest.raises(TpShapeMismatch, match="prefill tp 2.*decode tp 3"):
        check_tp_compatible(fp[2], dict(fp[1], tp_size=3))
    with pytest.raises(TpShapeMismatch, match="malformed"):
        check_tp_compatible(fp[1], {"tp_size": 2})
    # a geometry whose local head count disagrees with its TP size
    bad = tp_fingerprint(2, {"kv": [hnd_item(4, 6, 8, 1)] * 2, "state": _state(2)})
    with pytest.raises(TpShapeMismatch, match="holds 8 / 8 units, not 8 / 4"):
        check_tp_compatible(fp[1], bad)
    g = ItemGeometry.from_plain(hnd_item(4, 6, 8, 2).to_plain())
    assert g == hnd_item(4, 6, 8, 2)


# ------------------------------------------------------------------ PagePlan (resolved once)
def _old_plan_pages(src, dst, p, d, tp_p, tp_d, si, di, salt=0):
    """plan_pages as it was written before PagePlan: one descriptor at a time."""
    si = np.asarray(si, dtype=np.int64).reshape(-1)
    di = np.asarray(di, dtype=np.int64).reshape(-1)
    cols = []
    for k, (s, t) in enumerate(zip(src, dst)):
        ro, rd, rn = item_runs(s, t, p, d, tp_p, tp_d, salt)
        if not rn.size or not si.size:
            continue
        so = (si[:, None] * s.item_bytes + ro[None, :]).ravel()
        do = (di[:, None] * t.item_bytes + rd[None, :]).ravel()
        so, do, nb = tp.coalesce(so, do, np.tile(rn, si.size))
        cols.append((np.full(so.size, k, dtype=np.int64), so, do, nb))
    if not cols:
        return [np.zeros(0, np.int64)] * 4
    return [np.concatenate([c[i] for c in cols]) for i in range(4)]


@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1), (4, 1), (2, 4), (2, 2)])
def test_page_plan_runs_equal_the_per_descriptor_plan(tp_p, tp_d):
    """Mixed descriptors (NHD, HND, a replicated latent, NHD again): the classes of equal
    geometry share their runs and the result is the per-descriptor plan, run for run (one
    item too, which takes the cached one-item template)."""
    rng = np.random.default_rng(tp_p * 7 + tp_d)

    def geoms(t):
        return [
            nhd_item(16, 64, 8, t),
            hnd_item(16, 64, 8, t),
            replicated_item(16 * 96),
            nhd_item(16, 64, 8, t),
        ]

    id_sets = [
        (np.arange(20), np.arange(5, 25)),
        (rng.permutation(40)[:20], rng.permutation(40)[:20]),
        ([3], [7]),  # one item (a state slot): PagePlan's one-item template
        ([0], [0]),
        ([39], [2]),
        ([], []),
    ]
    for p in range(tp_p):
        for d in range(tp_d):
            for salt in range(3):
                plan = tp.page_plan(geoms(tp_p), geoms(tp_d), p, d, tp_p, tp_d, salt)
                assert not plan.whole or tp_p == tp_d
                for si, di in id_sets:
                    got = plan.runs(si, di)
                    want = _old_plan_pages(geoms(tp_p), geoms(tp_d), p, d, tp_p, tp_d, si, di, salt)
                    for a, b in zip((got.desc, got.src_off, got.dst_off, got.nbytes), want):
                        assert a.tolist() == b.tolist(), (p, d, salt)


def test_page_plan_one_class_and_whole_items():
    g = [replicated_item(512)] * 6  # MLA: the latent of 6 layers, whole pages from one replica
    sender = [r for r in range(2) if tp.page_plan(g, g, r, 0, 2, 1, 5).classes]
    assert len(sender) == 1  # one replica sends, the other moves nothing
    plan = tp.page_plan(g, g, sender[0], 0, 2, 1, 5)
    assert plan.whole and len(plan.classes) == 1 and plan.classes[0][0] == tuple(range(6))
    runs = plan.runs(np.arange(100, 200), np.arange(0, 100))
    assert runs.desc.tolist() == list(range(6))  # one run per descriptor
    assert runs.nbytes.tolist() == [100 * 512] * 6
    idle = tp.page_plan(g, g, 1 - sender[0], 0, 2, 1, 5)
    assert not idle.whole and len(idle.runs(np.arange(3), np.arange(3))) == 0
    with pytest.raises(tp.InvalidArgument):
        plan.runs([1, 2], [1])
    with pytest.raises(TpShapeMismatch):
        tp.page_plan([nhd_item(16, 64, 8, 2)], [hnd_item(32, 64, 8, 1)], 0, 0, 2, 1)
