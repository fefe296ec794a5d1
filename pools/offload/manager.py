"""Offload manager: retract a request's KV pages and state slots to host memory and bring
them back later, usually into different pages and slots.

Works over ANY pool through its descriptor views: ``pool.get_item_views()`` (uint8
``[num_pages, item_len]`` per KV buffer; row p = page p) and, where the pool has recurrent
state, ``pool.get_state_item_views()`` (row s = slot s). Per-layer MHA, page-major, MLA and
hybrid pools are therefore handled by the same code; page-major pools simply have one view.

Copies: the pairing device id -> host id is split into runs contiguous on both sides;
every (buffer, run) pair is a *piece*. Four paths move them:

* **batch** (CUDA, a driver with ``cuMemcpyBatchAsync`` (>= 12.8), a pinned host pool at its
  UVA address): a request whose pieces average at least ``batch_min_piece_bytes`` (default
  :data:`BATCH_MIN_PIECE_BYTES`) goes through ``cuMemcpyBatchAsync`` on the copy engines
  (:func:`kvxfer.kernels.cuda_driver.memcpy_batch_async`), whatever their size, in a few
  calls growing from ``batch_first_pieces`` pieces (the copy starts after the first): large
  pieces cross the bus faster that way than through the kernel, single pages slower
  (bench/results/offload-host-h200.md), and a few calls replace a ``copy_`` per piece.
* **fused** (:mod:`kvxfer.pools.offload.fused`, CUDA with a device-mapped pinned host pool): ONE
  Triton kernel launch moves every piece of the request (KV and state together) straight
  between the device buffers and the host pool. Chosen automatically when the request
  has at least ``fused_min_pieces`` pieces averaging at most ``fused_max_piece_bytes``
  (large contiguous pieces keep the copy engines); ``fused=True`` forces it for every
  request not taken by the batch copy (also on CPU under the Triton interpreter, for tests),
  ``fused=False`` disables it and the batch copy.
* **direct** (:mod:`kvxfer.pools.offload.copier`): each piece is ONE ``copy_``.
* **staged**: requests broken into many short runs go through a bounded device staging
  buffer (gather, then one large copy per buffer and batch; allocated once at
  construction: ``staging_bytes``, default 64 MiB per direction on CUDA when the fused path
  is unavailable, none otherwise and on CPU).

The path taken is recorded on the handle (``handle.path``). On CUDA, offloads run on
a dedicated device-to-host stream and restores on a host-to-device stream; each first waits
(stream-side) for the work already queued on the caller's current stream (through one reusable
driver event, :class:`~kvxfer.kernels.cuda_driver.StreamLink`: the host time before the copy
starts is what a request pays on top of the bus), and records an event that the handle
exposes. Nothing on this path synchronises the device. On CPU the
copies are plain synchronous copies, chunked the same way.

Memory: host memory comes from a bounded :class:`~kvxfer.pools.offload.host_pool.HostPool`;
``discard``/``abort`` and ``restore`` return it at once. Restore frees the host block at
submission and leaves its event as a *fence*: later offloads (the only writers of host
memory) wait for it on their stream before writing, so reuse never races a pending read.

Validation happens before any copy or allocation: ids must be 1-D integers inside the pool
(page 0 and slot 0 are reserved), unique, and a restore must match the handle's page and
slot counts and the source pool's geometry; violations raise typed errors and write nothing.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from kvxfer.kernels.cuda_driver import StreamLink, batch_available
from kvxfer.kernels.errors import (
    CudaError,
    IndexOutOfRange,
    InvalidArgument,
    ShapeMismatch,
    UnsupportedOperation,
)
from kvxfer.kernels.piece_copy import kernel_runnable

from .copier import Copier
from .fused import BATCH_FIRST, FusedCopier
from .handle import OffloadHandle, OffloadState
from .host_pool import HostPool
from .pieces import wants_fused
from .runs import as_id_array, check_ids, expand_extents, pair_runs
from .views import pool_geometry, pool_views

logger = logging.getLogger(__name__)

__all__ = ["OffloadManager", "pool_views", "pool_geometry"]

#: the current CUstream handle of a device index without building a torch Stream object
#: (``torch.cuda.current_stream`` costs tens of µs of host time per call on the H200 host)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _rows(views) -> int:
    """Rows every one of ``views`` has (0 for none)."""
    return min((int(v.shape[0]) for v in views), default=0)


def _ids(arr: np.ndarray, views, rows: int, what: str) -> bool:
    """Check ``arr`` against ``rows`` rows of ``views`` (id 0 is the reserved padding page /
    dummy slot); returns whether the ids increase."""
    if arr.size and not views:
        raise InvalidArgument(f"{what} given but the pool has no such buffers")
    return check_ids(arr, 1, rows, what)


def _both(pages, slots, names, views, rows) -> tuple[bool, bool]:
    """:func:`_ids` of the pages and of the slots against their views and row counts."""
    return (_ids(pages, views[0], rows[0], names[0]), _ids(slots, views[1], rows[1], names[1]))


def _on(stream):
    """``torch.cuda.stream(stream)``, or nothing for None (CPU)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


