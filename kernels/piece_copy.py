"""Copy many (buffer, item-run) pieces between two address spaces in ONE launch.

The offload manager moves a retracted request's pages between device buffers and a
page-locked, device-mapped host pool. With per-layer pools that is ``runs x buffers``
pieces; issuing one ``copy_`` per piece costs a driver call each and leaves the bus idle
between them. Here every piece is described by a row of a small int64 *task table*
``[T, 3] = (src address, dst address, nbytes)`` (built on the host by
:func:`kvxfer.pools.offload.pieces.plan_tasks`, pieces split into tiles so that many programs
share the work) and one kernel launch copies them all, each program moving one tile with
16-byte vector loads and stores. The addresses are whatever the *kernel* can dereference:
device pointers, and for mapped host memory its device pointer (identical to the host
pointer under UVA). On CPU (Triton interpreter) both sides are plain CPU addresses.

Invariants:

* every address and size in a table handed to a launch with ``align=A`` is a multiple of
  ``A`` (a power of two <= 16): :func:`copy_tasks` checks it on the host copy of the table;
* pieces never overlap each other's destinations and a source is never also a destination
  (offload/restore move between distinct memories), so tiles may run in any order;
* the kernel copies raw bytes; ``T == 0`` is a no-op.

:func:`copy_pieces` is the same copy with one row per *piece* and the tiles cut by the
kernel (program ``(piece, tile)``; :func:`pieces_grid` refuses pieces too uneven for one
grid), so the host writes no row per tile. :class:`TaskLauncher` launches either kernel
without Triton's binder or torch (:mod:`kvxfer.kernels.native_launch`): the table goes into a
pinned ring slot the kernel reads, the launch is one ``cuLaunchKernel``.

:func:`copy_item_runs_reference` is the plain-torch oracle at the item level: for every
buffer ``b`` and run ``(s0, d0, n)``, ``dst_views[b][d0:d0+n] = src_views[b][s0:s0+n]``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import CudaError, InvalidArgument, ShapeMismatch, UnsupportedOperation

__all__ = [
    "BLOCK_BYTES",
    "NUM_WARPS",
    "copy_tasks",
    "copy_pieces",
    "copy_item_runs_reference",
    "ALIGNMENTS",
    "check_alignment",
    "kernel_runnable",
    "TaskLauncher",
]

# Bytes one program moves per loop iteration: 128 threads x 2 x 16-byte vectors.
BLOCK_BYTES = 4096
NUM_WARPS = 4
ALIGNMENTS = (1, 2, 4, 8, 16)


@triton.jit
def _copy_tasks_kernel(tasks, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Program i copies task i: ``nbytes`` bytes from ``src`` to ``dst`` (table row i)."""
    row = tasks + tl.program_id(0).to(tl.int64) * 3
    src_addr = tl.load(row)
    dst_addr = tl.load(row + 1)
    nbytes = tl.load(row + 2)
    # cast inline (a multiple_of hint on a helper's result is lost on Triton 3.6)
    src = src_addr.to(tl.pointer_type(tl.int8))
    dst = dst_addr.to(tl.pointer_type(tl.int8))
    if ALIGN > 1:
        src = tl.multiple_of(src, ALIGN)
        dst = tl.multiple_of(dst, ALIGN)
        nbytes = tl.multiple_of(nbytes, ALIGN)
    offs = tl.arange(0, BLOCK)
    # iterate over a count (not over byte offsets): ``i * BLOCK`` keeps its divisibility,
    # so the mask below stays constant over each ALIGN-byte vector
    for i in range(0, tl.cdiv(nbytes, BLOCK)):
        o = i * BLOCK + offs
        m = o < nbytes
        x = tl.load(src + o, mask=m)
        tl.store(dst + o, x, mask=m)


