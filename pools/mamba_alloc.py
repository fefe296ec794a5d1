"""Mamba state slot allocator.

Slots ``1..size`` are allocatable; slot 0 is the padding slot and is never handed out.
Allocation is per request, so the free list is a Python list (no per-token work).
``alloc(n)`` returns ``None`` (nothing changed) when fewer than ``n`` slots are free;
``free`` validates every id first (range → :class:`IndexOutOfRange`, already free or listed
twice → :class:`DoubleFree`) and changes nothing on error.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument
from kvxfer.pools.req_to_token import SlotIds, as_id_list

logger = logging.getLogger(__name__)


class MambaSlotAllocator:
    def __init__(self, size: int):
        if int(size) < 1:
            raise InvalidArgument(f"MambaSlotAllocator size must be >= 1, got {size}")
        self.size = int(size)
        self.clear()

    def clear(self) -> None:
        self._free: List[int] = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Optional[List[int]]:
        n = int(n)
        if n < 0:
            raise InvalidArgument(f"cannot allocate a negative number of mamba slots ({n})")
        if n > len(self._free):
            return None
        out = self._free[:n]
        del self._free[:n]
        for s in out:
            self._is_free[s] = False
        return out

    def check_free(self, ids: SlotIds) -> List[int]:
        """Validate a free without doing it; returns the ids as a list."""
        lst = as_id_list(ids, "mamba slots")
        seen = set()
        for s in lst:
            if s < 1 or s > self.size:
                raise IndexOutOfRange(
                    f"mamba slot {s} outside [1, {self.size}] (slot 0 is the padding slot)"
                )
            if self._is_free[s] or s in seen:
                raise DoubleFree(f"mamba slot {s} is already free")
            seen.add(s)
        return lst

    def free(self, ids: SlotIds) -> None:
        lst = self.check_free(ids)
        for s in lst:
            self._is_free[s] = True
        self._free.extend(lst)

    def is_allocated(self, slot: int) -> bool:
        return 1 <= slot <= self.size and not self._is_free[slot]

    def __repr__(self) -> str:
        return f"MambaSlotAllocator(size={self.size}, free={len(self._free)})"
