"""Request → token-location table.

``ReqToTokenPool`` owns an int32 table ``req_to_token[size + 1, max_context_len]``: row ``r``
holds the KV token ids of the request that occupies request slot ``r``. Invariants:

* Row 0 is padding. It is never handed out, so padded batches (e.g. CUDA-graph replays that
  default their request index to 0) read and write it harmlessly.
* Every slot in ``1..size`` is either free or allocated, never both; ``free`` of a free slot
  raises :class:`DoubleFree`, of ``0`` or ``> size`` raises :class:`IndexOutOfRange`, and in
  both cases nothing changes.
* ``req_generation[r]`` is incremented every time slot ``r`` is handed out, so a holder of a
  stale ``(slot, generation)`` pair can detect reuse.

Allocation is per request (not per token), so the free list is a plain Python list.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, List, Optional, Sequence, Union

import torch

from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument

logger = logging.getLogger(__name__)

SlotIds = Union[int, Sequence[int], torch.Tensor]


def as_id_list(ids: SlotIds, what: str) -> List[int]:
    """Normalise an int / sequence / tensor of ids to a list of Python ints."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InvalidArgument(f"{what} must be integers, got dtype {ids.dtype}")
        return [int(x) for x in ids.reshape(-1).tolist()]
    if isinstance(ids, int):
        return [int(ids)]
    out = []
    for x in ids:
        if isinstance(x, torch.Tensor):
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, int):
            raise InvalidArgument(f"{what} must be integers, got {x!r}")
        out.append(int(x))
    return out


class ReqToTokenPool:
    """A table mapping a request slot to its token locations (see module docstring)."""

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device] = "cpu"):
        if int(size) < 1:
            raise InvalidArgument(f"ReqToTokenPool size must be >= 1, got {size}")
        if int(max_context_len) < 1:
            raise InvalidArgument(f"max_context_len must be >= 1, got {max_context_len}")
        self.size = int(size)
        self.max_context_len = int(max_context_len)
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (self.size + 1, self.max_context_len), dtype=torch.int32, device=self.device
        )
        self.req_generation = torch.zeros(self.size + 1, dtype=torch.int64)
        self._free_slots: List[int] = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        return len(self._free_slots)

    @property
    def free_slots(self) -> List[int]:
        """A copy of the free slot ids (in hand-out order)."""
        return list(self._free_slots)

    def generation(self, slot: int) -> int:
        self._check_range([slot])
        return int(self.req_generation[slot])

    # ------------------------------------------------------------------ writes
    def write(self, indices: Any, values: Any) -> None:
        """``req_to_token[indices] = values`` (indices as accepted by torch indexing)."""
        self.req_to_token[indices] = values

    # ------------------------------------------------------------------ alloc / free
    def alloc(self, n: int) -> Optional[List[int]]:
        """Hand out ``n`` free slots; ``None`` (nothing changed) if fewer are free."""
        return self._alloc_slots(n)

    def _alloc_slots(self, n: int) -> Optional[List[int]]:
        n = int(n)
        if n < 0:
            raise InvalidArgument(f"cannot allocate a negative number of slots ({n})")
        if n > len(self._free_slots):
            return None
        out = self._free_slots[:n]
        del self._free_slots[:n]
        for s in out:
            self._is_free[s] = False
        if out:
            self.req_generation[out] += 1
        return out

    def alloc_reqs(self, reqs: Sequence[Any]) -> Optional[List[int]]:
        """Give every request without a slot (``req.req_pool_idx is None``) a fresh slot.

        Requests that already hold a slot (chunked prefill continuing) keep it. Returns the
        slot of every request in order, or ``None`` with nothing changed when too few slots
        are free.
        """
        need = sum(1 for r in reqs if r.req_pool_idx is None)
        fresh = self._alloc_slots(need)
        if fresh is None:
            return None
        it = iter(fresh)
        for r in reqs:
            if r.req_pool_idx is None:
                r.req_pool_idx = next(it)
        return [int(r.req_pool_idx) for r in reqs]

    def free(self, slots: SlotIds) -> None:
        """Return slots. Validates everything first: bad input changes nothing."""
        ids = as_id_list(slots, "request slots")
        self._check_range(ids)
        seen = set()
        for s in ids:
            if not self._is_free[s] and s not in seen:
                seen.add(s)
                continue
            raise DoubleFree(f"request slot {s} is already free")
        for s in ids:
            self._is_free[s] = True
        self._free_slots.extend(ids)

    def free_req(self, req: Any) -> None:
        """Free ``req.req_pool_idx`` and set it to ``None``."""
        if req.req_pool_idx is None:
            raise DoubleFree("request holds no request slot (req_pool_idx is None)")
        self.free(int(req.req_pool_idx))
        req.req_pool_idx = None

    def clear(self) -> None:
        self._free_slots = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size
        self.req_generation.zero_()

    # ------------------------------------------------------------------ helpers
    def _check_range(self, ids: Iterable[int]) -> None:
        for s in ids:
            if s < 1 or s > self.size:
                raise IndexOutOfRange(
                    f"request slot {s} outside [1, {self.size}] (slot 0 is the padding row)"
                )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, max_context_len={self.max_context_len}, "
            f"free={len(self._free_slots)}, device={self.device})"
        )
