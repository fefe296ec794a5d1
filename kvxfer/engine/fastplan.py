"""Plain-Python planning for tiny item writes (the hot path of one-page writes).

:func:`kvxfer.plan.plan_items` is vectorised numpy: right for thousands of ids, but a
write of one page, one state slot and one metadata row paid more in numpy call overhead
(``asarray``, ``unique``, ``lexsort``, ``diff``, broadcasts) than in its three ops
(measure with tests/engine/bench_write_overhead.py).
This module plans such parts with Python ints and the group's static layout resolved once
per peer (:class:`GroupPair`), and hands anything else back to the numpy planner.

Invariants (tested against :func:`kvxfer.plan.plan_items` in tests/engine)
- Same contract as ``plan_items``: ids in range on both sides (``IndexOutOfRange`` naming
  the first bad id), as many sources as destinations and unique destinations
  (``InvalidArgument``), one op per run per descriptor, descriptor-major, runs maximal and
  ordered by source id, every op inside its descriptor on both sides.
- Used only when both id lists are ``list``/``tuple`` of at most :data:`SMALL_IDS` plain
  ``int``, 1-D integer numpy arrays of at most as many ids, or a single ``int``; any other
  input returns None and takes the numpy path, so both paths see exactly the same
  validation for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

import numpy as np

from kvxfer import plan
from kvxfer.errors import IndexOutOfRange, InvalidArgument

#: largest id list planned here; longer lists go to the vectorised planner
SMALL_IDS = 16
#: largest number of ops (runs x descriptors) produced here
SMALL_OPS = 256


@dataclass(frozen=True)
class GroupPair:
    """Static layout of one group on both sides, resolved once per peer: descriptor
    pointers and item sizes, registration handles and remote region indices."""

    name: str
    lptrs: Tuple[int, ...]
    rptrs: Tuple[int, ...]
    item_lens: Tuple[int, ...]
    memh: Tuple[int, ...]
    ridx: Tuple[int, ...]
    local_items: int
    remote_items: int

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


def plan_small(g: GroupPair, src: List[int], dst: List[int], out, max_ops: int = SMALL_OPS) -> int:
    """Validate and append the ops of ``src -> dst`` to ``out`` (five lists: laddr, raddr,
    nbytes, memh, ridx). Returns the number of ops, or -1 (nothing appended) when the
    part would need more than ``max_ops``. Raises before appending anything."""
    what = f"group {g.name!r}"
    if len(src) != len(dst):
        raise InvalidArgument(f"{what}: {len(src)} source ids but {len(dst)} destination ids")
    _check_range(src, g.local_items, f"{what} source")
    _check_range(dst, g.remote_items, f"{what} destination")
    if len(set(dst)) != len(dst):
        seen: Set[int] = set()
        for dup in dst:  # the first id seen twice (there is one)
            if dup in seen:
                break
            seen.add(dup)
        raise InvalidArgument(f"{what}: destination item {dup} appears {dst.count(dup)} times")
    if not src:
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
    laddr, raddr, nbytes, memh, ridx = out
    for lp, rp, il, mh, ri in zip(g.lptrs, g.rptrs, g.item_lens, g.memh, g.ridx):
        for s0, d0, n in runs:
            laddr.append(lp + s0 * il)
            raddr.append(rp + d0 * il)
            nbytes.append(n * il)
            memh.append(mh)
            ridx.append(ri)
    return nops
