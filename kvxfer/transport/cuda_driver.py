"""The few CUDA driver calls the engine makes itself, through ctypes (no torch, no CUDA
Python bindings): pointer attributes, legacy IPC export/import and one async D2D copy.

Invariants
- Nothing is loaded at import: ``libcuda.so.1`` is opened on the first call, once; on a
  machine without a driver every query answers None (never raises).
- :func:`ipc_export` answers only for memory the driver reports legacy-IPC capable
  (``cudaMalloc``-style; not CUDA VMM); the blob is :data:`IPC_BLOB_BYTES` bytes: the
  64-byte ``CUipcMemHandle`` of the whole allocation, then the little-endian u64 offset of
  ``addr`` inside it, so the importer can rebuild ``addr``'s image.
- :func:`ipc_open` / :func:`ipc_close` need a current CUDA context on the calling thread
  (the caller enters ``torch.cuda.device``); an import in the exporting process itself
  fails (the driver refuses it) and is reported as :class:`CudaError`, not a crash.
"""
from __future__ import annotations

import ctypes
import struct
from typing import Dict, Optional, Tuple

from kvxfer.errors import KvxferError

IPC_HANDLE_BYTES = 64
IPC_BLOB_BYTES = IPC_HANDLE_BYTES + 8
#: cuIpcOpenMemHandle flag: enable peer access lazily (the import may be on another GPU)
_LAZY_ENABLE_PEER_ACCESS = 1
# CUpointer_attribute values
_ATTR_MEMORY_TYPE = 2
_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED = 2, 4
_ATTR_DEVICE_ORDINAL, _ATTR_LEGACY_IPC, _ATTR_RANGE_START, _ATTR_RANGE_SIZE = 9, 10, 11, 12


class CudaError(KvxferError):
    """A CUDA driver call failed (``code`` is the CUresult)."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} failed: CUresult {code}")
        self.code = code


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


_SIGS = {
    "cuPointerGetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong],
    "cuIpcGetMemHandle": [ctypes.POINTER(_IpcHandle), ctypes.c_ulonglong],
    "cuIpcOpenMemHandle_v2": [ctypes.POINTER(ctypes.c_ulonglong), _IpcHandle, ctypes.c_uint],
    "cuIpcCloseMemHandle": [ctypes.c_ulonglong],
    "cuMemcpyDtoDAsync_v2": [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t,
                             ctypes.c_void_p],
}
_FNS: Dict[str, Optional[object]] = {}
_LIB: list = []  # [CDLL] or [None] once looked up


def _fn(name: str):
    """The driver function ``name`` (None without a driver), looked up once."""
    if name in _FNS:
        return _FNS[name]
    if not _LIB:
        try:
            _LIB.append(ctypes.CDLL("libcuda.so.1"))
        except OSError:
            _LIB.append(None)
    fn = None
    if _LIB[0] is not None:
        try:
            fn = getattr(_LIB[0], name)
            fn.argtypes = _SIGS[name]
            fn.restype = ctypes.c_int
        except AttributeError:
            fn = None
    _FNS[name] = fn
    return fn


def _attr(attr: int, addr: int, ctype=ctypes.c_ulonglong) -> Optional[int]:
    fn = _fn("cuPointerGetAttribute")
    if fn is None:
        return None
    out = ctype(0)
    if fn(ctypes.byref(out), attr, addr) != 0:
        return None
    return out.value


def alloc_range(addr: int) -> Optional[Tuple[int, int]]:
    """``(base, size)`` of the CUDA allocation holding ``addr``; None for non-device
    memory or without a driver (needs no current context)."""
    base = _attr(_ATTR_RANGE_START, addr)
    size = _attr(_ATTR_RANGE_SIZE, addr) if base is not None else None
    return (base, size) if size else None


def ipc_capable(addr: int) -> Optional[bool]:
    """Whether the driver reports ``addr``'s allocation legacy-IPC capable (False for CUDA
    VMM memory, which UCX can reach only by emulated PUTs); None when not device memory."""
    if alloc_range(addr) is None:
        return None
    v = _attr(_ATTR_LEGACY_IPC, addr, ctypes.c_int)
    return None if v is None else bool(v)


def device_ordinal(addr: int) -> Optional[int]:
    """CUDA device ordinal of device memory at ``addr`` (None when unknown)."""
    if alloc_range(addr) is None:
        return None
    return _attr(_ATTR_DEVICE_ORDINAL, addr, ctypes.c_int)


def kernel_device(addr: int) -> Optional[int]:
    """Ordinal of the CUDA device whose kernels should read ``addr``: device memory (plain or
    VMM) and managed memory; None for host memory (pageable or page-locked), for pointers
    the driver does not know, and without a driver."""
    kind = _attr(_ATTR_MEMORY_TYPE, addr, ctypes.c_uint)
    if kind not in (_MEMORYTYPE_DEVICE, _MEMORYTYPE_UNIFIED):
        return None
    return _attr(_ATTR_DEVICE_ORDINAL, addr, ctypes.c_int)


def ipc_export(addr: int) -> Optional[bytes]:
    """IPC blob for the device memory at ``addr`` (see module doc), or None when it is not
    legacy-IPC-capable device memory or the driver refuses."""
    rng = alloc_range(addr)
    fn = _fn("cuIpcGetMemHandle")
    if rng is None or fn is None or not ipc_capable(addr):
        return None
    h = _IpcHandle()
    if fn(ctypes.byref(h), rng[0]) != 0:
        return None
    return pack_blob(h, addr - rng[0])


def pack_blob(h: "_IpcHandle", offset: int) -> bytes:
    """The handle's 64 raw bytes (NULs included), then ``offset`` as little-endian u64."""
    return ctypes.string_at(ctypes.addressof(h), IPC_HANDLE_BYTES) + struct.pack("<Q", offset)


