"""``PageMajorMHATokenToKVPool``: every layer's K and V in ONE raw byte buffer, page-major.

A page holds all layers, layer-major within the page (for layer ``l``: K rows ``[page_size, H,
D]`` then V rows ``[page_size, H, Dv]``); the byte map is :class:`kvxfer.pools.layout.PageMajorGeometry`.
Per-layer K/V are 4-D strided views ``[num_pages, page_size, H, D]`` of that buffer (each token
row contiguous, pages strided by ``page_bytes``), so attention backends index them like any
paged cache.

Because one page of all layers is one contiguous byte range, registration is exactly ONE
descriptor entry covering the whole buffer with ``item_len = page_bytes``: a transfer of a run
of pages is one RMA operation instead of ``2 * layer_num``. Move, prefix-valid store and host
copy/restore are all supported (through the 4-D views). Needs ``size % page_size == 0``.

With ``post_capture_active=True`` the raw buffer is reserved (one descriptor, store dtype
``uint8``) and backed page by page of all layers (see :mod:`kvxfer.pools.post_capture`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvxfer.kernels.errors import InvalidArgument
from kvxfer.kernels.store_paged import store_kv_paged
from kvxfer.pools.cpu_copy import TokenBuffer
from kvxfer.pools.layout import KvBufferDesc, PageMajorGeometry
from kvxfer.pools.mha import MHATokenToKVPool

logger = logging.getLogger(__name__)

__all__ = ["PageMajorMHATokenToKVPool"]


class PageMajorMHATokenToKVPool(MHATokenToKVPool):
    """Page-major MHA pool (see module docstring). Same constructor as
    :class:`MHATokenToKVPool`; ``layout`` may only be ``"page_major"``."""

    kind = "mha_page_major"

    def __init__(self, *args, layout: str = "page_major", **kwargs):
        super().__init__(*args, layout=layout, **kwargs)

    def _set_layout(self, layout: str) -> None:
        if layout != "page_major":
            raise InvalidArgument(
                f"PageMajorMHATokenToKVPool has layout 'page_major', got {layout!r}"
            )
        self.layout = "page_major"
        self.geometry = PageMajorGeometry.for_pool(
            size=self.size,
            page_size=self.page_size,
            layer_num=max(self.layer_num, 1),
            head_num=self.head_num,
            head_dim=self.head_dim,
            v_head_dim=self.v_head_dim,
            itemsize=self.store_dtype.itemsize,
        )
        self.num_pages = self.geometry.num_pages

    def _create_buffers(self) -> None:
        g = self.geometry
        if self.post_capture_active:
            descs = [g.buffer_desc("kv")] if self.layer_num else []
            self.raw = self._reserve_backing(descs, torch.uint8)[0]
        else:
            nbytes = g.total_bytes if self.layer_num else 0
            # zeros: unwritten slots read as zero, as in the per-layer pool.
            self.raw = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        flat = self.raw.view(self.store_dtype)
        self.k_buffer, self.v_buffer = [], []
        for layer in range(self.layer_num):
            for kind, out in (("k", self.k_buffer), ("v", self.v_buffer)):
                spec = g.view_spec(kind, layer)
                out.append(flat.as_strided(spec.shape, spec.strides, spec.offset))

    def _copy_buffers(self) -> list[torch.Tensor]:
        return self.k_buffer + self.v_buffer

    def _registered(self) -> list[tuple[torch.Tensor, KvBufferDesc]]:
        if not self.layer_num:
            return []
        return [(self.raw, self.geometry.buffer_desc("kv"))]

    def kv_token_segments(self) -> Optional[list[list[int]]]:
        """One descriptor; per layer a K segment then a V segment (token row bytes)."""
        if not self.layer_num:
            return []
        g = self.geometry
        return [[g.token_bytes("k"), g.token_bytes("v")] * self.layer_num]

    def _token_buffers(self) -> list[TokenBuffer]:
        return [TokenBuffer(b, "paged") for b in self.k_buffer + self.v_buffer]

    def _rows_contiguous(self) -> bool:
        return False

    def _store_paged(self, k_buf: torch.Tensor, v_buf: torch.Tensor, loc, k, v) -> None:
        store_kv_paged(k_buf, v_buf, loc, k, v, backend=self.kernel_backend)

    def _drop_buffers(self) -> None:
        super()._drop_buffers()
        self.raw = None
