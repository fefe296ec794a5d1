"""The fixed-cost planning of item writes (the hot path of every request's write).

:func:`kvxfer.plan.plan_items` is general vectorised numpy. Called once per part of every
write, its fixed cost dominated: a write of one page, one state slot and one metadata row
paid more in numpy call overhead (``asarray``, ``unique``, ``lexsort``, ``diff``,
broadcasts) than in its three ops, and a 1000-page write of consecutive pages (10 PUTs) paid
~100 µs for about thirty numpy calls over its ids (bench/plan_cost.py,
bench/results/plan-cpu.md). This module plans ItemWrite parts with the group's static
layout resolved once per peer (:class:`GroupPair`):

* :func:`plan_small`: short lists of Python ints, in plain Python;
* :func:`plan_ids`: id arrays, in a few numpy calls: strictly increasing ids (a request's
  pages in order) are range-checked by their end points and need no sort; consecutive ids
  on both sides are one run per descriptor without any per-id arithmetic; a plan of few
  ops is built with Python ints (no broadcasts), a large one with one broadcast per column.

Invariants (tested against :func:`kvxfer.plan.plan_items` in tests/engine)
- Same contract as ``plan_items``: ids in range on both sides (``IndexOutOfRange`` naming
  the first bad id), as many sources as destinations and unique destinations
  (``InvalidArgument``), one op per run per descriptor, descriptor-major, runs maximal and
  ordered by source id, every op inside its descriptor on both sides; the same error
  type and message for the same bad input, raised before anything is appended.
- :func:`plan_small` takes only ``list``/``tuple`` of at most :data:`SMALL_IDS` plain
  ``int``, 1-D integer numpy arrays of at most as many ids, or a single ``int``
  (:func:`small_ids`); :func:`plan_ids` anything :func:`kvxfer.plan.as_ids` takes (it
  converts with it, so both see exactly the same validation of the id values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import numpy as np

from kvxfer import plan
from kvxfer.errors import IndexOutOfRange, InvalidArgument

#: largest id list planned here; longer lists go to the vectorised planner
SMALL_IDS = 16
#: largest number of ops (runs x descriptors) produced here; above ~160 the numpy broadcast
#: (:func:`item_runs` + :func:`emit`, ~40 µs on the CPU box whatever the count) is cheaper
#: than Python ints (~0.25 µs per op): 256 ops of 16 scattered ids took 61 µs here, 39 µs
#: there (per-layer 16-page writes, the device lane's usual size)
SMALL_OPS = 160


_U64 = np.uint64
_I64 = np.int64
_I64_DTYPE = np.dtype(np.int64)
#: the five op columns of a plan: laddr, raddr, nbytes, memh, ridx (Python ints)
Columns = Tuple[List[int], List[int], List[int], List[int], List[int]]


@dataclass(frozen=True)
class GroupPair:
    """Static layout of one group on both sides, resolved once per peer: descriptor
    pointers and item sizes, registration handles and remote region indices (as tuples of
    Python ints, and as ``(D, 1)`` numpy columns for :func:`plan_ids`' broadcasts)."""

    name: str
    lptrs: Tuple[int, ...]
    rptrs: Tuple[int, ...]
    item_lens: Tuple[int, ...]
    memh: Tuple[int, ...]
    ridx: Tuple[int, ...]
    local_items: int
    remote_items: int
    # derived in __post_init__
    lptr_col: np.ndarray = field(init=False, repr=False, compare=False)
    rptr_col: np.ndarray = field(init=False, repr=False, compare=False)
    item_col: np.ndarray = field(init=False, repr=False, compare=False)
    memh_col: np.ndarray = field(init=False, repr=False, compare=False)
    ridx_col: np.ndarray = field(init=False, repr=False, compare=False)
    src_what: str = field(init=False, repr=False, compare=False)
    dst_what: str = field(init=False, repr=False, compare=False)
    descs: Tuple[Tuple[int, int, int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        col = lambda v, t: np.array(v, dtype=t).reshape(-1, 1)  # noqa: E731
        for name, v, t in (
            ("lptr_col", self.lptrs, _U64),
            ("rptr_col", self.rptrs, _U64),
            ("item_col", self.item_lens, _I64),
            ("memh_col", self.memh, _U64),
            ("ridx_col", self.ridx, _U64),
        ):
            a = col(v, t)
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        object.__setattr__(self, "src_what", f"group {self.name!r} source")
        object.__setattr__(self, "dst_what", f"group {self.name!r} destination")
        # one descriptor's ops, zipped (the inner loop of the Python planners)
        object.__setattr__(
            self, "descs", tuple(zip(self.lptrs, self.rptrs, self.item_lens, self.memh, self.ridx))
        )

    @staticmethod
    def make(local: plan.GroupLayout, remote: plan.GroupLayout, memh, ridx) -> "GroupPair":
        plan.check_compatible(local, remote)
        return GroupPair(
            local.name,
            local.ptrs,
            remote.ptrs,
            local.item_lens,
            tuple(int(x) for x in memh),
            tuple(int(x) for x in ridx),
            local.num_items,
            remote.num_items,
        )


def small_ids(values) -> Optional[List[int]]:
    """``values`` as a list of ints when it is a short list/tuple of plain ints (or one
    int); None for anything else (the numpy path validates it)."""
    t = type(values)
    if t is int:
        return [values]
    if t is np.ndarray:  # a short 1-D integer array: its ints (tolist gives plain ints)
        if values.ndim == 1 and values.size <= SMALL_IDS and values.dtype.kind in "iu":
            return values.tolist()
        return None
    if (t is list or t is tuple) and len(values) <= SMALL_IDS:
        for v in values:
            if type(v) is not int:
                return None
        return list(values)
    return None


def _check_range(ids: List[int], n: int, what: str) -> None:
    bad = [v for v in ids if v < 0 or v >= n]
    if bad:
        raise IndexOutOfRange(
            f"{what}: item id {bad[0]} out of range [0, {n}) ({len(bad)} bad id(s))"
        )


def _dup_error(g: GroupPair, dst: List[int]) -> InvalidArgument:
    seen: Set[int] = set()
    for dup in dst:  # the first id seen twice (there is one)
        if dup in seen:
            break
        seen.add(dup)
    return InvalidArgument(
        f"group {g.name!r}: destination item {dup} appears {dst.count(dup)} times"
    )


def plan_small(
    g: GroupPair, src: List[int], dst: List[int], out: Columns, max_ops: int = SMALL_OPS
) -> int:
    """Validate and append the ops of ``src -> dst`` to ``out`` (five lists: laddr, raddr,
    nbytes, memh, ridx). Returns the number of ops, or -1 (nothing appended) when the
    part would need more than ``max_ops``. Raises before appending anything."""
    k = len(src)
    if k != len(dst):
        raise InvalidArgument(f"group {g.name!r}: {k} source ids but {len(dst)} destination ids")
    if k == 1:  # one item (a state slot, an aux row, a one-page request): one run
        s0, d0 = src[0], dst[0]
        if not 0 <= s0 < g.local_items:
            _check_range(src, g.local_items, g.src_what)
        if not 0 <= d0 < g.remote_items:
            _check_range(dst, g.remote_items, g.dst_what)
        runs = [(s0, d0, 1)]
    else:
        _check_range(src, g.local_items, g.src_what)
        _check_range(dst, g.remote_items, g.dst_what)
        if len(set(dst)) != k:
            raise _dup_error(g, dst)
        if not k:
            return 0
        pairs = sorted(zip(src, dst))
        runs = []
        s0, d0 = pairs[0]
        n = 1
        for s, d in pairs[1:]:
            if s == s0 + n and d == d0 + n:
                n += 1
            else:
                runs.append((s0, d0, n))
                s0, d0, n = s, d, 1
        runs.append((s0, d0, n))
    nops = len(runs) * len(g.item_lens)
    if nops > max_ops:
        return -1
    _append(g, runs, out)
    return nops


def _append(g: GroupPair, runs: List[Tuple[int, int, int]], out: Columns) -> None:
    """Append the ops of ``runs`` (``(s0, d0, n)``, ordered) to ``out``, descriptor-major."""
    laddr, raddr, nbytes, memh, ridx = out
    if len(runs) == 1:
        s0, d0, n = runs[0]
        laddr += [lp + s0 * il for lp, _, il, _, _ in g.descs]
        raddr += [rp + d0 * il for _, rp, il, _, _ in g.descs]
        nbytes += [n * il for il in g.item_lens]
        memh += g.memh
        ridx += g.ridx
        return
    for lp, rp, il, mh, ri in g.descs:
        for s0, d0, n in runs:
            laddr.append(lp + s0 * il)
            raddr.append(rp + d0 * il)
            nbytes.append(n * il)
            memh.append(mh)
            ridx.append(ri)


def as_ids(values, what: str) -> np.ndarray:
    """:func:`kvxfer.plan.as_ids` with a shortcut for what it returns unchanged (a 1-D
    int64 numpy array)."""
    if type(values) is np.ndarray and values.dtype == _I64_DTYPE and values.ndim == 1:
        return values
    return plan.as_ids(values, what)


def check_ids(
    src: np.ndarray, dst: np.ndarray, n_src: int, n_dst: int, src_what: str, dst_what: str
) -> Tuple[bool, bool]:
    """Range-check equal-length int64 id arrays (IndexOutOfRange as
    :func:`kvxfer.plan.check_ids` words it, sources first). Returns ``(src_increasing,
    dst_increasing)`` (strictly): such ids are range-checked by their end points alone and
    strictly increasing destinations are distinct."""
    k = src.size
    if k < 2:
        if k and not (0 <= int(src[0]) < n_src):
            plan.check_ids(src, n_src, src_what)
        if k and not (0 <= int(dst[0]) < n_dst):
            plan.check_ids(dst, n_dst, dst_what)
        return True, True
    inc = []
    for ids, n, what in ((src, n_src, src_what), (dst, n_dst, dst_what)):
        up = np.count_nonzero(ids[1:] > ids[:-1]) == k - 1  # (cheaper than .all())
        lo, hi = (int(ids[0]), int(ids[-1])) if up else (int(ids.min()), int(ids.max()))
        if lo < 0 or hi >= n:
            plan.check_ids(ids, n, what)  # raises, naming the first bad id
        inc.append(up)
    return inc[0], inc[1]


def item_runs(
    g: GroupPair, src_items, dst_items
) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate an ItemWrite part of any size as :func:`kvxfer.plan.plan_items` does (same
    errors, same order of checks) and return its maximal runs ``(s0, d0, n)`` ordered by
    source id, then the validated int64 ``src`` / ``dst`` ids."""
    src = as_ids(src_items, g.src_what)
    dst = as_ids(dst_items, g.dst_what)
    k = src.size
    if k != dst.size:
        raise InvalidArgument(f"group {g.name!r}: {k} source ids but {dst.size} destination ids")
    s_up, d_up = check_ids(src, dst, g.local_items, g.remote_items, g.src_what, g.dst_what)
    if not d_up and plan.has_duplicates(dst):
        vals, counts = np.unique(dst, return_counts=True)
        raise InvalidArgument(
            f"group {g.name!r}: destination item {int(vals[counts > 1][0])} appears "
            f"{int(counts[counts > 1][0])} times"
        )
    if not k:
        return src, dst, src, src, dst
    if s_up and d_up and int(src[-1]) - int(src[0]) == k - 1 == int(dst[-1]) - int(dst[0]):
        # consecutive on both sides: one run (a request's pages in order)
        return src[:1], dst[:1], np.array([k], dtype=_I64), src, dst
    if s_up:  # ordered by source already: runs break where either side does (ids in range:
        # the differences cannot overflow)
        brk = np.flatnonzero((src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)) + 1
        starts = np.concatenate(([0], brk))
        return src[starts], dst[starts], np.diff(np.append(starts, k)), src, dst
    s0, d0, n = plan.merge_runs(src, dst)
    return s0, d0, n, src, dst


def emit(
    g: GroupPair,
    s0: np.ndarray,
    d0: np.ndarray,
    n: np.ndarray,
    small: Columns,
    small_ops: int = SMALL_OPS,
) -> Optional[Tuple[np.ndarray, ...]]:
    """The ops of runs ``(s0, d0, n)`` (from :func:`item_runs`), descriptor-major: at most
    ``small_ops`` of them are appended to ``small`` (None returned: no numpy broadcast for a
    few ops), more are returned as five uint64 columns."""
    runs = s0.size
    if runs * len(g.item_lens) <= small_ops:
        _append(g, list(zip(s0.tolist(), d0.tolist(), n.tolist())), small)
        return None
    item = g.item_col
    return (
        (g.lptr_col + (s0[None, :] * item).astype(_U64)).ravel(),
        (g.rptr_col + (d0[None, :] * item).astype(_U64)).ravel(),
        (n[None, :] * item).astype(_U64).ravel(),
        np.repeat(g.memh_col, runs),
        np.repeat(g.ridx_col, runs),
    )


# ------------------------------------------------------------------------ raw writes
#: largest RawWrite (runs) planned in Python ints; longer ones go to kvxfer.plan.plan_raw
SMALL_RAW = 64


@dataclass(frozen=True)
class RawPair:
    """Static layout of one group on both sides for RawWrites (item sizes may differ):
    descriptor pointers and lengths, registration handles and remote region indices of the
    descriptors both sides have."""

    lptrs: Tuple[int, ...]
    rptrs: Tuple[int, ...]
    llens: Tuple[int, ...]
    rlens: Tuple[int, ...]
    memh: Tuple[int, ...]
    ridx: Tuple[int, ...]

    @staticmethod
    def make(local: plan.GroupLayout, remote: plan.GroupLayout, memh, ridx) -> "RawPair":
        n = min(local.count, remote.count)
        return RawPair(
            local.ptrs[:n],
            remote.ptrs[:n],
            local.lens[:n],
            remote.lens[:n],
            tuple(int(x) for x in memh[:n]),
            tuple(int(x) for x in ridx[:n]),
        )


def _raw_ints(values) -> Optional[List[int]]:
    """A RawWrite argument as a short list of ints (a scalar as one), None otherwise."""
    t = type(values)
    if t is int:
        return [values]
    if t is np.ndarray:
        if values.ndim <= 1 and values.size <= SMALL_RAW and values.dtype.kind in "iu":
            return values.reshape(-1).tolist()
        return None
    if (t is list or t is tuple) and len(values) <= SMALL_RAW:
        for v in values:
            if type(v) is not int:
                return None
        return list(values)
    return None


def plan_raw_small(g: RawPair, desc, src_off, dst_off, nbytes, out: Columns) -> bool:
    """Append the ops of a short RawWrite (at most :data:`SMALL_RAW` runs, ints or 1-D
    integer arrays, scalars broadcast) to ``out`` in its order, after checking every run
    (a descriptor both sides have, ``nbytes > 0``, inside the descriptor on both sides).
    Returns False, appending nothing, for anything else — any input this path does not
    take or a run that fails a check — so that :func:`kvxfer.plan.plan_raw` plans it or
    raises its error: both paths accept exactly the same runs."""
    cols = []
    for v in (desc, src_off, dst_off, nbytes):
        c = _raw_ints(v)
        if c is None:
            return False
        cols.append(c)
    n = max(len(c) for c in cols)
    if not n:
        return False
    for i, c in enumerate(cols):
        if len(c) != n:
            if len(c) != 1:
                return False
            cols[i] = c * n
    ds, so, do, nb = cols
    count = len(g.lptrs)
    llens, rlens = g.llens, g.rlens
    for d, s, t, k in zip(ds, so, do, nb):
        if not (0 <= d < count and k > 0 and 0 <= s <= llens[d] - k and 0 <= t <= rlens[d] - k):
            return False
    laddr, raddr, nbs, memh, ridx = out
    lptrs, rptrs, mh, ri = g.lptrs, g.rptrs, g.memh, g.ridx
    laddr += [lptrs[d] + s for d, s in zip(ds, so)]
    raddr += [rptrs[d] + t for d, t in zip(ds, do)]
    nbs += nb
    memh += [mh[d] for d in ds]
    ridx += [ri[d] for d in ds]
    return True