@triton.jit
def _copy_pieces_kernel(pieces, tile, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``(p, t)`` copies tile ``t`` of piece ``p`` (table row p: src, dst, nbytes):
    bytes ``[t * tile, min((t + 1) * tile, nbytes))``; a tile past the piece's end does
    nothing. The host writes one row per piece: the tiles are cut here."""
    row = pieces + tl.program_id(0).to(tl.int64) * 3
    nbytes = tl.load(row + 2)
    start = tl.program_id(1).to(tl.int64) * tile
    if start < nbytes:
        src = (tl.load(row) + start).to(tl.pointer_type(tl.int8))
        dst = (tl.load(row + 1) + start).to(tl.pointer_type(tl.int8))
        n = tl.minimum(nbytes - start, tile)
        if ALIGN > 1:
            src = tl.multiple_of(src, ALIGN)
            dst = tl.multiple_of(dst, ALIGN)
            n = tl.multiple_of(n, ALIGN)
        offs = tl.arange(0, BLOCK)
        for i in range(0, tl.cdiv(n, BLOCK)):
            o = i * BLOCK + offs
            m = o < n
            x = tl.load(src + o, mask=m)
            tl.store(dst + o, x, mask=m)


#: CUDA's grid y limit: the most tiles a piece of :func:`copy_pieces` may be cut into
MAX_TILES_PER_PIECE = 65535


def pieces_grid(nbytes: np.ndarray, tile: int) -> tuple[int, int] | None:
    """``(pieces, tiles per piece)``: the grid of :func:`copy_pieces` over pieces of
    ``nbytes`` cut into ``tile``-byte tiles, or None when that grid would be mostly empty
    programs (pieces of very different sizes: more than 4x the tiles with work, plus one per
    piece) or taller than the grid allows; the caller then cuts the tiles on the host
    (:func:`copy_tasks`)."""
    p = int(nbytes.size)
    if p == 0 or tile <= 0:
        return None
    t = -(-int(nbytes.max()) // tile)
    work = int((-(-nbytes.astype(np.int64) // tile)).sum())
    if t > MAX_TILES_PER_PIECE or p * t > 4 * work + p:
        return None
    return p, t


def pieces_alignment(*cols: np.ndarray) -> int:
    """The widest power of two <= 16 dividing every entry of the columns."""
    acc = 16
    for c in cols:
        if c.size:
            acc |= int(np.bitwise_or.reduce(c.astype(np.uint64, copy=False)))
    return acc & -acc


def copy_pieces(pieces: torch.Tensor, tile: int, align: int, *, host_pieces: np.ndarray) -> int:
    """Launch (through Triton, on the current stream) the copy of every row ``(src, dst,
    nbytes)`` of ``pieces`` cut into ``tile``-byte tiles on the device (one program per tile:
    :func:`pieces_grid`); ``host_pieces`` is the same table as numpy. Returns the programs
    launched. Raises :class:`InvalidArgument` (misaligned table, a tile that is not a
    positive multiple of 16, a grid :func:`pieces_grid` refuses)."""
    _check_table(pieces)
    if host_pieces.shape != tuple(pieces.shape):
        raise ShapeMismatch(f"host_pieces {host_pieces.shape} != pieces {tuple(pieces.shape)}")
    if tile <= 0 or tile % 16:
        raise InvalidArgument(f"tile must be a positive multiple of 16, got {tile}")
    check_alignment(host_pieces, align)
    if not host_pieces.shape[0]:
        return 0
    grid = pieces_grid(host_pieces[:, 2], tile)
    if grid is None:
        raise InvalidArgument(f"pieces too uneven for {tile}-byte tiles on the device")
    dispatch.require_runnable(_copy_pieces_kernel, pieces.device)
    with dispatch.launch_context(pieces.device):
        _copy_pieces_kernel[grid](pieces, tile, ALIGN=align, BLOCK=BLOCK_BYTES, num_warps=NUM_WARPS)
    return grid[0] * grid[1]


def kernel_runnable(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tables on ``device`` (CUDA, or the interpreter)."""
    return device.type == "cuda" or dispatch.is_interpreted(_copy_tasks_kernel)


def _check_table(tasks: torch.Tensor) -> None:
    if not isinstance(tasks, torch.Tensor):
        raise InvalidArgument(f"tasks must be a torch.Tensor, got {type(tasks).__name__}")
    if tasks.dtype != torch.int64 or tasks.dim() != 2 or tasks.shape[1] != 3:
        raise ShapeMismatch(f"tasks must be int64 [T, 3], got {tasks.dtype} {tuple(tasks.shape)}")
    if not tasks.is_contiguous():
        raise InvalidArgument(f"tasks must be contiguous, strides {tasks.stride()}")


def check_alignment(host_tasks: np.ndarray, align: int) -> None:
    """Raise unless every address and size of ``host_tasks`` is a multiple of ``align``."""
    if align not in ALIGNMENTS:
        raise InvalidArgument(f"align must be one of {ALIGNMENTS}, got {align!r}")
    if (
        host_tasks.size
        and align > 1
        and int(np.bitwise_or.reduce(host_tasks, axis=None)) & (align - 1)
    ):  # one OR pass on the hot path; locate the offender only on failure
        bad = np.flatnonzero((host_tasks % align).any(axis=1))
        if bad.size:
            raise InvalidArgument(
                f"task {int(bad[0])} = {host_tasks[bad[0]].tolist()} is not {align}-byte aligned"
            )
    if host_tasks.size and (host_tasks[:, 2] < 0).any():
        raise InvalidArgument("task sizes must be >= 0")


def copy_tasks(tasks: torch.Tensor, align: int, *, host_tasks: np.ndarray | None = None) -> int:
    """Launch the copy of every row of ``tasks`` (on the current stream). Returns the number
    of programs launched (``T``).

    ``tasks``: int64 ``[T, 3]`` on the device that runs the kernel (a CPU tensor under the
    Triton interpreter). ``host_tasks``: the same table as numpy, when the caller has it, to
    check alignment without reading ``tasks`` back (a device read-back would synchronise).
    """
    _check_table(tasks)
    if host_tasks is None:
        if tasks.device.type != "cpu":
            raise InvalidArgument("copy_tasks on a device table needs host_tasks to check it")
        host_tasks = tasks.numpy()
    if host_tasks.shape != tuple(tasks.shape):
        raise ShapeMismatch(f"host_tasks {host_tasks.shape} != tasks {tuple(tasks.shape)}")
    check_alignment(host_tasks, align)
    t = int(tasks.shape[0])
    if t:
        dispatch.require_runnable(_copy_tasks_kernel, tasks.device)
        with dispatch.launch_context(tasks.device):
            _copy_tasks_kernel[(t,)](tasks, ALIGN=align, BLOCK=BLOCK_BYTES, num_warps=NUM_WARPS)
    return t


#: (device ordinal, align, kernel) -> the natively launched kernel, or why it cannot be
_native: dict = {}


def native_kernel(ordinal: int, align: int, pieces: bool = False):
    """The copy kernel for ``align`` — the task kernel of :func:`copy_tasks`, or with
    ``pieces`` the tile-cutting one of :func:`copy_pieces` — compiled for device ``ordinal``
    and launched through :mod:`kvxfer.kernels.native_launch`, or a string saying why it
    cannot be (cached per process: compiled once)."""
    key = (int(ordinal), int(align), bool(pieces))
    got = _native.get(key)
    if got is None:
        from kvxfer.kernels.native_launch import compile_kernel

        try:
            if not torch.cuda.is_available():
                raise UnsupportedOperation("torch sees no CUDA device")
            sample = torch.empty((1, 3), dtype=torch.int64, device=f"cuda:{ordinal}")
            fn, args, sizes = (
                (_copy_pieces_kernel, (sample, 1 << 14), (8, 4))  # tile: i32, 16-divisible
                if pieces
                else (_copy_tasks_kernel, (sample,), (8,))
            )
            got = compile_kernel(
                fn, args, ordinal, NUM_WARPS, arg_sizes=sizes, ALIGN=align, BLOCK=BLOCK_BYTES
            )
        except (UnsupportedOperation, CudaError, RuntimeError) as exc:
            got = f"{type(exc).__name__}: {exc}"
        _native[key] = got
    return got


def task_launcher(ordinal: int, who: str):
    """A :class:`TaskLauncher` for device ``ordinal``, or None when native launches are off
    (``$KVXFER_NATIVE_LAUNCH=0``) or cannot run here (logged at INFO naming ``who``: the
    caller then launches through torch and Triton)."""
    from kvxfer.kernels import native_launch

    if not native_launch.enabled():
        return None
    try:
        return TaskLauncher(ordinal)
    except (UnsupportedOperation, CudaError) as exc:
        logging.getLogger(__name__).info("%s launches through Triton (%s)", who, exc)
        return None


class TaskLauncher:
    """:func:`copy_tasks` without torch or Triton on the launch path: each launch's table is
    written into a slot of a :class:`~kvxfer.kernels.native_launch.TableRing` (page-locked,
    device-mapped: the kernel reads it over the bus, nothing is uploaded) and the kernel
    compiled for its alignment is launched by ``cuLaunchKernel``; the slot's driver event is
    recorded after the launches and returned. One owner thread (a lane's loop thread, an
    offload manager's caller).

    Raises :class:`UnsupportedOperation` at construction when the kernel for 16-byte
    alignment cannot be launched this way (callers keep :func:`copy_tasks`)."""

    def __init__(self, ordinal: int) -> None:
        from kvxfer.kernels.native_launch import TableRing

        self.ordinal = int(ordinal)
        first = native_kernel(self.ordinal, 16)
        if isinstance(first, str):
            raise UnsupportedOperation(f"no native copy launch on cuda:{ordinal}: {first}")
        self.ring = TableRing(self.ordinal)
        self.ctx = self.ring.ctx

    def supports(self, groups) -> bool:
        """Whether every ``(align, table)`` group has a natively launched kernel."""
        return all(not isinstance(native_kernel(self.ordinal, a), str) for a, _ in groups)

    def launch(self, groups, stream: int):
        """Copy every row of the ``(align, host table)`` groups (:func:`split_by_alignment`
        output, tables checked here as :func:`copy_tasks` does) on ``stream`` (a CUstream
        handle); returns the event recorded after them (``query`` / ``synchronize``). Groups
        must be :meth:`supports`-ed. Raises :class:`InvalidArgument` before launching
        anything for a misaligned table, :class:`CudaError` from the driver."""
        rows = 0
        for align, g in groups:
            check_alignment(g, align)
            rows += g.shape[0] + (g.shape[0] & 1)  # each group's rows start 16-byte aligned
        pushed = self.ctx.enter()
        try:
            slot, words, dev = self.ring.take(3 * rows)
            try:
                at = 0
                for align, g in groups:
                    n = int(g.shape[0])
                    if n:
                        words[3 * at : 3 * (at + n)] = g.reshape(-1)
                        native_kernel(self.ordinal, align).launch(n, stream, dev + 24 * at)
                        at += n + (n & 1)
            finally:  # even after a failed launch: the slot is not rewritten under a running one
                ev = self.ring.done(slot, stream)
            return ev
        finally:
            self.ctx.leave(pushed)

    def launch_pieces(
        self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, tile: int, stream: int
    ):
        """Copy pieces ``src[i] -> dst[i]`` of ``nbytes[i]`` bytes (> 0) on ``stream``, cut
        into ``tile``-byte tiles (a multiple of 16 below 2**31) by the kernel itself: the
        host writes one row per piece, nothing per tile. Returns the slot's event, or None —
        nothing launched — when :func:`pieces_grid` refuses the shape or the kernel cannot be
        launched natively (the caller then cuts tiles on the host: :meth:`launch`)."""
        if tile <= 0 or tile % 16 or tile >= 1 << 31:
            return None
        grid = pieces_grid(nbytes, tile)
        if grid is None:
            return None
        kernel = native_kernel(self.ordinal, pieces_alignment(src, dst, nbytes), pieces=True)
        if isinstance(kernel, str):
            return None
        p = grid[0]
        pushed = self.ctx.enter()
        try:
            slot, words, dev = self.ring.take(3 * p)
            try:
                rows = words[: 3 * p].reshape(p, 3)
                rows[:, 0], rows[:, 1], rows[:, 2] = src, dst, nbytes
                kernel.launch(p, stream, dev, tile, grid_y=grid[1])
            finally:
                ev = self.ring.done(slot, stream)
            return ev
        finally:
            self.ctx.leave(pushed)

    def record(self, stream: int):
        """A slot's event recorded on ``stream`` with no table (after copies the caller
        issued itself, e.g. ``cuMemcpyDtoDAsync``)."""
        pushed = self.ctx.enter()
        try:
            return self.ring.done(self.ring.take(0)[0], stream)
        finally:
            self.ctx.leave(pushed)

    def close(self) -> None:
        """Wait for the ring's launches and free it (idempotent)."""
        self.ring.close()


def copy_item_runs_reference(
    src_views: Sequence[torch.Tensor], dst_views: Sequence[torch.Tensor], runs
) -> None:
    """Torch oracle: copy item rows of every buffer along ``runs`` ``[R, 3]`` of
    ``(src_start, dst_start, length)`` (vectorised: one gather/scatter per buffer)."""
    if len(src_views) != len(dst_views):
        raise ShapeMismatch(f"{len(src_views)} source views vs {len(dst_views)} destinations")
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if runs.shape[0] == 0:
        return
    lengths = runs[:, 2]
    pos = np.arange(int(lengths.sum()), dtype=np.int64)
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    src = torch.from_numpy(np.repeat(runs[:, 0], lengths) + pos - first)
    dst = torch.from_numpy(np.repeat(runs[:, 1], lengths) + pos - first)
    for b, (s, d) in enumerate(zip(src_views, dst_views)):
        if s.shape[1:] != d.shape[1:] or s.dtype != d.dtype:
            raise ShapeMismatch(
                f"buffer {b}: source {s.dtype} {tuple(s.shape)} vs "
                f"destination {d.dtype} {tuple(d.shape)}"
            )
        d.index_copy_(0, dst.to(d.device), s.index_select(0, src.to(s.device)).to(d.device))
