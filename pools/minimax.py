"""``MiniMaxSparseKVPool``: dense + sparse attention layers over one main MHA pool, plus the
sparse layers' index caches.

Composition (all sub-pools share ``size``, ``page_size`` and therefore token ids):

* ``main_pool`` -- :class:`MHATokenToKVPool` with every local layer (dense and sparse), indexed
  by global layer id (``start_layer`` .. ``start_layer + layer_num - 1``; the local dense and
  sparse ids must tile that range exactly);
* ``index_kv_pool`` -- index K **and** V (``[slots, index_head_num, idx_head_dim]``) for the
  sparse layers whose index branch reads V;
* ``index_k_pool`` -- index K only (:class:`MHATokenToKOnlyPool`) for the sparse layers listed
  in ``disable_value_sparse_layer_ids``.

Index rows are indexed by the same token ids as the main K/V, so a request's pages cover its
index rows too: registration lists main then index buffers in ONE KV group
(``main.k*, main.v*, index_kv.k*, index_kv.v*, index_k.k*``; item = one page of that buffer),
and moves / host copies treat every buffer alike (a move is ONE launch over all of them).
:meth:`get_main_buf_infos` / :meth:`get_index_buf_infos` give the two parts separately.

Stores: :meth:`set_fused_kv_index_buffer` writes main K/V and index K (+V) of a sparse layer in
one launch (:func:`kvxfer.kernels.store_multi.store_rows_multi`, a raw-byte kernel, so any dtypes and
head dims fuse); with ``fuse_store=False`` it falls back to separate stores. Both paths convert
and check every input (shapes, dtypes; ids on the host-checked paths, see :mod:`kvxfer.kernels.store`)
before the first write, so they write identical bytes, and on a refusal neither writes any.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import InvalidArgument, UnsupportedOperation
from kvxfer.kernels.store import store_kv
from kvxfer.kernels.store_multi import store_rows_multi
from kvxfer.pools.base import KVCache
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.noop import MHATokenToKOnlyPool
from kvxfer.pools.write_loc import unwrap_write_loc

logger = logging.getLogger(__name__)

__all__ = ["MiniMaxSparseKVPool"]


def _ids(name: str, ids: Optional[Iterable[int]]) -> list[int]:
    out = []
    for i in ids or []:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise InvalidArgument(f"{name} must hold non-negative ints, got {i!r}")
        out.append(i)
    if len(set(out)) != len(out):
        raise InvalidArgument(f"{name} has duplicates: {out}")
    return out


def _renamed(prefix: str, regs: list) -> list:
    return [
        (
            t,
            KvBufferDesc(
                f"{prefix}.{d.name}",
                d.shape,
                row_bytes=d.row_bytes,
                tokens_per_row=d.tokens_per_row,
            ),
        )
        for t, d in regs
    ]


class MiniMaxSparseKVPool(KVCache):
    """Main MHA pool + index K/V and K-only pools (see module docstring)."""

    kind = "minimax_sparse"
    layout = "nhd"

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        idx_head_dim: int,
        dense_layer_ids,
        sparse_layer_ids,
        device="cpu",
        *,
        disable_value_sparse_layer_ids=None,
        index_dtype: Optional[torch.dtype] = None,
        index_head_num: int = 1,
        v_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        fuse_store: bool = True,
        cpu_copy_chunk_tokens: int = 8192,
        post_capture_active: bool = False,
    ):
        if post_capture_active:
            raise UnsupportedOperation(
                "MiniMaxSparseKVPool does not support post_capture_active=True"
            )
        dense = _ids("dense_layer_ids", dense_layer_ids)
        sparse = _ids("sparse_layer_ids", sparse_layer_ids)
        no_v = set(_ids("disable_value_sparse_layer_ids", disable_value_sparse_layer_ids))
        if set(dense) & set(sparse):
            raise InvalidArgument(
                f"layers {sorted(set(dense) & set(sparse))} are both dense and sparse"
            )
        if no_v - set(sparse):
            raise InvalidArgument(
                f"disable_value_sparse_layer_ids {sorted(no_v - set(sparse))} are not sparse layers"
            )
        every = sorted(dense + sparse)
        start = start_layer if start_layer is not None else (every[0] if every else 0)
        end = end_layer if end_layer is not None else (every[-1] if every else start)
        local = [i for i in every if start <= i <= end]
        if local != list(range(start, start + len(local))):
            raise InvalidArgument(
                f"local layers {local} must be exactly {start}..{start + len(local) - 1} (no gaps)"
            )
        super().__init__(
            size,
            page_size,
            dtype,
            len(local),
            device,
            start_layer=start,
            end_layer=end_layer,
            kernel_backend=kernel_backend,
            cpu_copy_chunk_tokens=cpu_copy_chunk_tokens,
        )
        if not isinstance(fuse_store, bool):
            raise InvalidArgument(f"fuse_store must be a bool, got {fuse_store!r}")
        self.fuse_store = fuse_store
        self.dense_layer_ids = [i for i in local if i in set(dense)]
        self.sparse_layer_ids = [i for i in local if i in set(sparse)]
        kv_sparse = [i for i in self.sparse_layer_ids if i not in no_v]
        k_only = [i for i in self.sparse_layer_ids if i in no_v]
        self.index_kv_layer_id_mapping = {g: j for j, g in enumerate(kv_sparse)}
        self.index_k_layer_id_mapping = {g: j for j, g in enumerate(k_only)}
        self.index_dtype = dtype if index_dtype is None else index_dtype
        self.idx_head_dim = idx_head_dim
        self.index_head_num = index_head_num
        common = dict(
            device=self.device,
            kernel_backend=kernel_backend,
            cpu_copy_chunk_tokens=cpu_copy_chunk_tokens,
        )
        self.main_pool = MHATokenToKVPool(
            size,
            page_size,
            dtype,
            head_num,
            head_dim,
            self.layer_num,
            v_head_dim=v_head_dim,
            start_layer=start,
            **common,
        )
        self.index_kv_pool = (
            MHATokenToKVPool(
                size,
                page_size,
                self.index_dtype,
                index_head_num,
                idx_head_dim,
                len(kv_sparse),
                **common,
            )
            if kv_sparse
            else None
        )
        self.index_k_pool = (
            MHATokenToKOnlyPool(
                size,
                page_size,
                self.index_dtype,
                index_head_num,
                idx_head_dim,
                len(k_only),
                **common,
            )
            if k_only
            else None
        )
        self.head_num = self.main_pool.head_num
        self.head_dim = self.main_pool.head_dim
        self.v_head_dim = self.main_pool.v_head_dim
        bufs = [t for t, _ in self._registered()]
        self._copy_table = KvCopyTable(bufs) if bufs else None
        logger.debug("created %r (%d bytes)", self, self.get_kv_size_bytes())

    # -- plumbing -------------------------------------------------------------------------------
    def _sub_pools(self) -> list[tuple[str, KVCache]]:
        out = [("main", self.main_pool)]
        if self.index_kv_pool is not None:
            out.append(("index_kv", self.index_kv_pool))
        if self.index_k_pool is not None:
            out.append(("index_k", self.index_k_pool))
        return out

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        return [r for name, p in self._sub_pools() for r in _renamed(name, p._registered())]

    def _token_buffers(self) -> list[TokenBuffer]:
        return [b for _, p in self._sub_pools() for b in p._token_buffers()]

    def get_main_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The main K/V entries of :meth:`get_contiguous_buf_infos` (its first ``2 * layer_num``)."""
        return self.main_pool.get_contiguous_buf_infos()

    def get_index_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """The index entries (index K/V then index K-only); item = one page, id = page id."""
        ptrs, lens, items = [], [], []
        for name, p in self._sub_pools():
            if name != "main":
                a, b, c = p.get_contiguous_buf_infos()
                ptrs += a
                lens += b
                items += c
        return ptrs, lens, items

    def kv_token_segments(self) -> None:
        """None: MiniMax sparse: sub-pools are not modelled as token geometry; transfers need equal page sizes."""
        return None

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            dense_layer_ids=list(self.dense_layer_ids),
            sparse_layer_ids=list(self.sparse_layer_ids),
            k_only_sparse_layer_ids=list(self.index_k_layer_id_mapping),
            idx_head_dim=self.idx_head_dim,
            index_head_num=self.index_head_num,
            index_dtype=str(self.index_dtype).replace("torch.", ""),
        )
        return d

    # -- layer lookups --------------------------------------------------------------------------
    def _sparse(self, layer, mapping: dict, what: str) -> int:
        lid = getattr(layer, "layer_id", layer)
        self.layer_index(lid)  # typed errors for bad ids
        if lid not in mapping:
            raise InvalidArgument(f"layer {lid} has no {what}; such layers: {sorted(mapping)}")
        return mapping[lid]

    # -- main K/V -------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_layer(self.layer_index(layer_id))
        return self.main_pool.get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._wait_layer(self.layer_index(layer_id))
        return self.main_pool.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc, k: torch.Tensor, v: torch.Tensor, **kw) -> None:
        """Main K/V of any layer (dense or sparse); ``loc`` may be a :class:`KVWriteLoc`."""
        self.main_pool.set_kv_buffer(layer, unwrap_write_loc(loc)[0], k, v, **kw)

    # -- index caches ---------------------------------------------------------------------------
    def get_index_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self._sparse(layer_id, self.index_kv_layer_id_mapping, "index V cache")
        self._wait_layer(self.layer_index(layer_id))
        return self.index_kv_pool.get_kv_buffer(j)

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        """Index K of any sparse layer (K-only group first, else the K side of the K/V group)."""
        self._wait_layer(self.layer_index(layer_id))
        if layer_id in self.index_k_layer_id_mapping:
            return self.index_k_pool.get_key_buffer(self.index_k_layer_id_mapping[layer_id])
        j = self._sparse(layer_id, self.index_kv_layer_id_mapping, "index cache (not sparse)")
        return self.index_kv_pool.get_key_buffer(j)

    def set_index_kv_buffer(
        self, layer, loc, idx_k: torch.Tensor, idx_v: torch.Tensor, **kw
    ) -> None:
        j = self._sparse(layer, self.index_kv_layer_id_mapping, "index V cache")
        self.index_kv_pool.set_kv_buffer(j, unwrap_write_loc(loc)[0], idx_k, idx_v, **kw)

    def set_index_k_buffer(self, layer, loc, idx_k: torch.Tensor, **kw) -> None:
        j = self._sparse(layer, self.index_k_layer_id_mapping, "K-only index cache")
        self.index_k_pool.set_k_buffer(j, unwrap_write_loc(loc)[0], idx_k, **kw)

    def can_fuse_store(self, layer) -> bool:
        """True when :meth:`set_fused_kv_index_buffer` of ``layer`` runs as one launch: fusion
        enabled and every target has token-row (NHD) buffers on one device."""
        lid = getattr(layer, "layer_id", layer)
        return (
            self.fuse_store
            and lid in self.sparse_layer_ids
            and all(p.layout == "nhd" for _, p in self._sub_pools())
        )

    def set_fused_kv_index_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: torch.Tensor,
        idx_k: torch.Tensor,
        idx_v: Optional[torch.Tensor] = None,
    ) -> None:
        """Main K/V + index K (+ index V unless the layer is K-only) of a sparse layer."""
        lid = getattr(layer, "layer_id", layer)
        k_only = lid in self.index_k_layer_id_mapping
        if not k_only:
            self._sparse(lid, self.index_kv_layer_id_mapping, "index cache (not sparse)")
        if k_only and idx_v is not None:
            raise InvalidArgument(f"layer {lid} is K-only (value disabled): pass idx_v=None")
        if not k_only and idx_v is None:
            raise InvalidArgument(f"layer {lid} has an index V cache: idx_v is required")
        # Convert and check every input before the first write: both paths then write the same
        # bytes, and a refusal leaves every buffer as it was.
        main = self.main_pool
        loc, k, v = main._prepare(unwrap_write_loc(loc)[0], k, v, None, None)
        m = main.layer_index(lid)
        if k_only:
            pool, j = self.index_k_pool, self.index_k_layer_id_mapping[lid]
            ik = pool._to_store(idx_k)
            pool._check_rows("idx_k", ik, loc.shape[0], (pool.head_num, pool.head_dim))
            index = (pool.k_buffer[j], None, ik, None)
        else:
            pool, j = self.index_kv_pool, self.index_kv_layer_id_mapping[lid]
            _, ik, iv = pool._prepare(loc, idx_k, idx_v, None, None)
            index = (pool.k_buffer[j], pool.v_buffer[j], ik, iv)
        targets = [(main.k_buffer[m], main.v_buffer[m], k, v), index]
        if self.can_fuse_store(lid):
            caches = [c for kc, vc, _, _ in targets for c in (kc, vc) if c is not None]
            sources = [x for _, _, ks, vs in targets for x in (ks, vs) if x is not None]
            store_rows_multi(caches, loc, sources, backend=self.kernel_backend)
            return
        # separate stores; loc and row counts are shared, so the first store's bounds check
        # (host-checked paths) refuses before anything is written
        for kc, vc, ks, vs in targets:
            store_kv(kc, vc, loc, ks, vs, backend=self.kernel_backend)

    # -- moves ----------------------------------------------------------------------------------
    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Copy token rows ``src -> tgt`` in main and index buffers alike, ONE launch."""
        tgt, src = self._move_locs(tgt_loc, src_loc)
        if self._copy_table is None or tgt.numel() == 0:
            return
        self._copy_table.move(tgt, src, backend=self.kernel_backend)

    def set_kv_buffer_prefix_valid(self, *args, **kwargs) -> None:
        raise UnsupportedOperation(
            "MiniMaxSparseKVPool: use main_pool.set_kv_buffer_prefix_valid "
            "and the index setters (speculative decoding of sparse "
            "layers writes index rows too)"
        )
