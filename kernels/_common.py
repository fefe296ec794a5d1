"""Shared checks and byte-level helpers for the kernel launchers.

The kernels move raw bytes: every cache row and source row is handed to Triton as a
``uint8`` view and the kernel reinterprets it in "units" of 1, 2 or 4 bytes (the widest
width that divides every base address, stride and row size involved). The data type of
the cache therefore never matters (bf16, fp16, fp32, fp8 stored as uint8 ...).

Invariants the helpers establish for the kernels:

* a *row* (one token's ``[H, D]`` block) is contiguous in memory; rows may be strided;
* addresses, strides and row sizes handed to a kernel are multiples of its ``UNIT``;
* indices are ``int32``/``int64`` one-dimensional tensors on the tensors' device.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

INDEX_DTYPES = (torch.int32, torch.int64)
# Bytes one program moves per tensor (K or V): big enough to keep several 16-byte
# vector loads in flight per thread, small enough to give the GPU many programs.
TILE_BYTES = 8192
# Widest reinterpretation unit; 16-byte vectors come from contiguity, not unit width.
MAX_UNIT = 4


def cdiv(a: int, b: int) -> int:
    """Ceil division on host ints (``triton.cdiv`` goes through the JIT call machinery)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def rows_contiguous(t: torch.Tensor, lead: int) -> bool:
    """True when the dims ``t.shape[lead:]`` of every row form one contiguous block (always
    True for a tensor without elements: there are no bytes to address)."""
    if t.is_contiguous():  # the common case, answered in C (launchers call this per call)
        return True
    expected = 1
    for size, stride in zip(reversed(t.shape[lead:]), reversed(t.stride()[lead:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def row_bytes(t: torch.Tensor, lead: int) -> int:
    return math.prod(t.shape[lead:]) * t.element_size()


def byte_rows(t: torch.Tensor, lead: int) -> torch.Tensor:
    """A ``uint8`` view ``[*t.shape[:lead], row_bytes]`` aliasing ``t``.

    The rows (dims from ``lead`` on) must be contiguous.
    """
    assert rows_contiguous(t, lead), "byte_rows needs contiguous rows"
    isz = t.element_size()
    size = (*t.shape[:lead], row_bytes(t, lead))
    stride = (*(s * isz for s in t.stride()[:lead]), 1)
    out = torch.empty(0, dtype=torch.uint8, device=t.device)
    out.set_(t.untyped_storage(), t.storage_offset() * isz, size, stride)
    return out


# dtypes every Triton version maps to a pointer type; others (fp8 variants, bool) are
# handed over as same-size uint8 views - the kernels reinterpret the bytes anyway.
_KERNEL_DTYPES = frozenset(
    {
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    }
)


def kernel_arg(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a same-shape uint8 view for 1-byte dtypes Triton may not know."""
    if t.dtype in _KERNEL_DTYPES:
        return t
    assert t.element_size() == 1, f"unexpected dtype {t.dtype}"
    return t.view(torch.uint8)


def byte_strides(t: torch.Tensor, lead: int) -> list[int]:
    """Strides in bytes of the ``lead`` row-index dims of ``t``."""
    return [s * t.element_size() for s in t.stride()[:lead]]


def pick_unit(values: Iterable[int]) -> int:
    """Largest power-of-two unit (<= MAX_UNIT bytes) dividing every value.

    That is the lowest set bit of ``MAX_UNIT | v0 | v1 | ...`` (MAX_UNIT is a power of two;
    values are non-negative): one pass of integer ORs, no per-value division loop.
    """
    acc = functools.reduce(operator.or_, values, MAX_UNIT)
    return acc & -acc


def pick_tile(row_units: int, unit: int, n: int) -> tuple[int, int, int]:
    """See :func:`_pick_tile`; memoised (launchers call it on every launch). ``n`` only
    matters up to ``TILE_BYTES`` (a power of two >= any ``TOK``), so it is clamped there to
    keep the memo small."""
    return _pick_tile(row_units, unit, min(n, TILE_BYTES))


@functools.lru_cache(maxsize=1024)
def _pick_tile(row_units: int, unit: int, n: int) -> tuple[int, int, int]:
    """``(TOK, BLOCK, num_warps)``: a program copies ``TOK`` rows x ``BLOCK`` units.

    ``BLOCK`` is a power of two covering the row in as few column tiles as possible, halved
    (down to 32 units) while more than 1/8 of its lanes would idle on a row that is not a
    power of two (e.g. MLA's 512 + 64); ``TOK`` fills the tile up to ``TILE_BYTES``.
    """
    tile_units = TILE_BYTES // unit
    row_units = max(row_units, 1)
    block = min(next_pow2(row_units), tile_units)

    def idle(b: int) -> float:
        return 1.0 - row_units / (-(-row_units // b) * b)

    while block > 32 and idle(block) > 0.125:
        block //= 2
    tok = min(max(1, tile_units // block), next_pow2(max(n, 1)))
    num_warps = max(1, min(8, tok * block * unit // 2048))
    return tok, block, num_warps


def check_index(name: str, loc: torch.Tensor, ndim: int = 1) -> torch.Tensor:
    """Validate an index tensor; returns it contiguous."""
    if not isinstance(loc, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(loc).__name__}")
    if loc.dtype not in INDEX_DTYPES:
        raise InvalidArgument(f"{name} must be int32 or int64, got {loc.dtype}")
    if loc.dim() != ndim:
        raise ShapeMismatch(f"{name} must be {ndim}-D, got shape {tuple(loc.shape)}")
    return loc.contiguous()


def check_mask(name: str, mask: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InvalidArgument(f"{name} must be a bool tensor, got {got}")
    if tuple(mask.shape) != (n,):
        raise ShapeMismatch(f"{name} must have shape ({n},), got {tuple(mask.shape)}")
    return mask.contiguous()


def check_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise InvalidArgument(f"{name} is on {t.device}, expected {device}")


def check_cache(name: str, cache: torch.Tensor, lead: int) -> None:
    if not isinstance(cache, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() < lead + 1:
        raise ShapeMismatch(
            f"{name} needs at least {lead + 1} dims, got shape {tuple(cache.shape)}"
        )
    if not rows_contiguous(cache, lead):
        raise InvalidArgument(
            f"{name} rows must be contiguous (shape {tuple(cache.shape)}, strides {cache.stride()})"
        )


def same_bytes_dtype(a: torch.dtype, b: torch.dtype) -> bool:
    """Equal dtypes, or two 1-byte dtypes (fp8 data against its uint8 store dtype)."""
    if a == b:
        return True
    return (
        torch.empty(0, dtype=a).element_size() == 1 and torch.empty(0, dtype=b).element_size() == 1
    )


def check_source(
    name: str, x: torch.Tensor, n: int, trail: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Validate a source tensor ``[n, *trail]``; returns it with contiguous rows."""
    if not isinstance(x, torch.Tensor):
        raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != (n, *trail):
        raise ShapeMismatch(f"{name} must have shape {(n, *trail)}, got {tuple(x.shape)}")
    if not same_bytes_dtype(x.dtype, dtype):
        raise ShapeMismatch(f"{name} has dtype {x.dtype} but the cache stores {dtype}")
    if not rows_contiguous(x, 1):
        x = x.contiguous()
    return x


def check_bounds(name: str, loc: torch.Tensor, rows: int) -> None:
    """Host-side check that every index lies in ``[0, rows)`` (syncs on CUDA)."""
    if loc.numel() == 0:
        return
    lo = int(loc.min())
    hi = int(loc.max())
    if lo < 0:
        raise IndexOutOfRange(f"{name} contains {lo}, outside [0, {rows})")
    if hi >= rows:
        raise IndexOutOfRange(f"{name} contains {hi}, outside [0, {rows})")


@triton.jit
def unit_ptr(p, UNIT: tl.constexpr):
    """Reinterpret a byte pointer as a pointer to UNIT-byte integers."""
    if UNIT == 4:
        q = p.to(tl.pointer_type(tl.int32))
    elif UNIT == 2:
        q = p.to(tl.pointer_type(tl.int16))
    else:
        q = p.to(tl.pointer_type(tl.int8))
    return q
