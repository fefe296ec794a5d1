"""``DeviceLane.launch_patterns`` on CPU: several PatternWrites (a write's piece
classes of the kv pages, its state slices) go as ONE native launch over their concatenated run tables, each item pair naming
its pattern's rows; the table is cached per combination of patterns; one part, or a launch
the native kernel refuses, goes pattern by pattern.

The lane is real except for the device: its row tables stay in host memory and the native
launch is replaced by a stand-in that runs the launch's tables by the kernel's rule
(:func:`~kvxfer.kernels.pattern_copy.copy_pattern_reference`'s, on absolute addresses), so
what is checked is what the kernel would be given. The launch itself runs on the GPU machine
(tests/gpu/test_native_launch.py, tests/disagg/test_pd_tp_pages.py with CUDA pools)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvxfer.engine import devcopy
from kvxfer.engine.slices import PatternRuns
from kvxfer.kernels import pattern_copy

pytestmark = pytest.mark.timeout(60)

ITEM_S, ITEM_D, N_S, N_D = 64, 256, 8, 4


class HostLane(devcopy.DeviceLane):
    """A DeviceLane over host buffers: remote region k (buffer k of ``dst``) mapped at its
    own address, row tables 'uploaded' as host tensors, single-pattern launches recorded."""

    def __init__(self, *dst: np.ndarray) -> None:  # no CUDA
        bases = [d.ctypes.data for d in dst]
        self.mapped = np.array(bases, dtype=np.uint64)
        self._rbase = np.array(bases, dtype=np.uint64)
        self._rlen = np.array([d.nbytes for d in dst], dtype=np.uint64)
        self._patterns = {}
        self._stats = {}
        self.profile = None
        self._tasks = SimpleNamespace(ring="ring")
        self._stream_h = 7
        self.uploads = 0
        self.singles: list = []

    def _upload_rows(self, host):
        self.uploads += 1
        return torch.from_numpy(host.copy())  # data_ptr(): host memory the stand-in reads

    def launch_pattern(self, pattern, lptrs, rptrs, ridx, src, dst):
        self.singles.append(len(src))
        rows = self._pattern_rows(pattern, lptrs, rptrs, ridx)
        _run(rows, np.stack([np.asarray(src), np.asarray(dst)], 1))
        return "single"


def _run(rows: np.ndarray, items: np.ndarray) -> None:
    """The kernel's rule on absolute addresses (rows [R, 5]; items [P, 2] or [P, 4])."""
    table = rows.tolist()
    for it in items.tolist():
        s, t, lo, hi = it if len(it) == 4 else (*it, 0, len(table))
        for so, do, n, ss, ds in table[lo:hi]:
            ctypes.memmove(do + t * ds, so + s * ss, n)


@pytest.fixture
def native(monkeypatch):
    """The stand-in native launch: records each call's tables and runs them."""
    calls: list = []

    def launch(ring, rows_ptr, host_rows, pairs, align, stream, span=0, shape=None, stamps=None):
        assert ring == "ring" and stream == 7 and align == pattern_copy.row_alignment(host_rows)
        assert shape == pattern_copy.checked_shape(host_rows, align)  # computed when cached
        n = host_rows.size
        dev = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(rows_ptr))
        assert np.array_equal(dev.reshape(-1, 5), host_rows)  # the uploaded table is read
        calls.append((pairs.copy(), span))
        _run(host_rows, pairs)
        return "event"

    monkeypatch.setattr(pattern_copy, "copy_pattern_native", launch)
    return calls


def _patterns():
    """Four piece classes of a 16 -> 64-token write (slot b of the larger page) and a partial
    piece, over two descriptors of ITEM_S / ITEM_D bytes."""
    pats = []
    for b in range(4):
        so = np.arange(0, ITEM_S, 16)
        pats.append(
            PatternRuns.make([(so, so + b * ITEM_S, np.full(4, 8))] * 2, [ITEM_S] * 2, [ITEM_D] * 2)
        )
    pats.append(PatternRuns.make([([4], [200], [4]), ([], [], [])], [ITEM_S] * 2, [ITEM_D] * 2))
    return pats


def _buffers(seed: int):
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, 2 * ITEM_S * N_S, dtype=np.uint8)
    dst = rng.integers(0, 256, 2 * ITEM_D * N_D, dtype=np.uint8)
    return src, dst


