"""Block-FP4 quantize / dequantize / store: Triton (interpreter on CPU) vs the torch reference,
the format (packing, scale, rounding) and the stated error bound."""

import pytest
import torch
from _kernels_testlib import DEVICE, ON_CUDA, distinct, gen

from kvxfer.kernels import fp4
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(90)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def randn(shape, dtype, seed, scale=3.0):
    g = gen(seed)
    x = torch.randn(shape, generator=g) * scale
    # per-row magnitudes spread over many octaves, so blocks get very different scales
    x = x * torch.exp2(torch.randint(-12, 12, (*shape[:-1], 1), generator=g).float())
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", fp4.FLOAT_DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (3, 2, 64)])
def test_triton_matches_reference_bytes(dtype, shape):
    x = randn(shape, dtype, seed=shape[0])
    q_t, s_t = fp4.quantize_fp4(x, backend="triton")
    q_r, s_r = fp4.quantize_fp4(x, backend="torch")
    assert q_t.shape == (*shape[:-1], shape[-1] // 2) and s_t.shape == (
        *shape[:-1],
        shape[-1] // 16,
    )
    assert torch.equal(q_t, q_r) and torch.equal(s_t, s_r)
    d_t = fp4.dequantize_fp4(q_t, s_t, dtype=dtype, backend="triton")
    d_r = fp4.dequantize_fp4(q_t, s_t, dtype=dtype, backend="torch")
    assert d_t.dtype == dtype and torch.equal(d_t, d_r)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_error_bound(dtype):
    """|deq(q(x)) - x| <= max(s/4, |x|/4) per element, amax/6 <= s < amax/3 per block."""
    x = randn((64, 128), dtype, seed=5)
    q, s = fp4.quantize_fp4(x, backend="triton")
    xf = x.float()
    err = (fp4.dequantize_fp4(q, s, dtype=torch.float32, backend="triton") - xf).abs()
    assert bool((err <= fp4.fp4_error_bound(x)).all())
    scale = ((s.to(torch.int32) - 127).float()).exp2()
    amax = xf.reshape(64, 8, 16).abs().amax(-1)
    assert bool((scale * 6 >= amax).all()) and bool((scale * 3 < amax).all())
    # the bound is not vacuous: worst block error <= amax / 4, typical error far below
    assert bool((err.reshape(64, 8, 16).amax(-1) <= amax / 4).all())
    rel_rms = (err.pow(2).mean() / xf.pow(2).mean()).sqrt()
    assert 0.02 < float(rel_rms) < 0.15


def test_grid_values_round_trip_exactly_and_packing_layout():
    vals = torch.tensor(GRID + [-v for v in GRID[1:]] + [0.0])  # 16 values, amax 6 -> s = 1
    x = (vals * 2.0**-3).to(DEVICE)[None]  # s = 2**-3
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        assert int(s[0, 0]) == 127 - 3
        # element 2i is the low nibble, 2i+1 the high nibble; codes 0..7, sign = bit 3
        assert int(q[0, 0]) == 0x10 and int(q[0, 1]) == 0x32 and int(q[0, 4]) == 0xA9
        assert torch.equal(fp4.dequantize_fp4(q, s, dtype=torch.float32, backend=backend), x)


