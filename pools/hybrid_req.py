"""``HybridReqToTokenPool``: request slots + a Mamba state slot per request (+ ping-pong slots).

A request (any object with the attributes of :class:`HybridReqState`) gets:

* ``req_pool_idx`` — its row of ``req_to_token`` (kept if already set: chunked prefill);
* ``mamba_pool_idx`` — its working Mamba slot (kept if already set: radix hit / next chunk);
* with ``enable_mamba_extra_buffer``: ``mamba_ping_pong_track_buffer`` — a list of
  ``ping_pong_size`` slots (2 with the overlap scheduler, else 1) where the scheduler
  snapshots ("tracks") the state at cache boundaries, and ``mamba_next_track_idx`` — the
  entry the next snapshot goes to. In *lazy* mode only entry 0 is allocated up front; the
  others are ``-1`` until :meth:`ensure_ping_pong_slot` fills them at a track boundary.

Ownership rules (no slot is ever leaked or owned twice):

* :meth:`alloc` is all-or-nothing: it checks request *and* mamba capacity before taking
  anything and returns ``None`` with nothing changed when either is short.
* :meth:`donate_mamba_ping_pong_slot` hands the slot holding the latest tracked state
  (index ``mamba_next_track_idx`` in lazy mode, the *other* index in normal mode) to the
  caller (e.g. a radix cache, which frees it later) and puts a caller-provided, already
  allocated slot in its place.
* :meth:`free_mamba_cache` frees the working slot and every ping-pong slot except the one
  at ``keep`` (ownership of which passes to the caller and which is returned), skipping
  ``-1`` entries, and clears the request's mamba fields. Everything is validated first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import torch

from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument
from kvxfer.pools.mamba import MambaLayerCache, MambaPool
from kvxfer.pools.mamba_alloc import MambaSlotAllocator
from kvxfer.pools.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)

__all__ = ["HybridReqToTokenPool", "HybridReqState"]

NO_SLOT = -1


@dataclass
class HybridReqState:
    """The request fields the hybrid pool reads and writes (use your own Req if it has them)."""

    req_pool_idx: Optional[int] = None
    mamba_pool_idx: Optional[int] = None
    mamba_ping_pong_track_buffer: Optional[List[int]] = None
    mamba_next_track_idx: Optional[int] = None
    mamba_needs_clear: bool = False


class HybridReqToTokenPool(ReqToTokenPool):
    def __init__(
        self,
        size: int,
        max_context_len: int,
        mamba_pool: MambaPool,
        device: Union[str, torch.device] = "cpu",
        *,
        enable_mamba_extra_buffer: bool = False,
        enable_mamba_extra_buffer_lazy: bool = False,
        enable_overlap_schedule: bool = True,
        start_layer: int = 0,
    ):
        super().__init__(size, max_context_len, device)
        if not isinstance(mamba_pool, MambaPool):
            raise InvalidArgument(
                f"mamba_pool must be a MambaPool, got {type(mamba_pool).__name__}"
            )
        if enable_mamba_extra_buffer_lazy and not enable_mamba_extra_buffer:
            raise InvalidArgument("enable_mamba_extra_buffer_lazy needs enable_mamba_extra_buffer")
        self.mamba_pool = mamba_pool
        self.mamba_allocator = MambaSlotAllocator(mamba_pool.size)
        self.enable_mamba_extra_buffer = bool(enable_mamba_extra_buffer)
        self.enable_mamba_extra_buffer_lazy = bool(enable_mamba_extra_buffer_lazy)
        self.ping_pong_size = 2 if enable_overlap_schedule else 1
        self.start_layer = int(start_layer)
        self.layer_transfer_counter = None
        self.req_index_to_mamba_index_mapping = torch.zeros(
            self.size + 1, dtype=torch.int32, device=self.device
        )
        self.req_index_to_mamba_ping_pong_track_buffer_mapping: Optional[torch.Tensor] = None
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = torch.zeros(
                (self.size + 1, self.ping_pong_size), dtype=torch.int64, device=self.device
            )

    # ------------------------------------------------------------------ alloc
    def _ping_pong_alloc_count(self) -> int:
        return 1 if self.enable_mamba_extra_buffer_lazy else self.ping_pong_size

    def alloc(self, reqs: Sequence[Any]) -> Optional[List[int]]:  # type: ignore[override]
        """Give each request a request slot, a mamba slot and ping-pong slots as needed.

        Returns every request's ``req_pool_idx`` or ``None`` (nothing changed) when request
        or mamba slots are short.
        """
        if isinstance(reqs, int):
            raise InvalidArgument("HybridReqToTokenPool.alloc takes request objects, not a count")
        need_req = sum(1 for r in reqs if r.req_pool_idx is None)
        need_mamba = sum(1 for r in reqs if r.mamba_pool_idx is None)
        if self.enable_mamba_extra_buffer:
            need_mamba += self._ping_pong_alloc_count() * sum(
                1 for r in reqs if r.mamba_ping_pong_track_buffer is None
            )
        if need_req > self.available_size() or need_mamba > self.mamba_allocator.available_size():
            return None
        select = self.alloc_reqs(reqs)
        assert select is not None  # capacity was checked above
        for r in reqs:
            if r.mamba_pool_idx is None:
                (r.mamba_pool_idx,) = self.mamba_allocator.alloc(1)
                r.mamba_needs_clear = True
            if self.enable_mamba_extra_buffer and r.mamba_ping_pong_track_buffer is None:
                n = self._ping_pong_alloc_count()
                got = self.mamba_allocator.alloc(n)
                assert got is not None
                r.mamba_ping_pong_track_buffer = got + [NO_SLOT] * (self.ping_pong_size - n)
                r.mamba_next_track_idx = 0
        if select:
            dev = self.device
            rows = torch.tensor(select, dtype=torch.int64, device=dev)
            self.req_index_to_mamba_index_mapping[rows] = torch.tensor(
                [int(r.mamba_pool_idx) for r in reqs], dtype=torch.int32, device=dev
            )
            if self.enable_mamba_extra_buffer:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping[rows] = torch.tensor(
                    [list(r.mamba_ping_pong_track_buffer) for r in reqs],
                    dtype=torch.int64,
                    device=dev,
                )
        return select

    # ------------------------------------------------------------------ lookups
    def get_mamba_indices(self, req_indices: torch.Tensor) -> torch.Tensor:
        return self.req_index_to_mamba_index_mapping[req_indices]

    def register_layer_transfer_counter(self, counter) -> None:
        self.layer_transfer_counter = counter

    def mamba_layer_cache(self, layer_id: int) -> MambaLayerCache:
        """State of mamba layer ``layer_id`` (waits for it when layer-wise loading is on)."""
        cache = self.mamba_pool.layer_cache(layer_id)  # validates the id first
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(int(layer_id) - self.start_layer)
        return cache

    def get_state_buf_infos(self):
        return self.mamba_pool.get_state_buf_infos()

    def get_state_item_views(self):
        return self.mamba_pool.get_state_item_views()

    def get_state_dim_per_tensor(self):
        return self.mamba_pool.get_state_dim_per_tensor()

    def get_state_parts_per_tensor(self):
        return self.mamba_pool.get_state_parts_per_tensor()

    # ------------------------------------------------------------------ ping-pong
    def _require_extra(self) -> None:
        if not self.enable_mamba_extra_buffer:
            raise InvalidArgument("ping-pong track slots need enable_mamba_extra_buffer=True")

    def _track_buffer(self, req: Any) -> List[int]:
        self._require_extra()
        buf = req.mamba_ping_pong_track_buffer
        if buf is None:
            raise InvalidArgument(
                "request holds no ping-pong track buffer (not allocated or freed)"
            )
        return buf

    def _check_pp_idx(self, idx: int) -> int:
        if not 0 <= int(idx) < self.ping_pong_size:
            raise IndexOutOfRange(f"ping-pong index {idx} outside [0, {self.ping_pong_size})")
        return int(idx)

    def get_mamba_ping_pong_other_idx(self, next_track_idx: int) -> int:
        return 1 - next_track_idx if self.ping_pong_size == 2 else next_track_idx

    def get_mamba_ping_pong_keep_idx(self, req: Any) -> int:
        """Index of the slot holding the most recently tracked state.

        Lazy mode: the state stays at ``mamba_next_track_idx`` (no eager swap); normal mode:
        at the *other* index (the scheduler swaps after each track).
        """
        if self.enable_mamba_extra_buffer_lazy:
            return int(req.mamba_next_track_idx)
        return self.get_mamba_ping_pong_other_idx(int(req.mamba_next_track_idx))

    def set_mamba_ping_pong_slot(self, req: Any, idx: int, value: int) -> None:
        """Set entry ``idx`` of the request's track buffer and sync the device mapping."""
        buf = self._track_buffer(req)
        buf[self._check_pp_idx(idx)] = int(value)
        if req.req_pool_idx is not None:
            row = torch.tensor(buf, dtype=torch.int64, device=self.device)
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[int(req.req_pool_idx)] = row

    def ensure_ping_pong_slot(self, req: Any, idx: int) -> Optional[int]:
        """Lazy mode: allocate entry ``idx`` if it is ``-1``. Returns the slot, or ``None``
        (nothing changed) when no mamba slot is free."""
        buf = self._track_buffer(req)
        idx = self._check_pp_idx(idx)
        if buf[idx] != NO_SLOT:
            return buf[idx]
        got = self.mamba_allocator.alloc(1)
        if got is None:
            return None
        self.set_mamba_ping_pong_slot(req, idx, got[0])
        return got[0]

    def donate_mamba_ping_pong_slot(
        self, req: Any, new_slot: Union[int, Sequence[int], torch.Tensor]
    ) -> int:
        """Give the tracked-state slot to the caller and track into ``new_slot`` instead.

        ``new_slot`` must be a mamba slot the caller allocated from :attr:`mamba_allocator`
        and owns; afterwards the pool (the request) owns it and the caller owns the returned
        slot.
        """
        buf = self._track_buffer(req)
        if isinstance(new_slot, torch.Tensor):
            new_slot = new_slot.reshape(-1)[0].item()
        elif not isinstance(new_slot, int):
            new_slot = list(new_slot)[0]
        new_slot = int(new_slot)
        if not self.mamba_allocator.is_allocated(new_slot):
            raise InvalidArgument(
                f"donation replacement slot {new_slot} is not an allocated mamba slot"
            )
        if new_slot == req.mamba_pool_idx or new_slot in buf:
            raise InvalidArgument(
                f"donation replacement slot {new_slot} is already used by this request"
            )
        idx = self.get_mamba_ping_pong_keep_idx(req)
        old = buf[idx]
        if old == NO_SLOT:
            raise InvalidArgument(
                f"no tracked mamba state to donate: ping-pong entry {idx} is unallocated (buf={buf})"
            )
        self.set_mamba_ping_pong_slot(req, idx, new_slot)
        return old

    # ------------------------------------------------------------------ free
    def free_mamba_cache(
        self, req: Any, mamba_ping_pong_track_buffer_to_keep: Optional[int] = None
    ) -> Optional[int]:
        """Free the request's mamba slot and ping-pong slots (all but ``keep``).

        Returns the kept slot (now owned by the caller), or ``None``. Validates first:
        a request without a mamba slot raises :class:`DoubleFree`, nothing changes.
        """
        if req.mamba_pool_idx is None:
            raise DoubleFree("request holds no mamba slot (mamba_pool_idx is None)")
        to_free = [int(req.mamba_pool_idx)]
        kept = None
        keep = mamba_ping_pong_track_buffer_to_keep
        if self.enable_mamba_extra_buffer and req.mamba_ping_pong_track_buffer is not None:
            buf = list(req.mamba_ping_pong_track_buffer)
            if keep is not None:
                keep = self._check_pp_idx(keep)
                kept = buf[keep] if buf[keep] != NO_SLOT else None
            to_free += [s for i, s in enumerate(buf) if i != keep and s != NO_SLOT]
        elif keep is not None:
            raise InvalidArgument(
                "mamba_ping_pong_track_buffer_to_keep given but the request has no track buffer"
            )
        self.mamba_allocator.check_free(to_free)
        self.mamba_allocator.free(to_free)
        req.mamba_pool_idx = None
        if self.enable_mamba_extra_buffer:
            req.mamba_ping_pong_track_buffer = None
            req.mamba_next_track_idx = None
        return kept

    def free_req(self, req: Any) -> None:
        """Free the request slot (not the mamba state; see :meth:`free_mamba_cache`)."""
        slot = req.req_pool_idx
        super().free_req(req)
        self.req_index_to_mamba_index_mapping[int(slot)] = 0
        if self.enable_mamba_extra_buffer:
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[int(slot)] = 0

    def clear(self) -> None:
        super().clear()
        if hasattr(self, "mamba_allocator"):
            self.mamba_allocator.clear()
            self.req_index_to_mamba_index_mapping.zero_()
            if self.req_index_to_mamba_ping_pong_track_buffer_mapping is not None:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping.zero_()
