"""Block-FP4 quantize / dequantize: e2m1 values, two per byte, one scale per 16 elements.

Format (every row of ``K`` elements, ``K % 16 == 0``, is cut into blocks of 16 consecutive
elements; a block never spans two rows):

* **values** -- e2m1 codes (sign bit 3, magnitude code 0..7 meaning
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``). Element ``2i`` of a row is the LOW nibble of byte ``i``,
  element ``2i + 1`` the HIGH nibble: a row is ``K // 2`` bytes.
* **scales** -- one byte per block, **UE8M0**: an unbiased power of two ``s = 2**(b - 127)``
  (``b`` in ``[1, 253]``, always a normal fp32). A row has ``K // 16`` scale bytes.
  ``s`` is the smallest power of two with ``6 * s >= amax`` (``amax`` = the block's largest
  magnitude), clamped to ``[2**-126, 2**126]``; an all-zero block gets ``2**-126``.

Quantization: ``y = x / s`` (exact: ``s`` is a power of two), then round-to-nearest onto the
e2m1 grid with ties to the even code (thresholds ``0.25 0.75 1.25 1.75 2.5 3.5 5``, ties at
0.75 / 1.75 / 3.5 go up). Zero codes never carry a sign, so bytes are canonical. Because
every step is exact, the Triton kernel and the torch reference produce identical bytes.

Error bound (per element, exact real arithmetic, inputs finite)::

    |dequant(quant(x)) - x| <= max(s / 4, |x| / 4),   amax / 6 <= s < amax / 3

i.e. at most ``amax / 12`` for small elements and 25 % relative for large ones (the e2m1
grid itself: spacing 0.5 below 2, 1 in [2, 4], 2 in [4, 6]). Dequantized values are
``code * s``, saturated to ``+-finfo(dtype).max``: in fp32 and bf16 they are exact except at the
largest scale ``s = 2**126`` (byte 253), where codes 4 and 6 (``2**128``, ``1.5 * 2**128``) are
past the range and come out as ``+-max``. The quantizer picks that scale only for ``amax >
1.5 * 2**127``, and there never code 6 (code 4 for ``|x| >= 3.5 * 2**126``); as ``|x| <=
max``, ``max`` is nearer ``x`` than ``2**128``, so the bound above still holds. fp16 outputs
saturate the same way to the fp16 range (from much smaller scales on).
Non-finite inputs give unspecified (but in-bounds) bytes.

Launchers (``backend``: ``"auto" | "triton" | "torch"``, see :mod:`kvxfer.kernels.dispatch`):

* :func:`quantize_fp4` ``x [..., K] -> (packed uint8 [..., K/2], scales uint8 [..., K/16])``;
* :func:`dequantize_fp4` ``(packed, scales[, loc]) -> [..., K]`` in a float dtype; with
  ``loc`` the inputs are caches ``[rows, ...]`` and rows ``loc`` are gathered first;
* :func:`store_fp4` quantizes ``x [N, ...]`` and writes row ``i`` to row ``loc[i]`` of a packed
  cache and a scale cache in ONE launch (optional bool ``mask``).

Bounds: as the other kernels -- on the torch path / CPU any ``loc`` outside ``[0, rows)``
raises :class:`IndexOutOfRange` before anything is written; on CUDA such rows are never
written (a gather yields zeros).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvxfer.kernels import _common as C
from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch

__all__ = [
    "BLOCK_ELEMS",
    "FLOAT_DTYPES",
    "quantize_fp4",
    "dequantize_fp4",
    "store_fp4",
    "quantize_fp4_reference",
    "dequantize_fp4_reference",
    "fp4_error_bound",
]

BLOCK_ELEMS = 16
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MIN_EXP, _MAX_EXP = -126, 126


# ------------------------------------------------------------------------------ Triton
@triton.jit
def _e2m1_codes(y):
    """fp32 ``y`` (|y| <= 6) -> 4-bit codes (int32), ties to the even code, unsigned zero."""
    a = tl.abs(y)
    c = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return c | tl.where((y < 0) & (c > 0), 8, 0)


@triton.jit
def _e2m1_values(c):
    """4-bit codes (int32) -> fp32 values."""
    mag = c & 7
    ex = mag >> 1
    half = (mag & 1).to(tl.float32) * 0.5
    pw = tl.where(ex == 3, 4.0, tl.where(ex == 2, 2.0, 1.0))
    v = tl.where(ex == 0, half, pw * (1.0 + half))
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _quant_store_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    loc_ptr,
    mask_ptr,
    n,
    rows,
    nblocks,
    x_stride,
    q_stride,
    s_stride,
    HAS_LOC: tl.constexpr,
    HAS_MASK: tl.constexpr,
    ROWS: tl.constexpr,
    BLK: tl.constexpr,
):
    """Program (i, j): blocks [j*BLK, (j+1)*BLK) of source rows [i*ROWS, (i+1)*ROWS)."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * BLK + tl.arange(0, BLK)
    live = r < n
    if HAS_LOC:
        dst = tl.load(loc_ptr + r, mask=live, other=-1).to(tl.int64)
        live = live & (dst >= 0) & (dst < rows)
    else:
        dst = r.to(tl.int64)
    if HAS_MASK:
        live = live & (tl.load(mask_ptr + r, mask=live, other=0) != 0)
    lb = live[:, None] & (b < nblocks)[None, :]  # [ROWS, BLK]
    e = tl.arange(0, 16)
    src = r.to(tl.int64)[:, None, None] * x_stride + b[None, :, None] * 16 + e[None, None, :]
    x = tl.load(x_ptr + src, mask=lb[:, :, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)  # [ROWS, BLK]
    bits = amax.to(tl.int32, bitcast=True)
    ex = ((bits >> 23) & 0xFF) - 127 - 2 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    ex = tl.minimum(tl.maximum(ex, -126), 126)
    recip = ((127 - ex) << 23).to(tl.float32, bitcast=True)
    y = x * recip[:, :, None]
    ye, yo = tl.split(tl.reshape(y, (ROWS, BLK, 8, 2)))
    packed = (_e2m1_codes(ye) | (_e2m1_codes(yo) << 4)).to(tl.uint8)  # [ROWS, BLK, 8]
    h = tl.arange(0, 8)
    qo = dst[:, None, None] * q_stride + b[None, :, None] * 8 + h[None, None, :]
    tl.store(q_ptr + qo, packed, mask=lb[:, :, None])
    so = dst[:, None] * s_stride + b[None, :]
    tl.store(s_ptr + so, (ex + 127).to(tl.uint8), mask=lb)


@triton.jit
def _dequant_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    loc_ptr,
    n,
    rows,
    nblocks,
    q_stride,
    s_stride,
    out_stride,
    max_val,
    HAS_LOC: tl.constexpr,
    ROWS: tl.constexpr,
    BLK: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * BLK + tl.arange(0, BLK)
    live = r < n
    if HAS_LOC:
        src = tl.load(loc_ptr + r, mask=live, other=-1).to(tl.int64)
        ok = live & (src >= 0) & (src < rows)
    else:
        src = r.to(tl.int64)
        ok = live
    inb = (b < nblocks)[None, :]
    lb = ok[:, None] & inb
    h = tl.arange(0, 8)
    q = tl.load(
        q_ptr + src[:, None, None] * q_stride + b[None, :, None] * 8 + h[None, None, :],
        mask=lb[:, :, None],
        other=0,
    ).to(tl.int32)
    sb = tl.load(s_ptr + src[:, None] * s_stride + b[None, :], mask=lb, other=0).to(tl.int32)
    s = tl.where(lb, (sb << 23).to(tl.float32, bitcast=True), 0.0)
    ve = _e2m1_values(q & 0xF)
    vo = _e2m1_values(q >> 4)
    v = tl.reshape(tl.join(ve, vo), (ROWS, BLK, 16)) * s[:, :, None]
    v = tl.minimum(tl.maximum(v, -max_val), max_val)
    e = tl.arange(0, 16)
    oo = r.to(tl.int64)[:, None, None] * out_stride + b[None, :, None] * 16 + e[None, None, :]
    om = (live[:, None] & inb)[:, :, None]
    tl.store(out_ptr + oo, v.to(out_ptr.dtype.element_ty), mask=om)


def _tile(nblocks: int, n: int) -> tuple[int, int]:
    blk = min(C.next_pow2(max(nblocks, 1)), 32)
    rows = min(max(1, 128 // blk), C.next_pow2(max(n, 1)))
    return rows, blk


# ------------------------------------------------------------------------------ reference
def _codes_reference(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    c = (
        (a > 0.25).int()
        + (a >= 0.75).int()
        + (a > 1.25).int()
        + (a >= 1.75).int()
        + (a > 2.5).int()
        + (a >= 3.5).int()
        + (a > 5.0).int()
    )
    return c | torch.where((y < 0) & (c > 0), 8, 0).int()


_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _values_reference(c: torch.Tensor) -> torch.Tensor:
    v = _GRID.to(c.device)[(c & 7).long()]
    return torch.where((c & 8) != 0, -v, v)


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    bits = amax.contiguous().view(torch.int32)
    ex = ((bits >> 23) & 0xFF) - 129 + ((bits & 0x7FFFFF) > 0x400000).int()
    return ex.clamp(_MIN_EXP, _MAX_EXP)


def quantize_fp4_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch oracle of :func:`quantize_fp4` (same bytes)."""
    k = x.shape[-1]
    blocks = x.reshape(-1, k // BLOCK_ELEMS, BLOCK_ELEMS).to(torch.float32)
    ex = _scale_exponent(blocks.abs().amax(dim=2))
    recip = ((127 - ex) << 23).view(torch.float32)
    codes = _codes_reference(blocks * recip[:, :, None]).reshape(blocks.shape[0], k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return (
        packed.reshape(*x.shape[:-1], k // 2),
        (ex + 127).to(torch.uint8).reshape(*x.shape[:-1], k // BLOCK_ELEMS),
    )


def dequantize_fp4_reference(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Plain-torch oracle of :func:`dequantize_fp4` without ``loc``."""
    k = packed.shape[-1] * 2
    q = packed.reshape(-1, k // 2).to(torch.int32)
    vals = torch.stack((_values_reference(q & 0xF), _values_reference(q >> 4)), dim=-1)
    vals = vals.reshape(q.shape[0], k // BLOCK_ELEMS, BLOCK_ELEMS)
    s = (scales.reshape(-1, k // BLOCK_ELEMS).to(torch.int32) << 23).view(torch.float32)
    out = (vals * s[:, :, None]).reshape(*packed.shape[:-1], k)
    big = torch.finfo(dtype).max
    return out.clamp(-big, big).to(dtype)


def fp4_error_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-element bound ``max(s / 4, |x| / 4)`` of the round-trip error (fp32, shape of x),
    with ``s`` the block scale :func:`quantize_fp4` picks."""
    k = x.shape[-1]
    blocks = x.reshape(-1, k // BLOCK_ELEMS, BLOCK_ELEMS).to(torch.float32)
    s = ((_scale_exponent(blocks.abs().amax(dim=2)) + 127) << 23).view(torch.float32)
    bound = torch.maximum(s[:, :, None].expand_as(blocks) / 4, blocks.abs() / 4)
    return bound.reshape(x.shape)


# ------------------------------------------------------------------------------ checks
def _row_elems(t: torch.Tensor, lead: int = 1) -> int:
    return math.prod(t.shape[lead:]) if t.dim() > lead else 1


def _check_float(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"{name} must be one of {FLOAT_DTYPES}, got {x.dtype}")
    return x


def _check_k(name: str, k: int) -> None:
    if k <= 0 or k % BLOCK_ELEMS:
        raise ShapeMismatch(
            f"{name}: a row has {k} elements, must be a positive multiple of {BLOCK_ELEMS}"
        )


def _check_u8_cache(name: str, cache) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        got = cache.dtype if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise InvalidArgument(f"{name} must be a uint8 tensor, got {got}")
    C.check_cache(name, cache, 1)
    return cache


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """``[n, ...]`` with contiguous rows -> a 2-D ``[n, row]`` view (same storage)."""
    return t.reshape(t.shape[0], -1) if t.dim() != 2 else t


def _check_caches(packed_cache, scale_cache) -> tuple[int, int]:
    _check_u8_cache("packed_cache", packed_cache)
    _check_u8_cache("scale_cache", scale_cache)
    if packed_cache.shape[0] != scale_cache.shape[0]:
        raise ShapeMismatch(
            f"packed_cache has {packed_cache.shape[0]} rows, scale_cache {scale_cache.shape[0]}"
        )
    k = 2 * _row_elems(packed_cache)
    _check_k("packed_cache", k)
    if _row_elems(scale_cache) != k // BLOCK_ELEMS:
        raise ShapeMismatch(
            f"scale_cache rows hold {_row_elems(scale_cache)} "
            f"bytes, expected {k // BLOCK_ELEMS} for {k} elements"
        )
    C.check_device(packed_cache.device, scale_cache=scale_cache)
    return packed_cache.shape[0], k


# ------------------------------------------------------------------------------ launchers
def quantize_fp4(x: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (bf16/fp16/fp32, ``K % 16 == 0``) -> ``(packed [..., K/2], scales
    [..., K/16])``, both uint8."""
    x = _check_float("x", x)
    if x.dim() == 0:
        raise ShapeMismatch("x must have at least one dim")
    k = x.shape[-1]
    _check_k("x", k)
    which = dispatch.resolve(backend, x.device)
    if which == "torch":
        return quantize_fp4_reference(x)
    flat = x.reshape(-1, k).contiguous()
    n = flat.shape[0]
    packed = torch.empty((n, k // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((n, k // BLOCK_ELEMS), dtype=torch.uint8, device=x.device)
    _launch_quant(flat, packed, scales, None, None)
    return packed.reshape(*x.shape[:-1], k // 2), scales.reshape(*x.shape[:-1], k // BLOCK_ELEMS)


def _launch_quant(x2, q2, s2, loc, mask) -> None:
    n = x2.shape[0]
    if n == 0:
        return
    dispatch.require_runnable(_quant_store_kernel, x2.device)
    nblocks = x2.shape[1] // BLOCK_ELEMS
    rows_t, blk = _tile(nblocks, n)
    grid = (triton.cdiv(n, rows_t), triton.cdiv(nblocks, blk))
    sel = mask.view(torch.uint8) if mask is not None else x2
    with dispatch.launch_context(x2.device):
        _quant_store_kernel[grid](
            x2,
            q2,
            s2,
            loc if loc is not None else x2,
            sel,
            n,
            q2.shape[0],
            nblocks,
            x2.stride(0),
            q2.stride(0),
            s2.stride(0),
            HAS_LOC=loc is not None,
            HAS_MASK=mask is not None,
            ROWS=rows_t,
            BLK=blk,
        )


def store_fp4(
    packed_cache: torch.Tensor,
    scale_cache: torch.Tensor,
    loc: torch.Tensor,
    x: torch.Tensor,
    *,
    mask=None,
    backend: str = "auto",
) -> None:
    """Quantize ``x [N, ...]`` row by row and write row ``i`` to row ``loc[i]`` of
    ``packed_cache [rows, ...]`` (``K/2`` bytes a row) and ``scale_cache [rows, ...]``
    (``K/16`` bytes a row), ``K = prod(x.shape[1:])``. ``mask`` (bool ``[N]``) restricts the
    write to rows where it is True."""
    loc = C.check_index("loc", loc)
    n = loc.shape[0]
    rows, k = _check_caches(packed_cache, scale_cache)
    x = _check_float("x", x)
    if x.dim() < 1 or x.shape[0] != n or _row_elems(x) != k:
        raise ShapeMismatch(f"x has shape {tuple(x.shape)}, expected {n} rows of {k} elements")
    if mask is not None:
        mask = C.check_mask("mask", mask, n)
    C.check_device(packed_cache.device, loc=loc, x=x, mask=mask)
    which = dispatch.resolve(backend, packed_cache.device)
    if which == "torch" or packed_cache.device.type != "cuda":
        C.check_bounds("loc", loc if mask is None else loc[mask], rows)
    if n == 0:
        return
    x2 = _flat_rows(x)
    if not C.rows_contiguous(x2, 1):
        x2 = x2.contiguous()
    q2, s2 = C.byte_rows(packed_cache, 1), C.byte_rows(scale_cache, 1)
    if which == "torch":
        if mask is not None:
            keep = mask.nonzero().squeeze(1)
            loc, x2 = loc[keep], x2[keep]
        q, s = quantize_fp4_reference(x2)
        q2[loc.long()] = q
        s2[loc.long()] = s
        return
    _launch_quant(x2, q2, s2, loc, mask)


def dequantize_fp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    loc=None,
    dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp4`: ``(packed [..., K/2], scales [..., K/16]) -> [..., K]``
    as ``dtype``. With ``loc`` (int ``[N]``), ``packed``/``scales`` are caches ``[rows, ...]``
    and the result is ``[N, *packed.shape[1:-1], K]`` for rows ``loc``."""
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, t in (("packed", packed), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() == 0:
            raise InvalidArgument(f"{name} must be a uint8 tensor with >= 1 dim")
    C.check_device(packed.device, scales=scales)
    k = packed.shape[-1] * 2
    _check_k("packed", k)
    which = dispatch.resolve(backend, packed.device)
    if loc is None:
        if tuple(scales.shape) != (*packed.shape[:-1], k // BLOCK_ELEMS):
            raise ShapeMismatch(
                f"scales has shape {tuple(scales.shape)}, expected "
                f"{(*packed.shape[:-1], k // BLOCK_ELEMS)}"
            )
        if which == "torch":
            return dequantize_fp4_reference(packed, scales, dtype)
        q2 = packed.reshape(-1, k // 2).contiguous()
        s2 = scales.reshape(-1, k // BLOCK_ELEMS).contiguous()
        out = torch.empty((q2.shape[0], k), dtype=dtype, device=packed.device)
        _launch_dequant(q2, s2, out, None)
        return out.reshape(*packed.shape[:-1], k)
    loc = C.check_index("loc", loc)
    if packed.dim() < 2:
        raise ShapeMismatch("with loc, packed must be a cache [rows, ..., K/2]")
    rows, kk = _check_caches(packed, scales)
    C.check_device(packed.device, loc=loc)
    out_shape = (loc.shape[0], *packed.shape[1:-1], k)
    if which == "torch" or packed.device.type != "cuda":
        C.check_bounds("loc", loc, rows)
    q2, s2 = C.byte_rows(packed, 1), C.byte_rows(scales, 1)
    if which == "torch":
        idx = loc.long()
        return dequantize_fp4_reference(q2[idx], s2[idx], dtype).reshape(out_shape)
    out = torch.empty((loc.shape[0], kk), dtype=dtype, device=packed.device)
    _launch_dequant(q2, s2, out, loc)
    return out.reshape(out_shape)


def _launch_dequant(q2, s2, out, loc) -> None:
    n = out.shape[0]
    if n == 0:
        return
    dispatch.require_runnable(_dequant_kernel, q2.device)
    nblocks = out.shape[1] // BLOCK_ELEMS
    rows_t, blk = _tile(nblocks, n)
    grid = (triton.cdiv(n, rows_t), triton.cdiv(nblocks, blk))
    with dispatch.launch_context(q2.device):
        _dequant_kernel[grid](
            q2,
            s2,
            out,
            loc if loc is not None else q2,
            n,
            q2.shape[0],
            nblocks,
            q2.stride(0),
            s2.stride(0),
            out.stride(0),
            float(torch.finfo(out.dtype).max),
            HAS_LOC=loc is not None,
            ROWS=rows_t,
            BLK=blk,
        )
