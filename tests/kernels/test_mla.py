"""MLA (nope, rope) store into one row and the inverse gather."""

import pytest
import torch
from _kernels_testlib import DEVICE, DTYPE_IDS, DTYPES, ON_CUDA, distinct, gen, guarded, rand, raw

from kvxfer.kernels import mla
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dn,dr,n", [(5, 3, 1), (16, 8, 7), (32, 4, 33)])
def test_store_and_gather_match_reference(dtype, dn, dr, n):
    g = gen(dn + n)
    rows = 40
    cache = rand((rows, 1, dn + dr), dtype, g)
    ref = cache.clone()
    loc = distinct(n, rows, g)
    nope, rope = rand((n, 1, dn), dtype, g), rand((n, 1, dr), dtype, g)
    mla.store_mla(cache, loc, nope, rope, backend="triton")
    mla.store_mla(ref, loc, nope, rope, backend="torch")
    assert torch.equal(raw(cache), raw(ref))
    assert torch.equal(raw(ref[loc, :, :dn]), raw(nope))
    assert torch.equal(raw(ref[loc, :, dn:]), raw(rope))
    back = distinct(n, rows, g, torch.int32)
    got = mla.gather_mla(cache, back, dn, backend="triton")
    want = mla.gather_mla(ref, back, dn, backend="torch")
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == dtype
        assert torch.equal(raw(a), raw(b))
    got = mla.gather_mla(cache, loc, dn, backend="triton")  # round trip
    assert torch.equal(raw(got[0]), raw(nope)) and torch.equal(raw(got[1]), raw(rope))


def test_store_strided_sources():
    """nope / rope sliced out of one projection output (strided rows)."""
    g = gen(31)
    proj = rand((6, 1, 40), torch.bfloat16, g)
    nope, rope = proj[:, :, :16], proj[:, :, 32:40]
    cache = rand((12, 1, 24), torch.bfloat16, g)
    ref = cache.clone()
    loc = distinct(6, 12, g)
    mla.store_mla(cache, loc, nope, rope, backend="triton")
    mla.store_mla(ref, loc, nope, rope, backend="torch")
    assert torch.equal(raw(cache), raw(ref))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_mla_empty_and_out_of_range(backend):
    g = gen(32)
    full, cache = guarded((10, 1, 12), torch.float16, g)
    before = raw(full).clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    mla.store_mla(cache, empty, cache[:0, :, :8], cache[:0, :, 8:], backend=backend)
    nope, rope = mla.gather_mla(cache, empty, 8, backend=backend)
    assert nope.shape == (0, 1, 8) and rope.shape == (0, 1, 4)
    loc = torch.tensor([2, 10], device=DEVICE)
    n_src, r_src = rand((2, 1, 8), torch.float16, g), rand((2, 1, 4), torch.float16, g)
    if ON_CUDA and backend == "triton":
        mla.store_mla(cache, loc, n_src, r_src, backend=backend)
        nope, rope = mla.gather_mla(cache, loc, 8, backend=backend)
        torch.cuda.synchronize()
        expect = before.view(18, -1).clone()
        expect[4 + 2] = torch.cat([raw(n_src[0]).flatten(), raw(r_src[0]).flatten()])
        assert torch.equal(raw(full).view(18, -1), expect)
        assert torch.equal(raw(nope[0]), raw(n_src[0])) and not raw(nope[1]).any()
        return
    with pytest.raises(IndexOutOfRange, match="10"):
        mla.store_mla(cache, loc, n_src, r_src, backend=backend)
    with pytest.raises(IndexOutOfRange, match="-5"):
        mla.gather_mla(cache, torch.tensor([-5], device=DEVICE), 8, backend=backend)
    assert torch.equal(raw(full), before)


def test_mla_out_of_range_masked_in_kernel():
    g = gen(33)
    full, cache = guarded((10, 1, 6), torch.float32, g)
    loc = torch.tensor([-1, 4, 10], device=DEVICE)
    n_src, r_src = rand((3, 1, 4), torch.float32, g), rand((3, 1, 2), torch.float32, g)
    expect = raw(full).clone().view(18, -1)
    expect[4 + 4] = torch.cat([raw(n_src[1]).flatten(), raw(r_src[1]).flatten()])
    mla._launch_store(cache, loc, n_src, r_src)
    assert torch.equal(raw(full).view(18, -1), expect)
    nope, rope = mla._launch_gather(cache, loc, 4)
    assert torch.equal(raw(nope[1]), raw(n_src[1])) and torch.equal(raw(rope[1]), raw(r_src[1]))
    assert not raw(nope[0]).any() and not raw(rope[2]).any()  # out of range reads as zeros


def test_mla_invalid_arguments():
    g = gen(34)
    cache = rand((8, 1, 12), torch.float16, g)
    loc = torch.tensor([0, 1], device=DEVICE)
    nope, rope = rand((2, 1, 8), torch.float16, g), rand((2, 1, 4), torch.float16, g)
    with pytest.raises(ShapeMismatch, match="rope"):
        mla.store_mla(cache, loc, nope, rope[:, :, :3])
    with pytest.raises(ShapeMismatch, match="dtype"):
        mla.store_mla(cache, loc, nope.float(), rope)
    with pytest.raises(ShapeMismatch, match=r"\[rows, 1, D\]"):
        mla.store_mla(cache.view(8, 2, 6), loc, nope, rope)
    with pytest.raises(ShapeMismatch, match="exceeds"):
        mla.store_mla(cache, loc, rand((2, 1, 13), torch.float16, g), rope)
    with pytest.raises(InvalidArgument, match="nope_dim"):
        mla.gather_mla(cache, loc, 13)
