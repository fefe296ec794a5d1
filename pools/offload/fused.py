"""Fused offload/restore copies: every (buffer, page-run) piece of a request in one launch.

The copy_-based :class:`~kvxfer.pools.offload.copier.Copier` issues one bus copy per run and
buffer; a per-layer pool with 64 buffers pays 64+ driver calls per request, and short runs
leave the bus idle between them. :class:`FusedCopier` instead builds a task table on the
host (pointer table per buffer: device base, host base as the *device* sees it, item
length; see :mod:`kvxfer.pools.offload.pieces`), uploads it with one small asynchronous copy and
launches :mod:`kvxfer.kernels.piece_copy` once per alignment class (once for every pool whose
buffers are 16-byte aligned): the kernel's programs load from the device buffers and store
straight into the mapped host pool (offload), or the reverse (restore), 16 bytes per
vector, with many programs in flight.

Everything is issued on the caller's current stream (the manager's copy streams) and
nothing synchronises. The table's pinned host copy is owned by torch's pinned caching
allocator, which keeps it alive until the upload has run; the device copy is freed in
stream order. On CPU (tests, Triton interpreter) "device" and "host" are both CPU memory
and ``device_delta`` is 0.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from kvxfer.kernels.cuda_driver import memcpy_batch_async
from kvxfer.kernels.piece_copy import copy_tasks, task_launcher

from .pieces import MAX_ALIGN, PieceTable, pick_tile_bytes, plan_tasks, split_by_alignment

logger = logging.getLogger(__name__)

__all__ = ["FusedCopier", "Part"]

#: default ``first`` of :meth:`FusedCopier.copy_batch`: pieces in its first driver call
#: (bench/results/offload-host-h200.md)
BATCH_FIRST = 4

# (device item views, host item views, runs [R, 3] of (device start, host start, length))
Part = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], np.ndarray]


class FusedCopier:
    """One-launch copies between device item views and a device-mapped host pool.

    ``device_delta``: device address minus host address of the host pool's memory (0 under
    UVA and on CPU). ``tile_bytes``: bytes per kernel program (``None``: chosen per request
    by :func:`~kvxfer.pools.offload.pieces.pick_tile_bytes`).
    """

    def __init__(
        self,
        device: torch.device,
        to_host: bool,
        device_delta: int,
        *,
        tile_bytes: int | None = None,
    ) -> None:
        self.device = device
        self.to_host = bool(to_host)
        self.device_delta = int(device_delta)
        self.tile_bytes = tile_bytes
        self.launches = 0  # kernel launches issued so far (all requests)
        self._tasks = (
            task_launcher(device.index or 0, "the fused offload path")
            if device.type == "cuda"
            else None
        )
        # pointer tables per (device views list, host views list): the manager passes the
        # same cached lists every call; the entries hold the lists so ids stay unique
        self._tables: dict[tuple[int, int], tuple] = {}

    @property
    def native(self) -> bool:
        """Whether :meth:`copy` launches natively when given the stream's handle."""
        return self._tasks is not None

    def _table(self, dev_views, host_views) -> PieceTable:
        key = (id(dev_views), id(host_views))
        hit = self._tables.get(key)
        if hit is not None and hit[0] is dev_views and hit[1] is host_views:
            return hit[2]
        table = PieceTable(
            [v.data_ptr() for v in dev_views],
            [h.data_ptr() + self.device_delta for h in host_views],
            [int(v.shape[1]) for v in dev_views],
        )
        if len(self._tables) >= 8:  # other target pools: keep the cache small
            self._tables.pop(next(iter(self._tables)))
        self._tables[key] = (dev_views, host_views, table)
        return table

    def plan(self, parts: Sequence[Part]) -> tuple[np.ndarray, int]:
        """The task table ``[T, 3]`` (src, dst, nbytes) for these parts (host side only)
        and an alignment every task has (the tables' common alignment)."""
        live = [(dv, hv, r) for dv, hv, r in parts if len(dv) and r.shape[0]]
        if not live:
            return np.zeros((0, 3), dtype=np.int64), MAX_ALIGN
        tables = [self._table(dv, hv) for dv, hv, _ in live]
        total = sum(int(r[:, 2].sum()) * int(t.lens.sum()) for t, (_, _, r) in zip(tables, live))
        tile = self.tile_bytes or pick_tile_bytes(total)
        chunks = []
        for table, (_, _, runs) in zip(tables, live):
            tasks = plan_tasks(table, runs, tile)  # (device addr, host addr, nbytes)
            if not self.to_host:
                tasks[:, [0, 1]] = tasks[:, [1, 0]]
            chunks.append(tasks)
        tasks = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        return tasks, min(t.align for t in tables)

    def pieces(self, parts: Sequence[Part]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dst, src, nbytes)`` int64 arrays, one entry per (buffer, run) piece of
        ``parts`` (host side only; pieces whole, buffer-major within a part)."""
        dev, host, size = [], [], []
        for dv, hv, runs in parts:
            if not len(dv) or not runs.shape[0]:
                continue
            t = self._table(dv, hv)
            lens = t.lens[:, None]  # [B, 1] x runs [R] -> [B, R]
            dev.append((t.src[:, None] + runs[:, 0] * lens).ravel())
            host.append((t.dst[:, None] + runs[:, 1] * lens).ravel())
            size.append((runs[:, 2] * lens).ravel())
        if len(dev) == 1:
            d, h, n = dev[0], host[0], size[0]
        elif dev:
            d, h, n = np.concatenate(dev), np.concatenate(host), np.concatenate(size)
        else:
            d = h = n = np.zeros(0, dtype=np.int64)
        return (h, d, n) if self.to_host else (d, h, n)

    def copy_batch(self, parts: Sequence[Part], stream: int, first: int = BATCH_FIRST) -> int:
        """Every piece of ``parts`` whole, through ``cuMemcpyBatchAsync`` on ``stream`` (a
        CUstream handle) on the copy engines; needs CUDA, a driver that has the call and
        ``device_delta == 0``. The first call carries ``first`` pieces, each later one twice
        the previous (``first=0``: all in one call), so the copy engines start after one
        short driver call while the host posts the rest (the call costs host time per
        copy). Returns the driver calls issued."""
        dst, src, nbytes = self.pieces(parts)
        total, calls, i = int(nbytes.size), 0, 0
        k = int(first) or total
        dev = self.device.index or 0
        while i < total:
            j = min(total, i + k)
            memcpy_batch_async(
                dst[i:j],
                src[i:j],
                nbytes[i:j],
                stream,
                dev,
                src_host=not self.to_host,
                dst_host=self.to_host,
            )
            calls, i, k = calls + 1, j, 2 * k
        self.launches += calls
        return calls

    def copy(self, parts: Sequence[Part], stream: int | None = None) -> int:
        """Issue the copies of ``parts`` on ``stream`` (a CUstream handle) through the native
        launcher when there is one (one table row per piece, tiles cut by the kernel; pieces
        too uneven for that: tiles cut here), else on the current stream (which must then be
        that stream); returns kernel launches."""
        if self._tasks is not None and stream is not None:
            dst, src, nbytes = self.pieces(parts)  # one row per piece, tiles cut on the device
            total = int(nbytes.sum())
            tile = self.tile_bytes or pick_tile_bytes(total)
            if nbytes.size and self._tasks.launch_pieces(src, dst, nbytes, tile, stream):
                self.launches += 1
                return 1
        tasks, align = self.plan(parts)
        # tables aligned to 16 bytes (every real pool) give one launch without per-task work
        groups = [(align, tasks)] if align == MAX_ALIGN else split_by_alignment(tasks)
        if self._tasks is not None and stream is not None and self._tasks.supports(groups):
            self._tasks.launch(groups, stream)
            self.launches += len(groups)
            return len(groups)
        launches = 0
        for align, group in groups:
            table = torch.from_numpy(group)
            if self.device.type == "cuda":
                table = table.pin_memory().to(self.device, non_blocking=True)
            copy_tasks(table, align, host_tasks=group)
            launches += 1
        self.launches += launches
        return launches
