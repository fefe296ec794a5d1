"""Move token rows ``src_loc -> tgt_loc`` in every KV buffer of a pool in ONE launch.

:class:`KvCopyTable` is built once from a pool's buffers. Each buffer is either

* a 3-D ``[rows, H, D]`` tensor whose rows are contiguous (per-layer pools), or
* a 4-D ``[num_pages, page_size, H, D]`` strided view whose token rows are contiguous
  (page-major pools; token ``t`` -> ``(t // page_size, t % page_size)``).

The table is a small int64 device tensor with one entry per buffer: base address, page
stride, token stride, tokens per page, row size and row count (strides/sizes in copy
units). The kernel's grid is ``(token tiles, buffers, column tiles)``, so one launch moves
every layer's K and V. The table keeps the buffers alive; it must be rebuilt if a pool
re-allocates its storage.

Invariants:

* rows are copied as raw bytes; buffers may differ in dtype, head count and head dim;
* an index outside ``[0, rows)`` (``rows`` = the smallest buffer's token capacity) raises
  :class:`IndexOutOfRange` before anything moves on the torch path / CPU; on CUDA a pair
  with an out-of-range index in a buffer is skipped for that buffer;
* the torch path gathers all sources before scattering; the Triton path reads and writes
  concurrently, so targets must be distinct and must not appear among the *other* pairs'
  sources (an identical ``tgt == src`` pair is harmless) - the scheduler's spec-decode
  and compaction moves satisfy this;
* ``N == 0`` is a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

# Table entry (int64 x 6): ptr, page_stride, tok_stride, page_size, row_units, rows.


@triton.jit
def _copy_rows_kernel(
    table,
    tgt_ptr,
    src_ptr,
    n,
    UNIT: tl.constexpr,
    ALIGN: tl.constexpr,
    VEC: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, b, j): units [j*BLOCK, (j+1)*BLOCK) of pairs [i*TOK, (i+1)*TOK) in buffer b."""
    entry = table + tl.program_id(1) * 6
    addr = tl.load(entry)
    # Cast inline, not through C.unit_ptr: Triton 3.6 loses a multiple_of hint placed on
    # the result of a helper call, and this kernel needs the hint to emit 16-byte accesses.
    if UNIT == 4:
        base = addr.to(tl.pointer_type(tl.int32))
    elif UNIT == 2:
        base = addr.to(tl.pointer_type(tl.int16))
    else:
        base = addr.to(tl.pointer_type(tl.int8))
    if ALIGN > 1:
        base = tl.multiple_of(base, ALIGN)
    page_stride = tl.load(entry + 1)
    tok_stride = tl.load(entry + 2)
    page_size = tl.load(entry + 3)
    row_units = tl.load(entry + 4)
    rows = tl.load(entry + 5)
    if VEC > 1:
        row_units = tl.multiple_of(row_units, VEC)
    pairs = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = pairs < n
    tgt = tl.load(tgt_ptr + pairs, mask=live, other=-1).to(tl.int64)
    src = tl.load(src_ptr + pairs, mask=live, other=-1).to(tl.int64)
    live = live & (tgt >= 0) & (tgt < rows) & (src >= 0) & (src < rows)
    tgt_page = tgt // page_size
    src_page = src // page_size
    tgt_row = tgt_page * page_stride + (tgt - tgt_page * page_size) * tok_stride
    src_row = src_page * page_stride + (src - src_page * page_size) * tok_stride
    if VEC > 1:
        tgt_row = tl.multiple_of(tgt_row, VEC)
        src_row = tl.multiple_of(src_row, VEC)
    cols = (tl.program_id(2) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = live[:, None] & (cols < row_units)
    x = tl.load(base + src_row[:, None] + cols, mask=m)
    tl.store(base + tgt_row[:, None] + cols, x, mask=m)


def _pow2_divisor(values: Sequence[int], cap: int) -> int:
    d = cap
    for v in values:
        while d > 1 and v % d:
            d //= 2
    return d


class KvCopyTable:
    """Pointer table over a pool's KV buffers; :meth:`move` copies rows in one launch."""

    def __init__(self, buffers: Sequence[torch.Tensor]):
        buffers = list(buffers)
        if not buffers:
            raise InvalidArgument("KvCopyTable needs at least one buffer")
        device = buffers[0].device
        entries, geometry = [], []
        for i, buf in enumerate(buffers):
            name = f"buffers[{i}]"
            if not isinstance(buf, torch.Tensor) or buf.dim() not in (3, 4):
                shape = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
                raise ShapeMismatch(
                    f"{name} must be 3-D [rows, H, D] or 4-D [pages, page_size, H, D], got {shape}"
                )
            if buf.device != device:
                raise InvalidArgument(f"{name} is on {buf.device}, expected {device}")
            lead = buf.dim() - 2
            C.check_cache(name, buf, lead)
            view = C.byte_rows(buf, lead)
            if lead == 1:
                page_stride, tok_stride, page_size = view.stride(0), 0, 1
            else:
                page_stride, tok_stride, page_size = view.stride(0), view.stride(1), buf.shape[1]
            rows = buf.shape[0] * (page_size if lead == 2 else 1)
            entries.append(
                [view.data_ptr(), page_stride, tok_stride, page_size, view.shape[-1], rows]
            )
            geometry += [view.data_ptr(), page_stride, tok_stride, view.shape[-1]]
        self.unit = C.pick_unit(geometry)
        self.align = _pow2_divisor(geometry, 16)
        self.vec = max(1, self.align // self.unit)
        for e in entries:
            e[1] //= self.unit
            e[2] //= self.unit
            e[4] //= self.unit
        self.device = device
        self.rows = min(e[5] for e in entries)
        self.max_row_units = max(e[4] for e in entries)
        self._buffers = buffers  # keeps the memory the table points at alive
        self._table = torch.tensor(entries, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self._buffers)

    def __repr__(self) -> str:
        return (
            f"KvCopyTable(buffers={len(self)}, rows={self.rows}, unit={self.unit}, "
            f"align={self.align}, device={self.device})"
        )

    def move(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor, *, backend: str = "auto") -> None:
        """Copy token row ``src_loc[i]`` to ``tgt_loc[i]`` in every buffer."""
        tgt_loc = C.check_index("tgt_loc", tgt_loc)
        src_loc = C.check_index("src_loc", src_loc)
        if tgt_loc.shape != src_loc.shape:
            raise ShapeMismatch(
                f"tgt_loc {tuple(tgt_loc.shape)} and src_loc {tuple(src_loc.shape)} differ"
            )
        C.check_device(self.device, tgt_loc=tgt_loc, src_loc=src_loc)
        which = dispatch.resolve(backend, self.device)
        if which == "torch" or self.device.type != "cuda":
            C.check_bounds("tgt_loc", tgt_loc, self.rows)
            C.check_bounds("src_loc", src_loc, self.rows)
        if tgt_loc.numel() == 0:
            return
        if which == "torch":
            self._move_reference(tgt_loc, src_loc)
        else:
            self._launch(tgt_loc, src_loc)

    def _launch(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Launch on validated indices (no host-side bounds check)."""
        n = tgt_loc.shape[0]
        if n == 0:
            return
        dispatch.require_runnable(_copy_rows_kernel, self.device)
        tok, block, warps = C.pick_tile(self.max_row_units, self.unit, n)
        grid = (C.cdiv(n, tok), len(self), C.cdiv(self.max_row_units, block))
        with dispatch.launch_context(self.device):
            _copy_rows_kernel[grid](
                self._table,
                tgt_loc,
                src_loc,
                n,
                UNIT=self.unit,
                ALIGN=self.align,
                VEC=self.vec,
                TOK=tok,
                BLOCK=block,
                num_warps=warps,
            )

    def _move_reference(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        move_reference(self._buffers, tgt_loc, src_loc)


def move_reference(
    buffers: Sequence[torch.Tensor], tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """Plain-torch oracle of :meth:`KvCopyTable.move` (gather, then scatter, per buffer)."""
    tgt, src = tgt_loc.long(), src_loc.long()
    for buf in buffers:
        rows = C.byte_rows(buf, buf.dim() - 2)
        if buf.dim() == 3:
            rows[tgt] = rows[src]
        else:
            ps = buf.shape[1]
            rows[tgt // ps, tgt % ps] = rows[src // ps, src % ps]


def move_kv(
    buffers: Sequence[torch.Tensor],
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """One-shot :meth:`KvCopyTable.move`; build a :class:`KvCopyTable` once for repeated moves."""
    KvCopyTable(buffers).move(tgt_loc, src_loc, backend=backend)
