"""Registration descriptors, item views and describe() for every KV pool.

Checks the documented math (entry count and order, lens = final_span_bytes(size), item = one
page), that item views alias exactly the registered bytes (a write through the pool API shows
up in the expected item row at the expected offset, and a write through an item view shows up
through the pool getters), and that describe() is a plain msgpack-able fingerprint."""

import msgpack
import pytest
import torch
from testenv import DEVICE

from kvxfer.pools.layout import PageMajorGeometry
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(60)

SIZE, PS, H, D, DV, L = 12, 4, 2, 4, 3, 3
DTYPES = [torch.bfloat16, torch.float32] + (
    [torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else []
)


def mha(layout, dtype, size=SIZE):
    return MHATokenToKVPool(size, PS, dtype, H, D, L, DEVICE, v_head_dim=DV, layout=layout)


def storage_end(t):
    return t.data_ptr() + t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,size", [("nhd", SIZE), ("nhd", 13), ("hnd", SIZE)])
def test_per_layer_mha_descriptors(layout, size, dtype):
    pool = mha(layout, dtype, size)
    isz = pool.store_dtype.itemsize
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert len(ptrs) == len(lens) == len(items) == 2 * L
    assert ptrs == [b.data_ptr() for b in pool.k_buffer + pool.v_buffer]  # k0..kL-1, v0..vL-1
    assert [d.name for d in pool.get_buffer_descs()] == [f"k{i}" for i in range(L)] + [
        f"v{i}" for i in range(L)
    ]
    k_page, v_page = PS * H * D * isz, PS * H * DV * isz
    assert items == [k_page] * L + [v_page] * L
    if layout == "nhd":  # rows = size + page_size token slots, exactly
        assert lens == [(size + PS) * H * D * isz] * L + [(size + PS) * H * DV * isz] * L
    else:  # whole pages
        assert lens == [(size // PS + 1) * k_page] * L + [(size // PS + 1) * v_page] * L
    for t, n in zip(pool.k_buffer + pool.v_buffer, lens):
        assert n <= t.numel() * t.element_size()


def test_page_major_has_exactly_one_entry():
    pool = PageMajorMHATokenToKVPool(SIZE, PS, torch.float16, H, D, L, DEVICE, v_head_dim=DV)
    g = PageMajorGeometry.for_pool(
        size=SIZE, page_size=PS, layer_num=L, head_num=H, head_dim=D, v_head_dim=DV, itemsize=2
    )
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    assert ptrs == [pool.raw.data_ptr()]
    assert lens == [g.total_bytes] == [pool.raw.numel()]
    assert items == [g.page_bytes] == [L * PS * H * (D + DV) * 2]
    # every per-layer view lies inside the one registered range
    for b in pool.k_buffer + pool.v_buffer:
        assert ptrs[0] <= b.data_ptr() < ptrs[0] + lens[0]


def test_mla_and_k_only_descriptors():
    mla = MLATokenToKVPool(SIZE, PS, torch.bfloat16, 6, 2, L, DEVICE)
    ptrs, lens, items = mla.get_contiguous_buf_infos()
    assert ptrs == [b.data_ptr() for b in mla.kv_buffer]
    assert lens == [(SIZE + PS) * 8 * 2] * L and items == [PS * 8 * 2] * L
    ko = MHATokenToKOnlyPool(SIZE, PS, torch.float32, H, D, L, DEVICE)
    ptrs, lens, items = ko.get_contiguous_buf_infos()
    assert len(ptrs) == L and lens == [(SIZE + PS) * H * D * 4] * L
    assert items == [PS * H * D * 4] * L
    noop = NoOpMHATokenToKVPool(SIZE, PS, torch.float16, H, D, L, DEVICE)
    assert noop.get_contiguous_buf_infos() == ([], [], []) and noop.get_item_views() == []


def all_pools(dtype):
    yield mha("nhd", dtype)
    yield mha("nhd", dtype, 13)
    yield mha("hnd", dtype)
    yield PageMajorMHATokenToKVPool(SIZE, PS, dtype, H, D, L, DEVICE, v_head_dim=DV)
    yield MLATokenToKVPool(SIZE, PS, dtype, 6, 2, L, DEVICE)
    yield MHATokenToKOnlyPool(SIZE, PS, dtype, H, D, L, DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, DTYPES[-1]], ids=str)
def test_item_views_alias_registered_bytes(dtype):
    for pool in all_pools(dtype):
        ptrs, lens, items = pool.get_contiguous_buf_infos()
        views = pool.get_item_views()
        assert len(views) == len(ptrs)
        for v, p, n, it in zip(views, ptrs, lens, items):
            assert v.dtype == torch.uint8 and v.shape == (n // it, it)
            assert v.stride() == (it, 1) and v.data_ptr() == p
            assert v.data_ptr() + v.numel() <= storage_end(v)


def _write_one_token(pool, layer, token, dtype):
    """Write token ``token`` of ``layer`` with a recognisable pattern; return its K row bytes."""
    loc = torch.tensor([token], device=DEVICE)
    if isinstance(pool, MLATokenToKVPool):
        k = torch.arange(1, 9, dtype=torch.float32).reshape(1, 1, 8).to(dtype).to(DEVICE)
        pool.set_kv_buffer(layer, loc, k, None)
        return k
    k = torch.arange(1, H * D + 1, dtype=torch.float32).reshape(1, H, D).to(dtype).to(DEVICE)
    if isinstance(pool, MHATokenToKOnlyPool):
        pool.set_kv_buffer(layer, loc, k, None)
    else:
        v = (-torch.arange(1, H * DV + 1, dtype=torch.float32)).reshape(1, H, DV).to(dtype)
        pool.set_kv_buffer(layer, loc, k, v.to(DEVICE))
    return k


def _as_bytes(x):
    return x.contiguous().view(-1).view(torch.uint8)


def _expected_k_offset(pool, layer, token):
    """(entry index, byte offset inside the item row, chunks) of K row ``token`` of ``layer``:
    ``chunks`` lists (offset, nbytes) pieces making up the row."""
    isz = pool.store_dtype.itemsize
    page, slot = divmod(token, PS)
    if isinstance(pool, PageMajorMHATokenToKVPool):
        g = pool.geometry
        base = g.byte_offset("k", layer, token) - page * g.page_bytes
        return 0, [(base, H * D * isz)]
    if isinstance(pool, MLATokenToKVPool):
        return layer, [(slot * 8 * isz, 8 * isz)]
    if pool.layout == "hnd":
        return layer, [((h * PS + slot) * D * isz, D * isz) for h in range(H)]
    return layer, [(slot * H * D * isz, H * D * isz)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, DTYPES[-1]], ids=str)
def test_pool_writes_show_up_in_the_expected_item_row(dtype):
    for pool in all_pools(dtype):
        layer, token = 1, 9  # page 2, slot 1
        k = _write_one_token(pool, layer, token, dtype)
        entry, chunks = _expected_k_offset(pool, layer, token)
        views = pool.get_item_views()
        row = views[entry][token // PS]
        got = torch.cat([row[o : o + n] for o, n in chunks])
        assert torch.equal(got.cpu(), _as_bytes(k).cpu()), type(pool).__name__
        # nothing else in the registered bytes is non-zero, except V of the same token
        nonzero_pages = {
            (e, p)
            for e, v in enumerate(views)
            for p in torch.nonzero(v.any(dim=1)).flatten().tolist()
        }
        assert {p for _, p in nonzero_pages} == {token // PS}, type(pool).__name__


def test_item_view_writes_show_up_in_pool_getters():
    for pool in all_pools(torch.float32):
        views = pool.get_item_views()
        views[0][3].fill_(0xFF)  # page 3 of the first registered entry -> NaN bytes
        kb = pool.get_key_buffer(0)
        ks = kb.float()
        if isinstance(pool, PageMajorMHATokenToKVPool):
            assert torch.isnan(ks[3]).all() and not torch.isnan(ks[:3]).any()
        elif getattr(pool, "layout", "nhd") == "hnd":
            assert torch.isnan(ks[3]).all() and not torch.isnan(ks[:3]).any()
        else:
            assert torch.isnan(ks[3 * PS : 4 * PS]).all() and not torch.isnan(ks[: 3 * PS]).any()


def test_describe_is_a_plain_fingerprint():
    seen = {}
    for pool in all_pools(torch.bfloat16):
        d = pool.describe()
        assert set(d) >= {
            "kind",
            "dtype",
            "page_size",
            "layer_num",
            "head_num",
            "head_dim",
            "v_head_dim",
            "layout",
            "item_lens",
        }
        assert d["dtype"] == "bfloat16" and d["page_size"] == PS and d["layer_num"] == L
        assert d["item_lens"] == pool.get_contiguous_buf_infos()[2]
        assert msgpack.unpackb(msgpack.packb(d)) == d
        seen[(d["kind"], d["layout"])] = d
    assert set(seen) == {
        ("mha", "nhd"),
        ("mha", "hnd"),
        ("mha_page_major", "page_major"),
        ("mla", "nhd"),
        ("k_only", "nhd"),
    }
    assert seen[("mla", "nhd")]["head_dim"] == 8 and seen[("mla", "nhd")]["v_head_dim"] == 6
    # the fingerprint ignores capacity: two sizes of one geometry describe identically
    assert mha("nhd", torch.bfloat16, 12).describe() == mha("nhd", torch.bfloat16, 40).describe()
    assert mha("nhd", torch.bfloat16).describe() != mha("nhd", torch.float16).describe()


def test_kv_size_bytes_matches_registered_lens():
    for pool in all_pools(torch.float16):
        assert pool.get_kv_size_bytes() == sum(pool.get_contiguous_buf_infos()[1])
