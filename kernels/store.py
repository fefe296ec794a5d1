"""Store K/V rows at token slots: plain, masked and prefix-valid stores.

``k_cache``/``v_cache`` are ``[rows, ...]`` with each row contiguous (rows may be
strided); ``k``/``v`` are ``[N, ...]`` with the same trailing shape and the cache's store
dtype. Row ``i`` of ``k`` goes to row ``loc[i]`` of ``k_cache`` (same for V).

Invariants:

* bytes are copied verbatim; the dtype only fixes the row size;
* an index outside ``[0, rows)`` raises :class:`IndexOutOfRange` before anything is
  written on the torch path and on CPU; on CUDA the kernel masks it off (never written,
  no host sync);
* only rows that are actually written are bounds-checked (masked-off rows and rows past a
  request's commit length may hold any value, e.g. ``-1`` padding);
* duplicate target indices leave one of the candidate rows (unspecified which) on GPU;
* ``N == 0`` is a no-op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

_MODE_PLAIN, _MODE_MASK, _MODE_PREFIX = 0, 1, 2


@triton.jit
def _store_rows_kernel(
    k_src,
    v_src,
    k_dst,
    v_dst,
    loc_ptr,
    sel_ptr,
    n,
    rows,
    seq_len,
    k_src_stride,
    v_src_stride,
    k_dst_stride,
    v_dst_stride,
    k_units,
    v_units,
    UNIT: tl.constexpr,
    HAS_V: tl.constexpr,
    MODE: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, j) copies units [j*BLOCK, (j+1)*BLOCK) of source rows [i*TOK, (i+1)*TOK).

    MODE 0: every row; MODE 1: rows whose byte in ``sel_ptr`` is non-zero; MODE 2: row
    ``r = b * seq_len + t`` only when ``t < sel_ptr[b]`` (commit lengths).
    """
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = toks < n
    loc = tl.load(loc_ptr + toks, mask=live, other=-1).to(tl.int64)
    live = live & (loc >= 0) & (loc < rows)
    if MODE == 1:
        live = live & (tl.load(sel_ptr + toks, mask=live, other=0) != 0)
    if MODE == 2:
        b = toks // seq_len
        commit = tl.load(sel_ptr + b, mask=live, other=0)
        live = live & ((toks - b * seq_len) < commit)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    src_row = toks.to(tl.int64)[:, None]
    dst_row = loc[:, None]
    km = live[:, None] & (cols < k_units)
    x = tl.load(C.unit_ptr(k_src, UNIT) + src_row * k_src_stride + cols, mask=km)
    if HAS_V:  # both loads in flight before either store
        vm = live[:, None] & (cols < v_units)
        y = tl.load(C.unit_ptr(v_src, UNIT) + src_row * v_src_stride + cols, mask=vm)
    tl.store(C.unit_ptr(k_dst, UNIT) + dst_row * k_dst_stride + cols, x, mask=km)
    if HAS_V:
        tl.store(C.unit_ptr(v_dst, UNIT) + dst_row * v_dst_stride + cols, y, mask=vm)


def _launch(k_cache, v_cache, loc, k, v, sel, mode: int, seq_len: int = 1) -> None:
    """Launch the kernel on validated arguments (no host-side bounds check).

    Hot path (one call per layer per forward step): no host sync, no allocation, no
    per-call lists - scalars only, the tile choice is memoised in :func:`C.pick_tile`.
    Sources have the cache's element size (``_validate`` guarantees it).
    """
    n = k.shape[0]
    if n == 0:
        return
    dispatch.require_runnable(_store_rows_kernel, k_cache.device)
    has_v = v_cache is not None
    if not has_v:
        v_cache, v = k_cache, k
    ek, ev = k_cache.element_size(), v_cache.element_size()
    k_src, v_src = k.stride(0) * ek, v.stride(0) * ev
    k_dst, v_dst = k_cache.stride(0) * ek, v_cache.stride(0) * ev
    k_row, v_row = C.row_bytes(k_cache, 1), C.row_bytes(v_cache, 1)
    unit = C.pick_unit(
        (
            k.data_ptr(),
            v.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_src,
            v_src,
            k_dst,
            v_dst,
            k_row,
            v_row,
        )
    )
    k_units, v_units = k_row // unit, v_row // unit
    row_units = max(k_units, v_units)
    tok, block, warps = C.pick_tile(row_units, unit, n)
    grid = (C.cdiv(n, tok), C.cdiv(row_units, block))
    with dispatch.launch_context(k_cache.device):
        _store_rows_kernel[grid](
            C.kernel_arg(k),
            C.kernel_arg(v),
            C.kernel_arg(k_cache),
            C.kernel_arg(v_cache),
            loc,
            loc if sel is None else sel,
            n,
            k_cache.shape[0],
            seq_len,
            k_src // unit,
            v_src // unit,
            k_dst // unit,
            v_dst // unit,
            k_units,
            v_units,
            UNIT=unit,
            HAS_V=has_v,
            MODE=mode,
            TOK=tok,
            BLOCK=block,
            num_warps=warps,
        )


