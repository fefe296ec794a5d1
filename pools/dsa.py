"""``DSATokenToKVPool``: an MLA latent cache plus a page-indexed DSA indexer buffer per layer.

Indexer buffer (one per layer), uint8 ``[num_pages, page_size * (D + 4 * D // B)]`` with
``D = index_head_dim`` (128 by default) and ``B = index_quant_block`` (128): for page ``p``

* ``buf[p, : page_size * D]`` -- the fp8 index keys of the page's tokens, token-major
  (slot ``s`` at ``[s * D, (s + 1) * D)``);
* ``buf[p, page_size * D :]`` -- their fp32 scales, ``D // B`` per token, token-major
  (slot ``s`` at bytes ``[s * 4 * D // B, (s + 1) * 4 * D // B)`` of that tail).

``num_pages = ceil((size + page_size) / page_size)``: page ``p`` covers the same token ids
``[p * page_size, (p + 1) * page_size)`` as the latent cache, so token ``t`` of the indexer
is ``(t // page_size, t % page_size)``. When ``size % page_size != 0`` the last page has slots
past ``num_slots``: they belong to no token, and every API (set, gets, move, host copy) refuses
ids ``>= num_slots`` as the ``KVCache`` contract says.

Lockstep invariant: every operation that relocates token rows touches the latent row AND
the token's index key + scale: :meth:`move_kv_cache` moves all three in ONE launch (a pointer
table over the latent buffers and 4-D per-token views of the indexer buffers);
:meth:`get_cpu_copy` / :meth:`load_cpu_copy` copy them token by token, so a retracted request
restored into other slots gets back its own index data, never what later owners of its old
pages wrote.

Registration: the latent buffers are the KV group (``get_contiguous_buf_infos``, as the MLA
pool); the indexer buffers are a separate *state* group, ``get_state_buf_infos()`` ->
``(ptrs, lens, item_lens)`` with item = one page (row ``p`` = page ``p``). State ids of this
group ARE page ids: transfer / offload a request's pages with the same ids in both groups.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from kvxfer.kernels.copy import KvCopyTable
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch, UnsupportedOperation
from kvxfer.kernels.store_paged import store_kv_paged
from kvxfer.pools.cpu_copy import TokenBuffer, check_bounds
from kvxfer.pools.layout import ceil_div
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.write_loc import unwrap_write_loc

logger = logging.getLogger(__name__)

__all__ = ["DSATokenToKVPool"]


class DSATokenToKVPool(MLATokenToKVPool):
    """MLA latent pool + DSA indexer buffers (see module docstring)."""

    kind = "dsa"

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
        index_head_dim: int = 128,
        index_quant_block: int = 128,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        kernel_backend: str = "auto",
        cpu_copy_chunk_tokens: int = 8192,
        post_capture_active: bool = False,
    ):
        if post_capture_active:
            raise UnsupportedOperation("DSATokenToKVPool does not support post_capture_active=True")
        super().__init__(
            size,
            page_size,
            dtype,
            kv_lora_rank,
            qk_rope_head_dim,
            layer_num,
            device,
            start_layer=start_layer,
            end_layer=end_layer,
            kernel_backend=kernel_backend,
            cpu_copy_chunk_tokens=cpu_copy_chunk_tokens,
        )
        for name, value in (
            ("index_head_dim", index_head_dim),
            ("index_quant_block", index_quant_block),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        if index_head_dim % index_quant_block:
            raise InvalidArgument(
                f"index_head_dim={index_head_dim} must be a multiple of "
                f"index_quant_block={index_quant_block}"
            )
        self.index_head_dim = index_head_dim
        self.index_quant_block = index_quant_block
        self.index_scales_per_token = index_head_dim // index_quant_block
        self.index_scale_bytes = 4 * self.index_scales_per_token
        self.index_num_pages = ceil_div(self.num_slots, page_size)
        self.index_row_bytes = page_size * (index_head_dim + self.index_scale_bytes)
        self.index_k_with_scale_buffer = [
            torch.zeros(
                (self.index_num_pages, self.index_row_bytes), dtype=torch.uint8, device=self.device
            )
            for _ in range(self.layer_num)
        ]
        self._index_k_views = [
            self._view(b, 0, index_head_dim) for b in self.index_k_with_scale_buffer
        ]
        self._index_s_views = [
            self._view(b, page_size * index_head_dim, self.index_scale_bytes)
            for b in self.index_k_with_scale_buffer
        ]
        if self.layer_num:
            # latent rows and index key/scale rows move together, one launch
            self._copy_table = KvCopyTable(
                self.kv_buffer + self._index_k_views + self._index_s_views
            )
            self._copy_table_full = self._copy_table

    def _view(self, buf: torch.Tensor, offset: int, width: int) -> torch.Tensor:
        """Per-token 4-D view ``[num_pages, page_size, 1, width]`` of bytes of ``buf``."""
        return buf.as_strided(
            (self.index_num_pages, self.page_size, 1, width),
            (self.index_row_bytes, width, width, 1),
            buf.storage_offset() + offset,
        )

    def _token_buffers(self) -> list[TokenBuffer]:
        return super()._token_buffers() + [
            TokenBuffer(v, "paged") for v in self._index_k_views + self._index_s_views
        ]

    # -- latent writes accept KVWriteLoc -----------------------------------------------------
    def set_kv_buffer(
        self,
        layer,
        loc,
        k: torch.Tensor,
        v: Optional[torch.Tensor] = None,
        *,
        mask: Optional[torch.Tensor] = None,
    ) -> None:
        super().set_kv_buffer(layer, unwrap_write_loc(loc)[0], k, v, mask=mask)

    def set_mla_kv_buffer(self, layer, loc, k_nope: torch.Tensor, k_rope: torch.Tensor) -> None:
        super().set_mla_kv_buffer(layer, unwrap_write_loc(loc)[0], k_nope, k_rope)

    # -- indexer: raw buffer, set, gets ---------------------------------------------------------
    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        """The raw indexer buffer ``[num_pages, page_size * (D + 4 * D // B)]`` (uint8)."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        return self.index_k_with_scale_buffer[idx]

    def set_index_k_scale_buffer(
        self, layer_id: int, loc, index_k: torch.Tensor, index_k_scale: torch.Tensor
    ) -> None:
        """Write token ``loc[i]``'s index key ``index_k[i]`` (``[N, D]`` fp8 or uint8) and its
        scales ``index_k_scale[i]`` (``[N, D // B]`` fp32, ``[N]`` fp32 when ``D == B``, or the
        raw ``[N, 4 * D // B]`` uint8 bytes). One launch for keys and scales. Ids outside
        ``[0, num_slots)`` are refused as by every other pool write (the last indexer page
        may hold slots past ``num_slots``; they are never written)."""
        idx = self.layer_index(layer_id)
        loc = self._as_loc(unwrap_write_loc(loc)[0])
        n = loc.shape[0]
        D, S = self.index_head_dim, self.index_scales_per_token
        if not isinstance(index_k, torch.Tensor) or index_k.element_size() != 1:
            raise InvalidArgument(
                f"index_k must be a 1-byte (fp8/uint8) tensor, got "
                f"{getattr(index_k, 'dtype', type(index_k).__name__)}"
            )
        self._check_rows("index_k", index_k, n, (D,))
        if not isinstance(index_k_scale, torch.Tensor):
            raise InvalidArgument(
                f"index_k_scale must be a tensor, got {type(index_k_scale).__name__}"
            )
        s = index_k_scale
        if s.dtype == torch.float32:
            if S == 1 and s.dim() == 1:
                s = s.unsqueeze(1)
            self._check_rows("index_k_scale", s, n, (S,))
            s = s.contiguous().view(torch.uint8)
        elif s.dtype == torch.uint8:
            self._check_rows("index_k_scale", s, n, (self.index_scale_bytes,))
        else:
            raise InvalidArgument(f"index_k_scale must be float32 (or raw uint8), got {s.dtype}")
        k = index_k.view(torch.uint8).reshape(n, 1, D).to(self.device)
        # the views' last page may extend past num_slots (size % page_size != 0): bound the
        # ids by the pool's slots, not the pages' capacity
        store_kv_paged(
            self._index_k_views[idx],
            self._index_s_views[idx],
            loc,
            k,
            s.reshape(n, 1, self.index_scale_bytes).to(self.device),
            backend=self.kernel_backend,
            num_tokens=self.num_slots,
        )

    def _page_slots(
        self, page_indices: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(page, slot, ok)`` of position ``pos`` of request row ``rows`` of a page table.

        Off CUDA a position past the table or a page id outside ``[0, num_pages)`` raises;
        on CUDA nothing is synchronised: such positions read as zeros (``ok`` False)."""
        ps, width = self.page_size, page_indices.shape[-1]
        col = torch.div(pos, ps, rounding_mode="floor")
        ok = col < width
        colc = col.clamp(max=max(width - 1, 0))
        if width == 0:
            pages = torch.zeros_like(pos)
        else:
            pages = (
                page_indices[rows, colc] if page_indices.dim() == 2 else page_indices[colc]
            ).to(torch.int64)
        if self.device.type != "cuda" and pos.numel():
            if not bool(ok.all()):
                raise ShapeMismatch(
                    f"page table has {width} pages per request; position "
                    f"{int(pos[~ok][0])} needs page column {int(col[~ok][0])}"
                )
            check_bounds(pages, self.index_num_pages, "page_indices")
        ok = ok & (pages >= 0) & (pages < self.index_num_pages)
        pages = torch.where(ok, pages, torch.zeros_like(pages))
        return pages, pos - col * ps, ok

    def _page_table(self, page_indices, ndim: int) -> torch.Tensor:
        if not isinstance(page_indices, torch.Tensor):
            page_indices = torch.as_tensor(page_indices, dtype=torch.int64)
        if page_indices.dim() != ndim or page_indices.dtype.is_floating_point:
            raise ShapeMismatch(
                f"page_indices must be a {ndim}-D integer tensor, got "
                f"{page_indices.dtype} {tuple(page_indices.shape)}"
            )
        return page_indices.to(self.device)

    def _gather(
        self, idx: int, pages: torch.Tensor, slots: torch.Tensor, ok: torch.Tensor, which: str
    ) -> torch.Tensor:
        views = self._index_k_views if which == "k" else self._index_s_views
        out = views[idx][pages, slots.clamp(0, self.page_size - 1), 0]
        if self.device.type == "cuda":
            out = torch.where(ok[:, None], out, torch.zeros_like(out))
        return out

    def get_index_k_continuous(self, layer_id: int, seq_len: int, page_indices) -> torch.Tensor:
        """Index keys of positions ``[0, seq_len)`` of one request whose pages are
        ``page_indices [num_pages]``: uint8 ``[seq_len, D]``."""
        return self._single(layer_id, seq_len, page_indices, "k")

    def get_index_k_scale_continuous(
        self, layer_id: int, seq_len: int, page_indices
    ) -> torch.Tensor:
        """Scale bytes of the same positions: uint8 ``[seq_len, 4 * D // B]``."""
        return self._single(layer_id, seq_len, page_indices, "s")

    def _single(self, layer_id: int, seq_len: int, page_indices, which: str) -> torch.Tensor:
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
            raise InvalidArgument(f"seq_len must be a non-negative int, got {seq_len!r}")
        table = self._page_table(page_indices, 1)
        pos = torch.arange(seq_len, device=self.device)
        pages, slots, ok = self._page_slots(table, pos, pos)
        return self._gather(idx, pages, slots, ok, which)

    def get_index_k_scale_buffer(
        self,
        layer_id: int,
        seq_len_tensor: torch.Tensor,
        page_indices: torch.Tensor,
        seq_len_sum: Optional[int] = None,
        max_seq_len: Optional[int] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused get for a batch: request ``b`` has ``seq_len_tensor[b]`` tokens on the pages of
        row ``b`` of ``page_indices [B, max_pages]``. Returns ``(k uint8 [sum, D], scale uint8
        [sum, 4 * D // B])``, requests concatenated in order. ``seq_len_sum`` (if known) avoids
        a device sync (on CUDA the call then never synchronises); ``max_seq_len`` is accepted for
        API parity and only validated (off CUDA)."""
        idx = self.layer_index(layer_id)
        self._wait_layer(idx)
        table = self._page_table(page_indices, 2)
        if (
            not isinstance(seq_len_tensor, torch.Tensor)
            or seq_len_tensor.dim() != 1
            or seq_len_tensor.shape[0] != table.shape[0]
        ):
            raise ShapeMismatch(
                f"seq_len_tensor must be 1-D with {table.shape[0]} entries, got "
                f"{tuple(getattr(seq_len_tensor, 'shape', ()))}"
            )
        lens = seq_len_tensor.to(self.device, torch.int64)
        if self.device.type != "cuda" and lens.numel():  # validation syncs: off CUDA only
            if int(lens.min()) < 0:
                raise InvalidArgument(f"seq_len_tensor holds {int(lens.min())} < 0")
            if max_seq_len is not None and int(lens.max()) > max_seq_len:
                raise InvalidArgument(
                    f"seq_len_tensor holds {int(lens.max())} > max_seq_len={max_seq_len}"
                )
            if seq_len_sum is not None and int(lens.sum()) != seq_len_sum:
                raise InvalidArgument(
                    f"seq_len_sum={seq_len_sum} but the lengths add up to {int(lens.sum())}"
                )
        total = int(lens.sum()) if seq_len_sum is None else int(seq_len_sum)
        rows = torch.repeat_interleave(
            torch.arange(lens.shape[0], device=self.device), lens, output_size=total
        )
        starts = torch.cumsum(lens, 0) - lens
        pos = torch.arange(total, device=self.device) - starts[rows]
        pages, slots, ok = self._page_slots(table, rows, pos)
        return (self._gather(idx, pages, slots, ok, "k"), self._gather(idx, pages, slots, ok, "s"))

    def get_index_k_scale_fp32(self, layer_id: int, loc) -> torch.Tensor:
        """fp32 scales ``[N, D // B]`` of token ids ``loc`` (a convenience for tests/tools)."""
        idx = self.layer_index(layer_id)
        loc = self._as_loc(unwrap_write_loc(loc)[0]).to(torch.int64)
        check_bounds(loc, self.num_slots, "loc")
        pages = torch.div(loc, self.page_size, rounding_mode="floor")
        raw = self._index_s_views[idx][pages, loc - pages * self.page_size, 0]
        return raw.contiguous().view(torch.float32)

    # -- the indexer as a transferable state group -------------------------------------------
    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """``(ptrs, lens, item_lens)`` of the indexer buffers; item = one page (all of its
        tokens' keys and scales); state id = page id."""
        bufs = self.index_k_with_scale_buffer
        return (
            [int(b.data_ptr()) for b in bufs],
            [int(b.nbytes) for b in bufs],
            [self.index_row_bytes] * len(bufs),
        )

    def get_state_item_views(self) -> list[torch.Tensor]:
        """uint8 ``[num_pages, item_len]`` views of the indexer buffers (row ``p`` = page ``p``)."""
        return list(self.index_k_with_scale_buffer)

    def get_state_dim_per_tensor(self) -> list[Optional[int]]:
        """The indexer is not split across TP ranks: no sliceable dim."""
        return [None] * self.layer_num

    def kv_token_segments(self) -> None:
        """None: DSA: the indexer buffers are not modelled as token geometry; transfers need equal page sizes."""
        return None

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            index_head_dim=self.index_head_dim,
            index_quant_block=self.index_quant_block,
            index_item_lens=self.get_state_buf_infos()[2],
        )
        return d

    def get_kv_size_bytes(self) -> int:
        return super().get_kv_size_bytes() + sum(
            int(b.nbytes) for b in self.index_k_with_scale_buffer
        )
