"""Map a VMM-backed pool of another process into this one, for full-speed device copies into it.

Why: UCX cannot PUT into CUDA VMM memory at speed (the driver reports the memory not
legacy-IPC capable, so UCX falls back to software emulation). With POSIX-FD allocation handles
the owning process can instead *export* its physical extents and a writer on the same host can
map them into its own address space and copy with the copy engines -- the same NVLink / HBM
path as ``cuda_ipc`` (copy rates into a shared pool: see bench/results/backing-h200.md).

Exporter (the pool's owner, e.g. a decode worker)::

    send_share(conn, pool.backing, generation=g)      # after finalize_backing / release_beyond

Importer (the writer, e.g. a prefill worker)::

    with recv_share(conn) as peer:                    # maps every extent; device found by UUID
        peer.tensors[i][dst_off:dst_off + n].copy_(src_bytes)   # buffer i's backed span
        peer.item_views()[i][dst_pages] = src_pages             # page granular

Mechanics: the exporter synchronises its device (no queued zero-fill may land after a peer's
write), exports each extent with ``cuMemExportToShareableHandle(POSIX_FD)``, and sends the
manifest and fds (:mod:`.share_wire`, ``SCM_RIGHTS``); its own fds are closed once sent. The
importer validates the manifest, reserves one range per exporter range
(``cuMemAddressReserve``), imports each fd (``cuMemImportFromShareableHandle``), closes it,
maps the handle at the same offset (``cuMemMap``) and grants its device read/write
(``cuMemSetAccess``). Teardown (``close``, idempotent, also on garbage collection once no
tensor uses a range): synchronise, unmap + release newest extent first, free each range,
release the retained context. The physical memory stays alive until *both* sides released
it, so neither side's teardown can fault the other.

Invariants: the importer's view of buffer ``i`` is exactly its backed span at export time;
a later ``finalize_backing``/``release_beyond`` on the exporter needs a new share (the
``generation`` number lets the two sides tell shares apart). Writers and the owner must not
touch the same pages concurrently -- the transfer protocol's job, as with RMA.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from typing import Any, Iterable, Optional, Sized, Union

import torch

from kvxfer.kernels.errors import BackingError, InvalidArgument, UnsupportedOperation

from .base import _RangeState
from .memory import tensor_over
from .share_wire import (
    BufferGrant,
    RangeGrant,
    ShareManifest,
    close_fds,
    recv_share_message,
    send_share_message,
)

logger = logging.getLogger(__name__)

__all__ = ["export_buffers", "send_share", "recv_share", "ImportedBuffers", "device_uuid"]


def device_uuid(index: int) -> str:
    """The GPU's UUID as torch reports it (stable across processes and CUDA_VISIBLE_DEVICES)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _posix_fd_enum(cu):
    return cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


# -- exporter ---------------------------------------------------------------------------------
def export_buffers(owner, *, generation: int = 0) -> tuple[ShareManifest, list]:
    """Manifest + one freshly exported fd per backed extent of ``owner`` (a
    :class:`~kvxfer.pools.backing.BackedBuffers` on CUDA with POSIX-FD handles). The caller owns the
    fds (:func:`send_share` closes them)."""
    from .cuda import _check

    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise InvalidArgument(f"generation must be an int >= 0, got {generation!r}")
    if owner.closed:
        raise BackingError("cannot share a closed BackedBuffers")
    provider = owner.provider
    handle_type = getattr(provider, "handle_type", "none")
    if provider.device_type != "cuda" or handle_type != "posix_fd":
        raise UnsupportedOperation(
            f"sharing needs CUDA VMM memory with POSIX-FD handles; this backing is "
            f"{provider.device_type} with handle type {handle_type!r} (build the pool with "
            f"backing_options={{'handle_types': ('posix_fd',)}})"
        )
    cu = provider.cu
    backings = owner._backings  # this package's own structures (see owner.py)
    index = {id(b): i for i, b in enumerate(backings)}
    ranges, fds = [], []
    try:
        for b in backings:
            b.sync()  # queued zero-fills land before any peer write
        with provider.current():
            for b in backings:
                extents = b.extents
                for off, _ in extents:
                    res = cu.cuMemExportToShareableHandle(
                        b._state.handles[off], _posix_fd_enum(cu), 0
                    )
                    fds.append(int(_check(res, "cuMemExportToShareableHandle(POSIX_FD)")))
                ranges.append(RangeGrant(b.reserved_bytes, tuple(extents)))
        buffers = tuple(
            BufferGrant(d.name, index[id(b)], off, span, d.item_len_bytes(owner.page_size))
            for (b, off), d, span in zip(owner._slots, owner.descs, owner.span_bytes)
        )
    except BaseException:
        close_fds(fds)
        raise
    manifest = ShareManifest(
        "posix_fd",
        provider.granularity,
        device_uuid(owner.device.index),
        generation,
        tuple(ranges),
        buffers,
    )
    return manifest, fds