def _args(src, dst):
    lptrs = [src.ctypes.data, src.ctypes.data + ITEM_S * N_S]
    rptrs = [dst.ctypes.data, dst.ctypes.data + ITEM_D * N_D]
    return lptrs, rptrs, np.zeros(2, dtype=np.int64)


def _bases(src, dst):
    """``launch_patterns``' bases: group ``kv`` over these buffers."""
    return {"kv": _args(src, dst)}


def _parts(pats, group="kv"):
    rng = np.random.default_rng(1)
    parts = []
    for k, p in enumerate(pats):
        n = 1 if k == len(pats) - 1 else 3
        parts.append(
            (p, rng.choice(N_S, n, replace=False), rng.choice(N_D, n, replace=False), group)
        )
    return parts


def test_piece_classes_go_in_one_launch_with_the_bytes_of_one_by_one(native):
    pats = _patterns()
    parts = _parts(pats)
    src, dst = _buffers(0)
    want = dst.copy()
    ref = HostLane(want)
    for p, s, d, _ in parts:  # the patterns one by one, into the reference copy
        ref.launch_pattern(p, *_args(src, want), s, d)
    lane = HostLane(dst)
    assert lane.launch_patterns(parts, _bases(src, dst)) == "event"
    assert np.array_equal(dst, want)
    ((pairs, span),) = native
    assert pairs.shape == (13, 4) and not lane.singles
    bounds = sorted({int(x) for x in pairs[:, 2:].ravel()})
    assert span == max(b - a for a, b in zip(bounds, bounds[1:]))
    # the same combination again: the cached table, no upload
    lane.launch_patterns(parts, _bases(src, dst))
    assert lane.uploads == 1 and len(native) == 2
    # another combination (a partial piece of another length): a table of its own
    other = parts[:4] + [
        (PatternRuns.make([([0], [0], [8])] * 2, [ITEM_S] * 2, [ITEM_D] * 2), [5], [3], "kv")
    ]
    lane.launch_patterns(other, _bases(src, dst))
    assert lane.uploads == 2 and len(native) == 3


def test_the_patterns_of_two_groups_go_in_one_launch(native):
    """A write's kv piece classes and its state slices (another group: other descriptors,
    another remote region) in one launch, each part's rows between its own group's
    descriptors."""
    pats = _patterns()
    state = PatternRuns.make([([8], [40], [16]), ([0], [0], [8])], [ITEM_S] * 2, [ITEM_D] * 2)
    parts = _parts(pats[:2]) + [(state, np.array([0, 5]), np.array([3, 1]), "state")]
    src, dst = _buffers(5)
    s_src, s_dst = _buffers(6)  # the state group's buffers: remote region 1
    before_s = s_dst.copy()

    def bases(d, s_d):
        ls, rs, _ = _args(s_src, s_d)
        return {"kv": _args(src, d), "state": (ls, rs, np.ones(2, dtype=np.int64))}

    want, want_s = dst.copy(), s_dst.copy()
    ref = HostLane(want, want_s)
    for p, s, d, g in parts:  # one by one, into the reference copies
        ref.launch_pattern(p, *bases(want, want_s)[g], s, d)
    lane = HostLane(dst, s_dst)
    assert lane.launch_patterns(parts, bases(dst, s_dst)) == "event"
    assert np.array_equal(dst, want) and np.array_equal(s_dst, want_s)
    assert not np.array_equal(s_dst, before_s)  # the state's bytes did move
    ((pairs, _),) = native
    assert pairs.shape == (6, 4) and not lane.singles


def test_one_part_goes_alone_and_empty_parts_not_at_all(native):
    pats = _patterns()
    src, dst = _buffers(2)
    lane = HostLane(dst)
    one = [(pats[0], np.array([1, 2]), np.array([0, 3]), "kv")]
    assert lane.launch_patterns(one, _bases(src, dst)) == "single"
    empty = np.zeros(0, dtype=np.int64)
    lane.launch_patterns(one + [(pats[1], empty, empty, "kv")], _bases(src, dst))
    assert lane.singles == [2, 2] and not native  # one live part: no combined launch


