"""The tile-cutting copy kernel (:func:`kvxfer.kernels.piece_copy.copy_pieces`: one table row
per piece, program ``(piece, tile)``) against the torch slicing of the same pieces, under the
Triton interpreter on CPU (compiled on the GPU with ``KVXFER_TEST_DEVICE=cuda``); and its grid
and alignment arithmetic, exhaustively on small inputs."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from _kernels_testlib import DEVICE

from kvxfer.kernels.errors import InvalidArgument
from kvxfer.kernels.piece_copy import (
    MAX_TILES_PER_PIECE,
    copy_pieces,
    pieces_alignment,
    pieces_grid,
)

pytestmark = pytest.mark.timeout(120)


def _case(lens, align, tile, seed=0):
    """Pieces of ``lens`` bytes at ``align``-aligned offsets of distinct destination slots;
    returns (src, dst after the kernel, dst after torch slicing)."""
    rng = np.random.default_rng(seed)
    slot = max(lens) + 64
    src = torch.randint(0, 256, (slot * len(lens) * 2,), dtype=torch.uint8).to(DEVICE)
    dst = torch.randint(0, 256, (slot * (len(lens) + 2),), dtype=torch.uint8).to(DEVICE)
    want = dst.cpu().clone()
    s_cpu = src.cpu()
    soff = rng.integers(0, (src.numel() - slot) // align, size=len(lens)) * align
    doff = rng.permutation(len(lens) + 2)[: len(lens)] * slot + align
    rows = np.stack(
        [src.data_ptr() + soff, dst.data_ptr() + doff, np.asarray(lens, dtype=np.int64)], axis=1
    ).astype(np.int64)
    for n, a, b in zip(rows[:, 2].tolist(), soff.tolist(), doff.tolist()):
        want[b : b + n] = s_cpu[a : a + n]
    a = pieces_alignment(rows[:, 0], rows[:, 1], rows[:, 2])
    assert a >= align
    copy_pieces(torch.from_numpy(rows).to(DEVICE), tile, a, host_pieces=rows)
    return dst.cpu(), want


@pytest.mark.parametrize(
    "lens,align,tile",
    [
        ((4096, 4096, 4096), 16, 1024),  # equal pieces, 4 tiles each
        ((5008, 48, 4096 + 16, 16), 16, 2048),  # uneven: tails and short pieces
        ((6, 18, 30), 2, 16),  # 2-byte alignment, many tiles
        ((7, 1, 33), 1, 16),  # byte alignment
        ((8192,), 8, 1 << 20),  # one tile larger than the piece
    ],
)
def test_copy_pieces_matches_torch(lens, align, tile):
    got, want = _case(lens, align, tile, seed=len(lens))
    assert torch.equal(got, want)


def test_copy_pieces_refuses_bad_input_and_writes_nothing():
    src = torch.zeros(64, dtype=torch.uint8).to(DEVICE)
    dst = torch.ones(64, dtype=torch.uint8).to(DEVICE)
    rows = np.array([[src.data_ptr(), dst.data_ptr(), 32]], dtype=np.int64)
    t = torch.from_numpy(rows).to(DEVICE)
    for tile in (0, 24, -16):
        with pytest.raises(InvalidArgument):
            copy_pieces(t, tile, 16, host_pieces=rows)
    bad = rows.copy()
    bad[0, 0] += 1
    with pytest.raises(InvalidArgument):
        copy_pieces(torch.from_numpy(bad).to(DEVICE), 16, 16, host_pieces=bad)
    assert bool((dst.cpu() == 1).all())


def test_pieces_grid_arithmetic():
    """Exhaustive over small pieces: the grid covers every byte (pieces x tiles of the
    longest piece), and is refused exactly when it is mostly empty or too tall."""
    for lens in itertools.product((1, 16, 17, 64, 100), repeat=3):
        n = np.asarray(lens, dtype=np.uint64)
        for tile in (16, 32, 64):
            g = pieces_grid(n, tile)
            t = -(-max(lens) // tile)
            work = sum(-(-x // tile) for x in lens)
            if 3 * t > 4 * work + 3:
                assert g is None
            else:
                assert g == (3, t) and t * tile >= max(lens)
    assert pieces_grid(np.zeros(0, dtype=np.uint64), 16) is None
    assert pieces_grid(np.array([16 * (MAX_TILES_PER_PIECE + 1)], dtype=np.uint64), 16) is None
    assert pieces_grid(np.array([16 * MAX_TILES_PER_PIECE], dtype=np.uint64), 16) == (
        1,
        MAX_TILES_PER_PIECE,
    )
    # one huge piece among many small ones: refused (the host cuts the tiles)
    assert pieces_grid(np.array([1 << 20] + [16] * 100, dtype=np.uint64), 16) is None


def test_pieces_alignment():
    for a in (1, 2, 4, 8, 16):
        for b in (1, 2, 4, 8, 16, 32, 64):
            cols = (np.array([64, 128], dtype=np.uint64), np.array([a * 3, 16], dtype=np.int64))
            assert pieces_alignment(*cols, np.array([b], dtype=np.uint64)) == min(a, b, 16)
    assert pieces_alignment() == 16


def test_pieces_kernel_compiles_to_16_byte_vectors_for_sm90():
    """Offline compile (skipped where this Triton cannot: the interpreter, no NVIDIA
    backend) for an H100/H200: 16-byte aligned pieces move as 128-bit vector loads and
    stores, as the task kernel's do (tests/offload/test_offload_fused.py)."""
    import triton
    from triton.runtime.jit import JITFunction

    from kvxfer.kernels import piece_copy

    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"this Triton cannot compile offline: {exc}")
    kern = piece_copy._copy_pieces_kernel
    fn = kern if isinstance(kern, JITFunction) else JITFunction(kern.fn)
    try:
        src = ASTSource(
            fn=fn,
            signature={"pieces": "*i64", "tile": "i32", "ALIGN": "constexpr", "BLOCK": "constexpr"},
            constexprs={"ALIGN": 16, "BLOCK": piece_copy.BLOCK_BYTES},
        )
        k = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": piece_copy.NUM_WARPS}
        )
    except Exception as exc:  # noqa: BLE001 - no NVIDIA backend / ptxas in this install
        pytest.skip(f"offline CUDA compile unavailable: {type(exc).__name__}: {exc}")
    ptx = k.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "st.global.b8" not in ptx and "st.global.u8" not in ptx
