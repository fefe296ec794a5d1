"""MLA latent pool, K-only pool and no-op pool behaviour."""

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels.errors import (
    IndexOutOfRange,
    InvalidArgument,
    ShapeMismatch,
    UnsupportedOperation,
)
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool

pytestmark = pytest.mark.timeout(60)

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32] + ([FP8] if FP8 is not None else [])
SIZE, PS, R, DR, L, H, D = 12, 4, 6, 2, 2, 2, 4


def raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def rnd(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mla_store_gather_and_views(dtype):
    pool = MLATokenToKVPool(SIZE, PS, dtype, R, DR, L, DEVICE, start_layer=3)
    loc = torch.tensor([1, 7, 15, 4], device=DEVICE)
    nope, rope = rnd((4, 1, R), dtype, 1), rnd((4, 1, DR), dtype, 2)
    before = pool.kv_buffer[1].clone()
    pool.set_mla_kv_buffer(4, loc, nope, rope)
    expected = before.clone()
    expected[loc] = raw(torch.cat([nope, rope], dim=-1))
    assert torch.equal(pool.kv_buffer[1], expected)
    assert not pool.kv_buffer[0].any()  # layer 3 untouched
    got_nope, got_rope = pool.get_mla_kv_buffer(4, loc)
    assert got_nope.dtype == dtype and torch.equal(raw(got_nope), raw(nope))
    assert torch.equal(raw(got_rope), raw(rope))
    key, value = pool.get_kv_buffer(4)
    assert key.shape == (SIZE + PS, 1, R + DR) and value.shape == (SIZE + PS, 1, R)
    assert torch.equal(raw(value[loc]), raw(nope)) and key.dtype == dtype
    if dtype != FP8:
        n32, _ = pool.get_mla_kv_buffer(4, loc, dst_dtype=torch.float32)
        assert n32.dtype == torch.float32 and torch.equal(n32, nope.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16] + ([FP8] if FP8 is not None else []), ids=str)
def test_mla_whole_row_write_and_move(dtype):
    pool = MLATokenToKVPool(SIZE, PS, dtype, R, DR, L, DEVICE)
    loc = torch.tensor([4, 5, 6], device=DEVICE)
    for layer in range(L):
        pool.set_kv_buffer(layer, loc, rnd((3, 1, R + DR), dtype, layer), None)
    expected = [b.clone() for b in pool.kv_buffer]
    tgt = torch.tensor([8, 9, 1], device=DEVICE)
    for b in expected:
        b[tgt] = b[loc].clone()
    pool.move_kv_cache(tgt, loc)
    for got, want in zip(pool.kv_buffer, expected):
        assert torch.equal(got, want)


def test_mla_errors():
    pool = MLATokenToKVPool(SIZE, PS, torch.float16, R, DR, L, DEVICE)
    loc = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ShapeMismatch):
        pool.set_mla_kv_buffer(
            0, loc, rnd((2, 1, R + 1), torch.float16, 1), rnd((2, 1, DR), torch.float16, 2)
        )
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer(0, loc, rnd((2, 1, R), torch.float16, 1))
    with pytest.raises(IndexOutOfRange):
        pool.get_mla_kv_buffer(L, loc)
    with pytest.raises(InvalidArgument):
        MLATokenToKVPool(SIZE, PS, torch.float16, 0, DR, L, DEVICE)
    if DEVICE == "cpu":
        before = [b.clone() for b in pool.kv_buffer]
        with pytest.raises(IndexOutOfRange):
            pool.set_mla_kv_buffer(
                0,
                torch.tensor([1, SIZE + PS], device=DEVICE),
                rnd((2, 1, R), torch.float16, 1),
                rnd((2, 1, DR), torch.float16, 2),
            )
        assert all(torch.equal(a, b) for a, b in zip(pool.kv_buffer, before))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_k_only_pool(dtype):
    pool = MHATokenToKOnlyPool(SIZE, PS, dtype, H, D, L, DEVICE)
    loc = torch.tensor([2, 3, 9], device=DEVICE)
    k = rnd((3, H, D), dtype, 5)
    pool.set_kv_buffer(1, loc, k, None)
    assert torch.equal(raw(pool.get_key_buffer(1)[loc]), raw(k))
    assert not pool.k_buffer[0].any()
    pool.set_k_buffer(0, loc, k, mask=torch.tensor([True, False, True], device=DEVICE))
    assert torch.equal(raw(pool.get_key_buffer(0)[loc[[0, 2]]]), raw(k[[0, 2]]))
    assert not pool.k_buffer[0][loc[1]].any()
    pool.move_kv_cache(torch.tensor([12, 13], device=DEVICE), loc[:2])
    assert torch.equal(pool.k_buffer[1][12:14], pool.k_buffer[1][loc[:2]])
    with pytest.raises(UnsupportedOperation):
        pool.get_value_buffer(0)
    with pytest.raises(UnsupportedOperation):
        pool.get_kv_buffer(0)
    with pytest.raises(UnsupportedOperation):
        pool.set_kv_buffer(0, loc, k, k)


def test_noop_pool_keeps_capacity_but_stores_nothing():
    pool = NoOpMHATokenToKVPool(SIZE, PS, torch.bfloat16, H, D, L, DEVICE, v_head_dim=3)
    assert pool.size == SIZE and pool.num_slots == SIZE + PS
    k, v = pool.get_kv_buffer(1)
    assert k.shape == (PS, H, D) and v.shape == (PS, H, 3) and k.dtype == torch.bfloat16
    loc = torch.tensor([1], device=DEVICE)
    with pytest.raises(UnsupportedOperation, match="set_kv_buffer"):
        pool.set_kv_buffer(
            0, loc, rnd((1, H, D), torch.bfloat16, 1), rnd((1, H, 3), torch.bfloat16, 2)
        )
    with pytest.raises(UnsupportedOperation):
        pool.set_kv_buffer_prefix_valid(0, loc[None], torch.tensor([1]), None, None)
    pool.move_kv_cache(loc, loc)  # no-op
    with pytest.raises(ShapeMismatch):
        pool.move_kv_cache(loc, torch.tensor([1, 2]))
    assert pool.get_kv_size_bytes() == 0
    assert pool.describe()["kind"] == "noop" and pool.describe()["item_lens"] == []
    with pytest.raises(InvalidArgument):
        NoOpMHATokenToKVPool(SIZE, PS, torch.bfloat16, H, D, L, DEVICE, layout="hnd")
