"""Bounded, page-granular host memory pool for offloaded KV pages and state slots.

The pool mirrors the *item geometry* of a device pool: for every KV descriptor buffer i it
holds a ``[num_pages, kv_item_lens[i]]`` uint8 view and for every state buffer j a
``[num_slots, state_item_lens[j]]`` view, all carved out of ONE host allocation made at
construction (never grown). A host page therefore holds one device page of every KV buffer,
and consecutive host pages are adjacent in every view, so a device run copies to a host
run as one chunk per buffer.

When ``pin_memory`` is set (the manager sets it for CUDA pools) the allocation is
page-locked with ``cudaHostRegister`` (portable + mapped) at its exact size (torch's pinned
caching allocator would round it up to a power of two); where registration is refused it
falls back to torch's pinned allocator. Either way the pool asks the driver for the
memory's device pointer (:func:`kvxfer.kernels.cuda_driver.device_pointer`): ``device_delta`` (device address minus host address, 0 under UVA)
lets kernels load/store the pool directly (the fused offload path); it is ``None`` when the
memory is not mapped or not pinned.

Invariants: ``used_pages + free_pages == num_pages`` (same for slots); memory is allocated
once and reused across requests; asking for more than is free raises
:class:`~kvxfer.kernels.errors.OutOfMemory` and takes nothing. *Fences* are opaque completion
objects (CUDA events) of copies that still read host memory that has already been
returned; the manager orders new writes into the pool after them.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvxfer.kernels import cuda_driver
from kvxfer.kernels.errors import InvalidArgument, OutOfMemory, UnsupportedOperation

from .extents import ExtentAllocator

logger = logging.getLogger(__name__)

#: ``cudaHostRegister`` flags: portable | mapped (kernels can reach the memory)
REGISTER_FLAGS = 0x01 | 0x02

__all__ = ["HostPool", "HostBlock"]


@dataclass
class HostBlock:
    """Host pages and slots held by one offloaded request (lists of ``(start, length)``)."""

    pages: list[tuple[int, int]] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_pages(self) -> int:
        return sum(n for _, n in self.pages)

    @property
    def num_slots(self) -> int:
        return sum(n for _, n in self.slots)


def _check_lens(lens: Sequence[int], what: str) -> tuple[int, ...]:
    out = []
    for i, v in enumerate(lens):
        if int(v) != v or v <= 0:
            raise InvalidArgument(f"{what}[{i}] = {v!r} must be a positive integer")
        out.append(int(v))
    return tuple(out)


class HostPool:
    """A fixed-capacity host arena of pages (KV items) and slots (state items)."""

    def __init__(
        self,
        kv_item_lens: Sequence[int],
        num_pages: int,
        *,
        state_item_lens: Sequence[int] = (),
        num_slots: int = 0,
        pin_memory: bool = False,
    ) -> None:
        self.kv_item_lens = _check_lens(kv_item_lens, "kv_item_lens")
        self.state_item_lens = _check_lens(state_item_lens, "state_item_lens")
        for name, v in (("num_pages", num_pages), ("num_slots", num_slots)):
            if int(v) != v or v < 0:
                raise InvalidArgument(f"{name} must be an integer >= 0, got {v!r}")
        self.num_pages = int(num_pages)
        self.num_slots = int(num_slots)
        if self.num_slots and not self.state_item_lens:
            raise InvalidArgument(f"num_slots={num_slots} but no state_item_lens were given")
        self.page_bytes = sum(self.kv_item_lens)
        self.slot_bytes = sum(self.state_item_lens)
        self.capacity_bytes = self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes
        self._registered_ptr: int | None = None
        self._buffer = self._allocate(self.capacity_bytes, bool(pin_memory))
        self.pinned = bool(pin_memory)
        self.device_delta: int | None = None
        if self.pinned and self.capacity_bytes:
            dev = cuda_driver.device_pointer(self._buffer.data_ptr())
            if dev is not None:
                self.device_delta = dev - self._buffer.data_ptr()
            else:
                logger.info(
                    "host pool memory is not mapped for device access; the fused "
                    "offload path is unavailable"
                )
        self.page_views: list[torch.Tensor] = []
        self.slot_views: list[torch.Tensor] = []
        off = 0
        for item_len in self.kv_item_lens:
            n = self.num_pages * item_len
            self.page_views.append(self._buffer[off : off + n].view(self.num_pages, item_len))
            off += n
        for item_len in self.state_item_lens:
            n = self.num_slots * item_len
            self.slot_views.append(self._buffer[off : off + n].view(self.num_slots, item_len))
            off += n
        assert off == self.capacity_bytes
        self._pages = ExtentAllocator(self.num_pages, "host pages")
        self._slots = ExtentAllocator(self.num_slots, "host slots")
        self._fences: list = []

    # -- construction ----------------------------------------------------------------
    @classmethod
    def for_views(
        cls,
        kv_views: Sequence[torch.Tensor],
        state_views: Sequence[torch.Tensor] = (),
        *,
        num_pages: int | None = None,
        num_slots: int = 0,
        capacity_bytes: int | None = None,
        pin_memory: bool = False,
    ) -> "HostPool":
        """Size a pool for these descriptor views: by ``num_pages`` or by ``capacity_bytes``
        (whatever is left after ``num_slots`` state slots, in whole pages)."""
        kv_lens = [int(v.shape[1]) for v in kv_views]
        st_lens = [int(v.shape[1]) for v in state_views]
        if (num_pages is None) == (capacity_bytes is None):
            raise InvalidArgument("give exactly one of num_pages or capacity_bytes")
        if num_pages is None:
            left = int(capacity_bytes) - int(num_slots) * sum(st_lens)
            page = sum(kv_lens)
            if left < 0:
                raise InvalidArgument(
                    f"capacity_bytes={capacity_bytes} cannot hold {num_slots} state slots"
                )
            num_pages = left // page if page else 0
        return cls(
            kv_lens, num_pages, state_item_lens=st_lens, num_slots=num_slots, pin_memory=pin_memory
        )

    def _allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        if not pin or nbytes == 0:
            return torch.empty(nbytes, dtype=torch.uint8)
        # Register whole OS pages that lie entirely inside our own allocation, so no page is
        # shared with (or already registered by) another allocation.
        page = mmap.PAGESIZE
        span = -(-nbytes // page) * page
        raw = torch.empty(span + page, dtype=torch.uint8)
        skip = -raw.data_ptr() % page
        buf = raw[skip : skip + nbytes]
        try:
            rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), span, REGISTER_FLAGS))
        except Exception as exc:  # no usable CUDA runtime
            rc = -1
            logger.debug("cudaHostRegister unavailable: %s", exc)
        if rc == 0:
            self._registered_ptr = buf.data_ptr()
            return buf
        logger.info(
            "cudaHostRegister(%d bytes) failed (rc=%d); using torch pinned memory", nbytes, rc
        )
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            raise UnsupportedOperation(f"pinned host memory is not available here: {exc}") from exc

    def close(self) -> None:
        """Unpin (when registered). The views must not be used afterwards."""
        ptr = getattr(self, "_registered_ptr", None)  # None also when __init__ failed early
        self._registered_ptr = None
        if ptr is not None:
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # interpreter shutdown: nothing sensible left to do
                pass

    def __del__(self) -> None:
        self.close()

    # -- accounting ------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return self._pages.free_count

    @property
    def used_pages(self) -> int:
        return self._pages.used_count

    @property
    def free_slots(self) -> int:
        return self._slots.free_count

    @property
    def used_slots(self) -> int:
        return self._slots.used_count

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes + self.used_slots * self.slot_bytes

    @property
    def is_empty(self) -> bool:
        return self.used_pages == 0 and self.used_slots == 0

    def check_invariants(self) -> None:
        self._pages.check_invariants()
        self._slots.check_invariants()

    # -- alloc / free ----------------------------------------------------------------
    def alloc(self, num_pages: int, num_slots: int = 0) -> HostBlock:
        """Reserve host pages and slots for one request, all or nothing."""
        if num_pages > self.free_pages or num_slots > self.free_slots:
            raise OutOfMemory(
                f"host pool full: {num_pages} pages / {num_slots} slots requested, "
                f"{self.free_pages}/{self.num_pages} pages and "
                f"{self.free_slots}/{self.num_slots} slots free"
            )
        pages = self._pages.alloc(num_pages)
        slots = self._slots.alloc(num_slots)
        return HostBlock(pages, slots)

    def free(self, block: HostBlock, fence=None) -> None:
        """Return a block now. ``fence``: completion object of a copy still reading it."""
        self._pages.free(block.pages)
        self._slots.free(block.slots)
        block.pages = []
        block.slots = []
        if fence is not None:
            if len(self._fences) >= 32:  # keep the list short between offloads
                self._fences = [f for f in self._fences if not f.query()]
            self._fences.append(fence)

    def live_fences(self) -> list:
        """Fences whose copies have not finished yet (finished ones are dropped)."""
        self._fences = [f for f in self._fences if not f.query()]
        return list(self._fences)

    def __repr__(self) -> str:
        return (
            f"HostPool(pages {self.used_pages}/{self.num_pages} x {self.page_bytes} B, "
            f"slots {self.used_slots}/{self.num_slots} x {self.slot_bytes} B, "
            f"pinned={self.pinned}, mapped={self.device_delta is not None})"
        )
