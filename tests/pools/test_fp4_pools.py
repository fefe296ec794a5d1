"""MHATokenToKVPoolFP4 / MLATokenToKVPoolFP4: quantization error bound on read-back, the
Triton and torch paths writing identical bytes, registration, host copy -> restore into other
slots, moves, KVWriteLoc, and argument errors (nothing written)."""

import pytest
import torch
from _sparse_pool_checks import (
    DEVICE,
    ON_CUDA,
    assert_same_views,
    check_registration,
    loc,
    views_snapshot,
)

from kvxfer.kernels.dispatch import force_backend
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.kernels.fp4 import fp4_error_bound
from kvxfer.pools.quantized import KV_QUANT, MHATokenToKVPoolFP4, MLATokenToKVPoolFP4
from kvxfer.pools.write_loc import KVWriteLoc

pytestmark = pytest.mark.timeout(90)

SIZE, PS, H, D, DV, L = 16, 4, 2, 32, 16, 2
R, DR = 32, 16


def rnd(shape, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)


def mha(**kw):
    return MHATokenToKVPoolFP4(SIZE, PS, torch.bfloat16, H, D, L, DEVICE, v_head_dim=DV, **kw)


def mla(**kw):
    return MLATokenToKVPoolFP4(SIZE, PS, torch.bfloat16, R, DR, L, DEVICE, **kw)


def test_mha_fp4_read_back_within_the_stated_bound():
    pool = mha()
    where = loc([4, 5, 9, 19])
    k, v = rnd((4, H, D), 1), rnd((4, H, DV), 2)
    pool.set_kv_buffer(1, where, k, v)
    kr, vr = pool.get_kv_rows(1, where)
    assert kr.dtype == torch.bfloat16 and kr.shape == (4, H, D) and vr.shape == (4, H, DV)
    assert bool(((kr.float() - k.float()).abs() <= fp4_error_bound(k)).all())
    assert bool(((vr.float() - v.float()).abs() <= fp4_error_bound(v)).all())
    assert float((kr.float() - k.float()).abs().max()) > 0  # really quantized
    full_k, full_v = pool.get_kv_buffer(1)
    assert full_k.shape == (SIZE + PS, H, D) and torch.equal(full_k[where], kr)
    assert torch.equal(full_v[where], vr)
    others = torch.ones(SIZE + PS, dtype=torch.bool, device=DEVICE)
    others[where] = False
    assert not bool(full_k[others].any()) and not bool(pool.get_key_buffer(0).any())


def test_mha_fp4_triton_and_torch_paths_write_identical_bytes():
    pools = [mha(kernel_backend="triton"), mha(kernel_backend="torch")]
    mask = torch.tensor([True, False, True, True, False], device=DEVICE)
    for p in pools:
        p.set_kv_buffer(0, loc([1, 2, 3, 8, 17]), rnd((5, H, D), 3), rnd((5, H, DV), 4), mask=mask)
        p.set_kv_buffer(1, loc([6, 7]), rnd((2, H, D), 5), rnd((2, H, DV), 6), k_scale=2.0)
        p.move_kv_cache(loc([12, 13]), loc([1, 8]))
    for a, b in zip(pools[0].get_item_views(), pools[1].get_item_views()):
        assert torch.equal(a, b)
    assert not bool(pools[0].get_key_buffer(0)[2].any())  # masked-off row untouched
    with force_backend("triton"):
        assert torch.equal(pools[0].get_key_buffer(0), pools[1].get_key_buffer(0))


