"""Heterogeneous TP x different page sizes x token windows (kvxfer.disagg.tp_tokens) against a
per-token brute force: every byte of every (token, segment, head) is labelled on prefill,
every pair's runs are applied, and decode's items must hold exactly the labels of the tokens
of the window in the heads each decode rank owns (each byte written once, nothing else)."""

import itertools

import numpy as np
import pytest

from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.disagg.runs import Runs
from kvxfer.disagg.tp_plan import (
    ItemGeometry,
    Segment,
    hnd_item,
    nhd_item,
    owned,
    page_major_item,
    plan_pages,
    replicated_item,
)
from kvxfer.disagg.tp_tokens import (
    TokenPlan,
    check_kv_tokens,
    per_token_item,
    token_segs,
)
from kvxfer.errors import IndexOutOfRange

pytestmark = pytest.mark.timeout(120)

RATIOS = ((1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2))
PAGES = ((1, 1), (2, 2), (4, 4), (2, 4), (4, 2), (3, 4), (4, 3), (1, 4))


def layouts(heads, tp, ps):
    """Per layout name: the kv descriptors' item geometries of a rank of ``tp``."""
    return {
        "nhd": [nhd_item(ps, 2, heads, tp), nhd_item(ps, 4, heads, tp)],
        "hnd": [hnd_item(ps, 2, heads, tp)],
        "pm": [page_major_item(2, ps, 2, 3, heads, tp)],
        "mla": [replicated_item(ps * 6), replicated_item(ps * 2)],
    }


# ------------------------------------------------------------------ brute-force reference
def ref_addr(seg, ps, slot, unit):
    """(offset, bytes) of token slot ``slot``, local unit ``unit`` of a tp_plan Segment at page
    size ``ps``: heads inside ``reps = ps`` rows, or ``unit_bytes = ps`` rows per block."""
    if seg.reps == ps and ps > 1:
        return seg.offset + slot * seg.stride + unit * seg.unit_bytes, seg.unit_bytes
    assert seg.reps == 1 and seg.unit_bytes % ps == 0
    rb = seg.unit_bytes // ps
    return seg.offset + unit * seg.unit_bytes + slot * rb, rb


def label(t, d, j, g, b):
    return (((t * 8 + d) * 64 + j) * 32 + g) * 64 + b


def fill_src(geoms, ps, pages, first, p, tp):
    """Prefill rank ``p``'s descriptors (int64 labels per byte; -2: no token byte)."""
    bufs = []
    for d, g in enumerate(geoms):
        buf = np.full((max(pages) + 1) * g.item_bytes, -2, dtype=np.int64)
        for i, page in enumerate(pages):
            for slot in range(ps):
                t = (first + i) * ps + slot
                for j, seg in enumerate(g.segments):
                    lo_u = owned(p, tp, seg.total)[0]
                    for u in range(seg.units):
                        off, n = ref_addr(seg, ps, slot, u)
                        at = page * g.item_bytes + off
                        buf[at : at + n] = [label(t, d, j, lo_u + u, b) for b in range(n)]
        bufs.append(buf)
    return bufs


