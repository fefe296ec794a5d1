"""Degenerate MHA pools: ``NoOpMHATokenToKVPool`` (no storage) and ``MHATokenToKOnlyPool``
(K without V).

``NoOpMHATokenToKVPool`` keeps the scheduler's capacity view (``size`` is honoured) but owns
only ``[page_size, H, D]`` zero placeholders per layer, for code that dereferences buffer
shapes. Any write, host copy or prefix store raises :class:`UnsupportedOperation`; moves are
no-ops; it registers nothing (empty descriptor lists).

``MHATokenToKOnlyPool`` stores K only (``[size + page_size, H, D]`` per layer) for layers
whose consumers never read V. Registration: ``layer_num`` entries ``k0..k{L-1}``.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import InvalidArgument, UnsupportedOperation
from kvxfer.kernels.store import store_kv
from kvxfer.pools.base import KVCache
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc, per_layer_descs
from kvxfer.pools.mha import MHATokenToKVPool

logger = logging.getLogger(__name__)

__all__ = ["NoOpMHATokenToKVPool", "MHATokenToKOnlyPool"]


class NoOpMHATokenToKVPool(MHATokenToKVPool):
    """Capacity without storage (see module docstring). Constructor as MHATokenToKVPool
    (``layout`` must be ``"nhd"``)."""

    kind = "noop"

    def _create_buffers(self) -> None:
        kw = dict(dtype=self.store_dtype, device=self.device)
        self.k_buffer = [
            torch.zeros((self.page_size, self.head_num, self.head_dim), **kw)
            for _ in range(self.layer_num)
        ]
        self.v_buffer = [
            torch.zeros((self.page_size, self.head_num, self.v_head_dim), **kw)
            for _ in range(self.layer_num)
        ]

    def _set_layout(self, layout: str) -> None:
        if layout != "nhd":
            raise InvalidArgument(f"NoOpMHATokenToKVPool has layout 'nhd', got {layout!r}")
        self.layout = "nhd"

    def _copy_buffers(self) -> list[torch.Tensor]:
        return []

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        return []

    def _token_buffers(self) -> list[TokenBuffer]:
        return []

    def _unsupported(self, what: str):
        return UnsupportedOperation(
            f"NoOpMHATokenToKVPool.{what}: this pool stores no KV (prefill-only workloads "
            f"whose attention never reads the cache); use MHATokenToKVPool instead"
        )

    def set_kv_buffer(self, *args, **kwargs) -> None:
        raise self._unsupported("set_kv_buffer")

    def set_kv_buffer_prefix_valid(self, *args, **kwargs) -> None:
        raise self._unsupported("set_kv_buffer_prefix_valid")

    def get_cpu_copy(self, *args, **kwargs):
        raise self._unsupported("get_cpu_copy")

    def load_cpu_copy(self, *args, **kwargs) -> None:
        raise self._unsupported("load_cpu_copy")

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        self._move_locs(tgt_loc, src_loc)  # still reject malformed arguments
        # nothing stored, nothing to move

    def get_kv_size_bytes(self) -> int:
        return 0


class MHATokenToKOnlyPool(KVCache):
    """K-only per-layer pool (see module docstring)."""

    kind = "k_only"
    layout = "nhd"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device="cpu",
        *,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        cpu_copy_chunk_tokens: int = 8192,
    ):
        super().__init__(
            size,
            page_size,
            dtype,
            layer_num,
            device,
            start_layer=start_layer,
            end_layer=end_layer,
            kernel_backend=kernel_backend,
            cpu_copy_chunk_tokens=cpu_copy_chunk_tokens,
        )
        for name, value in (("head_num", head_num), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = 0
        self.k_buffer = [
            torch.zeros(
                (self.num_slots, head_num, head_dim), dtype=self.store_dtype, device=self.device
            )
            for _ in range(self.layer_num)
        ]
        self._copy_table = KvCopyTable(self.k_buffer) if self.layer_num else None

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        descs = per_layer_descs(
            "k",
            self.layer_num,
            (self.num_slots, self.head_num, self.head_dim),
            self.store_dtype.itemsize,
            1,
        )
        return list(zip(self.k_buffer, descs))

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "rows") for b in self.k_buffer]

    def kv_token_heads(self) -> list[list[tuple[int, int]]]:
        """NHD rows: every row holds the ``H`` heads."""
        return [[(0, self.head_num)] for _ in self.k_buffer]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self._as_logical(self.k_buffer[idx])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise UnsupportedOperation("MHATokenToKOnlyPool stores no V")

    def get_kv_buffer(self, layer_id: int):
        raise UnsupportedOperation("MHATokenToKOnlyPool stores no V")

    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: Optional[torch.Tensor] = None,
        *,
        mask: Optional[torch.Tensor] = None,
        k_scale: Optional[float] = None,
    ) -> None:
        """Write ``k [N, H, D]`` at ``loc``; ``v`` must be None (this pool has no V)."""
        if v is not None:
            raise UnsupportedOperation("MHATokenToKOnlyPool stores no V; pass v=None")
        self.set_k_buffer(layer, loc, k, mask=mask, k_scale=k_scale)

    def set_k_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        k_scale: Optional[float] = None,
    ) -> None:
        idx = self.layer_index(layer)
        loc = self._as_loc(loc)
        k = self._to_store(k, k_scale)
        self._check_rows("k", k, loc.shape[0], (self.head_num, self.head_dim))
        if mask is not None:
            mask = mask.to(self.device)
        store_kv(self.k_buffer[idx], None, loc, k, None, mask=mask, backend=self.kernel_backend)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        tgt, src = self._move_locs(tgt_loc, src_loc)
        if self._copy_table is None or tgt.numel() == 0:
            return
        self._copy_table.move(tgt, src, backend=self.kernel_backend)