def test_mha_fp4_registration_and_item_views_alias_the_buffers():
    pool = mha()
    views = check_registration(pool)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert len(ptrs) == 4 * L
    assert ptrs == [
        b.data_ptr()
        for b in pool.k_buffer + pool.v_buffer + pool.k_scale_buffer + pool.v_scale_buffer
    ]
    assert (
        items
        == [PS * H * D // 2] * L
        + [PS * H * DV // 2] * L
        + [PS * H * D // 16] * L
        + [PS * H * DV // 16] * L
    )
    assert lens == [(SIZE + PS) * it // PS for it in items]
    d = pool.describe()
    assert d["kind"] == "mha_fp4" and d["kv_quant"] == KV_QUANT and d["dtype"] == "bfloat16"
    assert d["head_dim"] == D and d["v_head_dim"] == DV
    before = views_snapshot(views)
    pool.set_kv_buffer(0, loc([9]), rnd((1, H, D), 7), rnd((1, H, DV), 8))  # page 2
    changed = [i for i, (a, b) in enumerate(zip(before, views)) if not torch.equal(a, b)]
    assert changed == [0, L, 2 * L, 3 * L]  # k0, v0, k_scale0, v_scale0
    for i in changed:
        rows = (before[i] != views[i]).any(dim=1).nonzero().flatten().tolist()
        assert rows == [2]
    assert pool.get_kv_size_bytes() == sum(lens)


def test_mha_fp4_copy_restore_into_other_slots_and_move():
    pool = mha()
    src, dst = loc([4, 5, 6, 7, 13]), loc([18, 2, 9, 10, 11])
    pool.set_kv_buffer(0, src, rnd((5, H, D), 9), rnd((5, H, DV), 10))
    pool.set_kv_buffer(1, src, rnd((5, H, D), 11), rnd((5, H, DV), 12))
    want = [pool.get_kv_rows(layer, src) for layer in range(L)]
    copy = pool.get_cpu_copy(src)
    assert copy.num_tokens == 5 and len(copy.tensors) == 4 * L
    pool.set_kv_buffer(0, src, rnd((5, H, D), 13), rnd((5, H, DV), 14))  # a new owner
    pool.load_cpu_copy(copy, dst)
    for layer in range(L):
        got = pool.get_kv_rows(layer, dst)
        assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])
    pool.move_kv_cache(loc([1, 3]), loc([18, 11]))
    for layer in range(L):
        moved = pool.get_kv_rows(layer, loc([1, 3]))
        assert torch.equal(moved[0], want[layer][0][[0, 4]])
        assert torch.equal(moved[1], want[layer][1][[0, 4]])


def test_mha_fp4_prefix_valid_write_loc_and_scale():
    pool = mha()
    loc_2d = loc([[4, 5, 6], [8, 9, 10]])
    k, v = rnd((6, H, D), 15), rnd((6, H, DV), 16)
    pool.set_kv_buffer_prefix_valid(0, loc_2d, loc([2, 1]), k, v)
    written = pool.get_key_buffer(0)
    assert bool(written[[4, 5, 8]].any(dim=(1, 2)).all()) and not bool(written[[6, 9, 10]].any())
    other = mha()
    other.set_kv_buffer(
        0, KVWriteLoc(loc([4, 5, 8]), full_loc=loc([1, 2, 3, 4])), k[[0, 1, 3]], v[[0, 1, 3]]
    )
    for a, b in zip(pool.get_item_views(), other.get_item_views()):
        assert torch.equal(a, b)
    scaled = mha()
    scaled.set_kv_buffer(0, loc([4]), k[:1] * 8, v[:1], k_scale=8.0)
    assert torch.equal(scaled.get_item_views()[0], mha_one(k[:1], v[:1]).get_item_views()[0])


def mha_one(k, v):
    p = mha()
    p.set_kv_buffer(0, loc([4]), k, v)
    return p


def test_fp4_argument_errors_write_nothing():
    with pytest.raises(InvalidArgument, match="24"):
        MHATokenToKVPoolFP4(SIZE, PS, torch.bfloat16, H, 24, L, DEVICE)
    with pytest.raises(InvalidArgument, match="nhd"):
        MHATokenToKVPoolFP4(SIZE, PS, torch.bfloat16, H, D, L, DEVICE, layout="hnd")
    with pytest.raises(InvalidArgument, match="dtype"):
        MHATokenToKVPoolFP4(SIZE, PS, torch.uint8, H, D, L, DEVICE)
    with pytest.raises(InvalidArgument, match="qk_rope_head_dim=8"):
        MLATokenToKVPoolFP4(SIZE, PS, torch.bfloat16, R, 8, L, DEVICE)
    pool = mha()
    k, v = rnd((2, H, D), 1), rnd((2, H, DV), 2)
    if ON_CUDA:  # no raise, no sync: row 1 is written, the out-of-range row nowhere
        pool.set_kv_buffer(0, loc([1, SIZE + PS]), k, v)
        twin = mha()
        twin.set_kv_buffer(0, loc([1]), k[:1], v[:1])
        assert_same_views(pool.get_item_views(), twin.get_item_views())
        assert any(bool(x.any()) for x in twin.get_item_views())  # row 1 landed
    before = views_snapshot(pool.get_item_views())
    if not ON_CUDA:
        with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
            pool.set_kv_buffer(0, loc([1, SIZE + PS]), k, v)
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer(0, loc([1]), rnd((1, H, DV), 1), rnd((1, H, DV), 2))
    with pytest.raises(InvalidArgument, match="int64"):
        pool.set_kv_buffer(
            0, loc([1]), torch.zeros(1, H, D, dtype=torch.int64, device=DEVICE), rnd((1, H, DV), 2)
        )
    with pytest.raises(IndexOutOfRange):
        pool.set_kv_buffer(L, loc([1]), rnd((1, H, D), 1), rnd((1, H, DV), 2))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.get_item_views()))


def test_mla_fp4_read_back_and_identical_write_paths():
    a, b = mla(start_layer=3), mla(start_layer=3, kernel_backend="torch")
    assert (a.start_layer, a.end_layer, a.layer_num) == (3, 4, L)
    where = loc([4, 7, 11])
    nope, rope = rnd((3, 1, R), 17), rnd((3, 1, DR), 18)
    a.set_mla_kv_buffer(4, where, nope, rope)
    b.set_kv_buffer(4, KVWriteLoc(where), torch.cat((nope, rope), dim=-1))
    for x, y in zip(a.get_item_views(), b.get_item_views()):
        assert torch.equal(x, y)
    n2, r2 = a.get_mla_kv_buffer(4, where)
    assert n2.shape == (3, 1, R) and r2.shape == (3, 1, DR) and n2.dtype == torch.bfloat16
    assert bool(((n2.float() - nope.float()).abs() <= fp4_error_bound(nope)).all())
    assert bool(((r2.float() - rope.float()).abs() <= fp4_error_bound(rope)).all())
    full = a.get_key_buffer(4)
    assert full.shape == (SIZE + PS, 1, R + DR) and torch.equal(full[where, :, :R], n2)
    assert torch.equal(a.get_value_buffer(4)[where], n2)
    assert a.get_mla_kv_buffer(4, where, dst_dtype=torch.float32)[0].dtype == torch.float32
    with pytest.raises(IndexOutOfRange):
        a.get_key_buffer(2)


def test_mla_fp4_registration_copy_restore_move():
    pool = mla()
    assert all(b.dtype == torch.uint8 for b in pool.kv_buffer)  # no full-precision buffers
    views = check_registration(pool)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in pool.kv_buffer + pool.kv_scale_buffer]
    assert items == [PS * (R + DR) // 2] * L + [PS * (R + DR) // 16] * L
    assert pool.describe()["kind"] == "mla_fp4" and len(views) == 2 * L
    src, dst = loc([4, 5, 6]), loc([12, 19, 1])
    for layer in range(L):
        pool.set_mla_kv_buffer(layer, src, rnd((3, 1, R), 20 + layer), rnd((3, 1, DR), 30 + layer))
    want = [pool.get_mla_kv_buffer(layer, src) for layer in range(L)]
    copy = pool.get_cpu_copy(src)
    pool.set_mla_kv_buffer(0, src, rnd((3, 1, R), 40), rnd((3, 1, DR), 41))
    pool.load_cpu_copy(copy, dst)
    for layer in range(L):
        got = pool.get_mla_kv_buffer(layer, dst)
        assert torch.equal(got[0], want[layer][0]) and torch.equal(got[1], want[layer][1])
    pool.move_kv_cache(loc([8]), loc([19]))
    for layer in range(L):
        assert torch.equal(pool.get_mla_kv_buffer(layer, loc([8]))[0], want[layer][0][1:2])


def test_post_capture_backing_is_refused():
    from kvxfer.kernels.errors import UnsupportedOperation
    from kvxfer.pools.dsa import DSATokenToKVPool
    from kvxfer.pools.minimax import MiniMaxSparseKVPool

    with pytest.raises(UnsupportedOperation):
        mha(post_capture_active=True)
    with pytest.raises(UnsupportedOperation):
        mla(post_capture_active=True)
    with pytest.raises(UnsupportedOperation):
        DSATokenToKVPool(SIZE, PS, torch.bfloat16, R, DR, L, DEVICE, post_capture_active=True)
    with pytest.raises(UnsupportedOperation):
        MiniMaxSparseKVPool(
            SIZE, PS, torch.bfloat16, H, D, 4, [0], [1], DEVICE, post_capture_active=True
        )