def expected_dst(geoms, pd, pages, start, end, r, tp):
    """Decode rank ``r``'s descriptors as they must be after the window: labels of tokens
    [start, end) in its heads, -1 elsewhere."""
    out = []
    for d, g in enumerate(geoms):
        buf = np.full((max(pages) + 1) * g.item_bytes, -1, dtype=np.int64)
        for t in range(start, end):
            page, slot = pages[t // pd], t % pd
            for j, seg in enumerate(g.segments):
                lo_u = owned(r, tp, seg.total)[0]
                for u in range(seg.units):
                    off, n = ref_addr(seg, pd, slot, u)
                    at = page * g.item_bytes + off
                    buf[at : at + n] = [label(t, d, j, lo_u + u, b) for b in range(n)]
        out.append(buf)
    return out


def apply(runs, src_bufs, dst_bufs, counts):
    for d, so, do, n in zip(runs.desc, runs.src_off, runs.dst_off, runs.nbytes):
        assert n > 0
        assert 0 <= so and so + n <= src_bufs[d].size, "run leaves the source descriptor"
        assert 0 <= do and do + n <= dst_bufs[d].size, "run leaves the destination descriptor"
        dst_bufs[d][do : do + n] = src_bufs[d][so : so + n]
        counts[d][do : do + n] += 1


def check_window(kind, heads, tp_p, tp_d, ps, pd, tokens, start, end, chunk, rng, patterns=False):
    """Every decode rank's bytes after every prefill rank's runs of the window (or, with
    ``patterns``, their per-page patterns expanded) equal the brute force; no byte twice."""
    n_src, n_dst = -(-tokens // ps), -(-tokens // pd)
    src_pages = rng.permutation(n_src + 3)[:n_src]
    dst_pages = rng.permutation(n_dst + 3)[:n_dst]
    for r in range(tp_d):
        dgeo = layouts(heads, tp_d, pd)[kind]
        got = [np.full((max(dst_pages) + 1) * g.item_bytes, -1, dtype=np.int64) for g in dgeo]
        counts = [np.zeros(b.size, dtype=np.int64) for b in got]
        for p in range(tp_p):
            sgeo = layouts(heads, tp_p, ps)[kind]
            check_kv_tokens(sgeo, dgeo, ps, pd, tp_p, tp_d)
            src = fill_src(sgeo, ps, list(src_pages), 0, p, tp_p)
            plan = TokenPlan(tuple(sgeo), tuple(dgeo), ps, pd, p, r, tp_p, tp_d)
            # in chunks of ``chunk`` source pages, as prefill sends them
            for first in range(0, n_src, chunk):
                lo = max(first * ps, start)
                hi = max(lo, min((first + chunk) * ps, end))
                if patterns:
                    for s, t, pr in plan.patterns(
                        src_pages[first : first + chunk], dst_pages, lo, hi, src_first_page=first
                    ):
                        assert np.unique(t).size == t.size
                        apply(Runs(*pr.expand(s, t)), src, got, counts)
                    continue
                runs = plan.runs(
                    src_pages[first : first + chunk], dst_pages, lo, hi, src_first_page=first
                )
                apply(runs, src, got, counts)
        want = expected_dst(dgeo, pd, list(dst_pages), start, end, r, tp_d)
        for d in range(len(dgeo)):
            assert np.array_equal(got[d], want[d]), (kind, heads, tp_p, tp_d, ps, pd, r, d)
            assert counts[d].max(initial=0) <= 1, "a byte written twice"


CASES = [
    (kind, heads, tp_p, tp_d, ps, pd)
    for kind in ("nhd", "hnd", "pm", "mla")
    for heads in ((1,) if kind == "mla" else (2, 4))
    for (tp_p, tp_d) in RATIOS
    for (ps, pd) in PAGES
]


@pytest.mark.parametrize("kind,heads,tp_p,tp_d,ps,pd", CASES)
def test_windows_match_brute_force(kind, heads, tp_p, tp_d, ps, pd):
    rng = np.random.default_rng(hash((kind, heads, tp_p, tp_d, ps, pd)) % (1 << 32))
    tokens = 2 * max(ps, pd) + 1  # a last partial page on at least one side
    windows = {(0, tokens), (1, tokens), (ps, tokens), (pd, tokens), (tokens - 1, tokens)}
    windows.add((0, 0))
    for start, end in sorted(windows):
        check_window(kind, heads, tp_p, tp_d, ps, pd, tokens, start, end, 2, rng)


@pytest.mark.parametrize("kind,heads,tp_p,tp_d,ps,pd", CASES[::3])
def test_patterns_move_the_windows_bytes(kind, heads, tp_p, tp_d, ps, pd):
    """TokenPlan.patterns (one PatternWrite per piece class: the device lane's form of
    different page sizes and unaligned windows) moves exactly what runs() moves."""
    rng = np.random.default_rng(hash((kind, heads, tp_p, tp_d, ps, pd, 1)) % (1 << 32))
    tokens = 2 * max(ps, pd) + 1
    for start, end in sorted({(0, tokens), (1, tokens), (pd, tokens), (tokens - 1, tokens)}):
        check_window(kind, heads, tp_p, tp_d, ps, pd, tokens, start, end, 2, rng, True)


def test_patterns_are_few_and_cached():
    """Pages 4 -> 16 (aligned): four classes of whole pieces (the four slots of a 4-token
    page in a 16-token one); each class's runs are the same object on every call."""
    plan = TokenPlan(
        tuple(layouts(4, 1, 4)["nhd"]), tuple(layouts(4, 2, 16)["nhd"]), 4, 16, 0, 1, 1, 2
    )
    pats = plan.patterns(np.arange(64), np.arange(16), 0, 256)
    assert len(pats) == 4 and sum(s.size for s, _, _ in pats) == 64
    again = plan.patterns(np.arange(64), np.arange(16), 0, 256)
    assert all(a[2] is b[2] for a, b in zip(pats, again))
    odd = plan.patterns(np.arange(64), np.arange(16), 37, 250)  # unaligned both ends
    assert len(odd) <= 6


def test_chunking_does_not_matter():
    rng = np.random.default_rng(0)
    for chunk in (1, 2, 3, 50):
        check_window("hnd", 4, 2, 4, 4, 3, 23, 5, 23, chunk, rng)
        check_window("nhd", 4, 4, 1, 3, 4, 23, 7, 23, chunk, rng)


# ------------------------------------------------------------------ op counts
def _ops(kind, tp_p, tp_d, ps, pd, tokens, start=0, heads=8):
    n_src, n_dst = -(-tokens // ps), -(-tokens // pd)
    total = 0
    for r, p in itertools.product(range(tp_d), range(tp_p)):
        plan = TokenPlan(
            tuple(layouts(heads, tp_p, ps)[kind]),
            tuple(layouts(heads, tp_d, pd)[kind]),
            ps,
            pd,
            p,
            r,
            tp_p,
            tp_d,
        )
        total += len(plan.runs(np.arange(n_src), np.arange(n_dst), start, tokens))
    return total


def test_equal_pages_whole_window_is_plan_pages():
    """Equal page sizes, whole pages: exactly tp_plan.plan_pages's runs (the same merging)."""
    for kind, (tp_p, tp_d) in itertools.product(("nhd", "hnd", "pm", "mla"), RATIOS):
        heads = 1 if kind == "mla" else 4
        for r, p in itertools.product(range(tp_d), range(tp_p)):
            sg, dg = layouts(heads, tp_p, 4)[kind], layouts(heads, tp_d, 4)[kind]
            ids_s, ids_d = np.array([3, 0, 1, 5]), np.array([2, 3, 4, 0])
            a = TokenPlan(tuple(sg), tuple(dg), 4, 4, p, r, tp_p, tp_d).runs(ids_s, ids_d, 0, 16)
            b = plan_pages(sg, dg, p, r, tp_p, tp_d, ids_s, ids_d)
            for x, y in zip(
                (a.desc, a.src_off, a.dst_off, a.nbytes), (b.desc, b.src_off, b.dst_off, b.nbytes)
            ):
                assert np.array_equal(x, y), (kind, tp_p, tp_d, p, r)


def test_ops_grow_with_pieces_for_blocks_and_tokens_for_rows():
    # HND, 8 heads: one run per piece (16 tokens) per head of the decode rank's 4
    assert _ops("hnd", 1, 2, 16, 64, 256) == 2 * (256 // 16) * 4
    assert _ops("hnd", 2, 1, 64, 16, 256) == 2 * (256 // 16) * 4
    # equal page sizes: a page's heads merge (one run per page per pair), as plan_pages
    assert _ops("hnd", 1, 2, 16, 16, 256) == 2 * (256 // 16)
    # an unaligned start: its partial page moves head by head
    assert _ops("hnd", 1, 2, 16, 16, 256, start=5) == 2 * (4 + 256 // 16 - 1)
    assert _ops("hnd", 1, 2, 16, 64, 256, start=5) == 2 * (256 // 16) * 4
    # NHD: one run per token per descriptor per pair
    assert _ops("nhd", 1, 2, 16, 64, 256) == 2 * 2 * 256
    # MLA: one sender per decode rank, consecutive pages merge whole (2 descriptors)
    assert _ops("mla", 1, 2, 16, 64, 256, heads=1) == 2 * 2
    assert _ops("mla", 4, 1, 64, 16, 256, heads=1) == 2


# ------------------------------------------------------------------ handshake forms
def test_rows_and_blocks_are_one_form_per_token():
    for heads, tp in ((4, 1), (4, 2), (4, 4), (2, 4)):
        assert per_token_item(nhd_item(16, 2, heads, tp), 16) == per_token_item(
            hnd_item(16, 2, heads, tp), 16
        )
        assert per_token_item(nhd_item(16, 2, heads, tp), 16) == per_token_item(
            nhd_item(64, 2, heads, tp), 64
        )


def test_rows_against_blocks_of_several_heads_is_refused():
    with pytest.raises(TpShapeMismatch, match="rows of 4 heads against blocks of 2"):
        check_kv_tokens([nhd_item(16, 2, 4, 1)], [hnd_item(64, 2, 4, 2)], 16, 64, 1, 2)
    # one head on either side pairs with any form
    check_kv_tokens([nhd_item(16, 2, 4, 1)], [hnd_item(64, 2, 4, 4)], 16, 64, 1, 4)


def test_other_mismatches_name_both_shapes():
    with pytest.raises(TpShapeMismatch, match="prefill tp 1 page 16.*decode tp 2 page 64"):
        check_kv_tokens([nhd_item(16, 2, 4, 1)], [nhd_item(64, 4, 4, 2)], 16, 64, 1, 2)
    with pytest.raises(TpShapeMismatch, match="1 kv descriptors, decode 2"):
        check_kv_tokens([nhd_item(16, 2, 4, 1)], [nhd_item(64, 2, 4, 2)] * 2, 16, 64, 1, 2)
    with pytest.raises(TpShapeMismatch, match="does not hold 4 token rows"):
        token_segs(ItemGeometry(30, replicated_item(30).segments), 4)
    with pytest.raises(TpShapeMismatch, match="not a token segment"):
        token_segs(ItemGeometry(32, (Segment(2, 1, 30, 1, 30, 1),)), 4)


def test_window_outside_the_pages_is_refused():
    plan = TokenPlan(
        tuple(layouts(4, 1, 4)["nhd"]), tuple(layouts(4, 2, 8)["nhd"]), 4, 8, 0, 0, 1, 2
    )
    with pytest.raises(IndexOutOfRange):
        plan.runs(np.arange(2), np.arange(1), 0, 9)
    with pytest.raises(IndexOutOfRange):
        plan.runs(np.arange(2), np.arange(1), 0, 4, src_first_page=1)
    assert len(plan.runs(np.arange(2), np.arange(1), 3, 3)) == 0


# ------------------------------------------------------------------ the room's choice
def test_room_pages_pick_whole_pages_or_the_pairs_token_runs():
    from kvxfer.disagg.page_map import RoomPages
    from kvxfer.disagg.tp_rooms import TpPair
    from kvxfer.errors import UnsupportedOperation

    def pair(ps, pd):
        return TpPair(
            0, 1, 1, 2, {"kv": layouts(4, 1, ps)["hnd"]}, {"kv": layouts(4, 2, pd)["hnd"]}, ps, pd
        )

    def make(ps, pd, prefix, tokens, exact=False):
        return RoomPages.make(
            num_src=-(-tokens // ps),
            num_dst=-(-tokens // pd),
            src_page_size=ps,
            dst_page_size=pd,
            prefix=prefix,
            tokens=tokens,
            geom=None,
            exact=exact,
            who="room 9",
            tp=pair(ps, pd),
            salt=9,
        )

    assert not make(4, 4, 8, 30).by_runs  # whole pages: the pair's plan_pages
    pm = make(4, 8, 3, 30)
    assert pm.by_runs and pm.salt == 9
    runs = pm.runs(np.arange(2), 0, np.arange(4))  # first chunk: source pages 0, 1
    plan = TokenPlan(
        tuple(layouts(4, 1, 4)["hnd"]), tuple(layouts(4, 2, 8)["hnd"]), 4, 8, 0, 1, 1, 2
    )
    want = plan.runs(np.arange(2), np.arange(4), 3, 8)
    assert np.array_equal(runs.dst_off, want.dst_off) and runs.total_bytes == want.total_bytes
    assert make(4, 4, 5, 30).by_runs  # unaligned prefix
    with pytest.raises(UnsupportedOperation, match="prefill tp 1, decode tp 2, prefill page"):
        make(4, 8, 0, 30, exact=True)


def test_plan_hash_is_computed_once_and_equal_plans_share_patterns():
    """TokenPlan caches its hash (piece_runs is cached by plan, five classes a write): equal
    plans hash alike and get the same pattern objects."""
    a = TokenPlan(
        tuple(layouts(4, 1, 4)["hnd"]), tuple(layouts(4, 2, 16)["hnd"]), 4, 16, 0, 1, 1, 2
    )
    b = TokenPlan(
        tuple(layouts(4, 1, 4)["hnd"]), tuple(layouts(4, 2, 16)["hnd"]), 4, 16, 0, 1, 1, 2
    )
    c = TokenPlan(
        tuple(layouts(4, 1, 4)["hnd"]), tuple(layouts(4, 2, 16)["hnd"]), 4, 16, 0, 0, 1, 2
    )
    assert a == b and hash(a) == hash(b) and a != c
    assert hash(a) == hash(a) and a.__dict__["_hash"] == hash(a)
    pa, pb = (
        a.patterns(np.arange(64), np.arange(16), 3, 250),
        b.patterns(np.arange(64), np.arange(16), 3, 250),
    )
    assert [x[2] for x in pa] and all(x[2] is y[2] for x, y in zip(pa, pb))


def test_patterns_are_shared_by_the_salts_of_one_class():
    """Two page sizes and heterogeneous TP: every room (salt) of a pair without replicas gets
    the same pattern objects; MLA over 2 prefill ranks alternates its sender (2 classes)."""
    kw = dict(src_first_page=0)
    hnd = TokenPlan(
        tuple(layouts(4, 2, 4)["hnd"]), tuple(layouts(4, 1, 16)["hnd"]), 4, 16, 1, 0, 2, 1
    )
    assert [hnd.salt_class(r) for r in (0, 1, 3)] == [0, 0, 0]
    got = [hnd.patterns(np.arange(64), np.arange(16), 3, 250, salt=r, **kw) for r in range(3)]
    assert got[0] and all(x[2] is y[2] for g in got[1:] for x, y in zip(got[0], g))
    mla = TokenPlan(
        tuple(layouts(4, 2, 4)["mla"]), tuple(layouts(4, 1, 16)["mla"]), 4, 16, 1, 0, 2, 1
    )
    assert [mla.salt_class(r) for r in (0, 1, 3)] == [0, 1, 1]
    sends = [bool(mla.patterns(np.arange(64), np.arange(16), 3, 250, salt=r)) for r in (0, 1, 3)]
    assert sends[1] == sends[2] != sends[0]
