"""Host backing: ``mmap`` reserve (``PROT_NONE`` + ``MAP_NORESERVE``), ``mprotect`` commit.

Torch-free, Linux only. A reservation costs address space only; committing an extent makes it
readable and writable (pages are then populated on first touch, zero-filled); decommitting an
extent drops its pages (``MADV_DONTNEED``) and makes it inaccessible again, so a later commit
reads zeros. Touching a byte outside the committed extents faults (SIGSEGV): the owner's bounds
checks exist so that this cannot happen through the pool API.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import Any

from kvxfer.kernels.errors import BackingError, UnsupportedOperation

from .base import Backing, BackingProvider, _RangeState

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value (all arches we run on)
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = None


def _lib():
    """libc with the four calls we need, typed (loaded on first use, not at import)."""
    global _libc
    if _libc is None:
        if not sys.platform.startswith("linux"):
            raise UnsupportedOperation(
                f"host backing needs Linux mmap/mprotect, not {sys.platform}"
            )
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        for name in ("munmap", "mprotect", "madvise"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc = lib
    return _libc


def _os_error(what: str) -> BackingError:
    err = ctypes.get_errno()
    return BackingError(f"{what} failed: errno {err} ({os.strerror(err)})")


class _HostRange(_RangeState):
    def __init__(self, address: int, nbytes: int) -> None:
        super().__init__()
        self.address = address
        self.nbytes = nbytes

    def unmap(self, offset: int, nbytes: int) -> None:
        lib = _lib()
        addr = self.address + offset
        if lib.madvise(addr, nbytes, _MADV_DONTNEED) != 0:
            raise _os_error(f"madvise(DONTNEED, {addr:#x}, {nbytes})")
        if lib.mprotect(addr, nbytes, _PROT_NONE) != 0:
            raise _os_error(f"mprotect(NONE, {addr:#x}, {nbytes})")

    def free_range(self) -> None:
        if _lib().munmap(self.address, self.nbytes) != 0:
            raise _os_error(f"munmap({self.address:#x}, {self.nbytes})")


class HostBacking(Backing):
    """A ``PROT_NONE`` anonymous private mapping committed with ``mprotect``."""

    kind = "host"
    fresh_memory_is_zero = True

    def __init__(self, nbytes: int, granularity: int, max_extent_bytes: int) -> None:
        lib = _lib()
        addr = lib.mmap(
            None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
        )
        if addr is None or addr == _MAP_FAILED:
            raise _os_error(f"mmap reserve of {nbytes} bytes")
        self._setup(_HostRange(addr, nbytes), addr, nbytes, granularity, max_extent_bytes)

    def _map_extent(self, offset: int, nbytes: int) -> None:
        if _lib().mprotect(self.address + offset, nbytes, _PROT_RW) != 0:
            raise _os_error(f"mprotect(RW, {self.address + offset:#x}, {nbytes})")


class HostBackingProvider(BackingProvider):
    """Makes :class:`HostBacking` ranges. Granularity: the OS page size."""

    device_type = "cpu"

    def __init__(self, *, default_max_extent_bytes: int = 2 << 20) -> None:
        self.granularity = mmap.PAGESIZE
        self.default_max_extent_bytes = self._extent_cap(default_max_extent_bytes)

    def reserve(self, nbytes: int, *, max_extent_bytes: int | None = None) -> HostBacking:
        return HostBacking(
            self._reserve_size(nbytes), self.granularity, self._extent_cap(max_extent_bytes)
        )

    def info(self) -> dict[str, Any]:
        return {**super().info(), "kind": "host", "handle_type": "none"}
