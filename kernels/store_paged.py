"""Store K/V rows into page-major 4-D strided views.

``k_view``/``v_view`` are ``[num_pages, page_size, H, D]`` views whose token rows
(``[H, D]``) are contiguous while pages and the tokens inside a page are strided (the
page-major pool packs all layers of a page together, so consecutive pages of one layer
are a whole page of all layers apart). Token ``t`` lives at ``(t // page_size,
t % page_size)``; the valid token range is ``[0, num_tokens)``, by default ``[0, num_pages *
page_size)`` (a caller whose last page is only partly its own passes its own token count).

Invariants: as :mod:`kvxfer.kernels.store` - raw byte copies, out-of-range indices raise before
any write on the torch path / CPU and are masked off in the kernel on CUDA, ``N == 0`` is
a no-op, duplicate targets leave an unspecified candidate on GPU.
"""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch


@triton.jit
def _store_paged_kernel(
    k_src,
    v_src,
    k_dst,
    v_dst,
    loc_ptr,
    n,
    page_size,
    num_tokens,
    k_src_stride,
    v_src_stride,
    k_page_stride,
    k_tok_stride,
    v_page_stride,
    v_tok_stride,
    k_units,
    v_units,
    UNIT: tl.constexpr,
    HAS_V: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, j) copies units [j*BLOCK, (j+1)*BLOCK) of source rows [i*TOK, (i+1)*TOK)."""
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = toks < n
    loc = tl.load(loc_ptr + toks, mask=live, other=-1).to(tl.int64)
    live = live & (loc >= 0) & (loc < num_tokens)
    page = loc // page_size
    slot = loc - page * page_size
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    src_row = toks.to(tl.int64)[:, None]
    km = live[:, None] & (cols < k_units)
    k_row = (page * k_page_stride + slot * k_tok_stride)[:, None]
    x = tl.load(C.unit_ptr(k_src, UNIT) + src_row * k_src_stride + cols, mask=km)
    if HAS_V:  # both loads in flight before either store
        vm = live[:, None] & (cols < v_units)
        v_row = (page * v_page_stride + slot * v_tok_stride)[:, None]
        y = tl.load(C.unit_ptr(v_src, UNIT) + src_row * v_src_stride + cols, mask=vm)
    tl.store(C.unit_ptr(k_dst, UNIT) + k_row + cols, x, mask=km)
    if HAS_V:
        tl.store(C.unit_ptr(v_dst, UNIT) + v_row + cols, y, mask=vm)


def _launch(k_view, v_view, loc, k, v, num_tokens: int) -> None:
    """Launch the kernel on validated arguments (no host-side bounds check); ids outside
    ``[0, num_tokens)`` are masked off."""
    n = k.shape[0]
    if n == 0:
        return
    dispatch.require_runnable(_store_paged_kernel, k_view.device)
    has_v = v_view is not None
    if not has_v:
        v_view, v = k_view, k
    tensors = (k, v, k_view, v_view)
    strides = [
        C.byte_strides(k, 1)[0],
        C.byte_strides(v, 1)[0],
        *C.byte_strides(k_view, 2),
        *C.byte_strides(v_view, 2),
    ]
    k_row, v_row = C.row_bytes(k_view, 2), C.row_bytes(v_view, 2)
    unit = C.pick_unit([t.data_ptr() for t in tensors] + strides + [k_row, v_row])
    k_units, v_units = k_row // unit, v_row // unit
    tok, block, warps = C.pick_tile(max(k_units, v_units), unit, n)
    grid = (C.cdiv(n, tok), C.cdiv(max(k_units, v_units), block))
    with dispatch.launch_context(k_view.device):
        _store_paged_kernel[grid](
            *(C.kernel_arg(t) for t in tensors),
            loc,
            n,
            k_view.shape[1],
            num_tokens,
            *(s // unit for s in strides),
            k_units,
            v_units,
            UNIT=unit,
            HAS_V=has_v,
            TOK=tok,
            BLOCK=block,
            num_warps=warps,
        )


def store_kv_paged_reference(k_view, v_view, loc, k, v) -> None:
    """Plain-torch oracle of :func:`store_kv_paged` (vectorised 2-D advanced indexing)."""
    idx = loc.long()
    page_size = k_view.shape[1]
    page, slot = idx // page_size, idx % page_size
    C.byte_rows(k_view, 2)[page, slot] = C.byte_rows(k, 1)
    if v_view is not None:
        C.byte_rows(v_view, 2)[page, slot] = C.byte_rows(v, 1)


def _check_view(name, view):
    C.check_cache(name, view, 2)
    if view.dim() != 4:
        raise ShapeMismatch(
            f"{name} must be 4-D [num_pages, page_size, H, D], got shape {tuple(view.shape)}"
        )


def store_kv_paged(
    k_view, v_view, loc, k, v, *, backend: str = "auto", num_tokens: Optional[int] = None
) -> None:
    """Write ``k[i]``/``v[i]`` to token ``loc[i]`` of the page-major views.

    ``v_view`` (and then ``v``) may be None for K-only layouts. ``num_tokens`` (default: every
    slot of the views, ``num_pages * page_size``; at most that) bounds the valid ids
    ``[0, num_tokens)``: ids past it are refused / masked off like any out-of-range id, even
    when they fall inside the last page.
    """
    loc = C.check_index("loc", loc)
    n = loc.shape[0]
    _check_view("k_view", k_view)
    k = C.check_source("k", k, n, k_view.shape[2:], k_view.dtype)
    if v_view is None:
        if v is not None:
            raise InvalidArgument("v was given but v_view is None")
    else:
        _check_view("v_view", v_view)
        if tuple(v_view.shape[:2]) != tuple(k_view.shape[:2]):
            raise ShapeMismatch(
                f"k_view pages {tuple(k_view.shape[:2])} != v_view pages {tuple(v_view.shape[:2])}"
            )
        if v is None:
            raise InvalidArgument("v_view was given but v is None")
        v = C.check_source("v", v, n, v_view.shape[2:], v_view.dtype)
    C.check_device(k_view.device, loc=loc, k=k, v_view=v_view, v=v)
    rows = k_view.shape[0] * k_view.shape[1]
    if num_tokens is not None:
        if (
            isinstance(num_tokens, bool)
            or not isinstance(num_tokens, int)
            or not 0 <= num_tokens <= rows
        ):
            raise InvalidArgument(f"num_tokens must be an int in [0, {rows}], got {num_tokens!r}")
        rows = num_tokens
    which = dispatch.resolve(backend, k_view.device)
    if which == "torch" or k_view.device.type != "cuda":
        C.check_bounds("loc", loc, rows)
    if n == 0:
        return
    if which == "torch":
        store_kv_paged_reference(k_view, v_view, loc, k, v)
    else:
        _launch(k_view, v_view, loc, k, v, rows)
