"""``MHATokenToKVPool``: one K and one V buffer per layer.

Layouts (constructor argument ``layout``):

* ``"nhd"`` (default) -- ``[size + page_size, H, D]`` per layer: token ``t`` is row ``t``.
* ``"hnd"`` -- ``[num_pages, H, page_size, D]`` per layer: a page is one contiguous block, a
  token is ``H`` separate ``D``-element pieces. Needs ``size % page_size == 0``.

Registration: ``2 * layer_num`` entries, ``k0..k{L-1}`` then ``v0..v{L-1}``; ``lens`` =
``final_span_bytes(size)``, ``item_lens`` = one page of that buffer (``page_size * H * D *
itemsize``) -- for both layouts, since a page is contiguous in both.

Writes and moves go through the kernels (``kvxfer.kernels.store``, ``kvxfer.kernels.store_paged``,
``kvxfer.kernels.copy``): one launch per layer for a store, one launch for a move of all layers.

``post_capture_active=True`` reserves the buffers and backs page 0 only until
``finalize_backing(n)`` (see :mod:`kvxfer.pools.post_capture`); ``backing_options`` passes
``max_extent_bytes`` / ``handle_types`` / ``one_range`` / ``provider`` to the backing.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.kernels.store import store_kv, store_kv_prefix_valid
from kvxfer.kernels.store_paged import store_kv_paged
from kvxfer.pools.base import KVCache
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc, num_pages_for, per_layer_descs
from kvxfer.pools.post_capture import page_align_up

logger = logging.getLogger(__name__)

__all__ = ["MHATokenToKVPool"]

_LAYOUTS = ("nhd", "hnd")


class MHATokenToKVPool(KVCache):
    """Per-layer K/V pool (see module docstring)."""

    kind = "mha"

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
        v_head_dim: Optional[int] = None,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        layout: str = "nhd",
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
        for name, value in (
            ("head_num", head_num),
            ("head_dim", head_dim),
            ("v_head_dim", head_dim if v_head_dim is None else v_head_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        self.head_num = head_num
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self._set_layout(layout)
        self._init_post_capture(post_capture_active, backing_options)
        self._create_buffers()
        self._check_post_capture_built()
        copy_buffers = self._copy_buffers()
        self._copy_table = KvCopyTable(copy_buffers) if copy_buffers else None
        # captured CUDA graphs keep the full table (see pools.post_capture); eager calls
        # use tables and views narrowed to the backed span
        self._copy_table_full = (
            self._copy_table if self._backing is not None and self.device.type == "cuda" else None
        )
        self._refresh_kernel_views()
        logger.debug("created %r (%d bytes)", self, self.get_kv_size_bytes())

    # -- construction (overridden by the page-major pool) ------------------------------------
    def _set_layout(self, layout: str) -> None:
        if layout not in _LAYOUTS:
            raise InvalidArgument(f"layout must be one of {_LAYOUTS}, got {layout!r}")
        self.layout = layout
        if layout == "hnd":
            self.num_pages = num_pages_for(self.size, self.page_size)

    def _buffer_shapes(self) -> tuple[tuple, tuple]:
        H, ps = self.head_num, self.page_size
        if self.layout == "hnd":
            P = self.num_pages
            return (P, H, ps, self.head_dim), (P, H, ps, self.v_head_dim)
        return (self.num_slots, H, self.head_dim), (self.num_slots, H, self.v_head_dim)

    def _buffer_descs(self) -> list[KvBufferDesc]:
        """``k0..k{L-1}`` then ``v0..v{L-1}`` (registration order)."""
        k_shape, v_shape = self._buffer_shapes()
        tpr = self.page_size if self.layout == "hnd" else 1
        isz = self.store_dtype.itemsize
        return per_layer_descs("k", self.layer_num, k_shape, isz, tpr) + per_layer_descs(
            "v", self.layer_num, v_shape, isz, tpr
        )

    def _create_buffers(self) -> None:
        if self.post_capture_active:
            tensors = self._reserve_backing(self._buffer_descs(), self.store_dtype)
            self.k_buffer = tensors[: self.layer_num]
            self.v_buffer = tensors[self.layer_num :]
            return
        k_shape, v_shape = self._buffer_shapes()
        kw = dict(dtype=self.store_dtype, device=self.device)
        # zeros: unwritten slots (the padding page included) read as zero.
        self.k_buffer = [torch.zeros(k_shape, **kw) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(v_shape, **kw) for _ in range(self.layer_num)]

    def _rows_contiguous(self) -> bool:
        """True when a layer buffer is ``[num_slots, ...]`` with token ``t`` at row ``t``."""
        return self.layout == "nhd"

    def _paged_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """HND buffer -> one 4-D ``[pages, page_size, 1, D]`` view per head (rows contiguous)."""
        return [buf[:, h].unsqueeze(2) for h in range(self.head_num)]

    def _copy_buffers(self) -> list[torch.Tensor]:
        bufs = self.k_buffer + self.v_buffer
        if self.layout == "hnd":
            return [view for b in bufs for view in self._paged_views(b)]
        return bufs

    # -- post-capture hooks (pools.post_capture) ----------------------------------------------
    def _refresh_kernel_views(self) -> None:
        if self._backing is None:
            return
        self._k_live = [self._narrow(b) for b in self.k_buffer]
        self._v_live = [self._narrow(b) for b in self.v_buffer]
        copy_buffers = [self._narrow(b) for b in self._copy_buffers()]
        self._copy_table = KvCopyTable(copy_buffers) if copy_buffers else None

    def _drop_buffers(self) -> None:
        self.k_buffer, self.v_buffer, self._k_live, self._v_live = [], [], [], []
        self._copy_table = self._copy_table_full = None

    def _kernel_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K/V buffers the kernels index: narrowed to the backed span for a post-capture
        pool (their row limit), the full buffers otherwise and during graph capture."""
        if self._backing is None or self._capturing():
            return self.k_buffer, self.v_buffer
        return self._k_live, self._v_live

    def _kernel_copy_table(self) -> Optional[KvCopyTable]:
        return self._copy_table_full if self._capturing() else self._copy_table

    # -- KVCache plumbing ---------------------------------------------------------------------
    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        return list(zip(self.k_buffer + self.v_buffer, self._buffer_descs()))

    def kv_token_segments(self) -> Optional[list[list[int]]]:
        """NHD: one segment of ``H*D`` per layer buffer; HND ``[H, page_size, D]``: ``H``
        segments of ``D`` (bytes of one token row)."""
        if self.layout != "hnd":
            return super().kv_token_segments()
        isz, H = self.store_dtype.itemsize, self.head_num
        return [[self.head_dim * isz] * H] * self.layer_num + [
            [self.v_head_dim * isz] * H
        ] * self.layer_num

    def kv_token_heads(self) -> Optional[list[list[tuple[int, int]]]]:
        """Every NHD row (per layer or page-major) holds the ``H`` heads; an HND segment is
        one head."""
        segs = self.kv_token_segments()
        if segs is None:
            return None
        if self.layout == "hnd":
            return [[(h, 1) for h in range(self.head_num)] for _ in segs]
        return [[(0, self.head_num)] * len(s) for s in segs]

    def _token_buffers(self) -> list[TokenBuffer]:
        indexing = "hnd" if self.layout == "hnd" else "rows"
        return [TokenBuffer(b, indexing) for b in self.k_buffer + self.v_buffer]

    # -- getters ------------------------------------------------------------------------------
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self._as_logical(self.k_buffer[idx])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self._as_logical(self.v_buffer[idx])

    # -- writes -------------------------------------------------------------------------------
    def _prepare(self, loc, k, v, k_scale, v_scale):
        loc = self._as_loc(loc)
        k = self._to_store(k, k_scale)
        v = self._to_store(v, v_scale)
        n = loc.shape[0]
        self._check_rows("k", k, n, (self.head_num, self.head_dim))
        self._check_rows("v", v, n, (self.head_num, self.v_head_dim))
        return loc, k, v

    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
        """Write ``k [N, H, D]`` / ``v [N, H, Dv]`` of ``layer`` at token ids ``loc [N]``;
        with ``mask`` (bool ``[N]``) only rows where it is True are written."""
        idx = self.layer_index(layer)
        loc, k, v = self._prepare(loc, k, v, k_scale, v_scale)
        if mask is not None:
            mask = self._as_mask(mask, loc.shape[0])
        self._store_layer(idx, loc, k, v, mask)

    def _as_mask(self, mask, n: int) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise InvalidArgument(f"mask must be a bool tensor, got {mask!r:.80}")
        if tuple(mask.shape) != (n,):
            raise ShapeMismatch(f"mask has shape {tuple(mask.shape)}, expected {(n,)}")
        return mask.to(self.device)

    def _store_layer(self, idx: int, loc, k, v, mask) -> None:
        """Physical write into layer ``idx`` (inputs already in store dtype and checked)."""
        k_bufs, v_bufs = self._kernel_buffers()
        if self._rows_contiguous():
            store_kv(k_bufs[idx], v_bufs[idx], loc, k, v, mask=mask, backend=self.kernel_backend)
            return
        if mask is not None:  # paged stores have no mask: select rows (syncs on GPU)
            keep = mask.nonzero().flatten()
            loc, k, v = loc[keep], k[keep], v[keep]
        self._store_paged(k_bufs[idx], v_bufs[idx], loc, k, v)

    def _store_paged(self, k_buf: torch.Tensor, v_buf: torch.Tensor, loc, k, v) -> None:
        """HND: one paged store per head (a head's token row is contiguous)."""
        kv_views = zip(self._paged_views(k_buf), self._paged_views(v_buf))
        for h, (kh, vh) in enumerate(kv_views):
            store_kv_paged(
                kh, vh, loc, k[:, h : h + 1], v[:, h : h + 1], backend=self.kernel_backend
            )

    def set_kv_buffer_prefix_valid(
        self,
        layer,
        loc_2d,
        commit_lens,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        k_scale: Optional[float] = None,
        v_scale: Optional[float] = None,
    ) -> None:
        """Write row ``(b, t)`` of ``k/v [B*T, ...]`` at ``loc_2d[b, t]`` only when
        ``t < commit_lens[b]`` (speculative decoding commits a prefix of each draft)."""
        idx = self.layer_index(layer)
        if not isinstance(loc_2d, torch.Tensor) or loc_2d.dim() != 2:
            raise ShapeMismatch(
                f"loc_2d must be a 2-D tensor, got {getattr(loc_2d, 'shape', loc_2d)}"
            )
        if not isinstance(commit_lens, torch.Tensor) or tuple(commit_lens.shape) != (
            loc_2d.shape[0],
        ):
            raise ShapeMismatch(
                f"commit_lens must have shape {(loc_2d.shape[0],)}, got "
                f"{tuple(getattr(commit_lens, 'shape', ()))}"
            )
        B, T = loc_2d.shape
        flat, k, v = self._prepare(loc_2d.reshape(-1), k, v, k_scale, v_scale)
        commit_lens = commit_lens.to(self.device)
        if self._rows_contiguous():
            k_bufs, v_bufs = self._kernel_buffers()
            store_kv_prefix_valid(
                k_bufs[idx],
                v_bufs[idx],
                flat.view(B, T),
                commit_lens,
                k,
                v,
                backend=self.kernel_backend,
            )
            return
        keep = torch.arange(T, device=self.device)[None, :] < commit_lens.to(torch.int64)[:, None]
        self._store_layer(idx, flat, k, v, keep.reshape(-1))

    # -- reads ------------------------------------------------------------------------------
    def get_kv_rows(self, layer, loc) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k [N, H, D], v [N, H, Dv])``: the token rows at ids ``loc`` of ``layer``, as
        ``dtype`` (gathered copies) -- exactly what ``set_kv_buffer(layer, loc, k, v)``
        stored, whatever the layout (NHD row, HND head pieces, page-major row in a page of
        all layers). The read side of the store path: rebuilding a request's cache from its
        pages. Ids outside ``[0, token_limit)`` raise :class:`IndexOutOfRange` (one host
        sync)."""
        idx = self.layer_index(layer)
        self._wait_layer(idx)
        loc = self._as_loc(loc).long()
        if loc.numel():
            lo, hi = int(loc.min()), int(loc.max())
            if lo < 0 or hi >= self.token_limit:
                raise IndexOutOfRange(
                    f"loc contains {lo if lo < 0 else hi}, outside [0, {self.token_limit})"
                )
        k_bufs, v_bufs = self._kernel_buffers()
        return (
            self._as_logical(self._gather_rows(k_bufs[idx], loc)),
            self._as_logical(self._gather_rows(v_bufs[idx], loc)),
        )

    def _gather_rows(self, buf: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        """Token rows ``[N, H, D]`` of one layer buffer (NHD ``[slots, H, D]``, HND ``[pages,
        H, page_size, D]``, page-major view ``[pages, page_size, H, D]``)."""
        if self.layout == "nhd":
            return buf[loc]
        page, off = loc // self.page_size, loc % self.page_size
        if self.layout == "hnd":
            return buf[page, :, off]  # advanced indices around a slice: [N, H, D]
        return buf[page, off]

    # -- moves --------------------------------------------------------------------------------
    def move_kv_cache(self, tgt_loc, src_loc) -> None:
        """Copy token rows ``src_loc -> tgt_loc`` in every layer's K and V, one launch."""
        tgt, src = self._move_locs(tgt_loc, src_loc)
        table = self._kernel_copy_table()
        if table is None or tgt.numel() == 0:
            return
        table.move(tgt, src, backend=self.kernel_backend)
