"""Transfer planning: pure arithmetic, no torch and no UCX (numpy only).

Turns "these source items → those destination items of group G" into the fewest RMA
operations, with every remote address checked against the remote descriptor before
anything is posted.

Vocabulary
- A *group* is a named list of contiguous descriptors ``(ptr, nbytes, item_bytes)``. Item
  ``i`` of the group is the byte range ``[ptr_d + i*item_d, ptr_d + (i+1)*item_d)`` in
  *every* descriptor ``d`` (one page of every layer, one state slot of every state tensor).
  All descriptors of a group hold the same number of items.
- A *run* ``(s0, d0, n)`` is ``n`` items contiguous on both sides: ``s0..s0+n-1`` →
  ``d0..d0+n-1``. A run becomes one op per descriptor of the group, so a per-layer pool
  (2·L descriptors) costs 2·L ops per run and a page-major pool (1 descriptor) costs 1.
- :func:`tp_heads` / :func:`tp_sources`: which source TP ranks hold the KV heads of a
  destination rank under heterogeneous tensor parallelism (local head offsets per side).
- An :class:`Ops` batch is four parallel uint64 arrays (local address, remote address,
  byte count, descriptor index) — the form the native ``put_batch`` takes.

Invariants (tested exhaustively in tests/unit/test_plan.py)
- Every item id is in ``[0, num_items)`` of its side, or :class:`IndexOutOfRange` names it.
- Destination ids are unique (two sources for one destination would race).
- The runs cover exactly the requested (src, dst) pairs; no two consecutive runs could be
  merged further once sorted by source id.
- Every op lies inside its descriptor on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Sequence, Tuple

import numpy as np

from kvxfer.argcheck import as_int
from kvxfer.errors import IncompatibleLayout, IndexOutOfRange, InvalidArgument

_U64 = np.uint64


@dataclass(frozen=True)
class GroupLayout:
    """One named descriptor group. Build with :func:`make_group` (validates)."""

    name: str
    ptrs: Tuple[int, ...]
    lens: Tuple[int, ...]
    item_lens: Tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.ptrs)

    @property
    def num_items(self) -> int:
        return self.lens[0] // self.item_lens[0]

    @property
    def nbytes(self) -> int:
        return sum(self.lens)

    @property
    def item_bytes(self) -> int:
        """Bytes of one item across all descriptors."""
        return sum(self.item_lens)


def _int_list(values, what: str, name: str) -> Tuple[int, ...]:
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise InvalidArgument(f"group {name!r}: {what}[{i}] = {v!r} is not an integer")
        out.append(int(v))
    return tuple(out)


def make_group(
    name: str, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int]
) -> GroupLayout:
    """Validate a descriptor group: same count everywhere, positive sizes, ``lens`` a multiple
    of ``item_lens``, the same number of items in every descriptor, addresses in 64 bits."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"group name must be a non-empty str, got {name!r}")
    p, ln, il = (
        _int_list(ptrs, "ptrs", name),
        _int_list(lens, "lens", name),
        _int_list(item_lens, "item_lens", name),
    )
    if not p:
        raise InvalidArgument(f"group {name!r} has no descriptors")
    if not len(p) == len(ln) == len(il):
        raise InvalidArgument(f"group {name!r}: {len(p)} ptrs, {len(ln)} lens, {len(il)} item_lens")
    for i, (a, n, it) in enumerate(zip(p, ln, il)):
        if a <= 0 or n <= 0 or it <= 0:
            raise InvalidArgument(
                f"group {name!r} descriptor {i}: ptr={a:#x}, len={n}, item_len={it} must be > 0"
            )
        if a + n > 1 << 64:
            raise InvalidArgument(f"group {name!r} descriptor {i} overflows 64-bit addresses")
        if n % it:
            raise InvalidArgument(
                f"group {name!r} descriptor {i}: len {n} is not a multiple of item_len {it}"
            )
    counts = {n // it for n, it in zip(ln, il)}
    if len(counts) != 1:
        raise InvalidArgument(
            f"group {name!r}: descriptors hold different item counts {sorted(counts)}"
        )
    return GroupLayout(name, p, ln, il)


def check_compatible(local: GroupLayout, remote: GroupLayout) -> None:
    """Two sides of one group must agree on descriptor count and item sizes; the number of
    items may differ (prefill and decode pools are sized independently). Raises
    :class:`IncompatibleLayout` naming the field (``count`` or ``item_lens``)."""
    if local.count != remote.count:
        raise IncompatibleLayout(local.name, "count", local.count, remote.count)
    if local.item_lens != remote.item_lens:
        raise IncompatibleLayout(
            local.name, "item_lens", list(local.item_lens), list(remote.item_lens)
        )


# ------------------------------------------------------------------ item ids


def as_ids(values, what: str) -> np.ndarray:
    """Item ids as a 1-D int64 array. Accepts sequences, numpy arrays and tensors (device
    tensors are copied to the host once; anything ``np.asarray`` understands); rejects
    floats, bools and other shapes."""
    if getattr(values, "is_cuda", False) and hasattr(values, "cpu"):  # device tensor
        values = values.detach().cpu()
    try:
        arr = np.asarray(values)
    except Exception as exc:  # e.g. a CUDA tensor
        raise InvalidArgument(
            f"{what}: cannot read item ids from {type(values).__name__}: {exc}"
        ) from None
    if arr.ndim == 0 and arr.size == 1:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what}: item ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what}: item ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise IndexOutOfRange(f"{what}: item id {int(arr.max())} out of range")
    return arr.astype(np.int64, copy=False)


