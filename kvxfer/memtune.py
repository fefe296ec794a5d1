"""Keeping freed heap memory for reuse (opt-in, ``KVXFER_MALLOC=keep``).

Planning a write of many runs (heterogeneous TP head slices of NHD rows, byte runs of
different page sizes: 10^5 runs and more per leg) builds a few dozen NumPy arrays of about
a MiB each and frees them again. glibc serves such blocks from fresh ``mmap`` pages, or
trims the heap's top back to the kernel when they are freed, so every request faults the
same memory in again, page by page: on the CPU box a 1 -> 2 NHD leg's engine plan took
5.8 ms with the defaults and 1.1 ms with freed memory kept (bench/results/host-lane-cpu.md,
"Freed memory kept"). :func:`keep_heap` sets glibc's mmap threshold to
:data:`MMAP_THRESHOLD` (blocks up to it come from the heap) and its trim threshold to
:data:`TRIM_THRESHOLD` (up to that much free memory at the heap's top stays mapped).

Invariants
- Process-wide and once per process: it changes the C library's policy for every
  allocation of the process, not only kvxfer's, so it is never done unless asked for
  (:func:`kvxfer.config.malloc_policy`); the cost is at most :data:`TRIM_THRESHOLD` bytes of
  freed memory kept resident per heap.
- Torch-free; a no-op where the C library has no ``mallopt`` (not glibc): the status says so.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: blocks up to this size come from the heap (glibc's own dynamic ceiling on 64-bit hosts)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top kept mapped
TRIM_THRESHOLD = 256 << 20

_lock = threading.Lock()
_status: Optional[str] = None


def keep_heap() -> str:
    """Apply the settings above once per process; returns what happened: ``"kept"``, or
    ``"unavailable: ..."`` where ``mallopt`` is missing or refused them."""
    global _status
    with _lock:
        if _status is None:
            _status = _apply()
        return _status


def status() -> Optional[str]:
    """What :func:`keep_heap` did in this process, None when it was not called."""
    return _status


def _apply() -> str:
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "unavailable: no mallopt (not glibc)"
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    ):
        return "unavailable: mallopt refused the settings"
    return "kept"
