"""Heterogeneous tensor parallelism: which prefill rank sends which heads (or state rows) to
which decode rank, and the byte runs that move them. Torch-free (numpy only).

Rank rules (SGLang's, so a mixed deployment pairs the same ranks)
    An axis of ``total`` units (KV heads; rows of one part of a state tensor; ``1`` for a
    replicated tensor such as the MLA latent) is split over ``tp`` ranks:

    * ``tp <= total``: ``total % tp == 0``; rank ``r`` owns ``[r*n, (r+1)*n)``, ``n = total/tp``;
    * ``tp > total``: ``tp % total == 0``; rank ``r`` owns the one unit ``r // (tp/total)``
      (consecutive ranks replicate a unit, as ``QKVParallelLinear``'s
      ``tp_rank // num_kv_head_replicas``).

    The TP sizes must divide one another. The ranks a room involves (its *peers*) are:

    * ``Tp >= Td``: decode rank ``d`` and prefill ranks ``[d*k, (d+1)*k)``, ``k = Tp/Td``;
    * ``Tp < Td``: decode rank ``d`` and prefill rank ``d // (Td/Tp)``.

    Every prefill rank is a peer of at least one decode rank, so every prefill rank's sender
    learns of the room and releases its pages. Of a decode rank's peers, the ones owning a
    unit it needs send it; where several peers own the *same* units (replication: MLA,
    ``Tp > total``), exactly one of them sends — the replica ``salt % replicas`` (salt: e.g.
    the room id, which spreads the load over requests; ``0`` picks the first, as SGLang
    does) — and the others take part without moving bytes. (Per item: where whole items are
    replicated, the disagg layer cuts the room's pages into blocks and applies this rule per
    block, ``salt + block``: :meth:`kvxfer.disagg.tp_rooms.TpPair.replica_blocks`.)

Item geometry
    A transfer item (one page of one descriptor, or one state slot) holds one or more
    :class:`Segment`\\s: unit ``u`` of repetition ``i`` is the byte range
    ``[offset + i*stride + u*unit_bytes, +unit_bytes)``. A KV item is derived from the
    token geometry its pool states (``kv_token_segments()`` + ``kv_token_heads()``,
    :func:`token_item`; no layout switch here): heads inside every token row (NHD, each
    (layer, K|V) of a page-major page) give ``reps = page_size``; one segment per head
    (HND) gives ``reps = 1``, ``unit_bytes = page_size * head_bytes``; a pool's KV without
    heads (MLA / DSA latent) is replicated. A Mamba state slot is one segment per part of
    each tensor (conv ``x|B|C`` parts are split independently). A head range of a segment
    is one byte run per repetition, so a head slice costs ``reps`` runs per item: tokens
    for NHD, one for HND. A rank's single head is one contiguous block in either layout and
    joins a peer of either form (:func:`_recut`).

Invariants (tests/unit/test_tp_plan.py checks them exhaustively against a brute force)
    every unit a decode rank owns is written exactly once per room, from a prefill rank
    owning it; runs never leave their item; equal TP gives whole items (merged into runs of
    pages, as an ItemWrite would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.disagg.runs import Runs, run_starts
from kvxfer.errors import InvalidArgument

__all__ = [
    "AxisPlan",
    "ItemGeometry",
    "KvTokenGeometry",
    "Segment",
    "Slice",
    "check_ratio",
    "check_tp_compatible",
    "decode_peers",
    "envelope_state_geometry",
    "gather_items",
    "gather_runs",
    "hnd_item",
    "item_runs",
    "item_salt_period",
    "kv_geometries",
    "local_units",
    "nhd_item",
    "owned",
    "page_major_item",
    "page_plan",
    "PagePlan",
    "plan_axis",
    "plan_pages",
    "prefill_peers",
    "replicated_item",
    "salt_period",
    "scatter_items",
    "scatter_runs",
    "state_geometries",
    "state_item",
    "token_item",
    "tp_fingerprint",
]

Range = Tuple[int, int]


# ---------------------------------------------------------------------------- rank rules
def _pos(name: str, v: int) -> int:
    if isinstance(v, bool) or int(v) != v or int(v) <= 0:
        raise InvalidArgument(f"{name} must be a positive int, got {v!r}")
    return int(v)


def local_units(total: int, tp: int, what: str = "axis") -> int:
    """Units of an axis of ``total`` each of ``tp`` ranks holds (TpShapeMismatch when the
    axis cannot be split evenly: neither ``tp | total`` nor ``total | tp``)."""
    total, tp = _pos("total", total), _pos("tp", tp)
    if tp <= total:
        if total % tp:
            raise TpShapeMismatch(f"{what}: {total} units do not split over tp {tp}")
        return total // tp
    if tp % total:
        raise TpShapeMismatch(f"{what}: {total} units cannot be replicated over tp {tp}")
    return 1


def owned(rank: int, tp: int, total: int) -> Range:
    """``[start, stop)`` of the global units rank ``rank`` of ``tp`` holds (module rules)."""
    n = local_units(total, tp)
    if not 0 <= rank < tp:
        raise InvalidArgument(f"rank {rank} outside [0, {tp})")
    if tp <= total:
        return rank * n, rank * n + n
    u = rank // (tp // total)
    return u, u + 1


def check_ratio(prefill_tp: int, decode_tp: int) -> None:
    """TpShapeMismatch unless one TP size divides the other."""
    a, b = _pos("prefill tp", prefill_tp), _pos("decode tp", decode_tp)
    if max(a, b) % min(a, b):
        raise TpShapeMismatch(
            f"prefill tp {a} and decode tp {b}: one TP size must divide the other"
        )


def decode_peers(decode_rank: int, prefill_tp: int, decode_tp: int) -> Tuple[int, ...]:
    """Prefill ranks a room of decode rank ``decode_rank`` involves (module rules)."""
    check_ratio(prefill_tp, decode_tp)
    if not 0 <= decode_rank < decode_tp:
        raise InvalidArgument(f"decode rank {decode_rank} outside [0, {decode_tp})")
    if prefill_tp >= decode_tp:
        k = prefill_tp // decode_tp
        return tuple(range(decode_rank * k, decode_rank * k + k))
    return (decode_rank // (decode_tp // prefill_tp),)


def prefill_peers(prefill_rank: int, prefill_tp: int, decode_tp: int) -> Tuple[int, ...]:
    """Decode ranks whose rooms involve prefill rank ``prefill_rank`` (inverse of
    :func:`decode_peers`)."""
    check_ratio(prefill_tp, decode_tp)
    if not 0 <= prefill_rank < prefill_tp:
        raise InvalidArgument(f"prefill rank {prefill_rank} outside [0, {prefill_tp})")
    if prefill_tp >= decode_tp:
        return (prefill_rank // (prefill_tp // decode_tp),)
    k = decode_tp // prefill_tp
    return tuple(range(prefill_rank * k, prefill_rank * k + k))


@dataclass(frozen=True)
class Slice:
    """Units ``src`` (prefill-local ``[a, b)``) of ``prefill_rank`` land at ``dst``
    (decode-local ``[a', b')``, same length)."""

    prefill_rank: int
    src: Range
    dst: Range

    @property
    def count(self) -> int:
        return self.src[1] - self.src[0]


@dataclass(frozen=True)
class AxisPlan:
    """The mapping of one axis of ``total`` units: ``by_decode[d]`` lists the slices decode
    rank ``d`` receives (ordered by destination; together they cover its units once)."""

    total: int
    prefill_tp: int
    decode_tp: int
    salt: int
    by_decode: Tuple[Tuple[Slice, ...], ...]

    def receives(self, decode_rank: int) -> Tuple[Slice, ...]:
        return self.by_decode[decode_rank]

    def sends(self, prefill_rank: int) -> Tuple[Tuple[int, Slice], ...]:
        """``(decode rank, slice)`` for every slice ``prefill_rank`` must write."""
        return tuple(
            (d, s)
            for d in prefill_peers(prefill_rank, self.prefill_tp, self.decode_tp)
            for s in self.by_decode[d]
            if s.prefill_rank == prefill_rank
        )

    def targets(self, prefill_rank: int) -> Tuple[int, ...]:
        """Decode ranks ``prefill_rank`` moves bytes to (a subset of its peers)."""
        return tuple(sorted({d for d, _ in self.sends(prefill_rank)}))


def salt_period(total: int, prefill_tp: int, decode_tp: int) -> int:
    """How many salts give different plans of an axis of ``total`` units: the replicas of a
    unit among one decode rank's peers (``ps`` of the module rules). 1 — the salt does not
    matter — unless prefill has more ranks than decode *and* than units; then ``min(k, r)``
    (``k = Tp/Td`` peers, ``r = Tp/total`` replicas of a unit: aligned blocks of ranks, so
    the ones a decode rank's peers hold number the smaller). Divides ``prefill_tp``.
    Meaningful for shapes :func:`plan_axis` accepts (checked there)."""
    total, prefill_tp, decode_tp = (
        _pos("total", total),
        _pos("prefill tp", prefill_tp),
        _pos("decode tp", decode_tp),
    )
    if prefill_tp <= decode_tp or prefill_tp <= total:
        return 1
    return min(prefill_tp // decode_tp, prefill_tp // total)


def plan_axis(total: int, prefill_tp: int, decode_tp: int, salt: int = 0) -> AxisPlan:
    """The slices of an axis of ``total`` units between ``prefill_tp`` and ``decode_tp``
    ranks (module rules). TpShapeMismatch names both shapes when they cannot be joined.
    Cached; ``salt`` only matters modulo :func:`salt_period` (1 without replicas to pick
    from: every salt is the same plan, the same object)."""
    return _plan_axis(
        total, prefill_tp, decode_tp, int(salt) % salt_period(total, prefill_tp, decode_tp)
    )


@lru_cache(maxsize=512)
def _plan_axis(total: int, prefill_tp: int, decode_tp: int, salt: int) -> AxisPlan:
    try:
        check_ratio(prefill_tp, decode_tp)
        local_units(total, prefill_tp, "prefill")
        local_units(total, decode_tp, "decode")
    except TpShapeMismatch as exc:
        raise TpShapeMismatch(
            f"{total} units over prefill tp {prefill_tp} / decode tp {decode_tp}: {exc}"
        ) from None
    by_decode: List[Tuple[Slice, ...]] = []
    for d in range(decode_tp):
        need = owned(d, decode_tp, total)
        holders: Dict[Range, List[int]] = {}
        for p in decode_peers(d, prefill_tp, decode_tp):
            have = owned(p, prefill_tp, total)
            lo, hi = max(need[0], have[0]), min(need[1], have[1])
            if lo < hi:
                holders.setdefault((lo, hi), []).append(p)
        slices = []
        for (lo, hi), ps in sorted(holders.items()):
            p = ps[salt % len(ps)]
            start = owned(p, prefill_tp, total)[0]
            slices.append(Slice(p, (lo - start, hi - start), (lo - need[0], hi - need[0])))
        # owned blocks are aligned, so overlaps are disjoint or equal: they tile ``need``
        assert slices and slices[0].dst[0] == 0 and slices[-1].dst[1] == need[1] - need[0]
        by_decode.append(tuple(slices))
    return AxisPlan(total, prefill_tp, decode_tp, salt, tuple(by_decode))


# ---------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Segment:
    """A TP-split axis inside an item: unit ``u`` of repetition ``i`` is
    ``[offset + i*stride + u*unit_bytes, +unit_bytes)``; ``units`` is this rank's count,
    ``total`` the count over all ranks (the axis the rank rules split)."""

    offset: int
    reps: int
    stride: int
    units: int
    unit_bytes: int
    total: int

    @property
    def span(self) -> int:
        """Bytes from ``offset`` to the end of the last unit."""
        return (self.reps - 1) * self.stride + self.units * self.unit_bytes

    def describe(self) -> str:
        rep = f"{self.reps} x " if self.reps > 1 else ""
        return f"{rep}{self.units}/{self.total} units of {self.unit_bytes} B"


@dataclass(frozen=True)
class ItemGeometry:
    """Segments of one item of ``item_bytes`` (bytes outside every segment do not move)."""

    item_bytes: int
    segments: Tuple[Segment, ...]

    def __post_init__(self) -> None:
        _pos("item_bytes", self.item_bytes)
        if not self.segments:
            raise InvalidArgument("an item geometry needs at least one segment")
        for s in self.segments:
            for name in ("reps", "stride", "units", "unit_bytes", "total"):
                _pos(f"segment {name}", getattr(s, name))
            if s.offset < 0 or s.offset + s.span > self.item_bytes:
                raise InvalidArgument(f"segment {s} leaves the {self.item_bytes}-byte item")
            if s.reps > 1 and s.stride < s.units * s.unit_bytes:
                raise InvalidArgument(f"segment {s}: repetitions overlap")

    def describe(self) -> str:
        segs = ", ".join(s.describe() for s in self.segments[:2])
        more = f", ... ({len(self.segments)} segments)" if len(self.segments) > 2 else ""
        return f"item {self.item_bytes} B [{segs}{more}]"

    def to_plain(self) -> List[Any]:
        return [self.item_bytes, [list(_seg_tuple(s)) for s in self.segments]]

    @classmethod
    def from_plain(cls, v: Sequence[Any]) -> "ItemGeometry":
        try:
            item, segs = v
            return cls(int(item), tuple(Segment(*(int(x) for x in s)) for s in segs))
        except (TypeError, ValueError) as exc:
            raise TpShapeMismatch(f"malformed item geometry {v!r}: {exc}") from None


def _seg_tuple(s: Segment) -> Tuple[int, ...]:
    return (s.offset, s.reps, s.stride, s.units, s.unit_bytes, s.total)


def token_item(
    page_size: int,
    rows: Sequence[int],
    heads: Sequence[Tuple[int, int]],
    total_heads: int,
    tp: int,
) -> ItemGeometry:
    """The item of one KV descriptor from its token geometry (``pool.kv_token_segments()``:
    ``rows``, the bytes of one token row of each segment; ``pool.kv_token_heads()``:
    ``heads``, which of the rank's ``h`` heads each row holds), ``h`` from the rank rules:

    * a segment whose rows hold heads ``(0, h)``, ``h > 1``: the heads lie inside every
      token (NHD, page-major): ``reps = page_size``, unit = one head row;
    * ``h`` consecutive segments holding heads ``(0, 1), ..., (h - 1, 1)`` (HND; also a
      rank's single head): the heads are blocks, ``reps = 1``, unit = a head's page.

    Anything else (heads that are not this rank's ``h``) is an InvalidArgument."""
    h = local_units(total_heads, tp, "kv heads")
    if len(rows) != len(heads):
        raise InvalidArgument(f"{len(rows)} token segments but {len(heads)} head ranges")
    blocks = [(i, 1) for i in range(h)]
    segs: List[Segment] = []
    off = j = 0
    while j < len(rows):
        row = int(rows[j])
        if h > 1 and tuple(heads[j]) == (0, h) and row % h == 0:
            segs.append(Segment(off, page_size, row, h, row // h, total_heads))
            off, j = off + page_size * row, j + 1
        elif [tuple(x) for x in heads[j : j + h]] == blocks and set(rows[j : j + h]) == {row}:
            block = page_size * row
            segs.append(Segment(off, 1, h * block, h, block, total_heads))
            off, j = off + h * block, j + h
        else:
            raise InvalidArgument(
                f"token segment {j} holds heads {tuple(heads[j])} in {row}-byte rows: not the "
                f"{h} heads of a rank of tp {tp} ({total_heads} kv heads)"
            )
    return ItemGeometry(off, tuple(segs))


def nhd_item(page_size: int, head_bytes: int, total_heads: int, tp: int) -> ItemGeometry:
    """``[page_size, heads, head_bytes]``: heads inside every token."""
    h = local_units(total_heads, tp, "kv heads")
    return token_item(page_size, [h * head_bytes], [(0, h)], total_heads, tp)


def hnd_item(page_size: int, head_bytes: int, total_heads: int, tp: int) -> ItemGeometry:
    """``[heads, page_size, head_bytes]``: each head one block of the page."""
    h = local_units(total_heads, tp, "kv heads")
    return token_item(page_size, [head_bytes] * h, [(i, 1) for i in range(h)], total_heads, tp)


def page_major_item(
    layers: int,
    page_size: int,
    k_head_bytes: int,
    v_head_bytes: int,
    total_heads: int,
    tp: int,
) -> ItemGeometry:
    """The page-major page (:class:`kvxfer.pools.layout.PageMajorGeometry`): per layer the
    K rows ``[page_size, H, D]`` then the V rows ``[page_size, H, Dv]``."""
    h = local_units(total_heads, tp, "kv heads")
    rows = [h * k_head_bytes, h * v_head_bytes] * layers
    return token_item(page_size, rows, [(0, h)] * len(rows), total_heads, tp)


def replicated_item(item_bytes: int) -> ItemGeometry:
    """An item every rank holds whole (MLA latent page, a state tensor with no TP dim)."""
    return ItemGeometry(item_bytes, (Segment(0, 1, item_bytes, 1, item_bytes, 1),))


def state_item(
    row_bytes: int,
    part_totals: Sequence[int],
    tp: int,
    *,
    item_bytes: int = 0,
    offset: int = 0,
    outer: int = 1,
) -> ItemGeometry:
    """One state slot split along one dim: parts (e.g. conv ``x | B | C``) of
    ``part_totals[i]`` rows over all ranks, each split by the rank rules, stored back to
    back (``rows_local[0]`` rows of part 0, then part 1...) from ``offset``; ``outer`` > 1:
    the split dim is not the first one, ``outer`` rows of all local parts follow one another
    (a ``[outer, rows_local, ...]`` slot, e.g. a ``[K-1, dim]`` conv state), so each part is
    ``outer`` repetitions. ``item_bytes`` defaults to the parts' bytes."""
    segs: List[Segment] = []
    local = [local_units(int(g), tp, f"state part {i}") for i, g in enumerate(part_totals)]
    stride = sum(local) * row_bytes
    off = offset
    for n, g in zip(local, part_totals):
        segs.append(Segment(off, _pos("outer", outer), stride, n, row_bytes, int(g)))
        off += n * row_bytes
    return ItemGeometry(item_bytes or offset + outer * stride, tuple(segs))


def state_geometries(
    item_lens: Sequence[int],
    dims: Sequence[Any],
    parts: Sequence[Sequence[int]],
    tp: int,
    outer: Sequence[int] = (),
) -> List[ItemGeometry]:
    """Geometry of every plain (per-layer) state descriptor from a pool's metadata:
    ``item_lens`` (``get_state_buf_infos``), ``dims`` (``get_state_dim_per_tensor``: this
    rank's rows of the TP-split dim; ``None`` / ``-1``: replicated), ``parts``
    (``get_state_parts_per_tensor``: this rank's rows of each part; ``[]``: one part) and
    ``outer`` (rows before the split dim, per descriptor; ``()``: all 1, the split dim is
    the first). Totals are ``local rows * tp`` (a state dim replicated over ranks is not
    expressible here: refused at the handshake)."""
    if parts and len(parts) != len(item_lens):
        raise InvalidArgument(f"{len(parts)} part lists for {len(item_lens)} state descriptors")
    if outer and len(outer) != len(item_lens):
        raise InvalidArgument(f"{len(outer)} outer counts for {len(item_lens)} state descriptors")
    out: List[ItemGeometry] = []
    for i, (il, dim) in enumerate(zip(item_lens, dims)):
        if dim is None or int(dim) < 0:
            out.append(replicated_item(int(il)))
            continue
        rows = [int(x) for x in (parts[i] if parts else [])] or [int(dim)]
        o = int(outer[i]) if outer else 1
        if sum(rows) != int(dim) or o <= 0 or int(il) % (int(dim) * o):
            raise InvalidArgument(
                f"state descriptor {i}: parts {rows} x {o} outer / item {il} B do not fit "
                f"{dim} rows"
            )
        out.append(
            state_item(
                int(il) // (int(dim) * o), [r * tp for r in rows], tp, item_bytes=int(il), outer=o
            )
        )
    return out


def envelope_state_geometry(
    entry_bytes: int, regions: Sequence[Dict[str, Any]], tp: int
) -> ItemGeometry:
    """Geometry of an envelope state slot from ``MambaPool.get_state_item_regions()``:
    every region's layers, each split along its first dim part by part."""
    segs: List[Segment] = []
    for r in regions:
        rows = [int(x) for x in r.get("parts") or [r["sliceable_dim"]]]
        row_bytes = int(r["layer_bytes"]) // int(r["sliceable_dim"])
        for layer in range(int(r["num_layers"])):
            base = int(r["offset"]) + layer * int(r["layer_bytes"])
            segs += state_item(row_bytes, [n * tp for n in rows], tp, offset=base).segments
    return ItemGeometry(int(entry_bytes), tuple(segs))


class KvTokenGeometry(Protocol):
    """What :func:`kv_geometries` reads of a KV pool (kvxfer.pools' ``KVCache``): its
    token geometry, stated once by the pool (docs/shapes.md)."""

    page_size: int

    def get_contiguous_buf_infos(self) -> Tuple[List[int], List[int], List[int]]: ...

    def kv_token_segments(self) -> Optional[List[List[int]]]: ...

    def kv_token_heads(self) -> Optional[List[List[Tuple[int, int]]]]: ...


def kv_geometries(pool: KvTokenGeometry, total_heads: int, tp: int) -> List[ItemGeometry]:
    """Geometry of every KV descriptor of a pool, from its token geometry
    (:func:`token_item`); a descriptor without KV heads (MLA / DSA latent) is replicated.
    ``total_heads``: the model's KV heads over all ranks. Checked against the pool's item
    sizes."""
    _, _, items = pool.get_contiguous_buf_infos()
    heads = pool.kv_token_heads()
    if heads is None or len(heads) != len(items):
        raise InvalidArgument(f"a {type(pool).__name__} states no TP geometry")
    segs = pool.kv_token_segments() if any(heads) else []
    if segs is None or (segs and len(segs) != len(heads)):
        raise InvalidArgument(f"a {type(pool).__name__} states KV heads but no token segments")
    ps = int(pool.page_size)
    geoms = [
        token_item(ps, segs[i], h, total_heads, tp) if h else replicated_item(int(items[i]))
        for i, h in enumerate(heads)
    ]
    got = [g.item_bytes for g in geoms]
    if got != [int(x) for x in items]:
        raise InvalidArgument(f"TP geometry item sizes {got} != the pool's {list(items)}")
    return geoms


# ---------------------------------------------------------------------------- byte runs
def _recut(s: Segment, reps: int) -> Optional[Segment]:
    """A single-unit contiguous segment as ``reps`` equal repetitions, None if ``s`` is not
    one: a rank's only head is the same bytes whether its layout puts heads inside the token
    rows (NHD) or makes each a block (HND), so it joins a peer of either form."""
    size = s.reps * s.unit_bytes
    if s.units != 1 or (s.reps > 1 and s.stride != s.unit_bytes) or size % reps:
        return None
    return Segment(s.offset, reps, size // reps, 1, size // reps, s.total)


def _pair(
    src: ItemGeometry, dst: ItemGeometry, prefill_tp: int, decode_tp: int
) -> Tuple[Tuple[Segment, Segment], ...]:
    """The segments of the two sides, paired (a single-unit segment recut to its peer's
    repetitions, :func:`_recut`); TpShapeMismatch naming both when they cannot be joined."""

    def bad(why: str) -> TpShapeMismatch:
        return TpShapeMismatch(
            f"{why}: prefill tp {prefill_tp} {src.describe()}, "
            f"decode tp {decode_tp} {dst.describe()}"
        )

    if len(src.segments) != len(dst.segments):
        raise bad(f"{len(src.segments)} vs {len(dst.segments)} segments")
    out = []
    for i, (s, t) in enumerate(zip(src.segments, dst.segments)):
        if (s.reps, s.unit_bytes) != (t.reps, t.unit_bytes):
            if s.units == 1:
                s = _recut(s, t.reps) or s
            elif t.units == 1:
                t = _recut(t, s.reps) or t
        if (s.total, s.unit_bytes, s.reps) != (t.total, t.unit_bytes, t.reps):
            raise bad(f"segment {i} differs ({s.describe()} vs {t.describe()})")
        try:
            ns, nt = local_units(s.total, prefill_tp), local_units(t.total, decode_tp)
        except TpShapeMismatch as exc:
            raise bad(f"segment {i}: {exc}") from None
        if (ns, nt) != (s.units, t.units):
            raise bad(f"segment {i} holds {s.units} / {t.units} units, not {ns} / {nt}")
        out.append((s, t))
    return tuple(out)


def coalesce(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive runs contiguous on both sides (order kept)."""
    starts = run_starts(src, dst, nbytes)
    if starts.size == src.size:
        return src, dst, nbytes
    return src[starts], dst[starts], np.add.reduceat(nbytes, starts)


@lru_cache(maxsize=1024)
def _item_runs_cached(
    src: ItemGeometry,
    dst: ItemGeometry,
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    salt: int,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    so, do, nb = [], [], []
    for s, t in _pair(src, dst, prefill_tp, decode_tp):
        for sl in plan_axis(s.total, prefill_tp, decode_tp, salt).receives(decode_rank):
            if sl.prefill_rank != prefill_rank:
                continue
            i = np.arange(s.reps, dtype=np.int64)
            so.append(s.offset + i * s.stride + sl.src[0] * s.unit_bytes)
            do.append(t.offset + i * t.stride + sl.dst[0] * t.unit_bytes)
            nb.append(np.full(s.reps, sl.count * s.unit_bytes, dtype=np.int64))
    if not so:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    out = coalesce(np.concatenate(so), np.concatenate(do), np.concatenate(nb))
    for a in out:
        a.flags.writeable = False
    return out


def item_runs(
    src: ItemGeometry,
    dst: ItemGeometry,
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    salt: int = 0,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(src_off, dst_off, nbytes)`` int64 runs, relative to one item on each side, of what
    ``prefill_rank`` writes into ``decode_rank``'s item (empty: it sends nothing). Raises
    TpShapeMismatch naming both geometries when they cannot be joined. Cached (read-only
    arrays; every salt of one class of :func:`item_salt_period` gets the same arrays)."""
    salt = int(salt) % item_salt_period(src, dst, prefill_tp, decode_tp)
    return _item_runs_cached(src, dst, prefill_rank, decode_rank, prefill_tp, decode_tp, salt)


@lru_cache(maxsize=1024)
def item_salt_period(src: ItemGeometry, dst: ItemGeometry, prefill_tp: int, decode_tp: int) -> int:
    """How many salts give different runs of an item pair: the least common multiple of its
    segments' :func:`salt_period` (1 when no segment has replicas to pick from; divides
    ``prefill_tp``). TpShapeMismatch when the geometries cannot be joined."""
    out = 1
    for s, _ in _pair(src, dst, prefill_tp, decode_tp):
        out = math.lcm(out, salt_period(s.total, prefill_tp, decode_tp))
    return out


@dataclass(frozen=True, eq=False)
class PagePlan:
    """The per-item runs of every descriptor of a group for one prefill -> decode pair and
    salt, resolved once (:func:`page_plan`): descriptors of the same geometry pair share
    one *class* (their runs of the same items are the same offsets: only the descriptor
    differs), so a request computes each class's runs once, not each descriptor's.

    ``classes[c] = (descriptors, ro, rd, rn, src_item_bytes, dst_item_bytes)`` (read-only
    int64 runs relative to one item on each side, as :func:`item_runs`); classes that move
    nothing are left out. ``whole``: every descriptor moves its whole item into an item of
    the same size (replicated or equal shares): the plan of an ItemWrite."""

    descriptors: int
    classes: Tuple[Tuple[Tuple[int, ...], np.ndarray, np.ndarray, np.ndarray, int, int], ...]
    whole: bool

    def runs(self, src_items: Any, dst_items: Any) -> Runs:
        """:func:`plan_pages` of these items (the same runs in the same order)."""
        si = np.asarray(src_items, dtype=np.int64).reshape(-1)
        di = np.asarray(dst_items, dtype=np.int64).reshape(-1)
        if si.size != di.size:
            raise InvalidArgument(f"{si.size} source items but {di.size} destination items")
        if not si.size or not self.classes:
            return Runs.empty()
        if si.size == 1:  # one item (a request's state slot): its runs are a fixed template
            desc, so, do, nb, ss, ds = self._one_item()
            return Runs(desc, so + int(si[0]) * ss, do + int(di[0]) * ds, nb)
        return self._runs_many(si, di)

    def _runs_many(self, si: np.ndarray, di: np.ndarray) -> Runs:
        """:meth:`runs` by the per-class pass (any number of items, int64 1-D, non-empty)."""
        per: List[Optional[Tuple[np.ndarray, ...]]] = [None] * self.descriptors
        for descs, ro, rd, rn, sib, dib in self.classes:
            if rn.size == 1:  # one run per item: no 2-D broadcast
                so, do = si * sib + int(ro[0]), di * dib + int(rd[0])
                nb = np.full(si.size, int(rn[0]), dtype=np.int64)
            else:
                so = (si[:, None] * sib + ro[None, :]).ravel()
                do = (di[:, None] * dib + rd[None, :]).ravel()
                nb = np.tile(rn, si.size)
            cols = coalesce(so, do, nb)
            if len(self.classes) == 1 and descs == tuple(range(self.descriptors)):
                m, k = cols[0].size, len(descs)  # every descriptor alike: tile, no loop
                desc = np.repeat(np.arange(k, dtype=np.int64), m)
                return Runs(desc, np.tile(cols[0], k), np.tile(cols[1], k), np.tile(cols[2], k))
            for d in descs:
                per[d] = cols
        parts = [
            (np.full(c[0].size, d, dtype=np.int64),) + tuple(c)
            for d, c in enumerate(per)
            if c is not None
        ]
        return Runs(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def _one_item(self) -> Tuple[np.ndarray, ...]:
        """The runs of item 0 -> item 0 in :meth:`runs`' order, with each run's item
        strides ``(desc, src, dst, nbytes, src_stride, dst_stride)`` (read-only, cached).
        One item's runs are its class's runs moved by the item's offset on each side (they
        are coalesced already, and merging is the same after a shift), so a one-item request
        is two multiply-adds instead of the per-class pass."""
        got = self.__dict__.get("_one")
        if got is None:  # (frozen: cached by hand)
            per: List[Any] = [None] * self.descriptors
            for descs, ro, rd, rn, sib, dib in self.classes:
                for d in descs:
                    per[d] = (ro, rd, rn, sib, dib)
            cols = [
                (np.full(c[0].size, d, dtype=np.int64),)
                + c[:3]
                + tuple(np.full(c[0].size, b, dtype=np.int64) for b in c[3:])
                for d, c in enumerate(per)
                if c is not None
            ]
            got = tuple(np.concatenate([c[i] for c in cols]) for i in range(6))
            for a in got:
                a.flags.writeable = False
            self.__dict__["_one"] = got
        return got


def page_plan(
    src: Sequence[ItemGeometry],
    dst: Sequence[ItemGeometry],
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    salt: int = 0,
) -> PagePlan:
    """The :class:`PagePlan` of a group (geometries ``src[i]`` / ``dst[i]`` per descriptor);
    TpShapeMismatch when the geometries cannot be joined (checked for every descriptor)."""
    if len(src) != len(dst):
        raise TpShapeMismatch(f"prefill has {len(src)} descriptors, decode {len(dst)}")
    classes: Dict[Tuple[ItemGeometry, ItemGeometry], List[Any]] = {}
    whole = True
    for d, (s, t) in enumerate(zip(src, dst)):
        ro, rd, rn = item_runs(s, t, prefill_rank, decode_rank, prefill_tp, decode_tp, salt)
        if not (
            s.item_bytes == t.item_bytes
            and rn.size == 1
            and int(ro[0]) == int(rd[0]) == 0
            and int(rn[0]) == s.item_bytes
        ):
            whole = False
        if not rn.size:
            continue
        c = classes.get((s, t))
        if c is None:
            classes[(s, t)] = [[d], ro, rd, rn, s.item_bytes, t.item_bytes]
        else:
            c[0].append(d)
    return PagePlan(
        len(src),
        tuple((tuple(c[0]), c[1], c[2], c[3], c[4], c[5]) for c in classes.values()),
        whole,
    )


def plan_pages(
    src: Sequence[ItemGeometry],
    dst: Sequence[ItemGeometry],
    prefill_rank: int,
    decode_rank: int,
    prefill_tp: int,
    decode_tp: int,
    src_items: Any,
    dst_items: Any,
    salt: int = 0,
) -> Runs:
    """The runs moving items ``src_items[k]`` (prefill ids) into ``dst_items[k]`` (decode
    ids) of every descriptor ``i`` (geometries ``src[i]`` / ``dst[i]``), from
    ``prefill_rank`` to ``decode_rank``, descriptor-major, then item, then run; runs
    contiguous on both sides are merged (whole items of consecutive ids become one run, as
    an ItemWrite's). A caller planning many requests of one pair keeps the
    :func:`page_plan` instead (:meth:`PagePlan.runs`: the same runs)."""
    plan = page_plan(src, dst, prefill_rank, decode_rank, prefill_tp, decode_tp, salt)
    return plan.runs(src_items, dst_items)


# ---------------------------------------------------------------------------- staging
def _windows(buf: np.ndarray, n: int) -> np.ndarray:
    """Rows ``i -> buf[i:i+n]`` (no copy): fancy-indexing them moves whole runs."""
    return np.lib.stride_tricks.as_strided(buf, shape=(buf.size - n + 1, n), strides=(1, 1))


def gather_runs(buf: np.ndarray, offs: np.ndarray, nbytes: np.ndarray, out: np.ndarray) -> int:
    """Pack runs ``buf[offs[k] : offs[k]+nbytes[k]]`` back to back into ``out`` (uint8, host
    memory); returns the bytes packed. One numpy copy per distinct run size."""
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1])) if nbytes.size else nbytes
    for n in np.unique(nbytes):
        k = nbytes == n
        _windows(out, int(n))[pos[k]] = _windows(buf, int(n))[offs[k]]
    return int(nbytes.sum())


def scatter_runs(buf: np.ndarray, offs: np.ndarray, nbytes: np.ndarray, src: np.ndarray) -> None:
    """Inverse of :func:`gather_runs`: unpack ``src`` into the runs of ``buf``."""
    pos = np.concatenate(([0], np.cumsum(nbytes)[:-1])) if nbytes.size else nbytes
    for n in np.unique(nbytes):
        k = nbytes == n
        _windows(buf, int(n))[offs[k]] = _windows(src, int(n))[pos[k]]


def _item_view(buf: np.ndarray, item_bytes: int, ro: np.ndarray, rn: np.ndarray):
    """``[items, runs, n]`` strided view of ``buf`` when one item's runs are equal-sized at a
    constant step (NHD / HND / page-major head slices are), else None."""
    if not rn.size or bool((rn != rn[0]).any()):
        return None
    step = int(ro[1] - ro[0]) if ro.size > 1 else int(rn[0])
    if step < int(rn[0]) or (ro.size > 1 and bool((np.diff(ro) != step).any())):
        return None
    n, first = int(rn[0]), int(ro[0])
    items = (buf.size - first - (ro.size - 1) * step - n) // item_bytes + 1
    return np.lib.stride_tricks.as_strided(
        buf[first:], shape=(items, ro.size, n), strides=(item_bytes, step, 1)
    )


def gather_items(
    buf: np.ndarray,
    item_bytes: int,
    items: np.ndarray,
    ro: np.ndarray,
    rn: np.ndarray,
    out: np.ndarray,
) -> int:
    """Pack the runs ``(ro, rn)`` (:func:`item_runs`, one side) of every item ``items[k]``
    of ``buf`` back to back into ``out``, item-major: the order :func:`scatter_items` unpacks
    with the other side's runs. One strided copy when the runs are regular (the head-slice
    "gather kernel" of the staged path, host memory), else :func:`gather_runs`. Ids must be
    valid (not checked)."""
    items = np.asarray(items, dtype=np.int64)
    total = int(rn.sum()) * items.size
    v = _item_view(buf, item_bytes, ro, rn)
    if v is None:
        offs = (items[:, None] * item_bytes + ro[None, :]).ravel()
        return gather_runs(buf, offs, np.tile(rn, items.size), out)
    out[:total].reshape(items.size, *v.shape[1:])[...] = v[items]  # (np.take would copy all of v)
    return total


def scatter_items(
    buf: np.ndarray,
    item_bytes: int,
    items: np.ndarray,
    ro: np.ndarray,
    rn: np.ndarray,
    src: np.ndarray,
) -> None:
    """Inverse of :func:`gather_items` on the receiving side (its own runs and items)."""
    items = np.asarray(items, dtype=np.int64)
    total = int(rn.sum()) * items.size
    v = _item_view(buf, item_bytes, ro, rn)
    if v is None:
        offs = (items[:, None] * item_bytes + ro[None, :]).ravel()
        scatter_runs(buf, offs, np.tile(rn, items.size), src)
        return
    v[items] = src[:total].reshape(items.size, *v.shape[1:])


# ---------------------------------------------------------------------------- handshake
def tp_fingerprint(tp_size: int, groups: Dict[str, Sequence[ItemGeometry]]) -> Dict[str, Any]:
    """Plain (msgpack-able) TP shape one side advertises: its TP size and the item
    geometry of every descriptor of every group."""
    return {
        "tp_size": _pos("tp_size", tp_size),
        "groups": {g: [x.to_plain() for x in geoms] for g, geoms in groups.items()},
    }


def check_tp_compatible(prefill: Dict[str, Any], decode: Dict[str, Any]) -> None:
    """Raise TpShapeMismatch (naming both shapes) unless every descriptor of every group
    the two sides share can be joined; runs at the handshake, before any byte moves."""
    try:
        tp_p, tp_d = int(prefill["tp_size"]), int(decode["tp_size"])
        gp, gd = dict(prefill["groups"]), dict(decode["groups"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TpShapeMismatch(f"malformed TP fingerprint: {exc}") from None
    try:
        check_ratio(tp_p, tp_d)
    except TpShapeMismatch as exc:
        raise TpShapeMismatch(f"prefill tp {tp_p}, decode tp {tp_d}: {exc}") from None
    if set(gp) != set(gd):
        raise TpShapeMismatch(
            f"prefill tp {tp_p} has groups {sorted(gp)}, decode tp {tp_d} {sorted(gd)}"
        )
    for g in sorted(gp):
        src = [ItemGeometry.from_plain(v) for v in gp[g]]
        dst = [ItemGeometry.from_plain(v) for v in gd[g]]
        if len(src) != len(dst):
            raise TpShapeMismatch(
                f"group {g!r}: prefill tp {tp_p} has {len(src)} descriptors, "
                f"decode tp {tp_d} {len(dst)}"
            )
        for i, (s, t) in enumerate(zip(src, dst)):
            try:
                _pair(s, t, tp_p, tp_d)
            except TpShapeMismatch as exc:
                raise TpShapeMismatch(f"group {g!r} descriptor {i}: {exc}") from None