#: default of ``batch_min_piece_bytes``: a request whose (buffer, run) pieces average at least
#: this many bytes goes through cuMemcpyBatchAsync (runs of 4 pages, 128 KiB pieces: batch
#: ahead of the kernel; single 32 KiB pages: the kernel ahead; bench/results/offload-host-h200.md)
BATCH_MIN_PIECE_BYTES = 64 << 10


class OffloadManager:
    """Offload/restore of requests of one device pool through one bounded host pool.

    ``host_pool``: an existing :class:`HostPool` with the pool's item geometry, or ``None``
    to build one from ``num_host_pages`` / ``host_capacity_bytes`` and ``num_host_slots``
    (pinned when the pool lives on CUDA unless ``pin_memory`` says otherwise).
    ``staging_bytes`` (per direction) and ``min_chunk_bytes`` steer the staged path for
    fragmented requests (see :mod:`kvxfer.pools.offload.copier`); ``staging_bytes=0`` disables it.
    ``fused`` (``None``: automatic on CUDA, ``True``: always, ``False``: never),
    ``fused_min_pieces``, ``fused_max_piece_bytes`` and ``fused_tile_bytes`` steer the
    one-launch path (see the module docstring); ``fused=True`` where it cannot run (host
    pool not device-mapped; CPU without the Triton interpreter) raises
    ``UnsupportedOperation``. ``batch_min_piece_bytes``: the batch copy's threshold (0: never);
    ``batch_first_pieces``: pieces in its first driver call, each later call twice the
    previous (0: one call; :meth:`FusedCopier.copy_batch`).

    Not thread-safe: one scheduler thread drives a manager (handles may be awaited from
    an event loop on that thread).
    """

    def __init__(
        self,
        pool,
        host_pool: HostPool | None = None,
        *,
        num_host_pages: int | None = None,
        host_capacity_bytes: int | None = None,
        num_host_slots: int = 0,
        pin_memory: bool | None = None,
        staging_bytes: int | None = None,
        min_chunk_bytes: int = 2 << 20,
        fused: bool | None = None,
        fused_min_pieces: int = 4,
        fused_max_piece_bytes: int = 2 << 20,
        fused_tile_bytes: int | None = None,
        batch_min_piece_bytes: int = BATCH_MIN_PIECE_BYTES,
        batch_first_pieces: int = BATCH_FIRST,
    ) -> None:
        self.pool = pool
        kv, st = pool_views(pool)
        self._set_views(kv, st)
        self.geometry = pool_geometry(pool, kv, st)
        self.device = (kv or st)[0].device
        self._cuda = self.device.type == "cuda"
        if host_pool is None:
            host_pool = HostPool.for_views(
                kv,
                st,
                num_pages=num_host_pages,
                num_slots=num_host_slots,
                capacity_bytes=host_capacity_bytes,
                pin_memory=self._cuda if pin_memory is None else pin_memory,
            )
            self._owns_host = True
        else:
            if num_host_pages is not None or host_capacity_bytes is not None or num_host_slots:
                raise InvalidArgument("give either host_pool or its sizes, not both")
            self._owns_host = False
        if (host_pool.kv_item_lens, host_pool.state_item_lens) != self.geometry[:2]:
            raise ShapeMismatch(
                f"host pool item lens {host_pool.kv_item_lens}/{host_pool.state_item_lens} "
                f"do not match the pool's {self.geometry[0]}/{self.geometry[1]}"
            )
        self.host = host_pool
        self._link: StreamLink | None = None
        if self._cuda:
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)
            self._d2h_raw, self._h2d_raw = self._d2h.cuda_stream, self._h2d.cuda_stream
            try:
                self._link = StreamLink(self.device.index)
            except CudaError as exc:  # no cuda-bindings: torch's stream waits instead
                logger.info("offload streams ordered through torch (%s)", exc)
        self._setup_fused(fused, fused_min_pieces, fused_max_piece_bytes, fused_tile_bytes)
        if int(batch_min_piece_bytes) != batch_min_piece_bytes or batch_min_piece_bytes < 0:
            raise InvalidArgument(
                f"batch_min_piece_bytes must be an integer >= 0, got {batch_min_piece_bytes!r}"
            )
        #: pieces averaging at least this go as one cuMemcpyBatchAsync; 0 where it cannot
        #: (CPU, no such driver call, a host pool not at its UVA address) or when disabled
        self.batch_min_piece_bytes = (
            int(batch_min_piece_bytes)
            if self._fused_out is not None
            and self._cuda
            and self.host.device_delta == 0
            and batch_min_piece_bytes
            and batch_available()
            else 0
        )
        if int(batch_first_pieces) != batch_first_pieces or batch_first_pieces < 0:
            raise InvalidArgument(
                f"batch_first_pieces must be an integer >= 0, got {batch_first_pieces!r}"
            )
        self.batch_first_pieces = int(batch_first_pieces)
        if staging_bytes is None:
            staging_bytes = (64 << 20) if self._cuda and self._fused_out is None else 0
        if int(staging_bytes) != staging_bytes or staging_bytes < 0:
            raise InvalidArgument(f"staging_bytes must be an integer >= 0, got {staging_bytes!r}")
        kw = dict(staging_bytes=int(staging_bytes), min_chunk_bytes=min_chunk_bytes)
        self._out = Copier(self.device, True, **kw)
        self._in = Copier(self.device, False, **kw)
        self._live: dict[int, OffloadHandle] = {}
        self.stats = {
            "offloads": 0,
            "restores": 0,
            "discards": 0,
            "chunks": 0,
            "bytes": 0,
            "staged": 0,
            "fused": 0,
            "batch": 0,
        }

    def _setup_fused(self, fused, min_pieces, max_piece_bytes, tile_bytes) -> None:
        if fused not in (None, True, False):
            raise InvalidArgument(f"fused must be None, True or False, got {fused!r}")
        for name, v in (
            ("fused_min_pieces", min_pieces),
            ("fused_max_piece_bytes", max_piece_bytes),
        ):
            if int(v) != v or v < 1:
                raise InvalidArgument(f"{name} must be an integer >= 1, got {v!r}")
        if tile_bytes is not None and (
            int(tile_bytes) != tile_bytes or tile_bytes <= 0 or tile_bytes % 16
        ):
            raise InvalidArgument(
                f"fused_tile_bytes must be a positive multiple of 16, got {tile_bytes!r}"
            )
        self.fused_mode = fused
        self.fused_min_pieces = int(min_pieces)
        self.fused_max_piece_bytes = int(max_piece_bytes)
        self._fused_out = self._fused_in = None
        if fused is False:
            return
        if self._cuda:
            delta, why = self.host.device_delta, "the host pool is not mapped for device access"
            if not self.host.pinned:
                delta, why = None, "the host pool is not pinned"
        elif fused and kernel_runnable(self.device):  # CPU: only on request (interpreter)
            delta, why = 0, ""
        else:
            delta, why = None, f"the kernel cannot run on {self.device.type}"
        if delta is None:
            if fused:
                raise UnsupportedOperation(f"fused offload path unavailable: {why}")
            logger.info("fused offload path unavailable (%s); using copy_", why)
            return
        tb = None if tile_bytes is None else int(tile_bytes)
        self._fused_out = FusedCopier(self.device, True, delta, tile_bytes=tb)
        self._fused_in = FusedCopier(self.device, False, delta, tile_bytes=tb)

    @property
    def fused_available(self) -> bool:
        """Whether this manager can take the one-launch fused path."""
        return self._fused_out is not None

    # -- helpers ---------------------------------------------------------------------
    def refresh_views(self) -> None:
        """Re-read the pool's item views (after its backing grew). Called automatically
        when an id lies past the cached views; the geometry must not change."""
        kv, st = pool_views(self.pool)
        if pool_geometry(self.pool, kv, st) != self.geometry:
            raise ShapeMismatch(f"{type(self.pool).__name__} changed its item geometry")
        self._set_views(kv, st)

    def _set_views(self, kv, st) -> None:
        self._views = (kv, st)
        self._rows = (_rows(kv), _rows(st))

    def _checked(self, pages: np.ndarray, slots: np.ndarray, names, views=None):
        """``(kv views, state views, (pages increasing, slots increasing))`` for a copy of
        these ids, every id checked (:func:`check_ids`) against ``views`` (another pool's) or
        this pool's cached views, which are refreshed once when an id lies past them."""
        if views is not None:
            return (*views, _both(pages, slots, names, views, (_rows(views[0]), _rows(views[1]))))
        try:
            return (*self._views, _both(pages, slots, names, self._views, self._rows))
        except IndexOutOfRange:
            self.refresh_views()  # the pool's backing may have grown past the cached views
        return (*self._views, _both(pages, slots, names, self._views, self._rows))

    def _use_fused(self, pieces: int, nbytes: int) -> bool:
        return bool(self.fused_mode) or wants_fused(
            pieces,
            nbytes,
            min_pieces=self.fused_min_pieces,
            max_piece_bytes=self.fused_max_piece_bytes,
        )

    def _current_stream(self) -> int:
        """The caller's current CUstream handle on this manager's device."""
        if _raw_stream is not None:
            return _raw_stream(self.device.index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def _follow(self, stream: "torch.cuda.Stream", raw: int) -> None:
        """``stream`` waits (device-side) for the work queued on the caller's current stream."""
        if self._link is not None:
            self._link.order(raw, self._current_stream())
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def _issue(self, to_host: bool, kv, st, pages, slots, increasing, handle: OffloadHandle) -> int:
        """Issue the copies of one operation on its copy stream (CUDA; CPU: synchronously);
        returns the pieces (fused, batch) or bus copies (copy_ paths) and records the path
        on the handle."""
        fused = self._fused_out if to_host else self._fused_in
        stream = (self._d2h if to_host else self._h2d) if self._cuda else None
        if fused is not None:
            parts, pieces = [], 0
            block = handle.block
            for views, hviews, ids, ext, up in (
                (kv, self.host.page_views, pages, block.pages, increasing[0]),
                (st, self.host.slot_views, slots, block.slots, increasing[1]),
            ):
                if ids.size and views:
                    runs = pair_runs(ids, ext, up)
                    parts.append((views, hviews, runs))
                    pieces += runs.shape[0] * len(views)
            m = self.batch_min_piece_bytes
            if pieces and m and handle.nbytes >= m * pieces:
                raw = self._d2h_raw if to_host else self._h2d_raw
                handle.num_launches = fused.copy_batch(parts, raw, self.batch_first_pieces)
                handle.staged, handle.path = False, "batch"
                self.stats["batch"] += 1
                return pieces
            if pieces and self._use_fused(pieces, handle.nbytes):
                raw = (self._d2h_raw if to_host else self._h2d_raw) if self._cuda else None
                with _on(stream):
                    handle.num_launches = fused.copy(parts, raw)
                handle.staged, handle.path = False, "fused"
                self.stats["fused"] += 1
                return pieces
        copier = self._out if to_host else self._in
        with _on(stream):
            hp, hs = expand_extents(handle.block.pages), expand_extents(handle.block.slots)
            n_kv, staged = copier.copy(kv, self.host.page_views, pages, hp)
            n_st, _ = copier.copy(st, self.host.slot_views, slots, hs)
        handle.staged, handle.path = staged, ("staged" if staged else "direct")
        handle.num_launches = 0
        self.stats["staged"] += int(staged)
        return n_kv + n_st

    def _own(self, handle: OffloadHandle) -> None:
        if not isinstance(handle, OffloadHandle) or handle._owner is not self:
            raise InvalidArgument(f"{handle!r} does not belong to this offload manager")

    # -- API -------------------------------------------------------------------------
    def offload(self, pages, state_slots=()) -> OffloadHandle:
        """Copy ``pages`` (KV page ids) and ``state_slots`` to host memory; returns a handle.

        The device pages/slots may be reused once ``handle.done()`` (or after
        ``handle.order_before(stream)`` for work on ``stream``). Raises ``OutOfMemory``
        (nothing taken) when the host pool cannot hold the request.
        """
        pages_a = as_id_array(pages, "pages")
        slots_a = as_id_array(state_slots, "state_slots")
        kv, st, up = self._checked(pages_a, slots_a, ("pages", "state_slots"))
        if pages_a.size == 0 and slots_a.size == 0:
            raise InvalidArgument("offload of nothing: no pages and no state slots")
        block = self.host.alloc(int(pages_a.size), int(slots_a.size))
        nbytes = pages_a.size * self.host.page_bytes + slots_a.size * self.host.slot_bytes
        handle = OffloadHandle(self, pages_a, slots_a, block, self.geometry, int(nbytes))
        try:
            if self._cuda:
                self._follow(self._d2h, self._d2h_raw)
                for fence in self.host.live_fences():
                    self._d2h.wait_event(fence)
                chunks = self._issue(True, kv, st, pages_a, slots_a, up, handle)
                ev = torch.cuda.Event()
                ev.record(self._d2h)
                handle._event = handle._offload_event = ev
            else:
                chunks = self._issue(True, kv, st, pages_a, slots_a, up, handle)
                handle._state = OffloadState.OFFLOADED
        except BaseException:
            # a failed launch must not leak host memory; copies already queued still write
            # into the block, so later writers are fenced behind everything queued so far
            fence = None
            if self._cuda:
                fence = torch.cuda.Event()
                fence.record(self._d2h)
            self.host.free(block, fence=fence)
            raise
        handle.num_chunks = chunks
        self._live[handle.id] = handle
        self.stats["offloads"] += 1
        self.stats["chunks"] += chunks
        self.stats["bytes"] += handle.nbytes
        return handle

    def restore(
        self, handle: OffloadHandle, new_pages, new_slots=(), *, pool=None
    ) -> OffloadHandle:
        """Copy an offloaded request back into ``new_pages`` / ``new_slots`` (same counts as
        offloaded, in the same order) of ``pool`` (default: this manager's pool; another
        pool must have the same geometry). Host memory is returned at once; the data is in
        place when ``handle.done()`` or after ``handle.order_before(stream)``."""
        self._own(handle)
        handle._require(OffloadState.OFFLOADING, OffloadState.OFFLOADED, what="restore")
        target = self.pool if pool is None else pool
        pages_a = as_id_array(new_pages, "new_pages")
        slots_a = as_id_array(new_slots, "new_slots")
        names = ("new_pages", "new_slots")
        if target is self.pool:
            kv, st, up = self._checked(pages_a, slots_a, names)
        else:
            kv, st = pool_views(target)
            geo = pool_geometry(target, kv, st)
            if geo != handle.geometry:
                raise ShapeMismatch(
                    f"cannot restore into {type(target).__name__}: geometry {geo} differs "
                    f"from the offloaded pool's {handle.geometry}"
                )
            if (kv or st)[0].device != self.device:
                raise ShapeMismatch(
                    f"target pool is on {(kv or st)[0].device}, manager on {self.device}"
                )
            kv, st, up = self._checked(pages_a, slots_a, names, views=(kv, st))
        if pages_a.size != handle.num_pages or slots_a.size != handle.num_slots:
            raise ShapeMismatch(
                f"handle {handle.id} holds {handle.num_pages} pages and {handle.num_slots} "
                f"slots; restore got {pages_a.size} pages and {slots_a.size} slots"
            )
        block = handle.block
        if self._cuda:
            self._follow(self._h2d, self._h2d_raw)
            off_ev = handle._offload_event
            if off_ev is not None and not off_ev.query():
                self._h2d.wait_event(off_ev)
            chunks = self._issue(False, kv, st, pages_a, slots_a, up, handle)
            ev = torch.cuda.Event()
            ev.record(self._h2d)
            handle._event = ev
            handle._state = OffloadState.RESTORING
            self.host.free(block, fence=ev)
        else:
            chunks = self._issue(False, kv, st, pages_a, slots_a, up, handle)
            handle._event = None
            handle._state = OffloadState.RESTORED
            self.host.free(block)
        handle._offload_event = None
        handle.num_chunks = chunks
        del self._live[handle.id]
        self.stats["restores"] += 1
        self.stats["chunks"] += chunks
        return handle

    def discard(self, handle: OffloadHandle) -> None:
        """Drop an offloaded request (also while its offload is in flight): its host memory
        is free at once. Idempotent; a no-op after restore."""
        self._own(handle)
        st = handle.poll()
        if st in (OffloadState.DISCARDED, OffloadState.RESTORING, OffloadState.RESTORED):
            return
        self.host.free(handle.block, fence=handle._event)  # in-flight D2H still writes it
        handle._state = OffloadState.DISCARDED
        handle._event = handle._offload_event = None
        del self._live[handle.id]
        self.stats["discards"] += 1

    abort = discard

    @property
    def live_handles(self) -> list[OffloadHandle]:
        """Handles that still hold host memory."""
        return list(self._live.values())

    def close(self) -> None:
        """Discard every live handle; close the host pool if this manager built it."""
        for h in list(self._live.values()):
            self.discard(h)
        if self._link is not None:
            self._link.close()
        if self._owns_host:
            self.host.close()

    def __enter__(self) -> "OffloadManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"OffloadManager({type(self.pool).__name__} on {self.device}, "
            f"{len(self._live)} live, {self.host!r})"
        )
