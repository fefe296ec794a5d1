"""CUDA backing through the driver's virtual memory management (VMM) API.

Torch-free. The driver comes from :mod:`kvxfer.kernels.cuda_driver` (cuda-bindings, imported on
first use, never at import time); every driver failure here is a :class:`BackingError`.

- :class:`CudaVmmProvider` (one per device): retains the device's primary context (the one torch
  uses) and pushes it around every driver call, so the thread's current context is untouched;
  chooses the allocation handle type once by probing, in the order given (default
  ``FABRIC -> POSIX_FD -> NONE``): a type is chosen when the device reports support for it and a
  one-granule ``cuMemCreate`` with it succeeds. FABRIC handles let peers on other hosts/processes
  import the memory (and are ``CUDA_ERROR_NOT_PERMITTED`` without IMEX, as on our H200); POSIX-FD
  handles can be exported to another process on the same host (``cuMemExportToShareableHandle``
  + ``SCM_RIGHTS``) — the route to fast same-host transfers *into* VMM memory (docs/backing.md);
  NONE cannot be shared at all. The choice and every probe outcome are logged and reported in
  :meth:`CudaVmmProvider.info`. When the device supports GPUDirect RDMA on VMM memory, the
  allocations are made RDMA-capable so a NIC can register them.
- :class:`CudaVmmBacking`: ``cuMemAddressReserve`` (granularity-aligned) up front; each extent is
  ``cuMemCreate`` + ``cuMemMap`` + ``cuMemSetAccess`` (read/write for the owning device); teardown
  synchronises the context, then ``cuMemUnmap`` + ``cuMemRelease`` newest extent first, then
  ``cuMemAddressFree``. Fresh extents are *not* zeroed by the driver (the owner zeroes them).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Sequence

from kvxfer.kernels import cuda_driver
from kvxfer.kernels.errors import BackingError, CudaError, InvalidArgument

from .base import Backing, BackingProvider, _RangeState

logger = logging.getLogger(__name__)

#: handle types in the order they are tried by default
HANDLE_TYPE_ORDER: tuple[str, ...] = ("fabric", "posix_fd", "none")

_HANDLE_ENUM = {
    "fabric": "CU_MEM_HANDLE_TYPE_FABRIC",
    "posix_fd": "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    "none": "CU_MEM_HANDLE_TYPE_NONE",
}
_HANDLE_DEVICE_ATTR = {
    "fabric": "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED",
    "posix_fd": "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
}


def driver():
    """The initialised cuda-bindings driver module (:func:`kvxfer.kernels.cuda_driver.driver`).
    Raises BackingError."""
    try:
        return cuda_driver.driver()
    except CudaError as exc:
        raise BackingError(f"CUDA VMM backing: {exc}") from exc


def _check(res, what: str):
    """:func:`kvxfer.kernels.cuda_driver.check`, raising BackingError on a CUDA error."""
    try:
        return cuda_driver.check(res, what)
    except CudaError as exc:
        raise BackingError(str(exc)) from exc


def _map_with_access(cu, addr: int, nbytes: int, handle, access) -> None:
    """Map ``handle`` at ``addr`` and grant ``access``; on failure nothing stays mapped and the
    handle is released (the caller owns it only on success)."""
    try:
        _check(cu.cuMemMap(addr, nbytes, 0, handle, 0), f"cuMemMap({addr:#x}, {nbytes})")
        try:
            _check(cu.cuMemSetAccess(addr, nbytes, access, 1), "cuMemSetAccess")
        except BaseException:
            cu.cuMemUnmap(addr, nbytes)
            raise
    except BaseException:
        cu.cuMemRelease(handle)
        raise


def _is_error(cu, res, code: str) -> bool:
    return res[0] == getattr(cu.CUresult, code)


class _Context:
    """The device's retained primary context; released when the provider goes away."""

    def __init__(self, cu, device_index: int) -> None:
        self.cu = cu
        self.device_index = device_index
        self.device = _check(cu.cuDeviceGet(device_index), f"cuDeviceGet({device_index})")
        self.ctx = _check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        self.released = False

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        cu = self.cu
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")

    def attribute(self, name: str) -> int | None:
        attr = getattr(self.cu.CUdevice_attribute, name, None)
        if attr is None:
            return None
        res = self.cu.cuDeviceGetAttribute(attr, self.device)
        return int(res[1]) if res[0] == self.cu.CUresult.CUDA_SUCCESS else None

    def release(self) -> None:
        if not self.released:
            self.released = True
            _check(self.cu.cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")


class CudaVmmProvider(BackingProvider):
    """Per-device VMM state: context, allocation properties, chosen handle type."""

    device_type = "cuda"

    def __init__(
        self,
        device_index: int = 0,
        *,
        handle_types: Sequence[str] = HANDLE_TYPE_ORDER,
        default_max_extent_bytes: int = 256 << 20,
    ) -> None:
        handle_types = tuple(handle_types)
        bad = [h for h in handle_types if h not in _HANDLE_ENUM]
        if not handle_types or bad:
            raise InvalidArgument(
                f"handle_types must be a non-empty subset of {HANDLE_TYPE_ORDER}, got {handle_types}"
            )
        if int(device_index) < 0:
            raise InvalidArgument(f"device_index must be >= 0, got {device_index}")
        cu = driver()
        self.cu = cu
        self.device_index = int(device_index)
        self._ctx = _Context(cu, self.device_index)
        self._finalizer = weakref.finalize(self, self._ctx.release)
        try:
            if self._ctx.attribute("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED") == 0:
                raise BackingError(
                    f"cuda:{device_index} does not support virtual memory management"
                )
            self.gpu_direct_rdma = bool(
                self._ctx.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")
            )
            with self._ctx.current():
                self.handle_type, self.probe_report, self.prop, self.granularity = (
                    self._choose_handle_type(handle_types)
                )
        except BaseException:
            self._finalizer()
            raise
        self.default_max_extent_bytes = self._extent_cap(default_max_extent_bytes)
        logger.info(
            "cuda:%d VMM backing: handle type %s (probe: %s), granularity %d, GPUDirect RDMA %s",
            self.device_index,
            self.handle_type,
            ", ".join(f"{h}={r}" for h, r in self.probe_report),
            self.granularity,
            self.gpu_direct_rdma,
        )

    def _make_prop(self, handle_type: str, rdma: bool):
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        prop.requestedHandleTypes = getattr(cu.CUmemAllocationHandleType, _HANDLE_ENUM[handle_type])
        if rdma:
            prop.allocFlags.gpuDirectRDMACapable = 1
        return prop

    def _choose_handle_type(self, handle_types: tuple[str, ...]):
        """First handle type the device supports and cuMemCreate accepts; the outcome of
        every attempt is kept as ``[(type, "ok" | reason), ...]``."""
        cu = self.cu
        report: list[tuple[str, str]] = []
        for name in handle_types:
            attr = _HANDLE_DEVICE_ATTR.get(name)
            if attr is not None and self._ctx.attribute(attr) == 0:
                report.append((name, "unsupported by device"))
                continue
            # RDMA-capable first when the device offers it, then plain, before the next type
            for rdma in (True, False) if self.gpu_direct_rdma else (False,):
                label = f"{name}+rdma" if rdma else name
                prop = self._make_prop(name, rdma)
                gran_flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
                res = cu.cuMemGetAllocationGranularity(prop, gran_flag)
                if res[0] != cu.CUresult.CUDA_SUCCESS:
                    report.append((label, f"granularity: {cuda_driver.error_text(res[0])}"))
                    continue
                gran = int(res[1])
                res = cu.cuMemCreate(gran, prop, 0)
                if res[0] != cu.CUresult.CUDA_SUCCESS:
                    report.append((label, f"cuMemCreate: {cuda_driver.error_text(res[0])}"))
                    continue
                _check(cu.cuMemRelease(res[1]), "cuMemRelease (probe)")
                report.append((label, "ok"))
                self.gpu_direct_rdma = rdma
                return name, report, prop, gran
        raise BackingError(
            f"no usable VMM allocation handle type on cuda:{self.device_index}: "
            + "; ".join(f"{h}: {r}" for h, r in report)
        )

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make this device's primary context current for the duration (push/pop)."""
        if self._ctx.released:
            raise BackingError(f"CUDA VMM provider for cuda:{self.device_index} is closed")
        with self._ctx.current():
            yield

    def reserve(self, nbytes: int, *, max_extent_bytes: int | None = None) -> CudaVmmBacking:
        return CudaVmmBacking(self, self._reserve_size(nbytes), self._extent_cap(max_extent_bytes))

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "kind": "cuda_vmm",
            "device_index": self.device_index,
            "handle_type": self.handle_type,
            "handle_probe": list(self.probe_report),
            "gpu_direct_rdma": self.gpu_direct_rdma,
        }

    def close(self) -> None:
        self._finalizer()


