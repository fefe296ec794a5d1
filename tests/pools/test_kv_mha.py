"""MHA pools (NHD, HND, page-major): writes, masked / prefix-valid writes, moves, layer ids,
transfer-counter hook, bounds and argument errors. Expected contents are built with plain torch
indexing on a clone of each buffer, so every byte of every buffer is checked."""

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(60)

FP8 = getattr(torch, "float8_e4m3fn", None)
DTYPES = [torch.bfloat16, torch.float16, torch.float32] + ([FP8] if FP8 is not None else [])
LAYOUTS = ["nhd", "hnd", "page_major"]
SIZE, PS, H, D, DV, L = 12, 4, 2, 4, 3, 3  # 16 slots, 4 pages; V narrower than K


def make_pool(layout, dtype=torch.float16, start_layer=0, **kw):
    args = (SIZE, PS, dtype, H, D, L, DEVICE)
    if layout == "page_major":
        return PageMajorMHATokenToKVPool(*args, v_head_dim=DV, start_layer=start_layer, **kw)
    return MHATokenToKVPool(*args, v_head_dim=DV, start_layer=start_layer, layout=layout, **kw)


def rand(n, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, H, dim), generator=g)
    return x.to(dtype).to(DEVICE)


def raw(t):
    """Store-dtype bytes of a logical tensor (fp8 -> uint8) for exact comparison."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


def token_rows(pool, buf, loc):
    """Rows of a store buffer at token ids, through plain torch indexing."""
    loc = loc.to(buf.device).long()
    if pool.layout == "nhd":
        return buf[loc]
    page, slot = loc // pool.page_size, loc % pool.page_size
    if pool.layout == "hnd":
        return buf[page, :, slot]
    return buf[page, slot]


def put_rows(pool, buf, loc, rows):
    loc = loc.to(buf.device).long()
    if pool.layout == "nhd":
        buf[loc] = rows
        return
    page, slot = loc // pool.page_size, loc % pool.page_size
    if pool.layout == "hnd":
        buf[page, :, slot] = rows
    else:
        buf[page, slot] = rows


def snapshot(pool):
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]


def assert_buffers(pool, expected):
    for i, (got, want) in enumerate(zip(pool.k_buffer + pool.v_buffer, expected)):
        assert torch.equal(got, want), f"buffer {i} differs"


def store_bytes(pool, x):
    return raw(x.to(pool.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_then_read_every_byte(layout, dtype):
    pool = make_pool(layout, dtype)
    assert pool.store_dtype == (torch.uint8 if dtype == FP8 else dtype)
    expected = snapshot(pool)
    loc = torch.tensor([5, 0, 15, 8, 9, 3], device=DEVICE)  # includes padding slot 0, last slot
    for layer in range(L):
        k, v = rand(len(loc), D, dtype, layer), rand(len(loc), DV, dtype, 100 + layer)
        pool.set_kv_buffer(layer, loc, k, v)
        put_rows(pool, expected[layer], loc, store_bytes(pool, k))
        put_rows(pool, expected[L + layer], loc, store_bytes(pool, v))
        # reads through the public getters, in the logical dtype
        kb, vb = pool.get_kv_buffer(layer)
        assert kb.dtype == dtype and vb.dtype == dtype
        assert torch.equal(raw(token_rows(pool, kb, loc)), raw(k))
        assert torch.equal(raw(token_rows(pool, vb, loc)), raw(v))
    assert_buffers(pool, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_casts_and_scales(layout):
    pool = make_pool(layout, torch.bfloat16)
    loc = torch.tensor([4, 6], device=DEVICE)
    k = torch.full((2, H, D), 8.0, device=DEVICE)  # float32 input is cast to bf16
    v = torch.full((2, H, DV), 6.0, device=DEVICE)
    pool.set_kv_buffer(0, loc, k, v, k_scale=2.0, v_scale=3.0)
    kb, vb = pool.get_kv_buffer(0)
    assert torch.all(token_rows(pool, kb, loc) == 4.0)
    assert torch.all(token_rows(pool, vb, loc) == 2.0)
    assert torch.all(k == 8.0)  # the caller's tensor is not modified


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masked_write(layout):
    pool = make_pool(layout)
    expected = snapshot(pool)
    loc = torch.tensor([1, 2, 3, 7], device=DEVICE)
    mask = torch.tensor([True, False, True, False], device=DEVICE)
    k, v = rand(4, D, torch.float16, 1), rand(4, DV, torch.float16, 2)
    pool.set_kv_buffer(1, loc, k, v, mask=mask)
    put_rows(pool, expected[1], loc[mask], k[mask])
    put_rows(pool, expected[L + 1], loc[mask], v[mask])
    assert_buffers(pool, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefix_valid_write(layout):
    pool = make_pool(layout)
    expected = snapshot(pool)
    loc_2d = torch.tensor([[4, 5, 6], [8, 9, 10], [12, 13, 14]], device=DEVICE)
    commit = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEVICE)
    k, v = rand(9, D, torch.float16, 3), rand(9, DV, torch.float16, 4)
    pool.set_kv_buffer_prefix_valid(2, loc_2d, commit, k, v)
    keep = (torch.arange(3, device=DEVICE)[None, :] < commit[:, None].long()).reshape(-1)
    put_rows(pool, expected[2], loc_2d.reshape(-1)[keep], k[keep])
    put_rows(pool, expected[L + 2], loc_2d.reshape(-1)[keep], v[keep])
    assert_buffers(pool, expected)
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer_prefix_valid(2, loc_2d, commit[:2], k, v)
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer_prefix_valid(2, loc_2d.reshape(-1), commit, k, v)


@pytest.mark.parametrize("dtype", [torch.float32] + ([FP8] if FP8 is not None else []), ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_move_every_layer(layout, dtype):
    pool = make_pool(layout, dtype)
    src = torch.tensor([4, 5, 6, 7, 9], device=DEVICE)
    for layer in range(L):
        pool.set_kv_buffer(layer, src, rand(5, D, dtype, layer), rand(5, DV, dtype, 50 + layer))
    expected = snapshot(pool)
    tgt = torch.tensor([12, 13, 14, 1, 10], device=DEVICE)
    for buf in expected:
        put_rows(pool, buf, tgt, token_rows(pool, buf, src).clone())
    pool.move_kv_cache(tgt, src)
    assert_buffers(pool, expected)
    pool.move_kv_cache(tgt[:0], src[:0])  # empty move is a no-op
    assert_buffers(pool, expected)
    with pytest.raises(ShapeMismatch):
        pool.move_kv_cache(tgt, src[:2])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_major_equals_per_layer_pool(layout):
    """The same writes and moves leave every layer's rows equal byte-for-byte."""
    ref = make_pool("nhd", torch.bfloat16)
    pool = make_pool(layout, torch.bfloat16)
    loc = torch.tensor([2, 3, 4, 5, 11, 14], device=DEVICE)
    for layer in range(L):
        k, v = rand(6, D, torch.bfloat16, 7 * layer), rand(6, DV, torch.bfloat16, 9 + layer)
        ref.set_kv_buffer(layer, loc, k, v)
        pool.set_kv_buffer(layer, loc, k, v)
    for p in (ref, pool):
        p.move_kv_cache(torch.tensor([8, 9], device=DEVICE), torch.tensor([14, 2], device=DEVICE))
    every = torch.arange(ref.num_slots, device=DEVICE)
    for layer in range(L):
        for rb, pb in zip(ref.get_kv_buffer(layer), pool.get_kv_buffer(layer)):
            assert torch.equal(rb, token_rows(pool, pb, every))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_ids_offset_and_objects(layout):
    class Layer:
        def __init__(self, layer_id):
            self.layer_id = layer_id

    pool = make_pool(layout, start_layer=5)
    assert (pool.start_layer, pool.end_layer) == (5, 7)
    loc = torch.tensor([6], device=DEVICE)
    k, v = rand(1, D, torch.float16, 1), rand(1, DV, torch.float16, 2)
    pool.set_kv_buffer(Layer(6), loc, k, v)
    assert torch.equal(token_rows(pool, pool.get_key_buffer(6), loc), k)
    assert not torch.any(pool.get_key_buffer(5).float() != 0)
    for bad in (4, 8, Layer(0)):
        with pytest.raises(IndexOutOfRange):
            pool.set_kv_buffer(bad, loc, k, v)
        with pytest.raises(IndexOutOfRange):
            pool.get_key_buffer(getattr(bad, "layer_id", bad))
    with pytest.raises(InvalidArgument):
        pool.get_value_buffer("5")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_transfer_counter_gates_getters(layout):
    class Counter:
        def __init__(self):
            self.calls = []

        def wait_until(self, idx):
            self.calls.append(idx)

    pool = make_pool(layout, start_layer=2)
    c = Counter()
    pool.register_layer_transfer_counter(c)
    pool.get_key_buffer(2)
    pool.get_value_buffer(4)
    pool.get_kv_buffer(3)
    assert c.calls == [0, 2, 1, 1]


