"""Torch-free task planning for the fused offload/restore copy (one kernel launch).

Inputs: a *pointer table* (per buffer: source base address, destination base address,
item length in bytes) and the item *runs* ``[R, 3] = (src_start, dst_start, length)``
shared by every buffer of the table (see :func:`kvxfer.pools.offload.runs.contiguous_runs`).
Every (buffer, run) pair is a *piece* of ``length * item_len`` contiguous bytes on both
sides. Pieces are cut into *tiles* of at most ``tile_bytes`` so that many GPU programs
share a request, and each tile becomes one task row ``(src address, dst address, nbytes)``
of the int64 table the kernel (:mod:`kvxfer.kernels.piece_copy`) reads.

Invariants (tested exhaustively): the tasks of a plan cover every piece's bytes exactly
once, in piece order (buffer-major, then run order), each tile starting at a multiple of
``tile_bytes`` inside its piece; ``tile_bytes`` is a positive multiple of 16; a task's
*alignment* is the largest power of two <= 16 dividing both addresses and its size.
Everything is vectorised numpy (no Python loop per page or per tile).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

__all__ = [
    "PieceTable",
    "plan_tasks",
    "pick_tile_bytes",
    "split_by_alignment",
    "task_alignment",
    "wants_fused",
    "MAX_ALIGN",
    "tile_pieces",
]

MAX_ALIGN = 16
# tile sizes pick_tile_bytes chooses between (powers of two)
MIN_TILE = 8192
MAX_TILE = 1 << 20
TARGET_TASKS = 2048  # >= 2 programs per SM on a 132-SM GPU; 48 KiB of table at most


class PieceTable:
    """Per-buffer ``(src base, dst base, item_len)``: one row per buffer, int64."""

    def __init__(
        self, src_bases: Sequence[int], dst_bases: Sequence[int], item_lens: Sequence[int]
    ) -> None:
        self.src = np.asarray(src_bases, dtype=np.int64).reshape(-1)
        self.dst = np.asarray(dst_bases, dtype=np.int64).reshape(-1)
        self.lens = np.asarray(item_lens, dtype=np.int64).reshape(-1)
        if not (self.src.shape == self.dst.shape == self.lens.shape):
            raise ShapeMismatch(
                f"pointer table columns differ in length: {self.src.size}, "
                f"{self.dst.size}, {self.lens.size}"
            )
        if self.lens.size and (self.lens <= 0).any():
            i = int(np.flatnonzero(self.lens <= 0)[0])
            raise InvalidArgument(f"item_lens[{i}] = {int(self.lens[i])} must be positive")
        # every task planned from this table with a tile that is a multiple of MAX_ALIGN is
        # at least this aligned (addresses are base + k * item_len + j * tile)
        acc = int(
            np.bitwise_or.reduce(np.concatenate((self.src, self.dst, self.lens, [MAX_ALIGN])))
        )
        self.align = acc & -acc

    def __len__(self) -> int:
        return int(self.lens.size)

    def swapped(self) -> "PieceTable":
        """The same table with source and destination exchanged (restore vs offload)."""
        return PieceTable(self.dst, self.src, self.lens)


def wants_fused(pieces: int, nbytes: int, *, min_pieces: int, max_piece_bytes: int) -> bool:
    """The automatic choice: one fused launch when a request has at least ``min_pieces``
    (buffer, run) pieces averaging at most ``max_piece_bytes`` bytes; otherwise one copy_
    per piece (few pieces cost few driver calls, and large pieces already run the copy
    engines at full speed)."""
    return pieces >= min_pieces and nbytes <= max_piece_bytes * pieces


def pick_tile_bytes(
    total_bytes: int, *, target_tasks: int = TARGET_TASKS, lo: int = MIN_TILE, hi: int = MAX_TILE
) -> int:
    """A power of two in ``[lo, hi]`` giving about ``target_tasks`` tiles for the request:
    small requests still spread over many programs, large ones keep the table small."""
    want = max(1, -(-int(total_bytes) // max(1, int(target_tasks))))
    tile = 1 << (want - 1).bit_length()
    return int(min(max(tile, lo), hi))


def plan_tasks(table: PieceTable, runs: np.ndarray, tile_bytes: int) -> np.ndarray:
    """The int64 ``[T, 3]`` task rows ``(src, dst, nbytes)`` of every (buffer, run) piece."""
    if int(tile_bytes) != tile_bytes or tile_bytes <= 0 or tile_bytes % MAX_ALIGN:
        raise InvalidArgument(
            f"tile_bytes must be a positive multiple of {MAX_ALIGN}, got {tile_bytes!r}"
        )
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if runs.shape[0] == 0 or len(table) == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if (runs[:, 2] <= 0).any() or (runs[:, :2] < 0).any():
        raise InvalidArgument("runs need non-negative starts and positive lengths")
    lens = table.lens[:, None]  # [B, 1]
    src = (table.src[:, None] + runs[None, :, 0] * lens).reshape(-1)  # buffer-major
    dst = (table.dst[:, None] + runs[None, :, 1] * lens).reshape(-1)
    nbytes = (runs[None, :, 2] * lens).reshape(-1)
    return tile_pieces(src, dst, nbytes, tile_bytes)


def tile_pieces(
    src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, tile_bytes: int
) -> np.ndarray:
    """Task rows ``(src, dst, nbytes)`` of pieces (parallel int64 arrays, sizes > 0) cut
    into tiles of at most ``tile_bytes``, in piece order."""
    if int(tile_bytes) != tile_bytes or tile_bytes <= 0 or tile_bytes % MAX_ALIGN:
        raise InvalidArgument(
            f"tile_bytes must be a positive multiple of {MAX_ALIGN}, got {tile_bytes!r}"
        )
    if nbytes.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    tile = int(tile_bytes)
    k = -(-nbytes // tile)  # tiles per piece, >= 1
    if (k == k[0]).all():  # common: equal pieces (one run length) -> broadcasting only
        off = np.arange(int(k[0]), dtype=np.int64) * tile
        out = np.empty((nbytes.size, off.size, 3), dtype=np.int64)
        out[:, :, 0] = src[:, None] + off
        out[:, :, 1] = dst[:, None] + off
        out[:, :, 2] = np.minimum(tile, nbytes[:, None] - off)
        return out.reshape(-1, 3)
    piece = np.repeat(np.arange(nbytes.size, dtype=np.int64), k)
    first = np.cumsum(k) - k
    off = (np.arange(int(k.sum()), dtype=np.int64) - np.repeat(first, k)) * tile
    out = np.empty((piece.size, 3), dtype=np.int64)
    out[:, 0] = src[piece] + off
    out[:, 1] = dst[piece] + off
    out[:, 2] = np.minimum(tile, nbytes[piece] - off)
    return out


def task_alignment(tasks: np.ndarray) -> np.ndarray:
    """Per task: the largest power of two <= 16 dividing its two addresses and its size."""
    acc = tasks[:, 0] | tasks[:, 1] | tasks[:, 2] | MAX_ALIGN
    return acc & -acc


def split_by_alignment(tasks: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``[(align, tasks with that alignment)]``, widest first; usually one group (every
    pool buffer is 16-byte aligned with 16-byte multiple items). Row order is kept within a
    group; each group is C-contiguous."""
    if tasks.shape[0] == 0:
        return []
    al = task_alignment(tasks)
    if (al == al[0]).all():
        return [(int(al[0]), np.ascontiguousarray(tasks))]
    return [
        (int(a), np.ascontiguousarray(tasks[al == a]))
        for a in sorted(np.unique(al).tolist(), reverse=True)
    ]