class _CudaRange(_RangeState):
    def __init__(self, provider: CudaVmmProvider, ptr: int, nbytes: int) -> None:
        super().__init__()
        self.provider = provider  # keeps the context retained while the range lives
        self.ptr = ptr
        self.nbytes = nbytes
        self.handles: dict[int, Any] = {}  # extent offset -> allocation handle

    def sync(self) -> None:
        cu = self.provider.cu
        with self.provider.current():
            _check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def unmap(self, offset: int, nbytes: int) -> None:
        cu = self.provider.cu
        with self.provider.current():
            _check(cu.cuMemUnmap(self.ptr + offset, nbytes), "cuMemUnmap")
            handle = self.handles.pop(offset)
            _check(cu.cuMemRelease(handle), "cuMemRelease")

    def free_range(self) -> None:
        cu = self.provider.cu
        with self.provider.current():
            _check(cu.cuMemAddressFree(self.ptr, self.nbytes), "cuMemAddressFree")


class CudaVmmBacking(Backing):
    """One ``cuMemAddressReserve`` range, backed extent by extent with ``cuMemCreate``."""

    kind = "cuda_vmm"
    fresh_memory_is_zero = False

    def __init__(self, provider: CudaVmmProvider, nbytes: int, max_extent_bytes: int) -> None:
        cu = provider.cu
        self.provider = provider
        with provider.current():
            ptr = _check(
                cu.cuMemAddressReserve(nbytes, provider.granularity, 0, 0),
                f"cuMemAddressReserve({nbytes})",
            )
        self._setup(
            _CudaRange(provider, int(ptr), nbytes),
            int(ptr),
            nbytes,
            provider.granularity,
            max_extent_bytes,
        )
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = provider.device_index
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [desc]

    def _map_extent(self, offset: int, nbytes: int) -> None:
        cu, p = self.provider.cu, self.provider
        addr = self.address + offset
        with p.current():
            res = cu.cuMemCreate(nbytes, p.prop, 0)
            if _is_error(cu, res, "CUDA_ERROR_OUT_OF_MEMORY"):
                raise BackingError(
                    f"cuMemCreate({nbytes}) on cuda:{p.device_index}: out of device memory"
                )
            handle = _check(res, f"cuMemCreate({nbytes})")
            _map_with_access(cu, addr, nbytes, handle, self._access)
        self._state.handles[offset] = handle

    def pointer_attribute(self, name: str) -> Any:
        """A ``CU_POINTER_ATTRIBUTE_*`` of the range start (must be backed), for reports."""
        cu = self.provider.cu
        with self.provider.current():
            v = _check(
                cu.cuPointerGetAttribute(getattr(cu.CUpointer_attribute, name), self.address), name
            )
        return getattr(v, "name", None) or int(v)

    def info(self) -> dict[str, Any]:
        return {
            **super().info(),
            "handle_type": self.provider.handle_type,
            "device_index": self.provider.device_index,
        }
