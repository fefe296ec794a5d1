"""Store token rows into up to four caches in ONE launch (e.g. main K/V + index K/V).

``store_rows_multi(caches, loc, sources)``: ``caches[b]`` is ``[rows, ...]`` with contiguous
rows (all caches have the same ``rows`` and device), ``sources[b]`` is ``[N, ...]`` with the
trailing shape and store dtype of ``caches[b]``; row ``i`` of every source goes to row
``loc[i]`` of its cache. Caches may differ in row size and dtype: rows are copied as raw bytes
(the launch reinterprets everything in the widest common unit, as :mod:`kvxfer.kernels.store`).

It is exactly :func:`kvxfer.kernels.store.store_kv` applied to each (cache, source) pair, in one
launch: same bytes, same bounds behaviour (torch path / CPU: any ``loc`` outside
``[0, rows)`` raises :class:`IndexOutOfRange` before anything is written; CUDA: masked off),
``N == 0`` is a no-op, duplicate targets leave an unspecified candidate on GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

__all__ = ["MAX_BUFFERS", "store_rows_multi", "store_rows_multi_reference"]

MAX_BUFFERS = 4


@triton.jit
def _copy_part(
    src, dst, src_row, dst_row, src_stride, dst_stride, units, cols, live, UNIT: tl.constexpr
):
    m = live[:, None] & (cols < units)
    x = tl.load(C.unit_ptr(src, UNIT) + src_row * src_stride + cols, mask=m)
    tl.store(C.unit_ptr(dst, UNIT) + dst_row * dst_stride + cols, x, mask=m)


@triton.jit
def _store_multi_kernel(
    s0,
    s1,
    s2,
    s3,
    d0,
    d1,
    d2,
    d3,
    loc_ptr,
    n,
    rows,
    ss0,
    ss1,
    ss2,
    ss3,
    ds0,
    ds1,
    ds2,
    ds3,
    u0,
    u1,
    u2,
    u3,
    NBUF: tl.constexpr,
    UNIT: tl.constexpr,
    TOK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (i, j): units [j*BLOCK, (j+1)*BLOCK) of source rows [i*TOK, (i+1)*TOK), every
    buffer (a buffer whose rows are shorter masks the surplus columns off)."""
    toks = tl.program_id(0) * TOK + tl.arange(0, TOK)
    live = toks < n
    loc = tl.load(loc_ptr + toks, mask=live, other=-1).to(tl.int64)
    live = live & (loc >= 0) & (loc < rows)
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    src_row = toks.to(tl.int64)[:, None]
    dst_row = loc[:, None]
    _copy_part(s0, d0, src_row, dst_row, ss0, ds0, u0, cols, live, UNIT)
    if NBUF > 1:
        _copy_part(s1, d1, src_row, dst_row, ss1, ds1, u1, cols, live, UNIT)
    if NBUF > 2:
        _copy_part(s2, d2, src_row, dst_row, ss2, ds2, u2, cols, live, UNIT)
    if NBUF > 3:
        _copy_part(s3, d3, src_row, dst_row, ss3, ds3, u3, cols, live, UNIT)


def store_rows_multi_reference(caches, loc, sources) -> None:
    """Plain-torch oracle (no checks)."""
    idx = loc.long()
    for cache, src in zip(caches, sources):
        C.byte_rows(cache, 1)[idx] = C.byte_rows(src, 1)


def _validate(caches, sources, n: int):
    if not isinstance(caches, Sequence) or not isinstance(sources, Sequence):
        raise InvalidArgument("caches and sources must be sequences of tensors")
    if not 1 <= len(caches) <= MAX_BUFFERS:
        raise InvalidArgument(f"store_rows_multi takes 1..{MAX_BUFFERS} caches, got {len(caches)}")
    if len(sources) != len(caches):
        raise ShapeMismatch(f"{len(caches)} caches but {len(sources)} sources")
    out = []
    for b, (cache, src) in enumerate(zip(caches, sources)):
        C.check_cache(f"caches[{b}]", cache, 1)
        if cache.shape[0] != caches[0].shape[0]:
            raise ShapeMismatch(
                f"caches[{b}] has {cache.shape[0]} rows, caches[0] has {caches[0].shape[0]}"
            )
        src = C.check_source(f"sources[{b}]", src, n, cache.shape[1:], cache.dtype)
        C.check_device(caches[0].device, **{f"caches[{b}]": cache, f"sources[{b}]": src})
        out.append(src)
    return out


def store_rows_multi(
    caches: Sequence[torch.Tensor],
    loc: torch.Tensor,
    sources: Sequence[torch.Tensor],
    *,
    backend: str = "auto",
) -> None:
    """Write ``sources[b][i]`` to row ``loc[i]`` of ``caches[b]`` for every ``b`` (one launch)."""
    loc = C.check_index("loc", loc)
    n = loc.shape[0]
    sources = _validate(caches, sources, n)
    device = caches[0].device
    C.check_device(device, loc=loc)
    which = dispatch.resolve(backend, device)
    if which == "torch" or device.type != "cuda":
        C.check_bounds("loc", loc, caches[0].shape[0])
    if n == 0:
        return
    if which == "torch":
        store_rows_multi_reference(caches, loc, sources)
    else:
        _launch(list(caches), loc, sources)


def _launch(caches, loc, sources) -> None:
    n = loc.shape[0]
    dispatch.require_runnable(_store_multi_kernel, caches[0].device)
    dst = [C.byte_rows(c, 1) for c in caches]
    src = [C.byte_rows(s, 1) for s in sources]
    geometry = [t.data_ptr() for t in dst + src] + [t.stride(0) for t in dst + src]
    geometry += [t.shape[1] for t in dst]
    unit = C.pick_unit(geometry)
    units = [t.shape[1] // unit for t in dst]
    nbuf = len(dst)
    pad = MAX_BUFFERS - nbuf
    dst_p, src_p = dst + [dst[0]] * pad, src + [src[0]] * pad
    units_p = units + [0] * pad
    tok, block, warps = C.pick_tile(max(units), unit, n)
    grid = (triton.cdiv(n, tok), triton.cdiv(max(units), block))
    with dispatch.launch_context(caches[0].device):
        _store_multi_kernel[grid](
            *src_p,
            *dst_p,
            loc,
            n,
            caches[0].shape[0],
            *[t.stride(0) // unit for t in src_p],
            *[t.stride(0) // unit for t in dst_p],
            *units_p,
            NBUF=nbuf,
            UNIT=unit,
            TOK=tok,
            BLOCK=block,
            num_warps=warps,
        )
