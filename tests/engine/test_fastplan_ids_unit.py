"""The id-array planner (fastplan.item_runs + emit) and the WritePlanner built on it agree
with kvxfer.plan.plan_items: the same ops in the same order (descriptor-major, runs by
source id), the same error type and message for the same bad input, nothing appended
before an error; both the Python-int output (few ops) and the numpy block (many)."""

import random

import numpy as np
import pytest
from fastplan_pairs import group_pair, planner_of_three, reference_ops

from kvxfer import plan
from kvxfer.engine import fastplan
from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite
from kvxfer.errors import IndexOutOfRange, InvalidArgument

pytestmark = pytest.mark.timeout(120)


def _pair(item_lens=(64, 32, 16), n_local=40, n_remote=30):
    return group_pair(item_lens, n_local, n_remote, stride=0x100000)


def _fast(g, src, dst, small_ops=fastplan.SMALL_OPS):
    out = ([], [], [], [], [])
    s0, d0, n, si, di = fastplan.item_runs(g, src, dst)
    block = fastplan.emit(g, s0, d0, n, out, small_ops)
    if block is None:
        cols = out
    else:
        assert out == ([], [], [], [], [])
        assert all(c.dtype == np.uint64 and c.flags.c_contiguous for c in block)
        cols = [c.tolist() for c in block]
    return list(zip(*cols)), si, di


def _cases(rng, n_local=40, n_remote=30, k_max=35):
    cases = [
        ([], []),
        ([0], [0]),
        ([39], [29]),
        (list(range(10, 30)), list(range(0, 20))),  # consecutive both sides: one run
        (list(range(30, 10, -1)), list(range(20, 0, -1))),  # descending: one run when sorted
        (list(range(10, 30)), list(range(0, 10)) + list(range(11, 21))),  # a break on dst
        ([2, 2, 3, 4], [0, 1, 2, 3]),  # duplicate sources break runs
        ([0, 1, 2, 3], [3, 2, 1, 0]),
        ([5, 1, 9, 2, 3], [0, 6, 7, 8, 9]),
    ]
    for _ in range(600):
        k = rng.randint(1, k_max)
        dst = rng.sample(range(n_remote), min(k, n_remote))
        if rng.random() < 0.3:  # sorted / consecutive runs are the common case
            base = rng.randrange(n_local - len(dst) + 1)
            src = list(range(base, base + len(dst)))
            if rng.random() < 0.5:
                dst = sorted(dst)
        else:
            src = [rng.randrange(n_local) for _ in range(len(dst))]
        cases.append((src, dst))
    return cases


@pytest.mark.parametrize("item_lens", [(48,), (64, 32, 16)])
@pytest.mark.parametrize("small_ops", [0, 8, fastplan.SMALL_OPS])
def test_same_ops_in_the_same_order_as_plan_items(item_lens, small_ops):
    lg, rg, g, memh, ridx = _pair(item_lens)
    rng = random.Random(11)
    for src, dst in _cases(rng):
        want = reference_ops(lg, rg, memh, ridx, src, dst)
        for conv in (np.array, lambda v: np.array(v, np.int32), list):
            s, d = conv(src), conv(dst)
            got, si, di = _fast(g, s, d, small_ops)
            assert got == want, (src, dst, small_ops)
            assert si.tolist() == list(src) and di.tolist() == list(dst)