def test_ties_round_to_even_code_and_zero_is_unsigned():
    # block amax 6 -> s = 1; values are exact midpoints of the grid
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.1, 0, 0, 0, 0, 0, 0]
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, 0.0, 0, 0, 0, 0, 0, 0]
    x = torch.tensor([ties], device=DEVICE)
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        out = fp4.dequantize_fp4(q, s, dtype=torch.float32, backend=backend)
        assert out[0].tolist() == expect
        assert int(q[0, 4]) == 0  # -0.25 and -0.1 -> code 0 without the sign bit


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # 4 * 2**126 -> inf, clamped
def test_zero_and_extreme_blocks():
    x = torch.zeros(2, 32, device=DEVICE)
    x[1, 16:] = 3.0e38  # near fp32 max: scale 2**126
    x[1, :16] = 1e-40  # subnormal: scale clamps to 2**-126, values flush to 0
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        assert s[0].tolist() == [1, 1] and s[1].tolist() == [1, 253]
        out = fp4.dequantize_fp4(q, s, dtype=torch.float32, backend=backend)
        assert bool((out[0] == 0).all()) and bool((out[1, :16] == 0).all())
        assert bool(((out[1, 16:] - x[1, 16:]).abs() <= x[1, 16:] / 4).all())


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # 4 * 2**126 -> inf, clamped
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_largest_scale_codes_4_and_6_saturate_to_dtype_max(dtype):
    """At s = 2**126 (scale byte 253) codes 4 and 6 would be 2**128 and 1.5 * 2**128, past
    fp32 and bf16: they come out as +-finfo(dtype).max; every other code is exact."""
    codes = list(range(16))  # magnitudes 0..7, then the same negated
    packed = torch.tensor(
        [[codes[i] | codes[i + 1] << 4 for i in range(0, 16, 2)]], dtype=torch.uint8, device=DEVICE
    )
    scales = torch.tensor([[253]], dtype=torch.uint8, device=DEVICE)
    big = torch.finfo(dtype).max
    mags = [min(v * 2.0**126, big) for v in GRID]
    want = mags + [-m for m in mags]
    for backend in ("triton", "torch"):
        out = fp4.dequantize_fp4(packed, scales, dtype=dtype, backend=backend)
        assert out.dtype == dtype and out[0].tolist() == want
    # the quantizer reaches code 4 at that scale: the largest finite input comes back as itself
    x = torch.full((1, 16), big, dtype=dtype, device=DEVICE)
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        assert int(s[0, 0]) == 253 and int(q[0, 0]) == 0x66
        assert torch.equal(fp4.dequantize_fp4(q, s, dtype=dtype, backend=backend), x)


def test_fp16_output_is_clamped_not_inf():
    x = torch.full((1, 16), 65504.0, dtype=torch.float16, device=DEVICE)  # -> code 4 * 2**14
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        out = fp4.dequantize_fp4(q, s, dtype=torch.float16, backend=backend)
        assert bool(torch.isfinite(out).all()) and float(out[0, 0]) == 65504.0


