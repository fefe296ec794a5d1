"""Strided slices of items (the byte plan of a :class:`~kvxfer.engine.types.SliceWrite`):
pure run arithmetic and the host-memory gather / scatter. Torch-free (numpy only).

A *slice plan* of a group is, per descriptor ``d``, a list of runs ``(offs[d][r],
lens[d][r])`` relative to one item of that descriptor (e.g. the byte rows of a head range in
every token row of an NHD page). A SliceWrite of ``n`` items moves the runs of each of them;
unstaged it would cost ``n x ops_per_item`` PUTs (fewer where runs touch), staged it is
gathered into one packed stream and PUT in one op per landing-slot chunk.

Packing (both sides compute it; nothing but the item ids and the byte count is on the
wire): a chunk of ``k`` items is descriptor-major, then item, then run::

    [d0: item0 runs, item1 runs, ...][d1: item0 runs, ...] ...

so it is ``k x per_item`` bytes, where ``per_item`` is the sum of every run length. The
initiator packs with *its* runs, the target unpacks with the runs *it* derived itself: the
two plans pair run ``r`` of descriptor ``d`` with run ``r`` of descriptor ``d`` (same lengths,
the pairing both sides compute from their shapes), and a peer only ever names items.

Invariants (tests/unit/test_tp_slices.py checks them exhaustively)
- A :class:`SliceRuns` is validated once: every run non-empty and inside its descriptor's
  item; ``exclusive`` plans (every target's) have no two runs overlapping in an item, so
  a scatter writes no byte twice.
- :func:`chunks` cuts ``n`` items into consecutive ranges of at most ``cap`` bytes each,
  covering ``[0, n)`` exactly once; an item whose runs exceed ``cap`` is an
  InvalidArgument (nothing is cut).
- ``gather`` then ``scatter`` with paired plans moves exactly the bytes the direct runs
  (:func:`direct_runs`) would; no byte outside the plan's runs of the named items is read or
  written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from kvxfer.errors import InvalidArgument

_I64 = np.int64


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class SliceRuns:
    """Per descriptor, item-relative runs: ``offs[d]`` / ``lens[d]`` (read-only int64)."""

    offs: Tuple[np.ndarray, ...]
    lens: Tuple[np.ndarray, ...]

    @classmethod
    def make(
        cls, runs: Sequence[Tuple[Any, Any]], item_lens: Sequence[int], exclusive: bool = False
    ) -> "SliceRuns":
        """Validated plan from ``runs[d] = (offs, lens)`` of a group whose descriptor ``d``
        has items of ``item_lens[d]`` bytes. ``exclusive``: no two runs of a descriptor
        overlap (a target's plan). InvalidArgument names the first problem."""
        if len(runs) != len(item_lens):
            raise InvalidArgument(
                f"slice plan has {len(runs)} descriptors, the group {len(item_lens)}"
            )
        offs, lens = [], []
        for d, ((o, n), il) in enumerate(zip(runs, item_lens)):
            o = np.array(o, dtype=_I64).reshape(-1)
            n = np.array(n, dtype=_I64).reshape(-1)
            if o.size != n.size:
                raise InvalidArgument(f"descriptor {d}: {o.size} run offsets, {n.size} lengths")
            if n.size and (int(n.min()) <= 0 or int(o.min()) < 0 or int((o + n).max()) > il):
                raise InvalidArgument(
                    f"descriptor {d}: a run is empty or leaves the {il}-byte item"
                )
            if exclusive and n.size > 1:
                order = np.argsort(o, kind="stable")
                if bool(((o[order] + n[order])[:-1] > o[order][1:]).any()):
                    raise InvalidArgument(f"descriptor {d}: runs overlap")
            offs.append(_ro(o))
            lens.append(_ro(n))
        if not any(n.size for n in lens):
            raise InvalidArgument("slice plan moves no byte")
        return cls(tuple(offs), tuple(lens))

    @property
    def descriptors(self) -> int:
        return len(self.lens)

    @property
    def desc_bytes(self) -> Tuple[int, ...]:
        """Bytes one item contributes per descriptor."""
        return tuple(int(n.sum()) for n in self.lens)

    @property
    def per_item(self) -> int:
        """Packed bytes of one item (over every descriptor)."""
        return sum(self.desc_bytes)

    @property
    def ops_per_item(self) -> int:
        """Runs of one item over every descriptor (PUTs per item unstaged, before merging)."""
        return sum(int(n.size) for n in self.lens)

    def matches(self, other: "SliceRuns") -> bool:
        """Whether ``other`` packs the same stream layout (same run lengths, in order)."""
        return self.descriptors == other.descriptors and all(
            np.array_equal(a, b) for a, b in zip(self.lens, other.lens)
        )


def chunks(n: int, per_item: int, cap: int) -> List[Tuple[int, int]]:
    """Consecutive item ranges ``[i, j)`` covering ``[0, n)``, each at most ``cap`` packed
    bytes (as many items as fit). InvalidArgument when one item does not fit."""
    if per_item <= 0 or cap <= 0:
        raise InvalidArgument(f"chunks: per_item {per_item} / cap {cap} must be > 0")
    if per_item > cap:
        raise InvalidArgument(f"one item's slices ({per_item} B) exceed a {cap}-byte staging slot")
    k = cap // per_item
    return [(i, min(i + k, n)) for i in range(0, n, k)]


def direct_runs(
    runs: SliceRuns, item_lens: Sequence[int], items: np.ndarray, d: int
) -> Tuple[np.ndarray, np.ndarray]:
    """``(offs, lens)`` from descriptor ``d``'s base of the runs of ``items`` (item-major):
    what the unstaged path would PUT (and the packing order of that descriptor)."""
    items = np.asarray(items, dtype=_I64).reshape(-1)
    o, n = runs.offs[d], runs.lens[d]
    offs = (items[:, None] * int(item_lens[d]) + o[None, :]).reshape(-1)
    return offs, np.tile(n, items.size)


def direct_ops(runs: SliceRuns, item_lens: Sequence[int], items: np.ndarray) -> int:
    """PUTs the unstaged path needs for ``items`` (runs touching in the source and in the
    packed order are merged, as a RawWrite of consecutive pages would be)."""
    total = 0
    for d in range(runs.descriptors):
        if not runs.lens[d].size:
            continue
        offs, lens = direct_runs(runs, item_lens, items, d)
        total += 1 + int((offs[1:] != offs[:-1] + lens[:-1]).sum())
    return total


def regular(offs: np.ndarray, lens: np.ndarray) -> Optional[Tuple[int, int, int, int]]:
    """``(first, step, count, size)`` when one item's runs are ``count`` equal runs of
    ``size`` bytes at a constant ``step >= size`` (head slices of NHD / HND / page-major
    pages are), else None."""
    if not lens.size or bool((lens != lens[0]).any()):
        return None
    size = int(lens[0])
    step = int(offs[1] - offs[0]) if offs.size > 1 else size
    if step < size or (offs.size > 1 and bool((np.diff(offs) != step).any())):
        return None
    return int(offs[0]), step, int(offs.size), size


def _strided(buf: np.ndarray, item_bytes: int, shape: Tuple[int, int, int, int]) -> np.ndarray:
    """``[items, count, size]`` view of the runs of every whole item of ``buf``."""
    first, step, count, size = shape
    items = (buf.size - first - (count - 1) * step - size) // item_bytes + 1
    return np.lib.stride_tricks.as_strided(
        buf[first:], shape=(items, count, size), strides=(item_bytes, step, 1)
    )


def _windows(buf: np.ndarray, n: int) -> np.ndarray:
    """Rows ``i -> buf[i:i+n]`` (no copy): fancy-indexing them moves whole runs."""
    return np.lib.stride_tricks.as_strided(buf, shape=(buf.size - n + 1, n), strides=(1, 1))


def gather_host(
    buf: np.ndarray,
    item_bytes: int,
    items: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    out: np.ndarray,
) -> int:
    """Pack the runs ``(offs, lens)`` of every item ``items[k]`` of descriptor bytes ``buf``
    (uint8) into ``out`` item-major; returns the bytes packed. One strided copy when the runs
    are regular, else one fancy-indexed copy per distinct run size. Ids must be valid.
    (Not ``np.take``: it makes its non-contiguous source contiguous first, a copy of every
    item's runs per call: 14x slower for a 256-item chunk of a 4000-item descriptor.)"""
    items = np.asarray(items, dtype=_I64)
    total = int(lens.sum()) * items.size
    shape = regular(offs, lens)
    if shape is not None:
        v = _strided(buf, item_bytes, shape)
        out[:total].reshape(items.size, *v.shape[1:])[...] = v[items]
        return total
    o = (items[:, None] * item_bytes + offs[None, :]).reshape(-1)
    n = np.tile(lens, items.size)
    pos = np.concatenate(([0], np.cumsum(n)[:-1])).astype(_I64)
    for size in np.unique(n):
        k = n == size
        _windows(out, int(size))[pos[k]] = _windows(buf, int(size))[o[k]]
    return total


def scatter_host(
    buf: np.ndarray,
    item_bytes: int,
    items: np.ndarray,
    offs: np.ndarray,
    lens: np.ndarray,
    src: np.ndarray,
) -> None:
    """Inverse of :func:`gather_host`: unpack ``src`` into the runs of ``items`` of ``buf``."""
    items = np.asarray(items, dtype=_I64)
    total = int(lens.sum()) * items.size
    shape = regular(offs, lens)
    if shape is not None:
        v = _strided(buf, item_bytes, shape)
        v[items] = src[:total].reshape(items.size, *v.shape[1:])
        return
    o = (items[:, None] * item_bytes + offs[None, :]).reshape(-1)
    n = np.tile(lens, items.size)
    pos = np.concatenate(([0], np.cumsum(n)[:-1])).astype(_I64)
    for size in np.unique(n):
        k = n == size
        _windows(buf, int(size))[o[k]] = _windows(src, int(size))[pos[k]]


# ---------------------------------------------------------------- patterns (both sides' runs)
@dataclass(frozen=True, eq=False)
class PatternRuns:
    """The byte plan of a :class:`~kvxfer.engine.types.PatternWrite`: per descriptor ``d``,
    paired item-relative runs ``src[d][r] -> dst[d][r]`` of ``lens[d][r]`` bytes, validated
    once against both sides' item sizes (``src_item_lens`` / ``dst_item_lens``, kept so that
    a plan made for one pair of layouts is refused by another).

    Invariants: every run is non-empty and inside its descriptor's item on both sides; no two
    destination runs of a descriptor overlap (so distinct destination items receive disjoint
    bytes and a copy may run in any order)."""

    src: Tuple[np.ndarray, ...]
    dst: Tuple[np.ndarray, ...]
    lens: Tuple[np.ndarray, ...]
    src_item_lens: Tuple[int, ...]
    dst_item_lens: Tuple[int, ...]

    @classmethod
    def make(
        cls,
        runs: Sequence[Tuple[Any, Any, Any]],
        src_item_lens: Sequence[int],
        dst_item_lens: Sequence[int],
    ) -> "PatternRuns":
        """Validated plan from ``runs[d] = (src offs, dst offs, lens)``; InvalidArgument
        names the first problem."""
        sil, dil = tuple(int(x) for x in src_item_lens), tuple(int(x) for x in dst_item_lens)
        if not len(runs) == len(sil) == len(dil):
            raise InvalidArgument(
                f"pattern has {len(runs)} descriptors, the groups {len(sil)} / {len(dil)}"
            )
        cols: Tuple[List[np.ndarray], ...] = ([], [], [])
        for d, run in enumerate(runs):
            try:
                so, do, n = (np.array(a, dtype=_I64).reshape(-1) for a in run)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"descriptor {d}: malformed pattern runs ({exc})") from None
            if not so.size == do.size == n.size:
                raise InvalidArgument(f"descriptor {d}: run columns differ in length")
            if n.size:
                if int(n.min()) <= 0 or int(so.min()) < 0 or int(do.min()) < 0:
                    raise InvalidArgument(f"descriptor {d}: an empty run or a negative offset")
                if int((so + n).max()) > sil[d] or int((do + n).max()) > dil[d]:
                    raise InvalidArgument(
                        f"descriptor {d}: a run leaves the item ({sil[d]} / {dil[d]} bytes)"
                    )
                order = np.argsort(do, kind="stable")
                if bool(((do[order] + n[order])[:-1] > do[order][1:]).any()):
                    raise InvalidArgument(f"descriptor {d}: destination runs overlap")
            for col, a in zip(cols, (so, do, n)):
                col.append(_ro(a))
        if not any(n.size for n in cols[2]):
            raise InvalidArgument("pattern moves no byte")
        return cls(tuple(cols[0]), tuple(cols[1]), tuple(cols[2]), sil, dil)

    @property
    def runs_per_item(self) -> int:
        return sum(int(n.size) for n in self.lens)

    @property
    def bytes_per_item(self) -> int:
        return sum(int(n.sum()) for n in self.lens)

    def expand(
        self, src_items: np.ndarray, dst_items: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(desc, src offs, dst offs, lens)`` from each descriptor's base of every run of
        every item pair, descriptor-major then item then run, runs that continue the previous
        one on both sides merged (what the unpatterned path PUTs)."""
        si = np.asarray(src_items, dtype=_I64).reshape(-1)
        di = np.asarray(dst_items, dtype=_I64).reshape(-1)
        parts = []
        for d, (so, do, n) in enumerate(zip(self.src, self.dst, self.lens)):
            if not n.size or not si.size:
                continue
            s, t, nb = _merged(si, di, so, do, n, self.src_item_lens[d], self.dst_item_lens[d])
            parts.append((np.full(s.size, d, dtype=_I64), s, t, nb))
        if not parts:
            z = np.zeros(0, dtype=_I64)
            return z, z, z, z
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(4))  # type: ignore[return-value]

    @functools.cached_property
    def uniform(self) -> bool:
        """Every descriptor has the same runs and item sizes (every layer's K and V of a
        head slice do): :meth:`expand_one` then holds for all of them."""
        return (
            len(set(self.src_item_lens)) == 1
            and len(set(self.dst_item_lens)) == 1
            and all(
                np.array_equal(a, self.src[0])
                and np.array_equal(b, self.dst[0])
                and np.array_equal(n, self.lens[0])
                for a, b, n in zip(self.src, self.dst, self.lens)
            )
        )

    def expand_one(
        self, src_items: np.ndarray, dst_items: np.ndarray, d: int = 0
    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Descriptor ``d``'s part of :meth:`expand`: ``(src offs, dst offs, lens)``."""
        si = np.asarray(src_items, dtype=_I64).reshape(-1)
        di = np.asarray(dst_items, dtype=_I64).reshape(-1)
        so, do, n = self.src[d], self.dst[d], self.lens[d]
        if not n.size or not si.size:
            z = np.zeros(0, dtype=_I64)
            return z, z, z
        return _merged(si, di, so, do, n, self.src_item_lens[d], self.dst_item_lens[d])


def _merged(
    si: np.ndarray,
    di: np.ndarray,
    so: np.ndarray,
    do: np.ndarray,
    n: np.ndarray,
    sil: int,
    dil: int,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs ``(so, do, n)`` of every item pair ``si[k] -> di[k]`` (items of ``sil`` / ``dil``
    bytes) as byte offsets, item then run, those that continue the previous one on both
    sides merged."""
    s = (si[:, None] * sil + so[None, :]).reshape(-1)
    t = (di[:, None] * dil + do[None, :]).reshape(-1)
    nb = np.tile(n, si.size)
    cont = np.zeros(s.size, dtype=bool)
    cont[1:] = (s[1:] == s[:-1] + nb[:-1]) & (t[1:] == t[:-1] + nb[:-1])
    first = np.flatnonzero(~cont)
    if first.size != s.size:
        s, t, nb = s[first], t[first], np.add.reduceat(nb, first)
    return s, t, nb
