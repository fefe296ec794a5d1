"""Exhaustive tests of kvxfer.plan (pure arithmetic, no UCX, no torch)."""

import itertools

import numpy as np
import pytest

from kvxfer import plan
from kvxfer.errors import IndexOutOfRange, InvalidArgument

pytestmark = pytest.mark.timeout(60)


def grp(name="kv", ptrs=(0x1000,), items=8, item_lens=(16,)):
    return plan.make_group(name, list(ptrs), [items * il for il in item_lens], list(item_lens))


def reference_bytes(local, remote, src, dst):
    """(laddr, raddr) of every single byte the request must move, as a set."""
    out = set()
    for s, d in zip(src, dst):
        for lp, rp, il in zip(local.ptrs, remote.ptrs, local.item_lens):
            for b in range(il):
                out.add((lp + s * il + b, rp + d * il + b))
    return out


def op_bytes(ops):
    out = set()
    for la, ra, n in zip(ops.laddr.tolist(), ops.raddr.tolist(), ops.nbytes.tolist()):
        for b in range(n):
            out.add((la + b, ra + b))
    return out


# ------------------------------------------------------------------ groups


def test_make_group_ok():
    g = grp(ptrs=(0x1000, 0x9000), item_lens=(16, 32))
    assert g.count == 2 and g.num_items == 8 and g.item_bytes == 48 and g.nbytes == 8 * 48


@pytest.mark.parametrize(
    "args,msg",
    [
        (("", [1], [8], [8]), "name"),
        (("g", [], [], []), "no descriptors"),
        (("g", [1, 2], [8], [8, 8]), "ptrs"),
        (("g", [0], [8], [8]), "> 0"),
        (("g", [8], [0], [8]), "> 0"),
        (("g", [8], [8], [0]), "> 0"),
        (("g", [8], [12], [8]), "multiple"),
        (("g", [8, 64], [16, 32], [8, 8]), "item counts"),
        (("g", [2**64 - 8], [16], [8]), "overflows"),
        (("g", [1.5], [8], [8]), "not an integer"),
        (("g", [True], [8], [8]), "not an integer"),
    ],
)
def test_make_group_rejects(args, msg):
    with pytest.raises(InvalidArgument, match=msg):
        plan.make_group(*args)


def test_check_compatible_names_field():
    a = grp(item_lens=(16, 16), ptrs=(0x1000, 0x2000))
    with pytest.raises(plan.IncompatibleLayout) as e:
        plan.check_compatible(a, grp(item_lens=(16,)))
    assert e.value.field == "count"
    with pytest.raises(plan.IncompatibleLayout) as e:
        plan.check_compatible(a, grp(item_lens=(16, 32), ptrs=(0x1000, 0x2000)))
    assert e.value.field == "item_lens" and "item_lens" in str(e.value)
    plan.check_compatible(a, grp(item_lens=(16, 16), ptrs=(0x5000, 0x9000), items=99))


# ------------------------------------------------------------------- ids


@pytest.mark.parametrize(
    "value", [[1, 2], (1, 2), np.array([1, 2], np.int32), np.array([1, 2], np.uint64), range(1, 3)]
)
def test_as_ids_accepts(value):
    out = plan.as_ids(value, "x")
    assert out.dtype == np.int64 and out.tolist() == [1, 2]


def test_as_ids_torch_cpu():
    torch = pytest.importorskip("torch")
    assert plan.as_ids(torch.tensor([3, 4]), "x").tolist() == [3, 4]


@pytest.mark.parametrize(
    "value,exc",
    [
        ([1.0, 2.0], InvalidArgument),
        ([[1, 2]], InvalidArgument),
        ([True], InvalidArgument),
        (np.array([2**63], np.uint64), IndexOutOfRange),
    ],
)
def test_as_ids_rejects(value, exc):
    with pytest.raises(exc):
        plan.as_ids(value, "x")


def test_as_ids_scalar_and_empty():
    assert plan.as_ids(5, "x").tolist() == [5]
    assert plan.as_ids([], "x").size == 0


