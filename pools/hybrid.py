"""``HybridLinearKVPool``: a hybrid model's full-attention KV pool plus its Mamba state pool.

Hybrid models interleave full-attention layers with Mamba / linear-attention layers. The
full-attention layers' KV lives in an *inner* KV pool (any :class:`kvxfer.pools.base.KVCache`:
per-layer MHA in either layout, page-major, MLA, ...) built with ``layer_num =
len(full_attention_layer_ids)``; model layer ``full_attention_layer_ids[i]`` is inner layer
``kv_pool.start_layer + i``. The recurrent state lives in a :class:`MambaPool` whose spec names
the mamba layer ids. The two id sets must be disjoint; any other layer id raises
:class:`IndexOutOfRange`.

Transfers see two descriptor groups: ``get_contiguous_buf_infos()`` / ``get_item_views()`` are
the inner KV pool's (item = one page), ``get_state_buf_infos()`` / ``get_state_item_views()``
the Mamba pool's (item = one state slot). Host copies cover both: ``get_cpu_copy(indices,
mamba_indices)`` → :class:`HybridCpuCopy`; ``load_cpu_copy`` validates the Mamba part, then
loads the KV part (which validates itself before writing), then the Mamba part — so a bad
copy or bad indices raise before anything is written.

Post-capture backing (:mod:`kvxfer.pools.post_capture`) is the inner KV pool's: build it with
``post_capture_active=True``; ``finalize_backing`` / ``release_beyond`` / ``close`` /
``post_capture_backed_bytes`` / ``token_limit`` delegate to it (the Mamba state pool is sized
before capture and never resized). ``post_capture_active`` given here must agree with it.

Write locations: a :class:`~kvxfer.pools.write_loc.KVWriteLoc` given to a write is resolved here, in
:meth:`HybridLinearKVPool._write_loc`, and the inner pool gets a bare location: ``full_loc``
(already translated into the full-attention pool's slots) when the bundle carries one, else
``loc``. An MLA inner pool (``use_mla``: MLA, MLA-FP4, DSA) writes at ``loc``, as the reference
pool does.

``HybridReqToTokenPool`` (request → mamba slot bookkeeping) is re-exported from here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from kvxfer.pools.base import KVCache
from kvxfer.pools.errors import IndexOutOfRange, InvalidArgument
from kvxfer.pools.hybrid_req import HybridReqState, HybridReqToTokenPool  # noqa: F401
from kvxfer.pools.mamba import MambaCpuCopy, MambaLayerCache, MambaPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.write_loc import unwrap_write_loc

logger = logging.getLogger(__name__)

__all__ = ["HybridLinearKVPool", "HybridCpuCopy", "HybridReqToTokenPool", "HybridReqState"]


@dataclass
class HybridCpuCopy:
    """Host copy of a hybrid pool: the inner pool's KV copy and (optionally) Mamba state."""

    kv: Any
    mamba: Optional[MambaCpuCopy] = None

    @property
    def nbytes(self) -> int:
        kv = self.kv.nbytes if isinstance(self.kv.nbytes, int) else self.kv.nbytes()
        return int(kv) + (self.mamba.nbytes() if self.mamba is not None else 0)


