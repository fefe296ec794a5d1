"""Device-side addresses of page-locked host memory (for kernels that read/write it).

The fused offload path lets a Triton kernel load from and store to the host pool
directly. That needs the pool registered as *mapped* (``cudaHostRegister`` with
``cudaHostRegisterPortable | cudaHostRegisterMapped``) and its device pointer, which the
driver reports through ``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`` --
the same query Triton's launcher makes for its pointer arguments. Under UVA (every 64-bit
Linux system with a current GPU) it equals the host pointer.

The CUDA driver library is opened lazily, on the first query (never at import time); any
failure makes :func:`device_pointer` return ``None`` and the caller keeps its copy_ path.
"""
from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

__all__ = ["REGISTER_FLAGS", "device_pointer", "memory_type"]

# cudaHostRegisterPortable | cudaHostRegisterMapped
REGISTER_FLAGS = 0x01 | 0x02
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
CU_MEMORYTYPE_HOST = 1

_driver: ctypes.CDLL | None = None
_driver_error: str | None = None


def _lib() -> ctypes.CDLL | None:
    global _driver, _driver_error
    if _driver is None and _driver_error is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuPointerGetAttribute
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            fn.restype = ctypes.c_int
            _driver = lib
        except (OSError, AttributeError) as exc:
            _driver_error = str(exc)
            logger.debug("CUDA driver library unavailable: %s", exc)
    return _driver


def _attribute(ptr: int, attr: int, out) -> bool:
    lib = _lib()
    if lib is None or not ptr:
        return False
    rc = lib.cuPointerGetAttribute(ctypes.byref(out), attr, ctypes.c_uint64(ptr))
    if rc != 0:
        logger.debug("cuPointerGetAttribute(%#x, %d) -> %d", ptr, attr, rc)
    return rc == 0


def device_pointer(host_ptr: int) -> int | None:
    """The address at which kernels reach the mapped host memory at ``host_ptr``, or
    ``None`` when it is not mapped (or there is no CUDA driver). The caller must have made a
    CUDA context current (any CUDA runtime call, e.g. ``cudaHostRegister``, does)."""
    out = ctypes.c_uint64(0)
    if not _attribute(int(host_ptr), _CU_POINTER_ATTRIBUTE_DEVICE_POINTER, out):
        return None
    return int(out.value) or None


def memory_type(ptr: int) -> int | None:
    """``CU_MEMORYTYPE_*`` of ``ptr`` as the driver sees it (``None``: unknown to it)."""
    out = ctypes.c_uint32(0)
    if not _attribute(int(ptr), _CU_POINTER_ATTRIBUTE_MEMORY_TYPE, out):
        return None
    return int(out.value)
