"""MLA latent cache: store the (nope, rope) halves into one row, and the inverse gather.

``kv_cache`` is ``[rows, 1, Dn + Dr]`` with contiguous rows; ``nope`` is ``[N, 1, Dn]`` and
``rope`` ``[N, 1, Dr]`` in the cache's store dtype. Row ``loc[i]`` becomes
``concat(nope[i], rope[i])`` along the last dim.

Invariants: raw byte copies; out-of-range indices raise before any write (torch path /
CPU); on CUDA an out-of-range store is masked off and an out-of-range gather yields a zero
row; ``N == 0`` is a no-op (the gather returns empty tensors).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch


@triton.jit
def _store_mla_kernel(
    cache,
    nope,
    rope,
    loc_ptr,
    n,
    rows,
    cache_stride,
    nope_stride,
    rope_stride,
    nope_units,
    total_units,
    UNIT: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = toks < n
    loc = tl.load(loc_ptr + toks, mask=live, other=-1).to(tl.int64)
    live = (live & (loc >= 0) & (loc < rows))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    src_row = toks.to(tl.int64)[:, None]
    in_nope = cols < nope_units
    in_rope = (cols >= nope_units) & (cols < total_units)
    a = tl.load(C.unit_ptr(nope, UNIT) + src_row * nope_stride + cols, mask=live & in_nope)
    b = tl.load(
        C.unit_ptr(rope, UNIT) + src_row * rope_stride + (cols - nope_units), mask=live & in_rope
    )
    x = tl.where(in_nope, a, b)
    tl.store(
        C.unit_ptr(cache, UNIT) + loc[:, None] * cache_stride + cols,
        x,
        mask=live & (cols < total_units),
    )


@triton.jit
def _gather_mla_kernel(
    cache,
    nope,
    rope,
    loc_ptr,
    n,
    rows,
    cache_stride,
    nope_units,
    total_units,
    UNIT: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = toks < n
    loc = tl.load(loc_ptr + toks, mask=live, other=-1).to(tl.int64)
    ok = (live & (loc >= 0) & (loc < rows))[:, None]
    live = live[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    out_row = toks.to(tl.int64)[:, None]
    x = tl.load(
        C.unit_ptr(cache, UNIT) + loc[:, None] * cache_stride + cols,
        mask=ok & (cols < total_units),
        other=0,
    )
    tl.store(
        C.unit_ptr(nope, UNIT) + out_row * nope_units + cols, x, mask=live & (cols < nope_units)
    )
    tl.store(
        C.unit_ptr(rope, UNIT) + out_row * (total_units - nope_units) + (cols - nope_units),
        x,
        mask=live & (cols >= nope_units) & (cols < total_units),
    )


def _check_kv_cache(kv_cache):
    C.check_cache("kv_cache", kv_cache, 1)
    if kv_cache.dim() != 3 or kv_cache.shape[1] != 1:
        raise ShapeMismatch(f"kv_cache must be [rows, 1, D], got shape {tuple(kv_cache.shape)}")


def _geometry(kv_cache, nope_dim: int, others) -> tuple[int, int, int]:
    """``(unit, nope_units, total_units)`` for the cache and the ``(ptr, stride)`` of others."""
    isz = kv_cache.element_size()
    row, nope_bytes = C.row_bytes(kv_cache, 1), nope_dim * isz
    values = [kv_cache.data_ptr(), kv_cache.stride(0) * isz, row, nope_bytes]
    for t in others:
        values += [t.data_ptr(), t.stride(0) * t.element_size()]
    unit = C.pick_unit(values)
    return unit, nope_bytes // unit, row // unit


def store_mla_reference(kv_cache, loc, nope, rope) -> None:
    """Plain-torch oracle of :func:`store_mla`."""
    rows = torch.cat([C.byte_rows(nope, 1), C.byte_rows(rope, 1)], dim=1)
    C.byte_rows(kv_cache, 1)[loc.long()] = rows


def gather_mla_reference(kv_cache, loc, nope_dim: int):
    """Plain-torch oracle of :func:`gather_mla`."""
    n, width = loc.shape[0], kv_cache.shape[1]
    rows = C.byte_rows(kv_cache, 1)[loc.long()]
    nope = torch.empty(n, width, nope_dim, dtype=kv_cache.dtype, device=kv_cache.device)
    rope = torch.empty(
        n, width, kv_cache.shape[2] - nope_dim, dtype=kv_cache.dtype, device=kv_cache.device
    )
    split = C.row_bytes(nope, 1)
    C.byte_rows(nope, 1).copy_(rows[:, :split])
    C.byte_rows(rope, 1).copy_(rows[:, split:])
    return nope, rope


def store_mla(kv_cache, loc, nope, rope, *, backend: str = "auto") -> None:
    """Write ``concat(nope[i], rope[i], dim=-1)`` to row ``loc[i]`` of ``kv_cache``."""
    loc = C.check_index("loc", loc)
    n = loc.shape[0]
    _check_kv_cache(kv_cache)
    if not isinstance(nope, torch.Tensor) or nope.dim() != 3:
        raise ShapeMismatch(f"nope must be 3-D [N, 1, Dn], got {getattr(nope, 'shape', nope)}")
    nope_dim = nope.shape[2]
    width, total = kv_cache.shape[1], kv_cache.shape[2]
    if nope_dim > total:
        raise ShapeMismatch(f"nope dim {nope_dim} exceeds the cache row dim {total}")
    nope = C.check_source("nope", nope, n, (width, nope_dim), kv_cache.dtype)
    rope = C.check_source("rope", rope, n, (width, total - nope_dim), kv_cache.dtype)
    C.check_device(kv_cache.device, loc=loc, nope=nope, rope=rope)
    which = dispatch.resolve(backend, kv_cache.device)
    if which == "torch" or kv_cache.device.type != "cuda":
        C.check_bounds("loc", loc, kv_cache.shape[0])
    if n == 0:
        return
    if which == "torch":
        store_mla_reference(kv_cache, loc, nope, rope)
    else:
        _launch_store(kv_cache, loc, nope, rope)


def _launch_store(kv_cache, loc, nope, rope) -> None:
    n = loc.shape[0]
    if n == 0:
        return
    dispatch.require_runnable(_store_mla_kernel, kv_cache.device)
    unit, nope_units, total_units = _geometry(kv_cache, nope.shape[2], (nope, rope))
    tok, block, warps = C.pick_tile(total_units, unit, n)
    grid = (C.cdiv(n, tok), C.cdiv(total_units, block))
    with dispatch.launch_context(kv_cache.device):
        _store_mla_kernel[grid](
            C.kernel_arg(kv_cache),
            C.kernel_arg(nope),
            C.kernel_arg(rope),
            loc,
            n,
            kv_cache.shape[0],
            C.byte_strides(kv_cache, 1)[0] // unit,
            C.byte_strides(nope, 1)[0] // unit,
            C.byte_strides(rope, 1)[0] // unit,
            nope_units,
            total_units,
            UNIT=unit,
            TOK=tok,
            BLOCK=block,
            num_warps=warps,
        )


def gather_mla(kv_cache, loc, nope_dim: int, *, backend: str = "auto"):
    """Return ``(nope [N, 1, nope_dim], rope [N, 1, D - nope_dim])`` read from rows ``loc``."""
    loc = C.check_index("loc", loc)
    _check_kv_cache(kv_cache)
    if not isinstance(nope_dim, int) or not 0 <= nope_dim <= kv_cache.shape[2]:
        raise InvalidArgument(
            f"nope_dim must be an int in [0, {kv_cache.shape[2]}], got {nope_dim!r}"
        )
    C.check_device(kv_cache.device, loc=loc)
    which = dispatch.resolve(backend, kv_cache.device)
    if which == "torch" or kv_cache.device.type != "cuda":
        C.check_bounds("loc", loc, kv_cache.shape[0])
    if which == "torch":
        return gather_mla_reference(kv_cache, loc, nope_dim)
    return _launch_gather(kv_cache, loc, nope_dim)


def _launch_gather(kv_cache, loc, nope_dim: int):
    n, width, total = loc.shape[0], kv_cache.shape[1], kv_cache.shape[2]
    nope = torch.empty(n, width, nope_dim, dtype=kv_cache.dtype, device=kv_cache.device)
    rope = torch.empty(n, width, total - nope_dim, dtype=kv_cache.dtype, device=kv_cache.device)
    if n == 0:
        return nope, rope
    dispatch.require_runnable(_gather_mla_kernel, kv_cache.device)
    unit, nope_units, total_units = _geometry(kv_cache, nope_dim, (nope, rope))
    tok, block, warps = C.pick_tile(total_units, unit, n)
    grid = (C.cdiv(n, tok), C.cdiv(total_units, block))
    with dispatch.launch_context(kv_cache.device):
        _gather_mla_kernel[grid](
            C.kernel_arg(kv_cache),
            C.kernel_arg(nope),
            C.kernel_arg(rope),
            loc,
            n,
            kv_cache.shape[0],
            C.byte_strides(kv_cache, 1)[0] // unit,
            nope_units,
            total_units,
            UNIT=unit,
            TOK=tok,
            BLOCK=block,
            num_warps=warps,
        )
    return nope, rope
