"""Host copies of KV token rows, for retract (copy out) and restore (load back elsewhere).

A pool hands this module its *token buffers*: each a tensor plus how a token id indexes it:

* ``"rows"``  -- ``[rows, ...]``: token ``t`` is row ``t`` (NHD, MLA, K-only);
* ``"paged"`` -- ``[pages, page_size, ...]``: token ``t`` is ``[t // ps, t % ps]`` (page-major);
* ``"hnd"``   -- ``[pages, H, page_size, D]``: token ``t`` is ``[t // ps, :, t % ps]`` (HND).

Whatever the indexing, one token's row always comes out as a dense ``[*row_shape]`` block, so a
copy taken from one layout can be loaded into a pool of another layout with the same geometry.
Copies are made ``chunk_tokens`` tokens at a time: device scratch per step is bounded by
``chunk_tokens * row_bytes``; the host copy itself is allocated once. Loading validates
everything (type, buffer count, row shapes, dtype, token count, index bounds) before the
first byte is written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

logger = logging.getLogger(__name__)

__all__ = [
    "KvCpuCopy",
    "TokenBuffer",
    "copy_to_host",
    "load_from_host",
    "as_index_tensor",
    "check_bounds",
]

_INDEXINGS = ("rows", "paged", "hnd")


class TokenBuffer(NamedTuple):
    """A device buffer and how token ids index it (see module docstring)."""

    tensor: torch.Tensor
    indexing: str


@dataclass
class KvCpuCopy:
    """Token rows of every token buffer of a pool, on the host, in the pool's store dtype.

    ``tensors[i]`` is ``[num_tokens, *row_shapes[i]]``; row ``j`` belongs to the ``j``-th index
    passed to ``get_cpu_copy``. ``load_cpu_copy`` may put the rows back at any other indices.
    """

    tensors: list
    num_tokens: int
    store_dtype: torch.dtype
    row_shapes: tuple

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def __repr__(self) -> str:
        return (
            f"KvCpuCopy(num_tokens={self.num_tokens}, buffers={len(self.tensors)}, "
            f"dtype={self.store_dtype}, nbytes={self.nbytes})"
        )


def row_shape(buf: TokenBuffer) -> tuple:
    t = buf.tensor
    if buf.indexing == "rows":
        return tuple(t.shape[1:])
    if buf.indexing == "paged":
        return tuple(t.shape[2:])
    if buf.indexing == "hnd":
        return (t.shape[1], t.shape[3])
    raise InvalidArgument(f"unknown token indexing {buf.indexing!r}; expected {_INDEXINGS}")


def as_index_tensor(indices, device, name: str = "indices") -> torch.Tensor:
    """``indices`` (tensor, sequence of ints) as a 1-D int64 tensor on ``device``."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype.is_floating_point or indices.dtype == torch.bool or indices.is_complex():
            raise InvalidArgument(f"{name} must hold integers, got dtype {indices.dtype}")
        idx = indices
    else:
        try:
            idx = torch.as_tensor(list(indices), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"{name} must be a sequence of ints: {exc}") from None
    if idx.dim() != 1:
        raise ShapeMismatch(f"{name} must be 1-D, got shape {tuple(idx.shape)}")
    return idx.to(device=device, dtype=torch.int64)


def check_bounds(idx: torch.Tensor, limit: int, name: str) -> None:
    """Raise :class:`IndexOutOfRange` naming the first offending value outside ``[0, limit)``.

    Synchronises with the device; meant for slow paths (host copies, masked page stores).
    """
    if idx.numel() == 0:
        return
    bad = (idx < 0) | (idx >= limit)
    if bool(bad.any()):
        value = int(idx[bad][0])
        raise IndexOutOfRange(f"{name} holds {value}, outside [0, {limit})")


def _split(idx: torch.Tensor, page_size: int):
    return torch.div(idx, page_size, rounding_mode="floor"), torch.remainder(idx, page_size)


def gather_rows(buf: TokenBuffer, idx: torch.Tensor, page_size: int) -> torch.Tensor:
    """Dense ``[len(idx), *row_shape]`` rows of ``buf`` at token ids ``idx`` (a new tensor)."""
    t = buf.tensor
    if buf.indexing == "rows":
        return t.index_select(0, idx)
    page, slot = _split(idx, page_size)
    if buf.indexing == "paged":
        return t[page, slot]
    return t[page, :, slot]  # advanced dims first -> [n, H, D]