@pytest.mark.skipif(DEVICE != "cpu", reason="GPU kernels skip out-of-range rows instead of raising")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_range_locs_raise_and_write_nothing(layout):
    pool = make_pool(layout)
    before = snapshot(pool)
    k, v = rand(2, D, torch.float16, 1), rand(2, DV, torch.float16, 2)
    for bad in ([3, SIZE + PS], [-1, 3]):
        loc = torch.tensor(bad, device=DEVICE)
        with pytest.raises(IndexOutOfRange, match=str(bad[0] if bad[0] < 0 else bad[1])):
            pool.set_kv_buffer(0, loc, k, v)
        with pytest.raises(IndexOutOfRange):
            pool.set_kv_buffer(0, loc, k, v, mask=torch.tensor([True, True], device=DEVICE))
        with pytest.raises(IndexOutOfRange):
            pool.move_kv_cache(loc, torch.tensor([1, 2], device=DEVICE))
        with pytest.raises(IndexOutOfRange):
            pool.move_kv_cache(torch.tensor([1, 2], device=DEVICE), loc)
    assert_buffers(pool, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_get_kv_rows_reads_what_set_kv_buffer_stored(layout, dtype):
    """The read path inverts the store path in every layout: scattered ids, two layers written
    with different rows, each read back in the caller's order (heads and tokens in place);
    rows never written read as zero; bad ids raise."""
    pool = make_pool(layout, dtype)
    loc = torch.tensor([13, 2, 7, 4, 9], device=DEVICE)  # across pages, out of order
    rows = {}
    for layer in range(L):
        k, v = rand(5, D, dtype, 10 + layer), rand(5, DV, dtype, 20 + layer)
        pool.set_kv_buffer(layer, loc, k, v)
        rows[layer] = (k, v)
    for layer in range(L):
        order = torch.tensor([3, 0, 4, 1, 2], device=DEVICE)
        k, v = pool.get_kv_rows(layer, loc[order])
        assert k.dtype == v.dtype == dtype
        assert tuple(k.shape) == (5, H, D) and tuple(v.shape) == (5, H, DV)
        assert torch.equal(raw(k), raw(rows[layer][0][order]))
        assert torch.equal(raw(v), raw(rows[layer][1][order]))
    k, v = pool.get_kv_rows(1, torch.tensor([3, 8], device=DEVICE))  # never written
    assert not raw(k).any() and not raw(v).any()
    for bad in ([3, SIZE + PS], [-1, 3]):
        with pytest.raises(IndexOutOfRange):
            pool.get_kv_rows(0, torch.tensor(bad, device=DEVICE))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_write_arguments(layout):
    pool = make_pool(layout)
    loc = torch.tensor([1, 2], device=DEVICE)
    k, v = rand(2, D, torch.float16, 1), rand(2, DV, torch.float16, 2)
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer(0, loc, k[:1], v)
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer(0, loc, k, rand(2, D, torch.float16, 3))  # V has Dv, not D
    with pytest.raises(InvalidArgument):
        pool.set_kv_buffer(0, loc.float(), k, v)
    with pytest.raises(InvalidArgument):
        pool.set_kv_buffer(0, loc, k, v, mask=torch.tensor([1, 0], device=DEVICE))
    with pytest.raises(ShapeMismatch):
        pool.set_kv_buffer(0, loc, k, v, mask=torch.tensor([True], device=DEVICE))


def test_constructor_validation():
    with pytest.raises(InvalidArgument, match="layout"):
        MHATokenToKVPool(8, 4, torch.float16, 1, 4, 1, DEVICE, layout="vectorized_5d")
    with pytest.raises(InvalidArgument, match="size=10"):
        MHATokenToKVPool(10, 4, torch.float16, 1, 4, 1, DEVICE, layout="hnd")
    with pytest.raises(InvalidArgument, match="size=10"):
        PageMajorMHATokenToKVPool(10, 4, torch.float16, 1, 4, 1, DEVICE)
    with pytest.raises(InvalidArgument, match="page_major"):
        PageMajorMHATokenToKVPool(8, 4, torch.float16, 1, 4, 1, DEVICE, layout="nhd")
    with pytest.raises(InvalidArgument, match="head_dim"):
        MHATokenToKVPool(8, 4, torch.float16, 1, 0, 1, DEVICE)
    with pytest.raises(InvalidArgument, match="page_size"):
        MHATokenToKVPool(8, 0, torch.float16, 1, 4, 1, DEVICE)
    with pytest.raises(InvalidArgument, match="dtype"):
        MHATokenToKVPool(8, 4, "float16", 1, 4, 1, DEVICE)
    # NHD does not need a page-aligned size; rows are exactly size + page_size
    p = MHATokenToKVPool(10, 4, torch.float16, 1, 4, 2, DEVICE)
    assert p.k_buffer[0].shape == (14, 1, 4) and p.v_head_dim == 4


def test_zero_layer_pool_is_inert():
    p = MHATokenToKVPool(8, 4, torch.float16, 1, 4, 0, DEVICE)
    p.move_kv_cache(torch.tensor([1]), torch.tensor([2]))
    assert p.get_contiguous_buf_infos() == ([], [], [])
    assert p.get_item_views() == []