def send_share(
    sock: socket.socket, owner, *, generation: int = 0, timeout: float = 30.0
) -> ShareManifest:
    """Export ``owner``'s extents and send them over the connected AF_UNIX stream ``sock``."""
    manifest, fds = export_buffers(owner, generation=generation)
    try:
        send_share_message(sock, manifest, fds, timeout)
    finally:
        close_fds(fds)
    logger.info(
        "shared %d buffers (%d extents, generation %d) over %s",
        len(manifest.buffers),
        len(fds),
        generation,
        sock,
    )
    return manifest


# -- importer ---------------------------------------------------------------------------------
class _ImportContext:
    """The importing device's retained primary context, released after every range."""

    def __init__(self, cu, device_index: int) -> None:
        from .cuda import _Context

        self.ctx = _Context(cu, device_index)
        self._finalizer = weakref.finalize(self, self.ctx.release)

    def close(self) -> None:
        self._finalizer()


class _ImportedState(_RangeState):
    def __init__(self, cu, holder: _ImportContext, ptr: int, nbytes: int) -> None:
        super().__init__()
        self.cu, self.holder, self.ptr, self.nbytes = cu, holder, ptr, nbytes
        self.handles: dict = {}

    def sync(self) -> None:
        from .cuda import _check

        with self.holder.ctx.current():
            _check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def unmap(self, offset: int, nbytes: int) -> None:
        from .cuda import _check

        with self.holder.ctx.current():
            _check(self.cu.cuMemUnmap(self.ptr + offset, nbytes), "cuMemUnmap")
            _check(self.cu.cuMemRelease(self.handles.pop(offset)), "cuMemRelease")

    def free_range(self) -> None:
        from .cuda import _check

        with self.holder.ctx.current():
            _check(self.cu.cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")


class _ImportedRange:
    """One reserved range holding a peer's extents; the keepalive of tensors over it."""

    def __init__(
        self, cu, holder: _ImportContext, grant: RangeGrant, granularity: int, device_index: int
    ) -> None:
        from .cuda import _check

        self.cu = cu
        with holder.ctx.current():
            ptr = int(
                _check(
                    cu.cuMemAddressReserve(grant.reserved_bytes, granularity, 0, 0),
                    f"cuMemAddressReserve({grant.reserved_bytes})",
                )
            )
        self.address = ptr
        self._state = _ImportedState(cu, holder, ptr, grant.reserved_bytes)
        self._finalizer = weakref.finalize(self, self._state.release)
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = device_index
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]

    def map(self, offset: int, nbytes: int, fd: int) -> None:
        """Import ``fd`` (the caller closes it) and map it at ``offset``."""
        from .cuda import _check, _map_with_access

        cu, st = self.cu, self._state
        addr = self.address + offset
        with st.holder.ctx.current():
            handle = _check(
                cu.cuMemImportFromShareableHandle(fd, _posix_fd_enum(cu)),
                "cuMemImportFromShareableHandle(POSIX_FD)",
            )
            _map_with_access(cu, addr, nbytes, handle, self._access)
        st.handles[offset] = handle
        st.order.append((offset, nbytes))
        st.extents.append((offset, nbytes))

    def close(self) -> None:
        self._finalizer()