def scatter_rows(buf: TokenBuffer, idx: torch.Tensor, page_size: int, rows: torch.Tensor) -> None:
    """Write dense ``rows`` into ``buf`` at token ids ``idx``."""
    t = buf.tensor
    if buf.indexing == "rows":
        t.index_copy_(0, idx, rows)
        return
    page, slot = _split(idx, page_size)
    if buf.indexing == "paged":
        t[page, slot] = rows
    else:
        t[page, :, slot] = rows


def copy_to_host(
    buffers: Sequence[TokenBuffer],
    indices,
    *,
    page_size: int,
    limit: int,
    store_dtype: torch.dtype,
    chunk_tokens: int,
    pin_memory: bool = False,
) -> KvCpuCopy:
    """Copy the rows of ``indices`` out of every buffer into one host tensor per buffer."""
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be > 0, got {chunk_tokens}")
    device = buffers[0].tensor.device if buffers else torch.device("cpu")
    idx = as_index_tensor(indices, device)
    check_bounds(idx, limit, "indices")
    n = idx.numel()
    shapes = tuple(row_shape(b) for b in buffers)
    out = []
    for buf, shape in zip(buffers, shapes):
        host = torch.empty(
            (n, *shape),
            dtype=buf.tensor.dtype,
            device="cpu",
            pin_memory=pin_memory and buf.tensor.is_cuda,
        )
        for lo in range(0, n, chunk_tokens):
            rows = gather_rows(buf, idx[lo : lo + chunk_tokens], page_size)
            host[lo : lo + rows.shape[0]].copy_(rows, non_blocking=host.is_pinned())
        out.append(host)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return KvCpuCopy(tensors=out, num_tokens=n, store_dtype=store_dtype, row_shapes=shapes)


def validate_copy(
    copy, buffers: Sequence[TokenBuffer], idx: torch.Tensor, *, store_dtype: torch.dtype, limit: int
) -> None:
    """Every check of :func:`load_from_host`, without writing anything."""
    if not isinstance(copy, KvCpuCopy):
        raise InvalidArgument(f"expected a KvCpuCopy from get_cpu_copy, got {type(copy).__name__}")
    shapes = tuple(row_shape(b) for b in buffers)
    if len(copy.tensors) != len(buffers):
        raise ShapeMismatch(f"copy holds {len(copy.tensors)} buffers, pool has {len(buffers)}")
    if copy.store_dtype != store_dtype:
        raise ShapeMismatch(f"copy dtype {copy.store_dtype} != pool store dtype {store_dtype}")
    if idx.numel() != copy.num_tokens:
        raise ShapeMismatch(f"copy holds {copy.num_tokens} tokens, got {idx.numel()} indices")
    for i, (t, shape, buf) in enumerate(zip(copy.tensors, shapes, buffers)):
        if tuple(t.shape) != (copy.num_tokens, *shape):
            raise ShapeMismatch(
                f"copy buffer {i} has shape {tuple(t.shape)}, pool rows need "
                f"{(copy.num_tokens, *shape)}"
            )
        if t.dtype != buf.tensor.dtype:
            raise ShapeMismatch(f"copy buffer {i} dtype {t.dtype} != pool {buf.tensor.dtype}")
    check_bounds(idx, limit, "indices")


def load_from_host(
    copy: KvCpuCopy,
    buffers: Sequence[TokenBuffer],
    indices,
    *,
    page_size: int,
    limit: int,
    store_dtype: torch.dtype,
    chunk_tokens: int,
) -> None:
    """Write the rows of ``copy`` into ``buffers`` at ``indices`` (any ids, same count)."""
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be > 0, got {chunk_tokens}")
    device = buffers[0].tensor.device if buffers else torch.device("cpu")
    idx = as_index_tensor(indices, device)
    validate_copy(copy, buffers, idx, store_dtype=store_dtype, limit=limit)
    n = idx.numel()
    for buf, host in zip(buffers, copy.tensors):
        for lo in range(0, n, chunk_tokens):
            rows = host[lo : lo + chunk_tokens].to(device, non_blocking=host.is_pinned())
            scatter_rows(buf, idx[lo : lo + chunk_tokens], page_size, rows)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