def test_check_ids_names_first_bad():
    with pytest.raises(IndexOutOfRange, match=r"item id 9 out of range \[0, 8\).*2 bad"):
        plan.check_ids(np.array([1, 9, -1]), 8, "src")
    plan.check_ids(np.array([0, 7]), 8, "src")


# ----------------------------------------------------------------- runs


def brute_runs(src, dst):
    pairs = sorted(zip(src, dst))
    runs = []
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def test_merge_runs_exhaustive_small():
    """Every injective map of up to 4 source items into 5 destination slots."""
    for n in range(0, 5):
        for src in itertools.permutations(range(5), n):
            for dst in itertools.permutations(range(5), n):
                s0, d0, ln = plan.merge_runs(np.array(src, np.int64), np.array(dst, np.int64))
                got = list(zip(s0.tolist(), d0.tolist(), ln.tolist()))
                assert got == brute_runs(src, dst), (src, dst)


def test_merge_runs_random_large():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 400))
        src = rng.choice(1000, n, replace=False)
        dst = rng.choice(1000, n, replace=False)
        if rng.random() < 0.5:  # long contiguous stretches
            src, dst = np.sort(src), np.sort(dst)
            dst[: n // 2] = np.arange(n // 2) + 3
            src[: n // 2] = np.arange(n // 2) + 500
        s0, d0, ln = plan.merge_runs(src.astype(np.int64), dst.astype(np.int64))
        assert list(zip(s0.tolist(), d0.tolist(), ln.tolist())) == brute_runs(
            src.tolist(), dst.tolist()
        )
        assert ln.sum() == n


@pytest.mark.parametrize(
    "src,dst",
    [
        ([1, 1, 2], [4, 5, 6]),
        ([0, 0, 2], [5, 6, 7]),
        ([0, 2, 2], [5, 6, 7]),
        ([3, 4, 5], [7, 8, 9]),
    ],
)
def test_merge_runs_duplicate_sources_break_runs(src, dst):
    s0, d0, ln = plan.merge_runs(np.array(src), np.array(dst))
    assert ln.sum() == 3 and list(zip(s0, d0, ln)) == brute_runs(src, dst)


def test_merge_runs_duplicates_and_orders_match_brute_force():
    """Sorted, unsorted and duplicate sources (the three orderings merge_runs takes)."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        src = rng.integers(0, 30, n)
        if rng.random() < 0.3:
            src = np.sort(src)
        dst = rng.choice(100, n, replace=False)
        s0, d0, ln = plan.merge_runs(src.astype(np.int64), dst.astype(np.int64))
        assert list(zip(s0.tolist(), d0.tolist(), ln.tolist())) == brute_runs(
            src.tolist(), dst.tolist()
        )


@pytest.mark.parametrize(
    "ids,dup",
    [
        ([], False),
        ([3], False),
        ([1, 2, 3], False),
        ([3, 1, 2], False),
        ([1, 2, 2], True),
        ([5, 1, 5], True),
    ],
)
def test_has_duplicates(ids, dup):
    assert plan.has_duplicates(np.array(ids, dtype=np.int64)) is dup


# -------------------------------------------------------------- plan_items


def test_plan_items_exhaustive_bytes():
    """The byte mapping of the ops equals the reference for many layouts and id sets."""
    layouts = [
        ((0x1000,), (16,)),
        ((0x1000, 0x8000), (8, 24)),
        ((0x1000, 0x1080, 0x1100), (4, 4, 4)),
    ]
    rng = np.random.default_rng(1)
    for lptrs, ils in layouts:
        local = grp(ptrs=lptrs, items=8, item_lens=ils)
        remote = grp(ptrs=tuple(p + 0x100000 for p in lptrs), items=10, item_lens=ils)
        for _ in range(60):
            n = int(rng.integers(0, 8))
            src = rng.choice(8, n, replace=False).tolist()
            dst = rng.choice(10, n, replace=False).tolist()
            ops = plan.plan_items(local, remote, src, dst)
            assert op_bytes(ops) == reference_bytes(local, remote, src, dst)
            runs = len(brute_runs(src, dst))
            assert len(ops) == runs * local.count
            assert ops.total_bytes == n * sum(ils)
            # every op inside its descriptors on both sides
            for la, ra, nb, d in zip(
                ops.laddr.tolist(), ops.raddr.tolist(), ops.nbytes.tolist(), ops.desc.tolist()
            ):
                assert local.ptrs[d] <= la and la + nb <= local.ptrs[d] + local.lens[d]
                assert remote.ptrs[d] <= ra and ra + nb <= remote.ptrs[d] + remote.lens[d]


def test_plan_items_page_major_vs_per_layer_ops():
    L = 4
    per_layer = grp(
        ptrs=[0x10000 * (i + 1) for i in range(2 * L)], items=32, item_lens=[64] * (2 * L)
    )
    page_major = grp(ptrs=(0x100000,), items=32, item_lens=(64 * 2 * L,))
    src, dst = [0, 1, 2, 7, 9], [3, 4, 5, 0, 20]
    a = plan.plan_items(per_layer, per_layer, src, dst)
    b = plan.plan_items(page_major, page_major, src, dst)
    assert len(a) == 2 * L * len(b) == 2 * L * 3
    assert a.total_bytes == b.total_bytes


@pytest.mark.parametrize(
    "src,dst,exc,msg",
    [
        ([0, 8], [0, 1], IndexOutOfRange, "source: item id 8"),
        ([0, 1], [0, 10], IndexOutOfRange, "destination: item id 10"),
        ([-1], [0], IndexOutOfRange, "item id -1"),
        ([0, 1], [3, 3], InvalidArgument, "destination item 3 appears 2 times"),
        ([0, 1], [3], InvalidArgument, "2 source ids but 1"),
        ([0.5], [1], InvalidArgument, "integers"),
    ],
)
def test_plan_items_rejects(src, dst, exc, msg):
    local, remote = grp(items=8), grp(items=10, ptrs=(0x9000,))
    with pytest.raises(exc, match=msg):
        plan.plan_items(local, remote, src, dst)


def test_plan_items_incompatible():
    with pytest.raises(plan.IncompatibleLayout):
        plan.plan_items(grp(item_lens=(16,)), grp(item_lens=(32,)), [0], [0])


def test_plan_items_empty():
    assert len(plan.plan_items(grp(), grp(), [], [])) == 0


# ----------------------------------------------------------------- raw


def test_plan_raw_ok_and_bounds():
    local = grp(ptrs=(0x1000, 0x5000), items=4, item_lens=(16, 32))
    remote = grp(ptrs=(0x9000, 0xA000), items=4, item_lens=(16, 32))
    ops = plan.plan_raw(local, remote, [0, 1], [0, 100], [8, 0], [56, 28])
    assert ops.laddr.tolist() == [0x1000, 0x5000 + 100]
    assert ops.raddr.tolist() == [0x9008, 0xA000]
    assert ops.nbytes.tolist() == [56, 28]
    assert ops.desc.tolist() == [0, 1]
    assert len(plan.plan_raw(local, remote, 0, 0, 0, 64)) == 1  # scalars broadcast
    with pytest.raises(IndexOutOfRange, match="destination"):
        plan.plan_raw(local, remote, 0, 0, 1, 64)  # dst 1..65 > 64
    with pytest.raises(IndexOutOfRange, match="source"):
        plan.plan_raw(local, remote, 1, 100, 0, 29)
    with pytest.raises(IndexOutOfRange, match="descriptor"):
        plan.plan_raw(local, remote, 2, 0, 0, 1)
    with pytest.raises(InvalidArgument, match="nbytes"):
        plan.plan_raw(local, remote, 0, 0, 0, 0)
    with pytest.raises(InvalidArgument, match="differ"):
        plan.plan_raw(local, remote, [0, 1, 0], [0, 1], 0, 1)


# ------------------------------------------------------------- spans


def test_merge_spans_overlap_adjacent_gap():
    a = plan.make_group("a", [0x1000, 0x1100], [0x100, 0x100], [0x10, 0x10])  # adjacent
    b = plan.make_group("b", [0x1180, 0x4000], [0x100, 0x100], [0x10, 0x10])  # overlap, gap
    spans = plan.merge_spans([a, b])
    assert [(s.start, s.end) for s in spans] == [(0x1000, 0x1280), (0x4000, 0x4100)]
    assert spans[0].adjacent_only and not spans[1].adjacent_only
    assert set(spans[0].members) == {("a", 0), ("a", 1), ("b", 0)}
    assert plan.span_index(spans, b).tolist() == [0, 1]
    spans2 = plan.merge_spans([a, b], merge_adjacent=False)
    assert [(s.start, s.end) for s in spans2] == [
        (0x1000, 0x1100),
        (0x1100, 0x1280),
        (0x4000, 0x4100),
    ]


def test_merge_spans_random_cover():
    rng = np.random.default_rng(3)
    for _ in range(100):
        n = int(rng.integers(1, 12))
        starts = rng.integers(1, 200, n) * 16
        lens = rng.integers(1, 10, n) * 16
        g = plan.make_group("g", starts.tolist(), lens.tolist(), lens.tolist())
        spans = plan.merge_spans([g])
        covered = set()
        for s in spans:
            covered |= set(range(s.start, s.end))
        want = set()
        for st, ln in zip(starts.tolist(), lens.tolist()):
            want |= set(range(st, st + ln))
        assert covered == want  # adjacent merging: no gaps inside a span
        for x, y in zip(spans, spans[1:]):
            assert x.end < y.start  # disjoint and not touching
        idx = plan.span_index(spans, g)
        for i, (st, ln) in enumerate(zip(starts.tolist(), lens.tolist())):
            s = spans[int(idx[i])]
            assert s.start <= st and st + ln <= s.end


def test_check_inside():
    plan.check_inside([0x1000], [0x100], [0x1000], [0x100], [0], "g")
    with pytest.raises(IndexOutOfRange, match="outside region"):
        plan.check_inside([0x1000], [0x101], [0x1000], [0x100], [0], "g")
    with pytest.raises(IndexOutOfRange, match="region 1 of 1"):
        plan.check_inside([0x1000], [0x10], [0x1000], [0x100], [1], "g")


def test_concat():
    a = plan.plan_items(grp(), grp(), [0], [1])
    b = plan.plan_items(grp(), grp(), [2, 3], [5, 6])
    c = plan.concat([a, b])
    assert len(c) == 2 and c.laddr.dtype == np.uint64
    assert len(plan.concat([])) == 0


# ----------------------------------------------------------------- TP


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
def test_tp_sources_cover_every_head_once(heads):
    tps = [t for t in (1, 2, 4, 8, 16, 32) if heads % t == 0 or t % heads == 0]
    for src_tp in tps:
        for dst_tp in tps:
            for dst_rank in range(dst_tp):
                d0, dn = plan.tp_heads(heads, dst_tp, dst_rank)
                got = []
                for r, so, do, n in plan.tp_sources(heads, src_tp, dst_tp, dst_rank):
                    s0, sn = plan.tp_heads(heads, src_tp, r)
                    assert 0 <= so and so + n <= sn and 0 <= do and do + n <= dn
                    assert s0 + so == d0 + do  # same global head
                    got.extend(range(d0 + do, d0 + do + n))
                assert got == list(range(d0, d0 + dn))


def test_tp_heads_examples_and_errors():
    assert plan.tp_heads(8, 4, 3) == (6, 2)
    assert plan.tp_heads(2, 8, 5) == (1, 1)  # replicated KV heads
    assert plan.tp_sources(8, 2, 4, 1) == [(0, 2, 0, 2)]
    assert plan.tp_sources(8, 4, 2, 1) == [(2, 0, 0, 2), (3, 0, 2, 2)]
    with pytest.raises(InvalidArgument):
        plan.tp_heads(6, 4, 0)
    with pytest.raises(InvalidArgument):
        plan.tp_heads(4, 6, 0)
    with pytest.raises(IndexOutOfRange):
        plan.tp_heads(8, 4, 4)
