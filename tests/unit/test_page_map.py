"""kvxfer.disagg.page_map against a byte-level reference: every page-size pair of
{1, 2, 4, 16, 64}, every prefix K of the request, partial last pages, 1-4 segments; its
patterns (one PatternWrite per piece class) against its runs."""

import itertools

import numpy as np
import pytest

from kvxfer.disagg.page_map import (
    TokenGeometry,
    class_token,
    piece_classes,
    plan_patterns,
    plan_runs,
)
from kvxfer.errors import IndexOutOfRange, InvalidArgument

SIZES = (1, 2, 4, 16, 64)
GEOMS = ([[3]], [[2, 5]], [[1], [2, 2, 1]], [[3, 1, 2, 1]])


def reference(geom, src, ps, dst, pd, start, end):
    """{desc: sorted (src byte, dst byte) pairs} of tokens [start, end), one byte at a time."""
    out = {}
    for d, segs in enumerate(geom):
        pairs = []
        for t in range(start, end):
            cum = 0
            for tb in segs:
                s0 = src[t // ps] * ps * sum(segs) + ps * cum + (t % ps) * tb
                d0 = dst[t // pd] * pd * sum(segs) + pd * cum + (t % pd) * tb
                pairs += [(s0 + b, d0 + b) for b in range(tb)]
                cum += tb
        out[d] = sorted(pairs)
    return out


def expand(runs):
    out = {}
    for d, s, o, n in zip(runs.desc, runs.src_off, runs.dst_off, runs.nbytes):
        assert n > 0
        out.setdefault(int(d), []).extend((int(s) + b, int(o) + b) for b in range(int(n)))
    return {d: sorted(v) for d, v in out.items()}


def pages(n_tokens, size, rng):
    k = -(-n_tokens // size)
    return rng.permutation(np.arange(3, 3 + 2 * k))[:k]  # scattered, unique ids


@pytest.mark.parametrize("ps,pd", list(itertools.product(SIZES, SIZES)))
def test_runs_match_bytes(ps, pd):
    rng = np.random.default_rng(ps * 100 + pd)
    for n, segs in ((70, GEOMS[0]), (64, GEOMS[1]), (33, GEOMS[2]), (17, GEOMS[3])):
        geom = TokenGeometry.of(segs)
        src, dst = pages(n, ps, rng), pages(n, pd, rng)
        for k in range(0, n + 1):
            runs = plan_runs(geom, src, ps, dst, pd, k, n)
            want = reference(segs, src, ps, dst, pd, k, n) if k < n else {}
            got = expand(runs)
            assert got == {d: v for d, v in want.items() if v}, (n, k)
            # descriptor-major, no two runs that could have been one
            assert np.all(np.diff(runs.desc) >= 0)


@pytest.mark.parametrize("ps,pd", [(16, 64), (64, 16), (4, 4)])
def test_chunks_cover_the_request(ps, pd):
    """Prefill sends its pages in chunks: the chunks' runs add up to the whole request."""
    segs = [[2], [1, 3]]
    geom, rng, n, k = TokenGeometry.of(segs), np.random.default_rng(0), 150, 37
    src, dst = pages(n, ps, rng), pages(n, pd, rng)
    got: dict = {}
    a = 0
    for b in (1, 3, len(src)):  # chunk = source pages [a, b)
        b = min(b, len(src))
        lo, hi = max(a * ps, k), min(b * ps, n)
        part = plan_runs(geom, src[a:b], ps, dst, pd, lo, hi, src_first_page=a)
        for d, v in expand(part).items():
            got.setdefault(d, []).extend(v)
        a = b
    assert {d: sorted(v) for d, v in got.items()} == reference(segs, src, ps, dst, pd, k, n)


@pytest.mark.parametrize("segs", GEOMS)
def test_equal_pages_collapse_to_item_runs(segs):
    """Equal page sizes, consecutive ids: one run per descriptor per page run (as ItemWrite)."""
    geom = TokenGeometry.of(segs)
    src = np.array([5, 6, 7, 20, 21])
    dst = np.array([9, 10, 11, 12, 40])
    runs = plan_runs(geom, src, 16, dst, 16, 0, 80)
    # page runs pairing both sides: (5..7 -> 9..11), (20 -> 12), (21 -> 40)
    assert len(runs) == 3 * len(segs)
    item = geom.item_lens(16)
    assert runs.total_bytes == 5 * sum(item)


def test_16_to_64_op_count():
    """Four consecutive 16-token pages fill one 64-token page: one run per segment row."""
    geom = TokenGeometry.of([[8]])
    runs = plan_runs(geom, np.arange(1, 9), 16, np.array([3, 7]), 64, 0, 128)
    assert len(runs) == 2  # src pages 1-4 -> dst 3, 5-8 -> dst 7


def test_bad_ranges_raise():
    geom = TokenGeometry.of([[1]])
    with pytest.raises(IndexOutOfRange):
        plan_runs(geom, np.arange(2), 4, np.arange(4), 2, 0, 9)  # source holds 8 tokens
    with pytest.raises(IndexOutOfRange):
        plan_runs(geom, np.arange(4), 4, np.arange(2), 4, 0, 9)  # destination holds 8
    with pytest.raises(IndexOutOfRange):
        plan_runs(geom, np.arange(2), 4, np.arange(4), 4, 0, 8, src_first_page=1)
    with pytest.raises(InvalidArgument):
        TokenGeometry.of([[1], []])
    assert len(plan_runs(geom, np.arange(2), 4, np.arange(2), 4, 5, 5)) == 0


def _make(**kw):
    from kvxfer.disagg.page_map import RoomPages

    args = dict(
        num_src=10,
        num_dst=3,
        src_page_size=16,
        dst_page_size=64,
        prefix=0,
        tokens=150,
        geom=TokenGeometry.of([[4]]),
        exact=False,
        who="room 1",
    )
    args.update(kw)
    return RoomPages.make(**args)


def test_room_pages_picks_the_path_and_checks_counts():
    from kvxfer.errors import ShapeMismatch, UnsupportedOperation

    assert _make().geom is not None  # 16 -> 64: byte runs
    same = _make(num_dst=10, dst_page_size=16, prefix=32)
    assert same.geom is None  # equal sizes, aligned prefix: whole pages
    src, dst = same.whole_pages(np.arange(100, 104), 1, np.arange(200, 210))
    assert src.tolist() == [101, 102, 103] and dst.tolist() == [202, 203, 204]
    assert _make(num_dst=10, dst_page_size=16, prefix=33).geom is not None
    assert _make(tokens=None).tokens == 160  # the slots both sides hold
    with pytest.raises(ShapeMismatch, match="prefill sends 10 pages, decode allocated 9"):
        _make(num_dst=9, dst_page_size=16, tokens=None)
    with pytest.raises(ShapeMismatch, match="250 tokens"):
        _make(tokens=250)
    with pytest.raises(InvalidArgument, match="prefix 151"):
        _make(prefix=151)
    with pytest.raises(UnsupportedOperation, match="no token geometry"):
        _make(geom=None)
    with pytest.raises(UnsupportedOperation, match="integrity"):
        _make(exact=True)
    assert _make().dst_pages_done(2) == 1 and _make().dst_pages_done(10) == 3


def test_few_runs_only_for_token_major_geometries():
    """The pattern path's guard (prefill_side, tp_pattern="auto"): consecutive pages of a
    token-major geometry merge into a few runs, given back below the limit; scattered pages,
    a limit reached and multi-segment (HND-like) geometries give None."""
    pm = _make(prefix=37)  # 16 -> 64, one segment: NHD / MLA
    assert pm.geom.token_major and not TokenGeometry.of([[2, 2]]).token_major
    src, dst = np.arange(10, 20), np.arange(40, 43)
    few = pm.few_runs(src, 0, dst, limit=128)
    assert few is not None and len(few) == len(pm.runs(src, 0, dst)) < 4
    assert pm.few_runs(src, 0, dst, limit=len(few)) is None  # the limit is exclusive
    scattered = np.random.default_rng(0).permutation(np.arange(100, 200))[:10]
    assert pm.few_runs(scattered, 0, dst, limit=8) is None
    hnd = _make(prefix=37, geom=TokenGeometry.of([[2, 2]]))
    assert hnd.few_runs(src, 0, dst, limit=10**9) is None


def test_fingerprints_with_geometry_pair_other_page_sizes():
    from kvxfer.disagg.errors import LayoutMismatch
    from kvxfer.disagg.kv_args import check_compatible

    def fp(ps, segs, kind="mha"):
        out = {
            "page_size": ps,
            "dtype": "bfloat16",
            "kv_item_lens": [ps * sum(s) for s in segs] if segs else [ps * 4],
            "layout": {"kv": {"kind": kind, "page_size": ps, "item_lens": [ps * 4]}},
        }
        if segs:
            out["kv_segments"] = segs
        return out

    check_compatible(fp(16, [[4]]), fp(64, [[4]]), us="a", them="b")
    with pytest.raises(LayoutMismatch, match="kv_segments"):
        check_compatible(fp(16, [[4]]), fp(64, [[2, 2]]), us="a", them="b")
    with pytest.raises(LayoutMismatch, match="page_size"):  # one side states no geometry
        check_compatible(fp(16, [[4]]), fp(64, None), us="a", them="b")
    with pytest.raises(LayoutMismatch, match="layout.kv.kind"):
        check_compatible(fp(16, [[4]]), fp(64, [[4]], kind="mla"), us="a", them="b")


# ------------------------------------------------------------------ patterns (equal TP)
def canonical(desc, so, do, nb):
    """Runs sorted by (descriptor, destination), touching ones merged; AssertionError when
    two destination runs of a descriptor overlap (a byte written twice)."""
    desc, so, do, nb = (np.asarray(a, dtype=np.int64) for a in (desc, so, do, nb))
    order = np.lexsort((do, desc))
    desc, so, do, nb = desc[order], so[order], do[order], nb[order]
    out = []
    for d, s, o, n in zip(desc.tolist(), so.tolist(), do.tolist(), nb.tolist()):
        assert n > 0
        if out and out[-1][0] == d:
            pd_, ps_, po, pn = out[-1]
            assert po + pn <= o, "destination runs overlap"
            if po + pn == o and ps_ + pn == s:
                out[-1] = (d, ps_, po, pn + n)
                continue
        out.append((d, s, o, n))
    return out


def expand_patterns(pats):
    cols = [np.zeros(0, dtype=np.int64)] * 4
    for s, d, pr in pats:
        assert np.unique(d).size == d.size and np.unique(s).size == s.size
        assert pr.src_item_lens and pr.dst_item_lens
        cols = [np.concatenate([a, b]) for a, b in zip(cols, pr.expand(s, d))]
    return cols


def chunked(geom, src, ps, dst, pd, k, n, chunk, how):
    """``how`` (plan_runs or plan_patterns) over source pages in chunks of ``chunk``, as
    prefill sends them (RoomPages.chunk_tokens)."""
    out = []
    for a in range(0, len(src), chunk):
        lo = max(a * ps, k)
        hi = max(lo, min((a + chunk) * ps, n))
        out.append(how(geom, src[a : a + chunk], ps, dst, pd, lo, hi, src_first_page=a))
    return out


PAT_SIZES = ((1, 1), (4, 4), (16, 16), (2, 4), (4, 2), (16, 64), (64, 16), (3, 4), (4, 3), (1, 16))


@pytest.mark.parametrize("ps,pd", PAT_SIZES)
@pytest.mark.parametrize("segs", GEOMS)
def test_patterns_expand_to_the_runs(ps, pd, segs):
    """Equal TP: plan_patterns moves exactly the bytes plan_runs moves (the runs it posts
    today), for prefixes at, before, after and inside page boundaries, a last partial page
    on either side, and chunks of 1, 3 and all source pages."""
    geom = TokenGeometry.of(segs)
    rng = np.random.default_rng(ps * 1000 + pd * 10 + len(segs))
    big = max(ps, pd)
    for n in (3 * big + 1, 2 * big, 5 * big - 1):
        src, dst = pages(n, ps, rng), pages(n, pd, rng)
        prefixes = {0, 1, ps, pd, ps + 1, pd - 1, big + 3, n // 2, n - 1, n}
        for k in sorted(p for p in prefixes if 0 <= p <= n):
            for chunk in (1, 3, len(src)):
                runs = chunked(geom, src, ps, dst, pd, k, n, chunk, plan_runs)
                pats = chunked(geom, src, ps, dst, pd, k, n, chunk, plan_patterns)
                want = canonical(
                    *(np.concatenate([getattr(r, f) for r in runs]) for f in RUN_FIELDS)
                )
                got = canonical(*expand_patterns([p for part in pats for p in part]))
                assert got == want, (ps, pd, segs, n, k, chunk)


RUN_FIELDS = ("desc", "src_off", "dst_off", "nbytes")


def test_patterns_match_the_byte_reference():
    """16 -> 64 and 64 -> 16 with prefix 37, against the byte-at-a-time reference."""
    segs = [[2, 3], [1]]
    geom, rng, n = TokenGeometry.of(segs), np.random.default_rng(7), 150
    for ps, pd in ((16, 64), (64, 16)):
        src, dst = pages(n, ps, rng), pages(n, pd, rng)
        desc, so, do, nb = expand_patterns(plan_patterns(geom, src, ps, dst, pd, 37, n))
        got: dict = {}
        for d, s, o, b in zip(desc.tolist(), so.tolist(), do.tolist(), nb.tolist()):
            got.setdefault(d, []).extend((s + i, o + i) for i in range(b))
        assert {d: sorted(v) for d, v in got.items()} == reference(segs, src, ps, dst, pd, 37, n)


def test_patterns_are_few_and_cached():
    """16 -> 64 aligned: four classes (the four 16-token slots of a 64-token page), each
    one run per segment row; an unaligned window adds its partial pieces' classes; a class's
    runs are the same object on every call (the device lane caches per pattern object)."""
    geom = TokenGeometry.of([[8], [4, 4]])
    src, dst = np.arange(100, 164), np.arange(16)
    pats = plan_patterns(geom, src, 16, dst, 64, 0, 1024)
    assert len(pats) == 4 and sum(s.size for s, _, _ in pats) == 64
    assert all(pr.runs_per_item == 3 for _, _, pr in pats)
    again = plan_patterns(geom, src, 16, dst, 64, 0, 1024)
    assert all(a[2] is b[2] for a, b in zip(pats, again))
    odd = plan_patterns(geom, src, 16, dst, 64, 37, 1000)  # unaligned both ends
    assert len(odd) <= 6
    assert plan_patterns(geom, src, 16, dst, 64, 40, 40) == []


def test_pattern_windows_are_checked():
    geom = TokenGeometry.of([[1]])
    with pytest.raises(IndexOutOfRange):
        plan_patterns(geom, np.arange(2), 4, np.arange(4), 2, 0, 9)
    with pytest.raises(IndexOutOfRange):
        plan_patterns(geom, np.arange(4), 4, np.arange(2), 4, 0, 9)
    with pytest.raises(IndexOutOfRange):
        plan_patterns(geom, np.arange(2), 4, np.arange(4), 4, 0, 8, src_first_page=1)
    with pytest.raises(InvalidArgument):
        plan_patterns(geom, np.arange(2), 4, np.arange(2), 4, -1, 3)
    with pytest.raises(InvalidArgument):
        plan_patterns(geom, np.arange(2), 0, np.arange(2), 4, 0, 3)


@pytest.mark.parametrize("ps,pd", list(itertools.product(SIZES, SIZES)))
def test_piece_classes_partition_the_pieces(ps, pd):
    """Every piece in one class; distinct pages within a class; class_token sits at the
    class's slots."""
    n = 2 * max(ps, pd) + 3
    src, dst = np.arange(-(-n // ps)) + 50, np.arange(-(-n // pd)) + 500
    for k in (0, 1, 5, n - 1):
        classes = piece_classes(src, dst, ps, pd, k, n)
        covered = 0
        for (a, b, m), s, d in classes:
            assert np.unique(s).size == s.size and np.unique(d).size == d.size
            t = class_token(a, b, ps, pd)
            assert t % ps == a and t % pd == b and a + m <= ps and b + m <= pd
            covered += m * s.size
        assert covered == n - k


@pytest.mark.parametrize("ps,pd", list(itertools.product(SIZES, SIZES)))
def test_aligned_class_index_matches_the_general_grouping(ps, pd):
    """Page sizes dividing one another take arithmetic progressions (no sort): the same
    classes, in the same order, with the same pieces as the general grouping, every window."""
    from kvxfer.disagg.page_map import _class_index_aligned, _class_index_any

    n = 2 * max(ps, pd) + 5
    # every start near a page boundary of either size, every end
    edges = {e + d for e in (0, ps, pd, 2 * ps, 2 * pd) for d in (-1, 0, 1)}
    for start in sorted(x for x in edges | set(range(0, n, 5)) if 0 <= x < n):
        for end in range(start + 1, n + 1):
            fast, general = (
                _class_index_aligned(ps, pd, start, end),
                _class_index_any(ps, pd, start, end),
            )
            assert [c for c, _, _ in fast] == [c for c, _, _ in general], (start, end)
            for (_, s1, d1), (_, s2, d2) in zip(fast, general):
                assert np.array_equal(s1, s2) and np.array_equal(d1, d2), (start, end)


@pytest.mark.parametrize("ps,pd", [(3, 4), (6, 4), (5, 16), (16, 5)])
def test_piece_classes_of_page_sizes_that_do_not_divide(ps, pd):
    """The general grouping: every token of the window in exactly one piece of one class,
    pages distinct within a class, the class at its slots."""
    n = 3 * ps * pd + 2
    src, dst = np.arange(-(-n // ps)) + 50, np.arange(-(-n // pd)) + 500
    for k in (0, 1, ps + 1, n - 1):
        covered = []
        for (a, b, m), s, d in piece_classes(src, dst, ps, pd, k, n):
            assert np.unique(s).size == s.size and np.unique(d).size == d.size
            for sp, dp in zip(s.tolist(), d.tolist()):
                t = (sp - 50) * ps + a  # the piece's first token, from its source page
                assert (dp - 500) * pd + b == t and a + m <= ps and b + m <= pd
                covered.extend(range(t, t + m))
        assert sorted(covered) == list(range(k, n))


def test_class_index_is_cached_read_only_and_offset_by_the_first_page():
    from kvxfer.disagg.page_map import class_index

    a = class_index(16, 64, 37, 1000)
    assert class_index(16, 64, 37, 1000) is a
    for _, s, d in a:
        assert not s.flags.writeable and not d.flags.writeable
    src, dst = np.arange(100, 163), np.arange(200, 216)
    whole = piece_classes(src, dst, 16, 64, 37, 1000)
    part = piece_classes(src[2:], dst, 16, 64, 37, 1000, src_first_page=2)
    assert [(c, s.tolist(), d.tolist()) for c, s, d in whole] == [
        (c, s.tolist(), d.tolist()) for c, s, d in part
    ]


@pytest.mark.parametrize("segs", [[[3]], [[1], [4]], [[8], [2], [6]]])
def test_token_major_runs_match_the_general_path(segs):
    """One segment per descriptor: runs merged once over the pieces and scaled per
    descriptor are the general path's runs (``keep`` of every segment takes that path),
    scattered and consecutive pages, every page-size pair, chunks starting anywhere."""
    geom = TokenGeometry.of(segs)
    rng = np.random.default_rng(len(segs))
    for ps, pd in itertools.product(SIZES, (1, 3, 4, 64)):
        n = 2 * max(ps, pd) + 7
        for consecutive in (True, False):
            k_src, k_dst = -(-n // ps), -(-n // pd)
            src = np.arange(k_src) + 9 if consecutive else pages(n, ps, rng)
            dst = np.arange(k_dst) + 4 if consecutive else pages(n, pd, rng)
            for first in (0, 1):
                for start in (first * ps, first * ps + 1, n - 1):
                    if start >= n:
                        continue
                    got = plan_runs(geom, src[first:], ps, dst, pd, start, n, src_first_page=first)
                    want = plan_runs(
                        geom,
                        src[first:],
                        ps,
                        dst,
                        pd,
                        start,
                        n,
                        src_first_page=first,
                        keep=np.ones(len(segs), dtype=bool),
                    )
                    for x, y in zip(
                        (got.desc, got.src_off, got.dst_off, got.nbytes),
                        (want.desc, want.src_off, want.dst_off, want.nbytes),
                    ):
                        assert np.array_equal(x, y), (ps, pd, consecutive, first, start)


def _room(geom, n_src, n_dst, ps, pd, prefix, tokens):
    """An equal-TP room's pages by byte runs of ``geom`` (RoomPages.make, not exact)."""
    from kvxfer.disagg.page_map import RoomPages

    return RoomPages.make(
        num_src=n_src,
        num_dst=n_dst,
        src_page_size=ps,
        dst_page_size=pd,
        prefix=prefix,
        tokens=tokens,
        geom=geom,
        exact=False,
        who="t",
    )


@pytest.mark.parametrize("segs", [[[3]], [[1], [4]], [[8], [2], [6]]])
def test_few_runs_shortcuts_agree_with_the_runs(segs):
    """``RoomPages.few_runs`` skips building runs where their count is known: scattered pages
    give at least one run per page break on either side (None at once when that reaches the
    limit), consecutive pages exactly one per descriptor. Against the runs themselves, every
    page-size pair, pages consecutive / scattered / consecutive but for one break, every
    chunk start, several limits."""
    geom = TokenGeometry.of(segs)
    rng = np.random.default_rng(11)
    for ps, pd in itertools.product(SIZES, (1, 4, 64)):
        n = 2 * max(ps, pd) + 9
        k_src, k_dst = -(-n // ps), -(-n // pd)
        forms = {
            "consecutive": (np.arange(k_src) + 9, np.arange(k_dst) + 4),
            "scattered": (pages(n, ps, rng), pages(n, pd, rng)),
            "one break": (np.r_[np.arange(k_src - 1) + 9, [500]], np.arange(k_dst) + 4),
        }
        for prefix in (0, 1, ps):
            if prefix >= n:
                continue
            pm = _room(geom, k_src, k_dst, ps, pd, prefix, n)
            for name, (src, dst) in forms.items():
                for first in (0, 1, k_src - 1):
                    chunk = src[first:]
                    full = pm.runs(chunk, first, dst) if pm.by_runs else None
                    for limit in (1, len(segs) + 1, 64, 1 << 20):
                        got = pm.few_runs(chunk, first, dst, limit)
                        if not pm.by_runs:
                            continue
                        want = full if len(full) < limit else None
                        assert (got is None) == (want is None), (ps, pd, name, first, limit)
                        if got is not None:
                            for x, y in zip(
                                (got.desc, got.src_off, got.dst_off, got.nbytes),
                                (want.desc, want.src_off, want.dst_off, want.nbytes),
                            ):
                                assert np.array_equal(x, y), (ps, pd, name, first, limit)
    with pytest.raises(IndexOutOfRange):  # the window is still checked
        _room(geom, 4, 1, 16, 64, 1, 64).few_runs(
            np.arange(2), 0, np.zeros(0, dtype=np.int64), 64
        )  # no destination page


def test_few_runs_builds_no_runs_for_consecutive_or_scattered_pages(monkeypatch):
    """The two shortcuts answer without building the chunk's runs (the general path is for
    pages with a few breaks only)."""
    from kvxfer.disagg.page_map import RoomPages

    pm = _room(TokenGeometry.of([[4]] * 8), 1000, 250, 16, 64, 37, 16000)
    monkeypatch.setattr(RoomPages, "runs", lambda *a: pytest.fail("runs were built"))
    runs = pm.few_runs(np.arange(1000) + 3, 0, np.arange(250) + 7, 64)
    assert runs is not None and len(runs) == 8 and int(runs.nbytes.sum()) == 8 * 4 * (16000 - 37)
    rng = np.random.default_rng(2)
    assert pm.few_runs(rng.permutation(5000)[:1000], 0, np.arange(250) + 7, 64) is None