@pytest.mark.parametrize("why", ["alignment", "block", "rows"])
def test_another_groups_part_that_would_widen_the_launch_goes_apart(native, why):
    """A state part whose rows would narrow the launch's alignment, lengthen its vector
    block or outnumber its widest class goes in a launch of its own; the kv classes still
    go in one launch; every byte as the patterns one by one."""
    pats = _patterns()[:2]
    item, big = [ITEM_S] * 2, [4096] * 2
    state = {
        "alignment": lambda: PatternRuns.make([([8], [40], [4]), ([0], [0], [8])], item, item),
        # 1 KiB rows: a 1024-byte block, the kv's 8-byte rows run in 512-byte blocks
        "block": lambda: PatternRuns.make([([0], [0], [1024]), ([], [], [])], big, big),
        "rows": lambda: PatternRuns.make(
            [(np.arange(5) * 8, np.arange(5) * 8, np.full(5, 8))] * 2, item, item
        ),  # 10 rows, the widest kv class 8
    }[why]()
    parts = _parts(pats) + [(state, np.array([0]), np.array([0]), "state")]
    src, dst = _buffers(7)
    s_src, s_dst = _buffers(8)

    def bases(d, s_d):
        ls, rs, _ = _args(s_src, s_d)
        return {"kv": _args(src, d), "state": (ls, rs, np.ones(2, dtype=np.int64))}

    want, want_s = dst.copy(), s_dst.copy()
    ref = HostLane(want, want_s)
    for p, s, d, g in parts:
        ref.launch_pattern(p, *bases(want, want_s)[g], s, d)
    lane = HostLane(dst, s_dst)
    assert lane.launch_patterns(parts, bases(dst, s_dst)) == "single"  # the state's, last
    assert np.array_equal(dst, want) and np.array_equal(s_dst, want_s)
    ((pairs, _),) = native
    assert pairs.shape == (4, 4) and lane.singles == [1]  # the kv classes, then the state


def test_joins_answers_as_the_launch_decides(native):
    """``DeviceLane.joins`` (what ``Peer.joins_launch`` asks before a write is made) says
    what ``launch_patterns`` would do with the state part, from a cache after the first
    question."""
    pats = _patterns()[:2]
    item = [ITEM_S] * 2
    fits = PatternRuns.make([([8], [40], [16]), ([0], [0], [8])], item, [ITEM_D] * 2)
    narrow = PatternRuns.make([([8], [40], [4]), ([0], [0], [8])], item, item)
    src, dst = _buffers(10)
    s_src, s_dst = _buffers(11)
    ls, rs, _ = _args(s_src, s_dst)
    bases = {"kv": _args(src, dst), "state": (ls, rs, np.ones(2, dtype=np.int64))}
    lane = HostLane(dst, s_dst)
    main = [("kv", p) for p in pats]
    for runs, want in ((fits, True), (narrow, False)):
        assert lane.joins(main, ("state", runs), bases) is want
        st = (runs, np.array([0]), np.array([0]), "state")
        lane.singles.clear()
        lane.launch_patterns(_parts(pats) + [st], bases)
        assert lane.singles == ([] if want else [1])  # not joined: a launch of its own
    lane._pattern_rows = None  # cached: no table is built again
    assert lane.joins(main, ("state", fits), bases) and not lane.joins(
        main, ("state", narrow), bases
    )
    bare = HostLane(dst, s_dst)  # no native launcher: every part a launch of its own
    bare._tasks = None
    assert not bare.joins(main, ("state", fits), bases)


def test_no_native_launcher_goes_part_by_part_of_every_group():
    pats = _patterns()
    src, dst = _buffers(9)
    lane = HostLane(dst)
    lane._tasks = None
    st = (pats[0], np.array([1]), np.array([2]), "state")
    bases = {**_bases(src, dst), "state": _args(src, dst)}
    assert lane.launch_patterns(_parts(pats[:2]) + [st], bases) == "single"
    assert lane.singles == [3, 1, 1]


def test_a_refused_native_launch_falls_back_to_one_launch_per_part(monkeypatch):
    monkeypatch.setattr(pattern_copy, "copy_pattern_native", lambda *a, **k: None)
    pats = _patterns()
    parts = _parts(pats)
    src, dst = _buffers(3)
    want = dst.copy()
    ref = HostLane(want)
    for p, s, d, _ in parts:
        ref.launch_pattern(p, *_args(src, want), s, d)
    lane = HostLane(dst)
    assert lane.launch_patterns(parts, _bases(src, dst)) == "single"
    assert lane.singles == [3, 3, 3, 3, 1] and np.array_equal(dst, want)


def test_no_native_launcher_goes_pattern_by_pattern(native):
    pats = _patterns()
    parts = _parts(pats)
    src, dst = _buffers(4)
    lane = HostLane(dst)
    lane._tasks = None
    lane.launch_patterns(parts, _bases(src, dst))
    assert lane.singles == [3, 3, 3, 3, 1] and not native