def store_kv_reference(k_cache, v_cache, loc, k, v, *, mask=None) -> None:
    """Plain-torch oracle of :func:`store_kv` (no checks; vectorised index_put)."""
    if mask is not None:
        keep = mask.nonzero().squeeze(1)
        loc, k = loc[keep], k[keep]
        v = v[keep] if v is not None else None
    idx = loc.long()
    C.byte_rows(k_cache, 1)[idx] = C.byte_rows(k, 1)
    if v_cache is not None:
        C.byte_rows(v_cache, 1)[idx] = C.byte_rows(v, 1)


def _validate(k_cache, v_cache, k, v, n: int):
    C.check_cache("k_cache", k_cache, 1)
    k = C.check_source("k", k, n, k_cache.shape[1:], k_cache.dtype)
    if v_cache is None:
        if v is not None:
            raise InvalidArgument("v was given but v_cache is None (K-only pool)")
        return k, None
    C.check_cache("v_cache", v_cache, 1)
    if v_cache.shape[0] != k_cache.shape[0]:
        raise ShapeMismatch(
            f"k_cache has {k_cache.shape[0]} rows but v_cache has {v_cache.shape[0]}"
        )
    if v is None:
        raise InvalidArgument("v_cache was given but v is None")
    v = C.check_source("v", v, n, v_cache.shape[1:], v_cache.dtype)
    C.check_device(k_cache.device, v_cache=v_cache, v=v)
    return k, v


def store_kv(k_cache, v_cache, loc, k, v, *, mask=None, backend: str = "auto") -> None:
    """Write ``k[i]``/``v[i]`` to row ``loc[i]`` of ``k_cache``/``v_cache``.

    ``mask`` (bool ``[N]``), when given, restricts the write to rows where it is True.
    ``v_cache`` (and then ``v``) may be None for K-only pools.
    """
    loc = C.check_index("loc", loc)
    n = loc.shape[0]
    k, v = _validate(k_cache, v_cache, k, v, n)
    if mask is not None:
        mask = C.check_mask("mask", mask, n)
    C.check_device(k_cache.device, loc=loc, k=k, mask=mask)
    which = dispatch.resolve(backend, k_cache.device)
    if which == "torch" or k_cache.device.type != "cuda":
        C.check_bounds("loc", loc if mask is None else loc[mask], k_cache.shape[0])
    if n == 0:
        return
    if which == "torch":
        store_kv_reference(k_cache, v_cache, loc, k, v, mask=mask)
    else:
        sel = mask.view(torch.uint8) if mask is not None else None
        _launch(k_cache, v_cache, loc, k, v, sel, _MODE_MASK if mask is not None else _MODE_PLAIN)


def prefix_valid_mask(loc_2d: torch.Tensor, commit_lens: torch.Tensor) -> torch.Tensor:
    """Bool ``[B*T]``: position ``(b, t)`` is valid when ``t < commit_lens[b]``."""
    t = torch.arange(loc_2d.shape[1], device=loc_2d.device)
    return (t[None, :] < commit_lens.to(torch.int64)[:, None]).reshape(-1)


def store_kv_prefix_valid_reference(k_cache, v_cache, loc_2d, commit_lens, k, v) -> None:
    """Plain-torch oracle of :func:`store_kv_prefix_valid`."""
    mask = prefix_valid_mask(loc_2d, commit_lens)
    store_kv_reference(k_cache, v_cache, loc_2d.reshape(-1), k, v, mask=mask)


def store_kv_prefix_valid(
    k_cache, v_cache, loc_2d, commit_lens, k, v, *, backend: str = "auto"
) -> None:
    """Write row ``(b, t)`` (``k[b*T + t]``) to ``loc_2d[b, t]`` only when ``t < commit_lens[b]``.

    ``loc_2d`` is ``[B, T]``, ``commit_lens`` ``[B]`` (int32/int64), ``k``/``v`` ``[B*T, ...]``.
    """
    loc_2d = C.check_index("loc_2d", loc_2d, ndim=2)
    commit_lens = C.check_index("commit_lens", commit_lens)
    batch, seq_len = loc_2d.shape
    if commit_lens.shape[0] != batch:
        raise ShapeMismatch(
            f"commit_lens has {commit_lens.shape[0]} entries but loc_2d has {batch} rows"
        )
    n = batch * seq_len
    k, v = _validate(k_cache, v_cache, k, v, n)
    C.check_device(k_cache.device, loc_2d=loc_2d, commit_lens=commit_lens, k=k)
    which = dispatch.resolve(backend, k_cache.device)
    if which == "torch" or k_cache.device.type != "cuda":
        valid = prefix_valid_mask(loc_2d, commit_lens)
        C.check_bounds("loc_2d", loc_2d.reshape(-1)[valid], k_cache.shape[0])
    if n == 0:
        return
    if which == "torch":
        store_kv_prefix_valid_reference(k_cache, v_cache, loc_2d, commit_lens, k, v)
    else:
        _launch(k_cache, v_cache, loc_2d.reshape(-1), k, v, commit_lens, _MODE_PREFIX, seq_len)
