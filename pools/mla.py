"""``MLATokenToKVPool``: one latent buffer per layer, ``[size + page_size, 1, R + Dr]``.

Each token row holds the compressed latent (``kv_lora_rank = R`` elements, the "nope" part)
followed by the decoupled rope key (``qk_rope_head_dim = Dr`` elements). The key buffer is the
whole row; the value buffer is the latent prefix ``[..., :R]`` (a view).

Registration: ``layer_num`` entries ``kv0..kv{L-1}``; ``item_lens`` = one page of rows.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from kernels.copy import KvCopyTable
from kernels.errors import InvalidArgument
from kernels.mla import gather_mla, store_mla
from kernels.store import store_kv
from pools.base import KVCache
from pools.cpu_copy import TokenBuffer
from pools.layout import KvBufferDesc, per_layer_descs

logger = logging.getLogger(__name__)

__all__ = ["MLATokenToKVPool"]


class MLATokenToKVPool(KVCache):
    """Per-layer MLA latent pool (see module docstring)."""

    kind = "mla"
    layout = "nhd"
    head_num = 1

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int,
                 qk_rope_head_dim: int, layer_num: int, device="cpu", *,
                 start_layer: Optional[int] = None, end_layer: Optional[int] = None,
                 kernel_backend: str = "auto", cpu_copy_chunk_tokens: int = 8192):
        super().__init__(size, page_size, dtype, layer_num, device, start_layer=start_layer,
                         end_layer=end_layer, kernel_backend=kernel_backend,
                         cpu_copy_chunk_tokens=cpu_copy_chunk_tokens)
        for name, value in (("kv_lora_rank", kv_lora_rank), ("qk_rope_head_dim", qk_rope_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.head_dim = self.kv_cache_dim
        self.v_head_dim = kv_lora_rank
        self.kv_buffer = [
            torch.zeros((self.num_slots, 1, self.kv_cache_dim), dtype=self.store_dtype,
                        device=self.device)
            for _ in range(self.layer_num)
        ]
        self._copy_table = KvCopyTable(self.kv_buffer) if self.layer_num else None

    # -- KVCache plumbing ---------------------------------------------------------------------
    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        descs = per_layer_descs("kv", self.layer_num, (self.num_slots, 1, self.kv_cache_dim),
                                self.store_dtype.itemsize, 1)
        return list(zip(self.kv_buffer, descs))

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "rows") for b in self.kv_buffer]

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
    def set_kv_buffer(self, layer, loc, k: torch.Tensor, v: Optional[torch.Tensor] = None, *,
                      mask: Optional[torch.Tensor] = None) -> None:
        """Write whole rows ``k [N, 1, R + Dr]`` at ``loc``; ``v`` is ignored (it is part of k)."""
        idx = self.layer_index(layer)
        loc = self._as_loc(loc)
        k = self._to_store(k)
        self._check_rows("k", k, loc.shape[0], (1, self.kv_cache_dim))
        if mask is not None:
            mask = mask.to(self.device)
        store_kv(self.kv_buffer[idx], None, loc, k, None, mask=mask, backend=self.kernel_backend)

    def set_mla_kv_buffer(self, layer, loc, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        """Write ``k_nope [N, 1, R]`` and ``k_rope [N, 1, Dr]`` into one row per token."""
        idx = self.layer_index(layer)
        loc = self._as_loc(loc)
        n = loc.shape[0]
        nope, rope = self._to_store(k_nope), self._to_store(k_rope)
        self._check_rows("k_nope", nope, n, (1, self.kv_lora_rank))
        self._check_rows("k_rope", rope, n, (1, self.qk_rope_head_dim))
        store_mla(self.kv_buffer[idx], loc, nope, rope, backend=self.kernel_backend)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype: Optional[torch.dtype] = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_nope [N, 1, R], k_rope [N, 1, Dr])`` at ``loc``, as ``dst_dtype`` (default
        ``dtype``)."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        loc = self._as_loc(loc)
        nope, rope = gather_mla(self.kv_buffer[idx], loc, self.kv_lora_rank,
                                backend=self.kernel_backend)
        nope, rope = self._as_logical(nope), self._as_logical(rope)
        if dst_dtype is not None and dst_dtype != self.dtype:
            nope, rope = nope.to(dst_dtype), rope.to(dst_dtype)
        return nope, rope

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Copy rows ``src_loc -> tgt_loc`` in every layer, one launch."""
        tgt, src = self._move_locs(tgt_loc, src_loc)
        if self._copy_table is None or tgt.numel() == 0:
            return
        self._copy_table.move(tgt, src, backend=self.kernel_backend)
