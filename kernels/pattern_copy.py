"""Copy one per-item run pattern of many item pairs in ONE launch (same-host device lane).

A heterogeneous-TP page moves as the same handful of byte runs in every page (a rank's head
rows of each token, a rank's head blocks, ...): per descriptor ``d``, runs ``(so, do, n)``
relative to one item on each side, applied to every item pair ``(s_k, t_k)``. Expanded, that
is ``pages x runs`` rows (hundreds of thousands for a long request); here the run table is a
few hundred rows built once per geometry, the item pairs one ``[P, 2]`` table per write, and
program ``(i, k)`` computes its own addresses:

    src = src_row[i] + s_k * src_stride[i],   dst = dst_row[i] + t_k * dst_stride[i]

A *row* is ``(src address, dst address, nbytes, src item stride, dst item stride)`` int64:
the descriptor's base plus the run's in-item offset, and the descriptor's item size on each
side (:func:`pattern_rows` builds the table; runs longer than ``tile`` bytes are cut so that
many programs share them).

Several patterns (say the piece classes of a write between different page sizes, each with
its own runs and its own item pairs) go in one launch too: their row tables concatenated,
and each item pair a ``[4]`` row ``(s, t, lo, hi)`` naming the rows ``[lo, hi)`` of its
pattern (:func:`class_items`); program ``(i, k)`` copies rows ``lo + i*ROWS ..`` below
``hi`` of pair ``k``, and the grid spans the widest pattern.

Invariants:

* every address, size and stride handed to a launch with ``align=A`` is a multiple of ``A``
  (a power of two <= 16): :func:`copy_pattern` checks the host copy of the row table and the
  bases it was built from;
* item ids are checked by the caller (the engine's planner: every id names an item of its
  side, every run lies inside one item on both sides), so each program reads and writes inside
  the named items only;
* destinations of distinct (row, item pair) programs do not overlap (the caller's runs are
  disjoint within an item and destination items are distinct), so programs run in any order.

:func:`copy_pattern_reference` is the plain-torch oracle.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import CudaError, InvalidArgument, ShapeMismatch, UnsupportedOperation

__all__ = [
    "ROW_COLS",
    "MAX_ITEMS_PER_LAUNCH",
    "pattern_rows",
    "class_items",
    "row_alignment",
    "copy_pattern",
    "copy_pattern_native",
    "copy_pattern_reference",
]

#: columns of a row: src address, dst address, nbytes, src item stride, dst item stride
ROW_COLS = 5
#: CUDA's grid y limit: a launch covers at most this many item pairs (more: several launches)
MAX_ITEMS_PER_LAUNCH = 65535
#: bytes a program moves at most (a run longer than this is cut into rows of this size)
TILE_BYTES = 1 << 16
_ALIGNMENTS = (1, 2, 4, 8, 16)


@triton.jit
def _copy_pattern_kernel(
    rows,
    items,
    n_rows,
    ROWS: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
    CLASSES: tl.constexpr = False,
):
    """Program ``(i, k)`` copies rows ``i*ROWS .. i*ROWS+ROWS-1`` of item pair ``k``
    (``CLASSES``: of its row range ``[lo, hi)``, read from its ``[4]`` item row)."""
    k = tl.program_id(1).to(tl.int64)
    if CLASSES:
        sid = tl.load(items + 4 * k)
        did = tl.load(items + 4 * k + 1)
        lo = tl.load(items + 4 * k + 2)
        hi = tl.load(items + 4 * k + 3)
    else:
        sid = tl.load(items + 2 * k)
        did = tl.load(items + 2 * k + 1)
        lo = 0
        hi = n_rows
    offs = tl.arange(0, BLOCK)
    for j in range(ROWS):
        r = lo + tl.program_id(0).to(tl.int64) * ROWS + j
        if r < hi:
            row = rows + r * 5
            src = (tl.load(row) + sid * tl.load(row + 3)).to(tl.pointer_type(tl.int8))
            dst = (tl.load(row + 1) + did * tl.load(row + 4)).to(tl.pointer_type(tl.int8))
            nbytes = tl.load(row + 2)
            if ALIGN > 1:
                src = tl.multiple_of(src, ALIGN)
                dst = tl.multiple_of(dst, ALIGN)
                nbytes = tl.multiple_of(nbytes, ALIGN)
            for b in range(0, tl.cdiv(nbytes, BLOCK)):
                o = b * BLOCK + offs
                m = o < nbytes
                x = tl.load(src + o, mask=m)
                tl.store(dst + o, x, mask=m)


def pattern_rows(
    src_bases: np.ndarray,
    dst_bases: np.ndarray,
    src_strides: np.ndarray,
    dst_strides: np.ndarray,
    runs,
    tile: int = TILE_BYTES,
) -> np.ndarray:
    """The int64 row table ``[R, 5]`` of ``runs[d] = (src offs, dst offs, lens)`` (item-
    relative) of descriptors with bases ``src_bases[d]`` / ``dst_bases[d]`` and item sizes
    ``src_strides[d]`` / ``dst_strides[d]``; runs over ``tile`` bytes cut into tiles."""
    if tile <= 0 or tile % 16:
        raise InvalidArgument(f"tile must be a positive multiple of 16, got {tile}")
    parts = []
    for d, (so, do, n) in enumerate(runs):
        so, do, n = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (so, do, n))
        if not n.size:
            continue
        k = -(-n // tile)
        if int(k.max()) > 1:  # cut long runs
            rep = np.repeat(np.arange(n.size), k)
            cut = (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)) * tile
            so, do, n = so[rep] + cut, do[rep] + cut, np.minimum(tile, n[rep] - cut)
        t = np.empty((n.size, ROW_COLS), dtype=np.int64)
        t[:, 0] = int(src_bases[d]) + so
        t[:, 1] = int(dst_bases[d]) + do
        t[:, 2] = n
        t[:, 3] = int(src_strides[d])
        t[:, 4] = int(dst_strides[d])
        parts.append(t)
    if not parts:
        return np.zeros((0, ROW_COLS), dtype=np.int64)
    return np.ascontiguousarray(np.concatenate(parts))


def class_items(parts, bounds) -> np.ndarray:
    """The ``[P, 4]`` int64 item table of several patterns in one launch: for pattern ``c``
    with item pairs ``parts[c] = (src ids, dst ids)`` and rows ``[bounds[c], bounds[c+1])``
    of the concatenated row table, one row ``(s, t, bounds[c], bounds[c+1])`` per pair."""
    n = sum(len(s) for s, _ in parts)
    out = np.empty((n, 4), dtype=np.int64)
    at = 0
    for c, (src, dst) in enumerate(parts):
        k = len(src)
        out[at : at + k, 0], out[at : at + k, 1] = src, dst
        out[at : at + k, 2], out[at : at + k, 3] = bounds[c], bounds[c + 1]
        at += k
    return out


def row_alignment(rows: np.ndarray) -> int:
    """The widest power of two <= 16 dividing every entry of ``rows``."""
    if not rows.size:
        return 16
    acc = int(np.bitwise_or.reduce(rows, axis=None)) | 16
    return acc & -acc


def _block(rows: np.ndarray) -> int:
    """Bytes per vector loop iteration: the longest row rounded up to a power of two,
    between 512 and 4096."""
    longest = int(rows[:, 2].max()) if rows.size else 1
    return min(4096, max(512, 1 << (longest - 1).bit_length()))


def launch_stats(rows: np.ndarray) -> Tuple[int, int, int]:
    """``(rows, vector block, alignment)`` of one pattern's row table: what it brings to the
    shape of a launch it is part of (see :func:`joins_launch`)."""
    return int(rows.shape[0]), _block(rows), row_alignment(rows)


def joins_launch(main: Sequence[Tuple[int, int, int]], extra: Tuple[int, int, int]) -> bool:
    """Whether a pattern of :func:`launch_stats` ``extra`` can join a launch of patterns
    ``main`` (their stats) without widening it: no more rows than the widest (the grid
    spans the widest pattern, for every item), a vector block no longer (the block follows
    the longest row) and an alignment no narrower (the launch takes the narrowest). A
    pattern without rows joins anything."""
    rows, block, align = extra
    return not rows or (
        rows <= max(m[0] for m in main)
        and block <= max(m[1] for m in main)
        and align >= min(m[2] for m in main)
    )


def _check_rows(host_rows: np.ndarray, align: int) -> None:
    if align not in _ALIGNMENTS or row_alignment(host_rows) % align:
        raise InvalidArgument(f"the row table is not {align}-byte aligned (or {align} invalid)")
    if host_rows.size and (host_rows[:, 2] <= 0).any():
        raise InvalidArgument("row sizes must be > 0")


def _shape(host_rows: np.ndarray) -> tuple[int, int, int]:
    """``(block bytes, rows per program, warps)`` of a launch over this row table."""
    block = _block(host_rows)
    return block, max(1, 8192 // block), max(1, min(4, block // 512))


#: (ordinal, align, block, rows per program, warps, n_rows % 16 == 0) -> the natively
#: launched kernel, or why it cannot be
_native: dict = {}


def checked_shape(host_rows: np.ndarray, align: int) -> Tuple[int, int, int]:
    """Check ``host_rows`` for ``align`` as :func:`copy_pattern_native` does
    (:class:`InvalidArgument`) and return its launch shape ``(block bytes, rows per program,
    warps)``: what that function takes as ``shape`` for a table checked once when cached."""
    _check_rows(host_rows, align)
    return _shape(host_rows)


def _native_kernel(
    ordinal: int, align: int, host_rows: np.ndarray, shape: Tuple[int, int, int], classes: bool
):
    block, per, warps = shape
    n_rows = 16 if classes else int(host_rows.shape[0])  # with classes: unused, always 16
    key = (int(ordinal), int(align), block, per, warps, n_rows % 16 == 0, classes)
    got = _native.get(key)
    if got is None:
        from kvxfer.kernels.native_launch import compile_kernel

        try:
            t = torch.empty((1, ROW_COLS), dtype=torch.int64, device=f"cuda:{ordinal}")
            got = compile_kernel(
                _copy_pattern_kernel,
                (t, t, 16 if key[-1] else 17),  # n_rows's specialisation class (i32)
                ordinal,
                warps,
                arg_sizes=(8, 8, 4),
                ROWS=per,
                ALIGN=align,
                BLOCK=block,
                CLASSES=classes,
            )
        except (UnsupportedOperation, CudaError, RuntimeError) as exc:
            got = f"{type(exc).__name__}: {exc}"
        _native[key] = got
    return got


#: the parts of a native launch that ``copy_pattern_native``'s ``stamps`` end
NATIVE_PARTS = (
    "items + kernel lookup",
    "ring take",
    "table write",
    "cuLaunchKernel",
    "event record",
)


def _no_stamp() -> None:
    pass


def copy_pattern_native(
    ring,
    rows_ptr: int,
    host_rows: np.ndarray,
    pairs: np.ndarray,
    align: int,
    stream: int,
    span: int = 0,
    shape: Optional[Tuple[int, int, int]] = None,
    stamps: Optional[list] = None,
):
    """:func:`copy_pattern` launched by ``cuLaunchKernel`` (:mod:`kvxfer.kernels.
    native_launch`): ``rows_ptr`` is the device copy of ``host_rows``, the item pairs
    ``pairs`` (int64 ``[P, 2]``, or ``[P, 4]`` of several patterns with ``span`` their
    widest row range: :func:`class_items`) are written into a slot of ``ring`` (a
    ``TableRing`` of the same device) and read from there; returns the slot's event
    recorded on ``stream``, or None — nothing launched — when this table cannot be launched
    natively (one row, a kernel the native path refuses: the caller uses
    :func:`copy_pattern`). Checks the rows as there unless ``shape`` is given (the table's
    :func:`checked_shape`, computed when it was cached); raises :class:`InvalidArgument`
    before launching anything. ``stamps`` (diagnostics): ``time.perf_counter()`` is
    appended after the kernel's lookup, the ring slot's take, the table's write, the
    launch and the event's record (:data:`NATIVE_PARTS`)."""
    if shape is None:
        shape = checked_shape(host_rows, align)
    n_rows, n_items = int(host_rows.shape[0]), int(pairs.shape[0])
    cols = int(pairs.shape[1])
    classes = cols == 4
    if classes and not 0 < span <= n_rows:
        raise InvalidArgument(f"span {span} of patterns over {n_rows} rows")
    if n_rows <= 1 or n_rows >= 1 << 31:  # Triton makes 1 a constant; i32 parameter
        return None
    kernel = _native_kernel(ring.ordinal, align, host_rows, shape, classes)
    if isinstance(kernel, str):
        return None
    per = shape[1]
    grid_x = -(-(span if classes else n_rows) // per)
    stamp = _no_stamp  # without stamps: no clock read on the launch path
    if stamps is not None:
        out = stamps

        def stamp() -> None:
            out.append(time.perf_counter())

    stamp()
    pushed = ring.ctx.enter()
    try:
        slot, words, dev = ring.take(cols * n_items)
        stamp()
        try:
            words[: cols * n_items] = pairs.reshape(-1)
            stamp()
            for first in range(0, n_items, MAX_ITEMS_PER_LAUNCH):
                part = min(MAX_ITEMS_PER_LAUNCH, n_items - first)
                kernel.launch(
                    grid_x,
                    stream,
                    rows_ptr,
                    dev + 8 * cols * first,
                    16 if classes else n_rows,
                    grid_y=part,
                )
            stamp()
        finally:  # even after a failed launch: the slot is not rewritten under a running one
            ev = ring.done(slot, stream)
        stamp()
        return ev
    finally:
        ring.ctx.leave(pushed)


def copy_pattern(
    rows: torch.Tensor,
    items: torch.Tensor,
    align: int,
    *,
    host_rows: np.ndarray,
    span: int = 0,
) -> int:
    """Launch the copy of every row of ``rows`` for every item pair of ``items`` (int64
    ``[P, 2]``, on the same device) on the current stream; returns the programs launched.
    ``host_rows``: the row table as numpy (alignment is checked there, no read-back).
    Several patterns: ``items`` ``[P, 4]`` (:func:`class_items`), ``span`` the widest of
    their row ranges."""
    classes = isinstance(items, torch.Tensor) and items.dim() == 2 and items.shape[1] == 4
    for name, t, cols in (("rows", rows, ROW_COLS), ("items", items, 4 if classes else 2)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or t.dim() != 2 or t.shape[1] != cols or not t.is_contiguous():
            raise ShapeMismatch(
                f"{name} must be contiguous int64 [N, {cols}], got {t.dtype} {tuple(t.shape)}"
            )
    if items.device != rows.device:
        raise InvalidArgument(f"rows on {rows.device}, items on {items.device}")
    if host_rows.shape != tuple(rows.shape):
        raise ShapeMismatch(f"host_rows {host_rows.shape} != rows {tuple(rows.shape)}")
    _check_rows(host_rows, align)
    n_rows, n_items = int(rows.shape[0]), int(items.shape[0])
    if classes and not 0 < span <= n_rows:
        raise InvalidArgument(f"span {span} of patterns over {n_rows} rows")
    if not n_rows or not n_items:
        return 0
    dispatch.require_runnable(_copy_pattern_kernel, rows.device)
    block, per, warps = _shape(host_rows)  # rows per program: ~8 KiB of small runs each
    launched = 0
    with dispatch.launch_context(rows.device):
        for first in range(0, n_items, MAX_ITEMS_PER_LAUNCH):
            part = items[first : first + MAX_ITEMS_PER_LAUNCH]
            grid = (-(-(span if classes else n_rows) // per), int(part.shape[0]))
            _copy_pattern_kernel[grid](
                rows,
                part,
                n_rows,
                ROWS=per,
                ALIGN=align,
                BLOCK=block,
                CLASSES=classes,
                num_warps=warps,
            )
            launched += grid[0] * grid[1]
    return launched


def copy_pattern_reference(
    src: torch.Tensor, dst: torch.Tensor, rows: np.ndarray, items: np.ndarray
) -> None:
    """Torch oracle over two flat uint8 tensors whose row addresses are *offsets* into
    ``src`` / ``dst``: for every row and item pair, the row's bytes of item ``s`` land in
    item ``t`` (``items`` ``[P, 4]``: the rows ``[lo, hi)`` of each pair only)."""
    table = np.asarray(rows, dtype=np.int64).tolist()
    items = np.asarray(items, dtype=np.int64)
    if items.ndim == 2 and items.shape[1] == 4:
        pairs = [(s, t, lo, hi) for s, t, lo, hi in items.tolist()]
    else:
        pairs = [(s, t, 0, len(table)) for s, t in items.reshape(-1, 2).tolist()]
    for s, t, lo, hi in pairs:
        for so, do, n, ss, ds in table[lo:hi]:
            a, b = so + s * ss, do + t * ds
            dst[b : b + n] = src[a : a + n]