class HybridLinearKVPool(KVCache):
    kind = "hybrid_linear"

    def __init__(
        self,
        kv_pool: KVCache,
        mamba_pool: MambaPool,
        full_attention_layer_ids: Sequence[int],
        *,
        start_layer: int = 0,
        post_capture_active: Optional[bool] = None,
    ):
        if not isinstance(kv_pool, KVCache):
            raise InvalidArgument(f"kv_pool must be a KVCache, got {type(kv_pool).__name__}")
        if not isinstance(mamba_pool, MambaPool):
            raise InvalidArgument(
                f"mamba_pool must be a MambaPool, got {type(mamba_pool).__name__}"
            )
        ids = [int(i) for i in full_attention_layer_ids]
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise InvalidArgument(
                f"full_attention_layer_ids must be distinct non-negative ints: {ids}"
            )
        if len(ids) != kv_pool.layer_num:
            raise InvalidArgument(
                f"{len(ids)} full-attention layer ids but the KV pool has {kv_pool.layer_num} layers"
            )
        inner_pc = bool(getattr(kv_pool, "post_capture_active", False))
        if post_capture_active is not None and post_capture_active != inner_pc:
            raise InvalidArgument(
                f"post_capture_active={post_capture_active} but the inner KV pool was built with "
                f"post_capture_active={inner_pc} (the backing is the inner pool's)"
            )
        overlap = set(ids) & set(mamba_pool.spec.layer_ids)
        if overlap:
            raise InvalidArgument(
                f"layer ids {sorted(overlap)} are both full-attention and mamba layers"
            )
        all_ids = ids + list(mamba_pool.spec.layer_ids)
        super().__init__(
            kv_pool.size,
            kv_pool.page_size,
            kv_pool.dtype,
            kv_pool.layer_num,
            kv_pool.device,
            start_layer=int(start_layer),
            end_layer=max(max(all_ids), int(start_layer)),
            kernel_backend=getattr(kv_pool, "kernel_backend", "auto"),
            cpu_copy_chunk_tokens=getattr(kv_pool, "cpu_copy_chunk_tokens", 8192),
        )
        self.kv_pool = kv_pool
        self.full_kv_pool = kv_pool  # the reference's name
        self.mamba_pool = mamba_pool
        self.full_attention_layer_ids = ids
        self.full_attention_layer_id_mapping = {gid: i for i, gid in enumerate(ids)}
        self.use_mla = isinstance(kv_pool, MLATokenToKVPool)
        self.store_dtype = kv_pool.store_dtype
        self.layout = getattr(kv_pool, "layout", "nhd")
        self.head_num = getattr(kv_pool, "head_num", 0)
        self.head_dim = getattr(kv_pool, "head_dim", 0)
        self.v_head_dim = getattr(kv_pool, "v_head_dim", 0)
        # Layer-wise waiting happens here, on model layer ids; the inner pool must not wait.
        kv_pool.register_layer_transfer_counter(None)

    # ------------------------------------------------------------------ layer ids
    def _inner_layer(self, layer: Any) -> int:
        layer_id = getattr(layer, "layer_id", layer)
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise InvalidArgument(f"layer must be an int id or have .layer_id, got {layer!r}")
        try:
            idx = self.full_attention_layer_id_mapping[layer_id]
        except KeyError:
            raise IndexOutOfRange(
                f"layer id {layer_id} is not a full-attention layer "
                f"(full-attention layers: {self.full_attention_layer_ids})"
            ) from None
        return self.kv_pool.start_layer + idx

    def layer_index(self, layer: Any) -> int:
        return self._inner_layer(layer) - self.kv_pool.start_layer

    def _wait_for(self, layer_id: int) -> None:
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(int(layer_id) - self.start_layer)

    def _write_loc(self, loc):
        """The inner pool's write location for ``loc`` (a bare location or a
        :class:`KVWriteLoc`): ``full_loc`` when given (MLA inner pools: ``loc``), else ``loc``."""
        loc, _, full_loc = unwrap_write_loc(loc)
        return loc if full_loc is None or self.use_mla else full_loc

    # ------------------------------------------------------------------ KV access
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        inner = self._inner_layer(layer_id)
        self._wait_for(layer_id)
        return self.kv_pool.get_key_buffer(inner)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        inner = self._inner_layer(layer_id)
        self._wait_for(layer_id)
        return self.kv_pool.get_value_buffer(inner)

    def get_kv_buffer(self, layer_id: int):
        inner = self._inner_layer(layer_id)
        self._wait_for(layer_id)
        return self.kv_pool.get_kv_buffer(inner)

    def set_kv_buffer(self, layer, loc, k: torch.Tensor, v: Optional[torch.Tensor], **kw) -> None:
        self.kv_pool.set_kv_buffer(self._inner_layer(layer), self._write_loc(loc), k, v, **kw)

    def set_kv_buffer_prefix_valid(self, layer, *args, **kw) -> None:
        fn = getattr(self.kv_pool, "set_kv_buffer_prefix_valid", None)
        if fn is None:
            raise InvalidArgument(f"{type(self.kv_pool).__name__} has no prefix-valid store")
        fn(self._inner_layer(layer), *args, **kw)

    def set_mla_kv_buffer(self, layer, loc, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        fn = getattr(self.kv_pool, "set_mla_kv_buffer", None)
        if fn is None:
            raise InvalidArgument(f"{type(self.kv_pool).__name__} is not an MLA pool")
        fn(self._inner_layer(layer), self._write_loc(loc), k_nope, k_rope)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype: Optional[torch.dtype] = None):
        fn = getattr(self.kv_pool, "get_mla_kv_buffer", None)
        if fn is None:
            raise InvalidArgument(f"{type(self.kv_pool).__name__} is not an MLA pool")
        return fn(self._inner_layer(layer), loc, dst_dtype)

    def get_kv_rows(self, layer, loc):
        """The inner pool's token rows of model layer ``layer`` at ``loc`` (see
        :meth:`kvxfer.pools.mha.MHATokenToKVPool.get_kv_rows`)."""
        fn = getattr(self.kv_pool, "get_kv_rows", None)
        if fn is None:
            raise InvalidArgument(f"{type(self.kv_pool).__name__} has no get_kv_rows")
        inner = self._inner_layer(layer)
        self._wait_for(getattr(layer, "layer_id", layer))
        return fn(inner, loc)

    def get_v_head_dim(self) -> int:
        return int(self.v_head_dim)

    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Moves KV rows only (Mamba state is per request: see ``MambaPool.copy_from``)."""
        self.kv_pool.move_kv_cache(tgt_loc, src_loc)

    # ------------------------------------------------------------------ post-capture backing
    @property
    def post_capture_active(self) -> bool:
        return bool(getattr(self.kv_pool, "post_capture_active", False))

    @property
    def backing(self):
        return self.kv_pool.backing

    @property
    def closed(self) -> bool:
        return self.kv_pool.closed

    @property
    def token_limit(self) -> int:
        return self.kv_pool.token_limit

    @property
    def post_capture_backed_bytes(self) -> int:
        return self.kv_pool.post_capture_backed_bytes

    def finalize_backing(self, max_total_num_tokens) -> None:
        """Finalize the inner KV pool's backing (Mamba state is fixed before capture)."""
        self.kv_pool.finalize_backing(max_total_num_tokens)
        self.size = self.kv_pool.size

    def release_beyond(self, num_tokens) -> int:
        freed = self.kv_pool.release_beyond(num_tokens)
        self.size = self.kv_pool.size
        return freed

    def close(self) -> None:
        """Close the inner KV pool's backing (idempotent; the Mamba pool is ordinary memory)."""
        self.kv_pool.close()

    # ------------------------------------------------------------------ mamba access
    def mamba_layer_cache(self, layer_id: int) -> MambaLayerCache:
        cache = self.mamba_pool.layer_cache(layer_id)
        self._wait_for(layer_id)
        return cache

    # ------------------------------------------------------------------ registration
    def _registered(self):
        return self.kv_pool._registered()

    def _token_buffers(self):
        return self.kv_pool._token_buffers()

    def kv_token_segments(self):
        return self.kv_pool.kv_token_segments()

    def kv_token_heads(self):
        return self.kv_pool.kv_token_heads()

    def get_contiguous_buf_infos(self):
        return self.kv_pool.get_contiguous_buf_infos()

    def get_item_views(self) -> List[torch.Tensor]:
        return self.kv_pool.get_item_views()

    def get_buffer_descs(self):
        return self.kv_pool.get_buffer_descs()

    def get_kv_size_bytes(self) -> int:
        return self.kv_pool.get_kv_size_bytes()

    def get_state_buf_infos(self):
        return self.mamba_pool.get_state_buf_infos()

    def get_state_item_views(self) -> List[torch.Tensor]:
        return self.mamba_pool.get_state_item_views()

    def get_state_dim_per_tensor(self):
        return self.mamba_pool.get_state_dim_per_tensor()

    def get_state_parts_per_tensor(self):
        return self.mamba_pool.get_state_parts_per_tensor()

    def describe(self) -> Dict[str, Any]:
        d = self.kv_pool.describe()
        d = dict(d)
        d.update(
            kind=self.kind,
            kv=self.kv_pool.describe(),
            mamba=self.mamba_pool.describe(),
            full_attention_layer_ids=list(self.full_attention_layer_ids),
        )
        return d

    # ------------------------------------------------------------------ host copies
    def get_cpu_copy(self, indices, mamba_indices=None, **kw) -> HybridCpuCopy:
        """Host copy of KV token rows ``indices`` and (if given) Mamba slots ``mamba_indices``."""
        mamba = None
        if mamba_indices is not None:
            mamba = self.mamba_pool.get_cpu_copy(mamba_indices)
        return HybridCpuCopy(self.kv_pool.get_cpu_copy(indices, **kw), mamba)

    def load_cpu_copy(self, copy: HybridCpuCopy, indices, mamba_indices=None, **kw) -> None:
        """Restore into (possibly different) token ids / mamba slots; validated before writing."""
        if not isinstance(copy, HybridCpuCopy):
            raise InvalidArgument(f"expected a HybridCpuCopy, got {type(copy).__name__}")
        if (copy.mamba is None) != (mamba_indices is None):
            raise InvalidArgument(
                "mamba_indices must be given exactly when the copy holds mamba state "
                f"(copy has mamba state: {copy.mamba is not None})"
            )
        if copy.mamba is not None:
            self.mamba_pool.check_cpu_copy(copy.mamba, mamba_indices)
        self.kv_pool.load_cpu_copy(copy.kv, indices, **kw)
        if copy.mamba is not None:
            self.mamba_pool.load_cpu_copy(copy.mamba, mamba_indices)

    def __repr__(self) -> str:
        return (
            f"HybridLinearKVPool(kv={self.kv_pool!r}, mamba={self.mamba_pool!r}, "
            f"full_attention_layer_ids={self.full_attention_layer_ids})"
        )
