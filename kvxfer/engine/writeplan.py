"""Planning the writes to one peer: validate every part against both sides' layouts, then
split it into direct PUTs (the native batch's columns) and staged parts. No I/O and no
state but a per-group layout cache: a :class:`~kvxfer.engine.peer.Peer` owns one
:class:`WritePlanner` and posts what it returns.

A write made only of ItemWrites (of at most :data:`NATIVE_MAX_IDS` ids a part) is planned
in one native call (``_rma.plan_items``, when the extension has it), which returns None for
anything else and for bad input; then ItemWrite parts and short RawWrites are planned by
:mod:`kvxfer.engine.fastplan` (same validation as :func:`kvxfer.plan.plan_items` /
:func:`kvxfer.plan.plan_raw`, a fixed cost of a few µs); long RawWrites and expanded
PatternWrites by :mod:`kvxfer.plan`. Costs: bench/plan_cost.py, bench/results/plan-cpu.md.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np

from kvxfer import plan
from kvxfer.engine import fastplan, slices
from kvxfer.engine.groups import LocalGroups, RemoteGroups
from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite, SliceWrite
from kvxfer.errors import InvalidArgument, UnknownGroup, UnsupportedOperation
from kvxfer.plan import GroupLayout

_U64 = np.uint64
#: most ids in one ItemWrite part that the native planner takes (a larger part: numpy)
NATIVE_MAX_IDS = 1 << 22

Write = Union[ItemWrite, RawWrite, SliceWrite, PatternWrite]
Writes = Union[Write, Iterable[Write]]
#: a staged part: (group, source ids, destination ids, PUTs it would need unstaged)
StagedPart = Tuple[str, np.ndarray, np.ndarray, int]
#: a validated SliceWrite: (group, source ids, destination ids, source runs, key)
SlicePart = Tuple[str, np.ndarray, np.ndarray, slices.SliceRuns, int]
#: a validated PatternWrite for a lane (device or host): (group, source ids, destination ids, runs)
PatternPart = Tuple[str, np.ndarray, np.ndarray, slices.PatternRuns]
#: ``(laddr, raddr, nbytes, lmemh, ridx, staged parts, slice parts, pattern parts, host
#: pattern parts, bytes)``: uint64 columns of the direct PUTs, then the staged parts, then
#: the device lane's patterns, then the host lane's, then the direct PUTs' total bytes
Planned = Tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    List[StagedPart],
    List[SlicePart],
    List[PatternPart],
    List[PatternPart],
    int,
]


class WritePlanner:
    """Plans writes from ``local`` groups to one peer's ``remote`` groups. ``can_stage(group)``:
    whether the peer granted us landing slots for ``group`` (the staged path);
    ``can_pattern(group)``: whether the device lane copies PatternWrites of ``group``;
    ``host_pattern(group)``: whether the host lane does (from the pattern: no expansion);
    ``native``: the extension's ``plan_items`` (``kvxfer.transport._rma``), which plans a
    write of ItemWrites in one call and hands anything else back (None: the Python
    planners only; both give the same plan, tests/engine/test_native_plan.py)."""

    def __init__(
        self,
        local: LocalGroups,
        remote: RemoteGroups,
        peer_name: str,
        can_stage: Callable[[str], bool],
        can_pattern: Callable[[str], bool] = lambda group: False,
        host_pattern: Callable[[str], bool] = lambda group: False,
        native: Optional[Callable[..., Any]] = None,
    ):
        self._local, self._remote = local, remote
        self._peer_name = peer_name
        self._can_stage = can_stage
        self._can_pattern = can_pattern
        self._host_pattern = host_pattern
        self._pairs: Dict[str, fastplan.GroupPair] = {}  # static layout per group, resolved once
        self._raw: Dict[str, fastplan.RawPair] = {}  # the same for RawWrites
        #: group -> (descs, local items, remote items) of its pair: what ``native`` reads
        self._native_pairs: Dict[str, Tuple[Any, int, int]] = {}
        #: ``native`` bound to all but the write (``plan_items(..., writes)``)
        self._native = (
            None
            if native is None
            else functools.partial(
                native,
                ItemWrite,
                np.ndarray,
                self._native_pairs,
                NATIVE_MAX_IDS,
                fastplan.SMALL_OPS,
            )
        )

    def plan(self, writes: Writes, stage_min_ops: int = 0, patterns: bool = True) -> Planned:
        """Validate every part, then split: ``(laddr, raddr, nbytes, lmemh, ridx, staged)``
        for the direct PUTs and ``staged = [(group, src ids, dst ids)]`` for the ItemWrite
        parts that need more than ``stage_min_ops`` PUTs (0: none) and can be staged; then
        the SliceWrite parts, then the PatternWrite parts the device lane copies (with
        ``patterns`` and ``can_pattern``), then those the host lane copies (``patterns`` and
        ``host_pattern``; the others are expanded into direct PUTs), then the direct PUTs'
        total bytes. A list of ItemWrites only (``stage_min_ops`` 0) is planned natively
        when ``native`` takes it (the same columns in the same order: the parts of at most
        ``fastplan.SMALL_OPS`` ops first); otherwise ItemWrite parts are planned by
        :mod:`kvxfer.engine.fastplan` (same validation as :func:`kvxfer.plan.plan_items`;
        plans of a few ops in Python ints, collected into one array per column at the end);
        the rest by :mod:`kvxfer.plan`."""
        native = self._native
        if native is not None and not stage_min_ops:  # (a staged part: Python decides)
            got = native(writes)
            if got is not None:  # a list of ItemWrites of valid ids: one call
                laddr, raddr, nbytes, lmemh, ridx = np.frombuffer(got[0], _U64).reshape(5, -1)
                return laddr, raddr, nbytes, lmemh, ridx, [], [], [], [], got[1]
        if isinstance(writes, (ItemWrite, RawWrite, SliceWrite, PatternWrite)):
            writes = [writes]
        # laddr, raddr, nbytes, memh, ridx of the parts planned in Python ints
        small: fastplan.Columns = ([], [], [], [], [])
        blocks: List[Tuple[np.ndarray, ...]] = []  # the parts planned as uint64 columns
        staged: List[StagedPart] = []
        sliced: List[SlicePart] = []
        patterned: List[PatternPart] = []
        hosted: List[PatternPart] = []
        for w in writes:
            if isinstance(w, ItemWrite):  # the hot path: no other lookups once the pair is known
                pair = self._pairs.get(w.group)
                if pair is None:
                    pair = self._pair(w)
                stage = stage_min_ops > 0 and self._can_stage(w.group)
                src = fastplan.small_ids(w.src_items)
                dst = None if src is None else fastplan.small_ids(w.dst_items)
                if src is not None and dst is not None:
                    limit = min(fastplan.SMALL_OPS, stage_min_ops) if stage else fastplan.SMALL_OPS
                    if fastplan.plan_small(pair, src, dst, small, limit) >= 0:
                        continue
                s0, d0, n, si, di = fastplan.item_runs(pair, w.src_items, w.dst_items)
                n_ops = s0.size * len(pair.item_lens)
                if stage and n_ops > stage_min_ops:
                    staged.append((w.group, si, di, n_ops))
                    continue
                block = fastplan.emit(pair, s0, d0, n, small)
                if block is not None:
                    blocks.append(block)
                continue
            if not isinstance(w, (ItemWrite, RawWrite, SliceWrite, PatternWrite)):
                raise InvalidArgument(
                    "expected ItemWrite, RawWrite, SliceWrite or PatternWrite, got "
                    f"{type(w).__name__}"
                )
            lg, rg = self._layouts(w.group)
            if isinstance(w, SliceWrite):
                sliced.append(self._slice_part(w, lg, rg))
                continue
            if isinstance(w, PatternWrite):
                part = self._pattern_part(w, lg, rg)
                if patterns and self._can_pattern(w.group):
                    patterned.append(part)
                elif patterns and self._host_pattern(w.group):
                    hosted.append(part)
                else:
                    blocks.append(self._expanded(part, lg, rg))
                continue
            raw = self._raw.get(w.group)
            if raw is None:
                raw = self._raw[w.group] = fastplan.RawPair.make(
                    lg, rg, self._local.desc_memh[w.group], self._remote.desc_region[w.group]
                )
            if fastplan.plan_raw_small(raw, w.desc, w.src_off, w.dst_off, w.nbytes, small):
                continue
            ops = plan.plan_raw(lg, rg, w.desc, w.src_off, w.dst_off, w.nbytes)
            blocks.append(self._columns(w.group, ops))
        total = sum(small[2])
        if not blocks:  # one array for the five columns: each row is a contiguous column
            cols = np.array(small, dtype=_U64)
            laddr, raddr, nbytes, lmemh, ridx = cols
        else:
            if small[0]:
                blocks.insert(0, tuple(np.array(small, dtype=_U64)))
            total += sum(int(b[2].sum(dtype=_U64)) for b in blocks[1 if small[0] else 0 :])
            if len(blocks) == 1:
                laddr, raddr, nbytes, lmemh, ridx = (
                    np.ascontiguousarray(c, dtype=_U64) for c in blocks[0]
                )
            else:
                laddr, raddr, nbytes, lmemh, ridx = (
                    np.concatenate([b[i] for b in blocks]).astype(_U64, copy=False)
                    for i in range(5)
                )
        return laddr, raddr, nbytes, lmemh, ridx, staged, sliced, patterned, hosted, total

    def _expanded(self, part: PatternPart, lg: GroupLayout, rg: GroupLayout) -> tuple:
        """One pattern part's runs as direct PUTs: the five columns of :meth:`plan`. A
        uniform pattern (every descriptor the same runs: head slices of every layer's K and
        V) is expanded once and offset by each descriptor's base, its ids and runs being
        already checked (:meth:`_pattern_part`) and its extent checked here against every
        descriptor; any other through :func:`kvxfer.plan.plan_raw`, run by run."""
        group, src, dst, runs = part
        if runs.uniform and src.size:
            s, t, nb = runs.expand_one(src, dst)
            if (
                s.size
                and int((s + nb).max()) <= min(lg.lens)
                and int((t + nb).max()) <= min(rg.lens)
            ):
                k = s.size
                lptr = np.asarray(lg.ptrs, dtype=_U64)[:, None]
                rptr = np.asarray(rg.ptrs, dtype=_U64)[:, None]
                return (
                    (lptr + s.astype(_U64)[None, :]).reshape(-1),
                    (rptr + t.astype(_U64)[None, :]).reshape(-1),
                    np.tile(nb.astype(_U64), lg.count),
                    np.repeat(self._local.desc_memh[group].astype(_U64, copy=False), k),
                    np.repeat(self._remote.desc_region[group].astype(_U64, copy=False), k),
                )
        return self._columns(group, plan.plan_raw(lg, rg, *runs.expand(src, dst)))

    def _columns(self, group: str, ops) -> tuple:
        """The five columns of :meth:`plan` of ``group``'s planned ops."""
        d = ops.desc.astype(np.intp)
        return (
            ops.laddr,
            ops.raddr,
            ops.nbytes,
            self._local.desc_memh[group][d],
            self._remote.desc_region[group][d],
        )

    def _layouts(self, group: str) -> Tuple[GroupLayout, GroupLayout]:
        """Both sides' layouts of ``group`` (UnknownGroup naming the side that lacks it)."""
        lg = self._local.groups.get(group)
        if lg is None:
            raise UnknownGroup(f"no local group {group!r} (have {sorted(self._local.groups)})")
        rg = self._remote.groups.get(group)
        if rg is None:
            raise UnknownGroup(
                f"peer {self._peer_name} has no group {group!r} (has {sorted(self._remote.groups)})"
            )
        return lg, rg

    def _pair(self, w: ItemWrite) -> fastplan.GroupPair:
        """The static layout of an ItemWrite's group, resolved once (checks the item sizes;
        a RawWrite needs no pair)."""
        lg, rg = self._layouts(w.group)
        pair = self._pairs[w.group] = fastplan.GroupPair.make(
            lg, rg, self._local.desc_memh[w.group], self._remote.desc_region[w.group]
        )
        self._native_pairs[w.group] = (pair.descs, pair.local_items, pair.remote_items)
        return pair

    def _pattern_part(self, w: PatternWrite, lg: GroupLayout, rg: GroupLayout) -> PatternPart:
        """Validate a PatternWrite: ids in range on both sides, destinations distinct, every
        run inside one item of its descriptor on both sides (a PatternRuns made for other
        item sizes is refused)."""
        src, dst = _item_pairs(w.src_items, w.dst_items, lg, rg, "pattern write")
        if lg.count != rg.count:
            raise InvalidArgument(
                f"pattern write of {w.group!r}: {lg.count} local vs {rg.count} peer descriptors"
            )
        runs = w.runs
        if not isinstance(runs, slices.PatternRuns):
            runs = slices.PatternRuns.make(runs, lg.item_lens, rg.item_lens)
        elif (runs.src_item_lens, runs.dst_item_lens) != (lg.item_lens, rg.item_lens):
            raise InvalidArgument(f"pattern of {w.group!r} made for other item sizes")
        return (w.group, src, dst, runs)

    def _slice_part(self, w: SliceWrite, lg: GroupLayout, rg: GroupLayout) -> SlicePart:
        """Validate a SliceWrite (ids in range on both sides, our runs inside our items)."""
        if not self._can_stage(w.group):
            raise UnsupportedOperation(
                f"peer {self._peer_name} granted no landing slots of {w.group!r}: slice "
                f"writes need stage_slice_min_ops > 0 on both engines"
            )
        src, dst = _item_pairs(w.src_items, w.dst_items, lg, rg, "slice write")
        runs = w.runs
        if not isinstance(runs, slices.SliceRuns):
            runs = slices.SliceRuns.make(runs, lg.item_lens)
        elif runs.descriptors != len(lg.item_lens):
            raise InvalidArgument(f"slice plan of {runs.descriptors} descriptors for {w.group!r}")
        if isinstance(w.key, bool) or not isinstance(w.key, (int, np.integer)) or w.key < 0:
            raise InvalidArgument(f"slice write key must be an int >= 0, got {w.key!r}")
        return (w.group, src, dst, runs, int(w.key))


def _item_pairs(
    src_items, dst_items, lg: GroupLayout, rg: GroupLayout, what: str
) -> Tuple[np.ndarray, np.ndarray]:
    """Source / destination ids of a slice or pattern write: equal counts, each in range of
    its side, destinations distinct (InvalidArgument / IndexOutOfRange)."""
    src = fastplan.as_ids(src_items, "source")
    dst = fastplan.as_ids(dst_items, "destination")
    if src.size != dst.size:
        raise InvalidArgument(f"{src.size} source items but {dst.size} destination items")
    _, increasing = fastplan.check_ids(
        src, dst, lg.num_items, rg.num_items, "source", "destination"
    )
    if not increasing and plan.has_duplicates(dst):
        raise InvalidArgument(f"{what}: duplicate destination items")
    return src, dst
