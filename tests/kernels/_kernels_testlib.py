"""Helpers shared by the kernel tests (imported by name; pytest puts this folder on sys.path).

On CPU (default) the Triton kernels run under the interpreter and are compared with the
torch reference; with ``KVXFER_TEST_DEVICE=cuda`` the same tests run the compiled kernels
on the GPU against the reference on the GPU.
"""

from __future__ import annotations

import testenv
import torch

DEVICE = torch.device(testenv.DEVICE)
ON_CUDA = DEVICE.type == "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
DTYPE_IDS = ["bf16", "fp16", "fp32", "u8"]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: comparisons are on bytes)."""
    isz = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * isz), dtype=torch.uint8, generator=g)
    return raw.view(dtype).to(DEVICE)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a contiguous tensor, for exact comparisons."""
    return t.contiguous().view(torch.uint8)


def distinct(n: int, rows: int, g: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    return torch.randperm(rows, generator=g)[:n].to(dtype).to(DEVICE)


def guarded(shape, dtype, g: torch.Generator, guard_rows: int = 4):
    """A ``shape`` tensor that is the middle of a bigger random one: ``(full, view)``.

    Writes through an out-of-range index that escaped the in-kernel mask would land in
    the guard rows, which tests compare against their original bytes.
    """
    full = rand((shape[0] + 2 * guard_rows, *shape[1:]), dtype, g)
    return full, full[guard_rows : guard_rows + shape[0]]


def page_major_views(
    raw_buf: torch.Tensor,
    *,
    layers: int,
    num_pages: int,
    page_size: int,
    heads: int,
    head_dim: int,
    v_head_dim: int,
    dtype: torch.dtype,
):
    """Per-layer K/V 4-D views over one uint8 buffer in the page-major layout.

    A page holds all layers; within it, layer ``l`` is K rows ``[page_size, H, D]`` then V
    rows ``[page_size, H, Dv]``.
    """
    isz = torch.empty(0, dtype=dtype).element_size()
    k_row, v_row = heads * head_dim, heads * v_head_dim  # elements per token row
    layer_elems = page_size * (k_row + v_row)
    page_elems = layers * layer_elems
    assert raw_buf.numel() == num_pages * page_elems * isz
    typed = raw_buf.view(dtype)
    ks, vs = [], []
    for layer in range(layers):
        off = layer * layer_elems
        ks.append(
            typed.as_strided(
                (num_pages, page_size, heads, head_dim), (page_elems, k_row, head_dim, 1), off
            )
        )
        vs.append(
            typed.as_strided(
                (num_pages, page_size, heads, v_head_dim),
                (page_elems, v_row, v_head_dim, 1),
                off + page_size * k_row,
            )
        )
    return ks, vs