def check_ids(ids: np.ndarray, num_items: int, what: str) -> None:
    """Raise :class:`IndexOutOfRange` naming the first id outside ``[0, num_items)``."""
    if ids.size == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_items):
        return
    bad = (ids < 0) | (ids >= num_items)
    if bad.any():
        first = int(ids[int(np.argmax(bad))])
        raise IndexOutOfRange(
            f"{what}: item id {first} out of range [0, {num_items}) ({int(bad.sum())} bad id(s))"
        )


def _by_source(src: np.ndarray, dst: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` ordered by source id, ties by destination id. Already strictly
    ascending sources (the common case: a request's pages in order) skip the sort; unique
    sources need only a one-key sort."""
    if src.size < 2 or bool((src[1:] > src[:-1]).all()):
        return src, dst
    order = np.argsort(src, kind="stable")
    s = src[order]
    if not bool((s[1:] > s[:-1]).all()):  # duplicate sources: ties by destination
        order = np.lexsort((dst, src))
        s = src[order]
    return s, dst[order]


def has_duplicates(ids: np.ndarray) -> bool:
    """Whether a 1-D id array repeats a value (no sort when it is strictly ascending)."""
    if ids.size < 2 or bool((ids[1:] > ids[:-1]).all()):
        return False
    s = np.sort(ids)
    return not bool((s[1:] != s[:-1]).all())


def merge_runs(src: np.ndarray, dst: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs contiguous on both sides, ordered by source id.

    Returns ``(s0, d0, n)`` int64 arrays. ``dst`` must be unique (checked by the caller
    through :func:`plan_items`); duplicates in ``src`` are allowed (they break runs)."""
    if src.shape != dst.shape:
        raise InvalidArgument(f"{src.size} source ids but {dst.size} destination ids")
    if src.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z.copy(), z.copy()
    s, d = _by_source(src, dst)
    n = s.size
    if (
        int(s[-1]) - int(s[0]) == n - 1
        and int(d[-1]) - int(d[0]) == n - 1
        and (n < 2 or (bool((s[1:] > s[:-1]).all()) and bool((d[1:] > d[:-1]).all())))
    ):
        # both sides consecutive: one run (the common case of a contiguous request)
        return s[:1].copy(), d[:1].copy(), np.array([n], dtype=np.int64)
    brk = np.ones(s.size, dtype=bool)
    brk[1:] = (np.diff(s) != 1) | (np.diff(d) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, s.size))
    return s[starts], d[starts], lengths.astype(np.int64)


# ---------------------------------------------------------------------- ops


@dataclass
class Ops:
    """A batch of PUTs: parallel uint64 arrays; ``desc`` is the descriptor index within
    the group, ``group`` the group's name (one Ops per group; concatenate with
    :func:`concat`)."""

    laddr: np.ndarray
    raddr: np.ndarray
    nbytes: np.ndarray
    desc: np.ndarray

    def __len__(self) -> int:
        return int(self.laddr.size)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum(dtype=np.uint64)) if self.nbytes.size else 0

    @staticmethod
    def empty() -> "Ops":
        z = np.zeros(0, dtype=_U64)
        return Ops(z, z.copy(), z.copy(), z.copy())


def concat(parts: Iterable[Ops]) -> Ops:
    parts = list(parts)
    if not parts:
        return Ops.empty()
    return Ops(
        *(
            np.concatenate([getattr(p, f) for p in parts]).astype(_U64, copy=False)
            for f in ("laddr", "raddr", "nbytes", "desc")
        )
    )


def plan_items(local: GroupLayout, remote: GroupLayout, src_ids, dst_ids) -> Ops:
    """Validate ids (range on both sides, unique destinations) and return the ops, one per
    run per descriptor, descriptor-major. Raises before anything is computed for posting."""
    src = as_ids(src_ids, f"group {local.name!r} source")
    dst = as_ids(dst_ids, f"group {local.name!r} destination")
    if src.size != dst.size:
        raise InvalidArgument(
            f"group {local.name!r}: {src.size} source ids but {dst.size} destination ids"
        )
    check_compatible(local, remote)
    check_ids(src, local.num_items, f"group {local.name!r} source")
    check_ids(dst, remote.num_items, f"group {local.name!r} destination")
    if has_duplicates(dst):
        vals, counts = np.unique(dst, return_counts=True)
        raise InvalidArgument(
            f"group {local.name!r}: destination item {int(vals[counts > 1][0])} appears "
            f"{int(counts[counts > 1][0])} times"
        )
    s0, d0, n = merge_runs(src, dst)
    if s0.size == 0:
        return Ops.empty()
    item = np.asarray(local.item_lens, dtype=np.int64)[:, None]  # (D, 1)
    lptr = np.asarray(local.ptrs, dtype=_U64)[:, None]
    rptr = np.asarray(remote.ptrs, dtype=_U64)[:, None]
    laddr = lptr + (s0[None, :] * item).astype(_U64)
    raddr = rptr + (d0[None, :] * item).astype(_U64)
    nbytes = np.broadcast_to((n[None, :] * item).astype(_U64), laddr.shape)
    desc = np.broadcast_to(np.arange(local.count, dtype=_U64)[:, None], laddr.shape)
    return Ops(
        laddr.ravel(),
        raddr.ravel(),
        np.ascontiguousarray(nbytes).ravel(),
        np.ascontiguousarray(desc).ravel(),
    )


def plan_raw(local: GroupLayout, remote: GroupLayout, desc, src_off, dst_off, nbytes) -> Ops:
    """Raw form: byte ranges ``[src_off, src_off+nbytes)`` of local descriptor ``desc`` to
    ``[dst_off, ...)`` of the remote descriptor with the same index. All arguments may be
    scalars or equal-length arrays; every range is checked against both descriptors."""
    arrs = [
        as_ids(v, f"group {local.name!r} raw {w}")
        for v, w in ((desc, "desc"), (src_off, "src_off"), (dst_off, "dst_off"), (nbytes, "nbytes"))
    ]
    size = max(a.size for a in arrs)
    try:
        d, so, do, nb = (np.broadcast_to(a, (size,)) for a in arrs)
    except ValueError:
        raise InvalidArgument(
            f"group {local.name!r} raw: argument lengths {[a.size for a in arrs]} differ"
        ) from None
    if size == 0:
        return Ops.empty()
    check_ids(d, min(local.count, remote.count), f"group {local.name!r} raw descriptor")
    if (nb <= 0).any():
        raise InvalidArgument(f"group {local.name!r} raw: nbytes {int(nb[nb <= 0][0])} <= 0")
    llen = np.asarray(local.lens, dtype=np.int64)[d]
    rlen = np.asarray(remote.lens, dtype=np.int64)[d]
    for off, lim, side in ((so, llen, "source"), (do, rlen, "destination")):
        bad = (off < 0) | (off > lim - nb)
        if bad.any():
            i = int(np.argmax(bad))
            raise IndexOutOfRange(
                f"group {local.name!r} raw {side}: [{int(off[i])}, +{int(nb[i])}) outside "
                f"descriptor {int(d[i])} of {int(lim[i])} bytes"
            )
    lptr = np.asarray(local.ptrs, dtype=_U64)[d]
    rptr = np.asarray(remote.ptrs, dtype=_U64)[d]
    return Ops(lptr + so.astype(_U64), rptr + do.astype(_U64), nb.astype(_U64), d.astype(_U64))


# ------------------------------------------------------------ registrations


@dataclass(frozen=True)
class Span:
    """One merged registration: ``[start, end)`` and the (group, descriptor) pairs in it."""

    start: int
    end: int
    members: Tuple[Tuple[str, int], ...]
    adjacent_only: bool  # True when at least two members merely touch (no overlap)

    @property
    def length(self) -> int:
        return self.end - self.start


def merge_spans(groups: Sequence[GroupLayout], merge_adjacent: bool = True) -> List[Span]:
    """Merge the descriptors of all groups into as few registrations as possible:
    overlapping ranges always merge; touching ranges merge when ``merge_adjacent``."""
    return merge_ranges(
        [(p, p + n, (g.name, i)) for g in groups for i, (p, n) in enumerate(zip(g.ptrs, g.lens))],
        merge_adjacent,
    )


def merge_ranges(
    items: Sequence[Tuple[int, int, Tuple[str, int]]], merge_adjacent: bool = True
) -> List[Span]:
    """Merge ``(start, end, member)`` ranges; see :func:`merge_spans`."""
    spans: List[Span] = []
    cur = None
    for start, end, member in sorted(items):
        if cur is not None and (start < cur[1] or (merge_adjacent and start == cur[1])):
            cur = [cur[0], max(cur[1], end), cur[2] + [member], cur[3] or start == cur[1]]
            continue
        if cur is not None:
            spans.append(Span(cur[0], cur[1], tuple(cur[2]), cur[3]))
        cur = [start, end, [member], False]
    if cur is not None:
        spans.append(Span(cur[0], cur[1], tuple(cur[2]), cur[3]))
    return spans


def span_index(spans: Sequence[Span], group: GroupLayout) -> np.ndarray:
    """For each descriptor of ``group``, the index of the span that contains it."""
    out = np.empty(group.count, dtype=_U64)
    lookup = {m: k for k, s in enumerate(spans) for m in s.members}
    for i in range(group.count):
        out[i] = lookup[(group.name, i)]
    return out


def check_inside(
    ptrs: Sequence[int],
    lens: Sequence[int],
    bases: Sequence[int],
    lengths: Sequence[int],
    regs: Sequence[int],
    what: str,
) -> None:
    """Every descriptor ``[ptr, ptr+len)`` must lie inside its region ``regs[i]`` (used on
    region tables received from a peer before any address is derived from them)."""
    for i, (p, n, r) in enumerate(zip(ptrs, lens, regs)):
        if not 0 <= r < len(bases):
            raise IndexOutOfRange(f"{what} descriptor {i}: region {r} of {len(bases)}")
        if p < bases[r] or p + n > bases[r] + lengths[r]:
            raise IndexOutOfRange(
                f"{what} descriptor {i}: [{p:#x}, +{n}) outside region {r} "
                f"[{bases[r]:#x}, +{lengths[r]})"
            )


# ------------------------------------------------------------------ TP slicing


def tp_heads(num_heads: int, tp: int, rank: int) -> Tuple[int, int]:
    """Global KV-head range ``[first, first+count)`` held by ``rank`` of ``tp`` ranks.

    ``tp <= num_heads``: heads split evenly (``num_heads % tp == 0``). ``tp > num_heads``
    (e.g. GQA with fewer KV heads than ranks): each head is replicated on ``tp // num_heads``
    consecutive ranks (``tp % num_heads == 0``), so every rank holds exactly one head."""
    num_heads, tp = as_int(num_heads, "num_heads", 1), as_int(tp, "tp", 1)
    rank = as_int(rank, "rank")
    if not 0 <= rank < tp:
        raise IndexOutOfRange(f"rank {rank} out of range [0, {tp})")
    if tp <= num_heads:
        if num_heads % tp:
            raise InvalidArgument(f"{num_heads} heads do not split over tp={tp}")
        per = num_heads // tp
        return rank * per, per
    if tp % num_heads:
        raise InvalidArgument(f"tp={tp} is not a multiple of {num_heads} heads")
    return rank // (tp // num_heads), 1


def tp_sources(
    num_heads: int, src_tp: int, dst_tp: int, dst_rank: int
) -> List[Tuple[int, int, int, int]]:
    """Which source ranks feed destination rank ``dst_rank`` under heterogeneous TP.

    Returns ``[(src_rank, src_head_off, dst_head_off, n_heads)]`` with offsets in *local*
    head indices of each side, covering the destination's heads exactly once (when a head is
    replicated on several source ranks, the first holder is chosen)."""
    d0, dn = tp_heads(num_heads, dst_tp, dst_rank)
    out = []
    covered = d0
    for r in range(src_tp):
        s0, sn = tp_heads(num_heads, src_tp, r)
        lo, hi = max(s0, covered), min(s0 + sn, d0 + dn)
        if lo < hi:
            out.append((r, lo - s0, lo - d0, hi - lo))
            covered = hi
    assert covered == d0 + dn, "destination heads not covered"
    return out