def unpack_blob(blob: bytes) -> Tuple["_IpcHandle", int]:
    if len(blob) != IPC_BLOB_BYTES:
        raise ValueError(f"IPC blob of {len(blob)} bytes, expected {IPC_BLOB_BYTES}")
    h = _IpcHandle()
    ctypes.memmove(ctypes.addressof(h), bytes(blob[:IPC_HANDLE_BYTES]), IPC_HANDLE_BYTES)
    return h, struct.unpack("<Q", bytes(blob[IPC_HANDLE_BYTES:]))[0]


def ipc_open(blob: bytes) -> Tuple[int, int]:
    """Map a peer's blob into this process: ``(image of the peer's addr, mapped base)``;
    the base is what :func:`ipc_close` takes. Raises CudaError / ValueError."""
    h, offset = unpack_blob(blob)
    fn = _fn("cuIpcOpenMemHandle_v2")
    if fn is None:
        raise CudaError("cuIpcOpenMemHandle (no CUDA driver)", -1)
    base = ctypes.c_ulonglong(0)
    rc = fn(ctypes.byref(base), h, _LAZY_ENABLE_PEER_ACCESS)
    if rc != 0:
        raise CudaError("cuIpcOpenMemHandle", rc)
    return base.value + offset, base.value


def ipc_close(base: int) -> None:
    fn = _fn("cuIpcCloseMemHandle")
    if fn is not None:
        rc = fn(base)
        if rc != 0:
            raise CudaError("cuIpcCloseMemHandle", rc)


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cuMemcpyDtoDAsync`` on ``stream`` (a CUstream handle, 0 = legacy default)."""
    fn = _fn("cuMemcpyDtoDAsync_v2")
    if fn is None:
        raise CudaError("cuMemcpyDtoDAsync (no CUDA driver)", -1)
    rc = fn(dst, src, nbytes, stream)
    if rc != 0:
        raise CudaError("cuMemcpyDtoDAsync", rc)