@pytest.mark.parametrize("with_mask", [False, True])
def test_store_fp4_scatter_matches_reference(with_mask):
    g = gen(11)
    rows, n, H, D = 24, 9, 2, 32
    x = randn((n, H, D), torch.bfloat16, seed=3)
    loc = distinct(n, rows, g, torch.int32)
    mask = (torch.arange(n) % 3 != 0).to(DEVICE) if with_mask else None
    caches = []
    for backend in ("triton", "torch"):
        q = torch.randint(0, 256, (rows, H, D // 2), dtype=torch.uint8, generator=gen(1)).to(DEVICE)
        s = torch.randint(0, 256, (rows, H * D // 16), dtype=torch.uint8, generator=gen(2)).to(
            DEVICE
        )
        fp4.store_fp4(q, s, loc, x, mask=mask, backend=backend)
        caches.append((q, s))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    q, s = caches[0]
    ref_q, ref_s = fp4.quantize_fp4(x.reshape(n, H * D), backend="torch")
    keep = mask.cpu() if with_mask else torch.ones(n, dtype=torch.bool)
    lk = loc.long()
    assert torch.equal(q.reshape(rows, -1)[lk[keep.to(DEVICE)]], ref_q[keep.to(DEVICE)])
    assert torch.equal(s[lk[keep.to(DEVICE)]], ref_s[keep.to(DEVICE)])
    if with_mask:  # masked-off rows untouched
        untouched = torch.randint(
            0, 256, (rows, H, D // 2), dtype=torch.uint8, generator=gen(1)
        ).to(DEVICE)
        dropped = lk[~keep.to(DEVICE)]
        assert torch.equal(q[dropped], untouched[dropped])


def test_dequantize_with_loc_gathers_rows():
    rows, K = 20, 48
    x = randn((rows, 1, K), torch.float32, seed=8)
    q, s = fp4.quantize_fp4(x, backend="torch")
    loc = torch.tensor([3, 0, 19, 3], device=DEVICE)
    full = fp4.dequantize_fp4(q, s, dtype=torch.bfloat16, backend="torch")
    for backend in ("triton", "torch"):
        out = fp4.dequantize_fp4(q, s, loc=loc, dtype=torch.bfloat16, backend=backend)
        assert out.shape == (4, 1, K) and torch.equal(out, full[loc])


def test_out_of_range_raises_before_writing():
    q = torch.zeros(8, 8, dtype=torch.uint8, device=DEVICE)
    s = torch.zeros(8, 1, dtype=torch.uint8, device=DEVICE)
    x = torch.ones(3, 16, device=DEVICE)
    bad = torch.tensor([1, 8, 2], device=DEVICE)
    backends = ["torch"] if ON_CUDA else ["torch", "triton"]
    for backend in backends:
        with pytest.raises(IndexOutOfRange, match="8"):
            fp4.store_fp4(q, s, bad, x, backend=backend)
        with pytest.raises(IndexOutOfRange, match="-1"):
            fp4.dequantize_fp4(q, s, loc=torch.tensor([-1], device=DEVICE), backend=backend)
    assert not bool(q.any()) and not bool(s.any())
    # a masked-off bad index is not checked and not written
    fp4.store_fp4(q, s, bad, x, mask=torch.tensor([True, False, True], device=DEVICE))
    assert bool(q[1].any()) and bool(q[2].any())


@pytest.mark.skipif(not ON_CUDA, reason="in-kernel masking of bad rows is the CUDA path")
def test_cuda_kernel_masks_out_of_range_rows():
    full = torch.zeros(12, 8, dtype=torch.uint8, device=DEVICE)
    q, s = full[2:10], torch.zeros(8, 1, dtype=torch.uint8, device=DEVICE)
    fp4.store_fp4(
        q,
        s,
        torch.tensor([-1, 8, 3], device=DEVICE),
        torch.ones(3, 16, device=DEVICE),
        backend="triton",
    )
    assert bool(full[5].any()) and not bool(full[:5].any()) and not bool(full[6:].any())


def test_argument_errors():
    with pytest.raises(ShapeMismatch, match="24"):
        fp4.quantize_fp4(torch.zeros(2, 24, device=DEVICE))
    with pytest.raises(InvalidArgument, match="int32"):
        fp4.quantize_fp4(torch.zeros(2, 16, dtype=torch.int32, device=DEVICE))
    q = torch.zeros(4, 8, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ShapeMismatch, match="scale"):
        fp4.store_fp4(
            q,
            torch.zeros(4, 2, dtype=torch.uint8, device=DEVICE),
            torch.tensor([0], device=DEVICE),
            torch.zeros(1, 16, device=DEVICE),
        )
    with pytest.raises(ShapeMismatch, match="x has shape"):
        fp4.store_fp4(
            q,
            torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE),
            torch.tensor([0], device=DEVICE),
            torch.zeros(1, 32, device=DEVICE),
        )
    with pytest.raises(InvalidArgument, match="dtype"):
        fp4.dequantize_fp4(q, torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE), dtype=torch.int8)


def test_empty_inputs():
    x = torch.zeros(0, 32, device=DEVICE)
    for backend in ("triton", "torch"):
        q, s = fp4.quantize_fp4(x, backend=backend)
        assert q.shape == (0, 16) and s.shape == (0, 2)
        assert fp4.dequantize_fp4(q, s, backend=backend).shape == (0, 32)
