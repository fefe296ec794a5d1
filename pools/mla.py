"""``MLATokenToKVPool``: one latent buffer per layer, ``[size + page_size, 1, R + Dr]``.

Each token row holds the compressed latent (``kv_lora_rank = R`` elements, the "nope" part)
followed by the decoupled rope key (``qk_rope_head_dim = Dr`` elements). The key buffer is the
whole row; the value buffer is the latent prefix ``[..., :R]`` (a view).

Registration: ``layer_num`` entries ``kv0..kv{L-1}``; ``item_lens`` = one page of rows.

``post_capture_active=True`` reserves the buffers and backs page 0 only until
``finalize_backing(n)`` (see :mod:`kvxfer.pools.post_capture`).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import InvalidArgument
from kvxfer.kernels.mla import gather_mla, store_mla
from kvxfer.kernels.store import store_kv
from kvxfer.pools.base import KVCache
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc, per_layer_descs
from kvxfer.pools.post_capture import page_align_up

logger = logging.getLogger(__name__)

__all__ = ["MLATokenToKVPool"]


class MLATokenToKVPool(KVCache):
    """Per-layer MLA latent pool (see module docstring)."""

    kind = "mla"
    layout = "nhd"
    head_num = 1

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device="cpu",
        *,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        cpu_copy_chunk_tokens: int = 8192,
        post_capture_active: bool = False,
        backing_options: Optional[Mapping[str, Any]] = None,
    ):
        if post_capture_active is True:  # reserved upper bound: whole pages
            size = page_align_up(size, page_size)
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
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.head_dim = self.kv_cache_dim
        self.v_head_dim = kv_lora_rank
        self._init_post_capture(post_capture_active, backing_options)
        if post_capture_active:
            self.kv_buffer = self._reserve_backing(self._buffer_descs(), self.store_dtype)
        else:
            self.kv_buffer = [
                torch.zeros(
                    (self.num_slots, 1, self.kv_cache_dim),
                    dtype=self.store_dtype,
                    device=self.device,
                )
                for _ in range(self.layer_num)
            ]
        self._copy_table = KvCopyTable(self.kv_buffer) if self.layer_num else None
        # captured CUDA graphs keep the full buffers/table (see pools.post_capture)
        self._copy_table_full = (
            self._copy_table if self._backing is not None and self.device.type == "cuda" else None
        )
        self._refresh_kernel_views()

    def _buffer_descs(self) -> list[KvBufferDesc]:
        return per_layer_descs(
            "kv",
            self.layer_num,
            (self.num_slots, 1, self.kv_cache_dim),
            self.store_dtype.itemsize,
            1,
        )

    # -- post-capture hooks (pools.post_capture) ----------------------------------------------
    def _refresh_kernel_views(self) -> None:
        if self._backing is None:
            return
        self._kv_live = [self._narrow(b) for b in self.kv_buffer]
        self._copy_table = KvCopyTable(self._kv_live)

    def _drop_buffers(self) -> None:
        self.kv_buffer, self._kv_live = [], []
        self._copy_table = self._copy_table_full = None

    def _kernel_kv(self) -> list[torch.Tensor]:
        """Buffers the kernels index: narrowed to the backed span for a post-capture pool,
        the full buffers otherwise and during graph capture."""
        if self._backing is None or self._capturing():
            return self.kv_buffer
        return self._kv_live

    # -- KVCache plumbing ---------------------------------------------------------------------
    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        return list(zip(self.kv_buffer, self._buffer_descs()))

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "rows") for b in self.kv_buffer]

    def kv_token_heads(self) -> list[list[tuple[int, int]]]:
        """The latent is replicated over TP ranks: no KV heads (DSA, FP4 alike)."""
        return [[] for _ in self._registered()]

    # -- getters ------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Whole rows ``[num_slots, 1, R + Dr]`` (latent + rope)."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self._as_logical(self.kv_buffer[idx])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent part ``[num_slots, 1, R]`` (a view)."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self._as_logical(self.kv_buffer[idx][..., : self.kv_lora_rank])

    # -- writes / reads -----------------------------------------------------------------------
    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: Optional[torch.Tensor] = None,
        *,
        mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Write whole rows ``k [N, 1, R + Dr]`` at ``loc``; ``v`` is ignored (it is part of k)."""
        idx = self.layer_index(layer)
        loc = self._as_loc(loc)
        k = self._to_store(k)
        self._check_rows("k", k, loc.shape[0], (1, self.kv_cache_dim))
        if mask is not None:
            mask = mask.to(self.device)
        store_kv(self._kernel_kv()[idx], None, loc, k, None, mask=mask, backend=self.kernel_backend)

    def set_mla_kv_buffer(self, layer, loc, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``k_nope [N, 1, R]`` and ``k_rope [N, 1, Dr]`` into one row per token."""
        idx = self.layer_index(layer)
        loc = self._as_loc(loc)
        n = loc.shape[0]
        nope, rope = self._to_store(k_nope), self._to_store(k_rope)
        self._check_rows("k_nope", nope, n, (1, self.kv_lora_rank))
        self._check_rows("k_rope", rope, n, (1, self.qk_rope_head_dim))
        store_mla(self._kernel_kv()[idx], loc, nope, rope, backend=self.kernel_backend)

    def get_mla_kv_buffer(
        self, layer, loc, dst_dtype: Optional[torch.dtype] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_nope [N, 1, R], k_rope [N, 1, Dr])`` at ``loc``, as ``dst_dtype`` (default
        ``dtype``)."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        loc = self._as_loc(loc)
        nope, rope = gather_mla(
            self._kernel_kv()[idx], loc, self.kv_lora_rank, backend=self.kernel_backend
        )
        nope, rope = self._as_logical(nope), self._as_logical(rope)
        if dst_dtype is not None and dst_dtype != self.dtype:
            nope, rope = nope.to(dst_dtype), rope.to(dst_dtype)
        return nope, rope

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Copy rows ``src_loc -> tgt_loc`` in every layer, one launch."""
        tgt, src = self._move_locs(tgt_loc, src_loc)
        table = self._copy_table_full if self._capturing() else self._copy_table
        if table is None or tgt.numel() == 0:
            return
        table.move(tgt, src, backend=self.kernel_backend)
