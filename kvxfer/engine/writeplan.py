"""Planning the writes to one peer: validate every part against both sides' layouts, then
split it into direct PUTs (the native batch's columns) and staged parts. No I/O and no
state but a per-group layout cache: a :class:`~kvxfer.engine.peer.Peer` owns one
:class:`WritePlanner` and posts what it returns.

Tiny ItemWrite parts (short lists of ints) are planned in plain Python
(:mod:`kvxfer.engine.fastplan`, same validation); the rest by :mod:`kvxfer.plan`.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple, Union

import numpy as np

from kvxfer import plan
from kvxfer.engine import fastplan, slices
from kvxfer.engine.groups import LocalGroups, RemoteGroups
from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite, SliceWrite
from kvxfer.errors import InvalidArgument, UnknownGroup, UnsupportedOperation
from kvxfer.plan import GroupLayout

_U64 = np.uint64

Write = Union[ItemWrite, RawWrite, SliceWrite, PatternWrite]
Writes = Union[Write, Iterable[Write]]
#: a staged part: (group, source ids, destination ids, PUTs it would need unstaged)
StagedPart = Tuple[str, np.ndarray, np.ndarray, int]
#: a validated SliceWrite: (group, source ids, destination ids, source runs, key)
SlicePart = Tuple[str, np.ndarray, np.ndarray, slices.SliceRuns, int]
#: a validated PatternWrite for the device lane: (group, source ids, destination ids, runs)
PatternPart = Tuple[str, np.ndarray, np.ndarray, slices.PatternRuns]
#: ``(laddr, raddr, nbytes, lmemh, ridx, staged parts, slice parts, pattern parts)``: uint64
#: columns of the direct PUTs, then the staged parts, then the device-lane patterns
Planned = Tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    List[StagedPart],
    List[SlicePart],
    List[PatternPart],
]


class WritePlanner:
    """Plans writes from ``local`` groups to one peer's ``remote`` groups. ``can_stage(group)``:
    whether the peer granted us landing slots for ``group`` (the staged path);
    ``can_pattern(group)``: whether the device lane copies PatternWrites of ``group``."""

    def __init__(
        self,
        local: LocalGroups,
        remote: RemoteGroups,
        peer_name: str,
        can_stage: Callable[[str], bool],
        can_pattern: Callable[[str], bool] = lambda group: False,
    ):
        self._local, self._remote = local, remote
        self._peer_name = peer_name
        self._can_stage = can_stage
        self._can_pattern = can_pattern
        self._pairs: Dict[str, fastplan.GroupPair] = {}  # static layout per group, resolved once

    def plan(self, writes: Writes, stage_min_ops: int = 0, patterns: bool = True) -> Planned:
        """Validate every part, then split: ``(laddr, raddr, nbytes, lmemh, ridx, staged)``
        for the direct PUTs and ``staged = [(group, src ids, dst ids)]`` for the ItemWrite
        parts that need more than ``stage_min_ops`` PUTs (0: none) and can be staged; then
        the SliceWrite parts, then the PatternWrite parts the device lane copies (with
        ``patterns`` and ``can_pattern``; the others are expanded into direct PUTs).
        Tiny ItemWrite parts (short lists of ints) are planned in plain Python
        (:mod:`kvxfer.engine.fastplan`, same validation); the rest by :mod:`kvxfer.plan`."""
        local, remote = self._local, self._remote
        if isinstance(writes, (ItemWrite, RawWrite)):
            writes = [writes]
        # laddr, raddr, nbytes, memh, ridx of the tiny parts
        small: Tuple[List[int], ...] = ([], [], [], [], [])
        chunks: List[Tuple[np.ndarray, ...]] = []
        staged: List[StagedPart] = []
        sliced: List[SlicePart] = []
        patterned: List[PatternPart] = []
        if isinstance(writes, (SliceWrite, PatternWrite)):
            writes = [writes]
        for w in writes:
            if not isinstance(w, (ItemWrite, RawWrite, SliceWrite, PatternWrite)):
                raise InvalidArgument(
                    "expected ItemWrite, RawWrite, SliceWrite or PatternWrite, got "
                    f"{type(w).__name__}"
                )
            lg = local.groups.get(w.group)
            if lg is None:
                raise UnknownGroup(f"no local group {w.group!r} (have {sorted(local.groups)})")
            rg = remote.groups.get(w.group)
            if rg is None:
                raise UnknownGroup(
                    f"peer {self._peer_name} has no group {w.group!r} (has {sorted(remote.groups)})"
                )
            if isinstance(w, SliceWrite):
                sliced.append(self._slice_part(w, lg, rg))
                continue
            if isinstance(w, PatternWrite):
                part = self._pattern_part(w, lg, rg)
                if patterns and self._can_pattern(w.group):
                    patterned.append(part)
                    continue
                d, so, do, nb = part[3].expand(part[1], part[2])
                ops = plan.plan_raw(lg, rg, d, so, do, nb)
            elif isinstance(w, ItemWrite):
                pair = self._pairs.get(w.group)
                if pair is None:  # checks the item sizes (RawWrite needs no pair)
                    pair = self._pairs[w.group] = fastplan.GroupPair.make(
                        lg, rg, local.desc_memh[w.group], remote.desc_region[w.group]
                    )
                src = fastplan.small_ids(w.src_items)
                dst = None if src is None else fastplan.small_ids(w.dst_items)
                if src is not None and dst is not None:
                    limit = fastplan.SMALL_OPS
                    if stage_min_ops > 0 and self._can_stage(w.group):
                        limit = min(limit, stage_min_ops)
                    if fastplan.plan_small(pair, src, dst, small, limit) >= 0:
                        continue
                ops = plan.plan_items(lg, rg, w.src_items, w.dst_items)
                if 0 < stage_min_ops < len(ops) and self._can_stage(w.group):
                    staged.append(
                        (
                            w.group,
                            plan.as_ids(w.src_items, "source"),
                            plan.as_ids(w.dst_items, "destination"),
                            len(ops),
                        )
                    )
                    continue
            else:
                ops = plan.plan_raw(lg, rg, w.desc, w.src_off, w.dst_off, w.nbytes)
            d = ops.desc.astype(np.intp)
            chunks.append(
                (
                    ops.laddr,
                    ops.raddr,
                    ops.nbytes,
                    local.desc_memh[w.group][d],
                    remote.desc_region[w.group][d],
                )
            )
        if small[0] or not chunks:
            chunks.insert(0, tuple(np.array(c, dtype=_U64) for c in small))
        if len(chunks) == 1:
            laddr, raddr, nbytes, lmemh, ridx = (np.asarray(c, dtype=_U64) for c in chunks[0])
        else:
            laddr, raddr, nbytes, lmemh, ridx = (
                np.concatenate([c[i] for c in chunks]).astype(_U64, copy=False) for i in range(5)
            )
        return laddr, raddr, nbytes, lmemh, ridx, staged, sliced, patterned

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
    src = plan.as_ids(src_items, "source")
    dst = plan.as_ids(dst_items, "destination")
    if src.size != dst.size:
        raise InvalidArgument(f"{src.size} source items but {dst.size} destination items")
    plan.check_ids(src, lg.num_items, "source")
    plan.check_ids(dst, rg.num_items, "destination")
    if plan.has_duplicates(dst):
        raise InvalidArgument(f"{what}: duplicate destination items")
    return src, dst