def test_large_requests_match_plan_items():
    lg, rg, g, memh, ridx = _pair((16384,) * 8, n_local=1200, n_remote=1300)
    rng = np.random.default_rng(3)
    for src, dst in (
        (np.arange(100, 1100), np.arange(50, 1050)),
        (rng.permutation(1200)[:1000], rng.permutation(1300)[:1000]),
        (np.sort(rng.permutation(1200)[:1000]), np.sort(rng.permutation(1300)[:1000])),
        (np.arange(1000) // 2 * 2, np.arange(1000)),  # duplicate sources
    ):
        got, _, _ = _fast(g, src, dst)
        assert got == reference_ops(lg, rg, memh, ridx, src, dst)


def _error(fn):
    try:
        fn()
    except Exception as exc:
        return type(exc), str(exc)
    return None


BAD = [
    ([40], [0]),
    ([-1], [0]),
    ([0], [30]),
    ([0], [-5]),
    ([0, 1], [3, 3]),
    ([0, 1, 2], [4, 3, 4]),
    ([0, 1], [3]),
    ([3, 2, 1, 50], [0, 1, 2, 3]),  # unsorted, one out of range
    ([1, 2, 3, 40], [0, 1, 2, 3]),  # sorted, the last out of range
    ([0, 1, 2, 3], [0, 1, 2, 30]),
    ([0, 1, 2, 3], [5, 1, 9, 31]),
    ([0, 1, 2, 3], [-1, 1, 2, 3]),
    (list(range(20)), [0] * 20),  # long lists: the array path
    (list(range(20)), list(range(19))),
    ([1.0], [0]),
    ([True], [0]),
    ([[1]], [[0]]),
    (np.array([2**63 + 1], np.uint64), [0]),
]


@pytest.mark.parametrize("src,dst", BAD)
def test_same_errors_as_plan_items(src, dst):
    lg, rg, g, memh, ridx = _pair()
    want = _error(lambda: plan.plan_items(lg, rg, src, dst))
    assert want is not None and want[0] in (IndexOutOfRange, InvalidArgument)
    assert _error(lambda: fastplan.item_runs(g, src, dst)) == want
    s, d = np.asarray(src), np.asarray(dst)  # the same ids as arrays
    assert _error(lambda: fastplan.item_runs(g, s, d)) == _error(
        lambda: plan.plan_items(lg, rg, s, d)
    )


@pytest.mark.parametrize("ids", [[5], [0, 1, 2], [4, 2, 9], list(range(25)), [3, 3, 4]])
def test_check_ids_reports_increasing(ids):
    a = np.array(ids, np.int64)
    s_up, d_up = fastplan.check_ids(a, a, 40, 40, "s", "d")
    want = bool(np.all(a[1:] > a[:-1]))
    assert s_up == d_up == want


# ------------------------------------------------------------------ the planner, end to end
def _reference_plan(local, remote, writes):
    rows = []
    for w in writes:
        if isinstance(w, ItemWrite):
            ops = plan.plan_items(
                local.groups[w.group], remote.groups[w.group], w.src_items, w.dst_items
            )
        else:
            ops = plan.plan_raw(
                local.groups[w.group],
                remote.groups[w.group],
                w.desc,
                w.src_off,
                w.dst_off,
                w.nbytes,
            )
        d = ops.desc.astype(np.intp)
        rows += zip(
            ops.laddr.tolist(),
            ops.raddr.tolist(),
            ops.nbytes.tolist(),
            local.desc_memh[w.group][d].tolist(),
            remote.desc_region[w.group][d].tolist(),
        )
    return sorted(rows)


def test_planner_matches_reference_on_mixed_writes():
    planner, local, remote = planner_of_three()
    rng = random.Random(2)
    for _ in range(300):
        writes = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.5:
                k = rng.choice([1, 2, 5, 40, 100])
                dst = rng.sample(range(130), k)
                src = list(range(3, 3 + k)) if rng.random() < 0.5 else rng.sample(range(120), k)
                conv = rng.choice([list, np.array, lambda v: np.array(v, np.int32)])
                writes.append(ItemWrite("kv", conv(src), conv(dst)))
            elif kind < 0.8:
                writes.append(ItemWrite("st", [rng.randrange(16)], [rng.randrange(16)]))
            else:
                writes.append(RawWrite("aux", rng.randrange(64), rng.randrange(64), 8, 0))
        cols = planner.plan(writes)
        laddr, raddr, nbytes, memh, ridx, staged, sliced, patterned, hosted, total = cols
        assert not staged and not sliced and not patterned and not hosted
        for c in cols[:5]:
            assert c.dtype == np.uint64 and c.ndim == 1 and c.flags.c_contiguous
        got = sorted(zip(*(c.tolist() for c in cols[:5])))
        assert got == _reference_plan(local, remote, writes)
        assert total == sum(nbytes.tolist())


def test_planner_empty_and_errors_before_anything():
    planner, local, remote = planner_of_three()
    cols = planner.plan([])
    assert all(c.size == 0 and c.dtype == np.uint64 for c in cols[:5]) and cols[9] == 0
    with pytest.raises(IndexOutOfRange):
        planner.plan([ItemWrite("kv", [0], [0]), ItemWrite("kv", np.arange(200), np.arange(200))])
    with pytest.raises(InvalidArgument, match="appears"):
        planner.plan([ItemWrite("kv", np.arange(40), np.zeros(40, np.int64))])


def test_planner_stages_large_item_parts():
    planner, local, remote = planner_of_three(can_stage=True)
    src, dst = np.arange(0, 100, 2), np.arange(0, 100, 2)
    cols = planner.plan([ItemWrite("kv", src, dst), ItemWrite("st", [1], [2])], stage_min_ops=64)
    staged = cols[5]
    assert len(staged) == 1 and staged[0][0] == "kv" and staged[0][3] == 50 * 8
    assert staged[0][1].tolist() == src.tolist() and staged[0][2].tolist() == dst.tolist()
    assert cols[0].size == 2  # the state slot's two descriptors go direct
    # at or under the limit: direct
    cols = planner.plan([ItemWrite("kv", [0, 2], [0, 2])], stage_min_ops=64)
    assert not cols[5] and cols[0].size == 16


def test_pattern_ids_are_validated_as_before():
    from kvxfer.engine import slices

    planner, local, remote = planner_of_three(can_pattern=True)
    runs = slices.PatternRuns.make([([0], [0], [16])] * 8, [256] * 8, [256] * 8)
    for src, dst, err, text in (
        ([0, 1], [0, 0], InvalidArgument, "duplicate destination items"),
        ([0, 120], [0, 1], IndexOutOfRange, "source: item id 120"),
        ([0, 1], [1, 130], IndexOutOfRange, "destination: item id 130"),
        ([0, 1], [1], InvalidArgument, "2 source items but 1 destination"),
    ):
        with pytest.raises(err, match=text):
            planner.plan([PatternWrite("kv", np.array(src), np.array(dst), runs)])
    cols = planner.plan([PatternWrite("kv", np.arange(5), np.arange(7, 12), runs)])
    ((group, s, d, r),) = cols[7]
    assert group == "kv" and s.tolist() == list(range(5)) and d.tolist() == list(range(7, 12))


@pytest.mark.parametrize(
    "device, host, patterns, where",
    [
        (True, True, True, 7),  # the device lane first
        (False, True, True, 8),  # the host lane, from the pattern
        (False, False, True, None),  # expanded into direct runs
        (False, True, False, None),  # Peer.plan: always expanded
    ],
)
def test_pattern_parts_go_to_the_lane_that_copies_them(device, host, patterns, where):
    """A PatternWrite is handed to the device lane where it copies the group, else to the
    host lane (validated the same way: nothing expanded), else expanded into runs."""
    from kvxfer.engine import slices

    planner, _, _ = planner_of_three(can_pattern=device, host_pattern=host)
    runs = slices.PatternRuns.make([([0], [16], [16])] * 8, [256] * 8, [256] * 8)
    with pytest.raises(IndexOutOfRange, match="source: item id 120"):
        planner.plan([PatternWrite("kv", np.array([120]), np.array([1]), runs)], 0, patterns)
    cols = planner.plan([PatternWrite("kv", np.arange(5), np.arange(7, 12), runs)], 0, patterns)
    if where is None:
        assert not cols[7] and not cols[8] and cols[0].size == 5 * 8
        return
    assert cols[0].size == 0 and not cols[15 - where]
    ((group, s, d, r),) = cols[where]
    assert (group, s.tolist(), d.tolist(), r) == ("kv", list(range(5)), list(range(7, 12)), runs)


@pytest.mark.parametrize("seed", range(12))
def test_a_uniform_pattern_expands_as_run_by_run(seed):
    """Expanded for the direct path (no device lane), a pattern whose descriptors all have
    the same runs is offset from one expansion; the columns equal plan_raw's of
    PatternRuns.expand, run for run and in order; a non-uniform one takes plan_raw."""
    from kvxfer.engine import slices

    rng = np.random.default_rng(seed)
    planner, local, remote = planner_of_three(can_pattern=False)
    k = int(rng.integers(1, 5))
    starts = np.sort(rng.choice(np.arange(0, 240, 16), k, replace=False))
    one = (starts, rng.permutation(starts), np.full(k, int(rng.integers(1, 17))))
    descs = [one] * 8
    if seed % 3 == 2:  # one descriptor differs: not uniform
        descs = [one] * 7 + [([], [], [])]
    runs = slices.PatternRuns.make(descs, [256] * 8, [256] * 8)
    assert runs.uniform == (seed % 3 != 2)
    n = int(rng.integers(1, 60))
    src = np.arange(n) if seed % 2 else rng.choice(120, n, replace=False)
    dst = rng.choice(130, n, replace=False)
    got = planner.plan([PatternWrite("kv", src, dst, runs)])
    lg, rg = local.groups["kv"], remote.groups["kv"]
    ops = plan.plan_raw(lg, rg, *runs.expand(src, dst))
    d = ops.desc.astype(np.intp)
    want = (ops.laddr, ops.raddr, ops.nbytes, local.desc_memh["kv"][d], remote.desc_region["kv"][d])
    for a, b in zip(got[:5], want):
        assert a.dtype == np.uint64 and a.tolist() == b.tolist()
    assert got[9] == int(ops.nbytes.sum())


def _raw_cases(rng):
    """RawWrites of the 'st' group (2 descriptors of 16 x 64 B on both sides): valid and
    invalid, as ints, lists, tuples and arrays, scalars broadcast."""
    size = 16 * 64
    cases = [
        (0, 0, 0, 8),
        (1, size - 8, size - 8, 8),
        ([0, 1], [0, 8], [16, 24], [8, 8]),
        (np.array([0, 1, 0]), np.array([0, 8, 64]), 0, 8),
        ((1, 1), (0, 100), (5, 7), (3, 3)),
        (2, 0, 0, 8),  # no descriptor 2
        (-1, 0, 0, 8),
        (0, 0, 0, 0),  # empty run
        (0, -8, 0, 8),
        (0, size - 4, 0, 8),  # leaves the source descriptor
        (0, 0, size - 4, 8),  # leaves the destination descriptor
        ([0, 1], [0, 8, 16], 0, 8),  # lengths differ
        ([], [], [], []),
        (np.array([0], np.uint64), np.array([2**63 + 5], np.uint64), 0, 8),
        ([0], [1.5], [0], [8]),
        ([True], [0], [0], [8]),
        (np.zeros((1, 1), np.int64), 0, 0, 8),
        (np.zeros(100, np.int64), np.arange(100) * 8, np.arange(100) * 8, 8),  # long: numpy
    ]
    for _ in range(300):
        k = rng.randint(1, 6)
        cases.append(
            (
                [rng.randrange(3) for _ in range(k)],
                [rng.randrange(-8, size + 8) for _ in range(k)],
                [rng.randrange(-8, size + 8) for _ in range(k)],
                [rng.choice([0, 1, 8, 64, size]) for _ in range(k)],
            )
        )
    return cases


def test_short_raw_writes_match_plan_raw():
    planner, local, remote = planner_of_three()
    rng = random.Random(9)
    for desc, so, do, nb in _raw_cases(rng):
        w = RawWrite("st", so, do, nb, desc)
        want = _error(lambda w=w: _reference_plan(local, remote, [w]))
        got = _error(lambda w=w: planner.plan([w]))
        assert got == want, (desc, so, do, nb)
        if want is None:
            cols = planner.plan([w, ItemWrite("aux", [1], [2])])
            got_rows = sorted(zip(*(c.tolist() for c in cols[:5])))
            aux = _reference_plan(local, remote, [ItemWrite("aux", [1], [2])])
            assert got_rows == sorted(_reference_plan(local, remote, [w]) + aux)
            assert cols[9] == sum(cols[2].tolist())