class ImportedBuffers:
    """A peer's pool buffers mapped into this process (see the module docstring).

    ``tensors[i]``: uint8 tensor over buffer ``i``'s backed span (as exported), on
    :attr:`device`. After :meth:`close` the tensors must not be used.
    """

    def __init__(
        self,
        manifest: ShareManifest,
        fds: Iterable[int],
        device: Optional[Union[str, int, torch.device]] = None,
    ) -> None:
        """``fds``: one per extent in manifest order, the caller's to close; a list, or an
        iterator that yields them as they arrive (:func:`~.share_wire.recv_share_stream`:
        each is mapped before the next is asked for)."""
        from .cuda import driver

        if isinstance(fds, Sized) and len(fds) != manifest.num_extents:
            raise InvalidArgument(f"{manifest.num_extents} extents but {len(fds)} fds")
        self.manifest = manifest
        self.device = _resolve_device(device, manifest.device_uuid)
        cu = driver()
        self._holder = _ImportContext(cu, self.device.index)
        self._ranges: list[_ImportedRange] = []
        self.tensors: list[torch.Tensor] = []
        self._closed = False
        try:
            it = iter(fds)
            for grant in manifest.ranges:
                rng = _ImportedRange(
                    cu, self._holder, grant, manifest.granularity, self.device.index
                )
                self._ranges.append(rng)
                for off, n in grant.extents:
                    fd = next(it, None)
                    if fd is None:
                        raise BackingError(f"the share ended before its {manifest.num_extents} fds")
                    rng.map(off, n, fd)
            for b in manifest.buffers:
                addr = self._ranges[b.range].address + b.offset
                t = tensor_over(self.device, addr, b.span_bytes, self._ranges[b.range])
                if t.data_ptr() != addr or t.numel() != b.span_bytes:
                    raise BackingError(
                        f"{b.name}: tensor over the imported {addr:#x} came back at "
                        f"{t.data_ptr():#x} on {t.device}: not a view"
                    )
                self.tensors.append(t)
        except BaseException:
            self.close()
            raise
        logger.info(
            "imported %d buffers (%d extents, generation %d) on %s",
            len(self.tensors),
            manifest.num_extents,
            manifest.generation,
            self.device,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def generation(self) -> int:
        return self.manifest.generation

    @property
    def span_bytes(self) -> list:
        return [b.span_bytes for b in self.manifest.buffers]

    def _check_open(self) -> None:
        if self._closed:
            raise BackingError("ImportedBuffers is closed")

    def item_views(self) -> list:
        """uint8 ``[span // item_bytes, item_bytes]`` views: row ``p`` is page ``p``."""
        self._check_open()
        out = []
        for t, b in zip(self.tensors, self.manifest.buffers):
            out.append(t[: t.numel() // b.item_bytes * b.item_bytes].view(-1, b.item_bytes))
        return out

    def buf_infos(self) -> tuple:
        """``(ptrs, lens, item_lens)`` of the mapped spans in this process."""
        self._check_open()
        return (
            [t.data_ptr() for t in self.tensors],
            self.span_bytes,
            [b.item_bytes for b in self.manifest.buffers],
        )

    def info(self) -> dict[str, Any]:
        return {
            "device": str(self.device),
            "buffers": len(self.manifest.buffers),
            "extents": self.manifest.num_extents,
            "generation": self.generation,
            "mapped_bytes": sum(n for r in self.manifest.ranges for _, n in r.extents),
            "closed": self._closed,
        }

    def close(self) -> None:
        """Synchronise, unmap and release every imported extent, free the ranges, release the
        context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.tensors = []
        errors = []
        for r in reversed(self._ranges):
            try:
                r.close()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                errors.append(exc)
        self._ranges = []
        try:
            self._holder.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        if errors:
            raise BackingError(f"import teardown failed: {errors[0]}") from errors[0]

    def __enter__(self) -> "ImportedBuffers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ImportedBuffers {self.info()}>"


def _resolve_device(device, uuid: str) -> torch.device:
    if not torch.cuda.is_available():
        raise BackingError("importing a VMM share needs a CUDA device in this process")
    if device is not None:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if dev.type != "cuda":
            raise InvalidArgument(f"device must be a CUDA device, got {device!r}")
        return torch.device(
            "cuda", dev.index if dev.index is not None else torch.cuda.current_device()
        )
    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return torch.device("cuda", i)
    raise BackingError(
        f"the exporter's GPU {uuid} is not visible in this process "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
        f"pass device= explicitly"
    )


def recv_share(sock: socket.socket, *, device=None, timeout: float = 30.0) -> ImportedBuffers:
    """Receive a share from ``sock`` and map it (on ``device``, default: the exporter's GPU
    found by UUID). Every received fd is closed before this returns."""
    manifest, fds = recv_share_message(sock, timeout)
    try:
        return ImportedBuffers(manifest, fds, device)
    finally:
        close_fds(fds)
