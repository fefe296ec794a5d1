"""store_kv_paged into page-major 4-D strided views over one raw uint8 buffer."""

import pytest
import torch
from _kernels_testlib import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_CUDA,
    distinct,
    gen,
    page_major_views,
    rand,
    raw,
)

from kvxfer.kernels import store_paged
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(60)


def _page_major(dtype, g, *, layers=3, num_pages=5, page_size=4, heads=2, dim=3, vdim=5):
    isz = torch.empty(0, dtype=dtype).element_size()
    nbytes = num_pages * layers * page_size * heads * (dim + vdim) * isz
    buf = rand((nbytes,), torch.uint8, g)
    geo = dict(
        layers=layers,
        num_pages=num_pages,
        page_size=page_size,
        heads=heads,
        head_dim=dim,
        v_head_dim=vdim,
        dtype=dtype,
    )
    return buf, geo


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [1, 7, 19])
def test_paged_store_matches_reference(dtype, n):
    g = gen(n)
    buf, geo = _page_major(dtype, g)
    ref = buf.clone()
    ks, vs = page_major_views(buf, **geo)
    kr, vr = page_major_views(ref, **geo)
    rows = geo["num_pages"] * geo["page_size"]
    loc = distinct(n, rows, g)
    k = rand((n, geo["heads"], geo["head_dim"]), dtype, g)
    v = rand((n, geo["heads"], geo["v_head_dim"]), dtype, g)
    store_paged.store_kv_paged(ks[1], vs[1], loc, k, v, backend="triton")
    store_paged.store_kv_paged(kr[1], vr[1], loc, k, v, backend="torch")
    assert torch.equal(buf, ref)
    ps = geo["page_size"]
    assert torch.equal(raw(kr[1][loc // ps, loc % ps]), raw(k))  # token t -> (t//ps, t%ps)
    assert torch.equal(raw(vr[1][loc // ps, loc % ps]), raw(v))


def test_paged_store_page_size_one_and_k_only():
    g = gen(11)
    buf, geo = _page_major(
        torch.float16, g, layers=2, num_pages=9, page_size=1, heads=1, dim=8, vdim=4
    )
    ref = buf.clone()
    ks, _ = page_major_views(buf, **geo)
    kr, _ = page_major_views(ref, **geo)
    loc = distinct(6, 9, g, torch.int32)
    k = rand((6, 1, 8), torch.float16, g)
    store_paged.store_kv_paged(ks[0], None, loc, k, None, backend="triton")
    store_paged.store_kv_paged(kr[0], None, loc, k, None, backend="torch")
    assert torch.equal(buf, ref)
    assert torch.equal(raw(kr[0][loc.long(), 0]), raw(k))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_empty_and_out_of_range(backend):
    g = gen(12)
    buf, geo = _page_major(torch.bfloat16, g)
    before = buf.clone()
    ks, vs = page_major_views(buf, **geo)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    k0 = torch.empty(0, 2, 3, dtype=torch.bfloat16, device=DEVICE)
    v0 = torch.empty(0, 2, 5, dtype=torch.bfloat16, device=DEVICE)
    store_paged.store_kv_paged(ks[0], vs[0], empty, k0, v0, backend=backend)
    assert torch.equal(buf, before)
    rows = geo["num_pages"] * geo["page_size"]
    loc = torch.tensor([0, rows], device=DEVICE)
    k, v = rand((2, 2, 3), torch.bfloat16, g), rand((2, 2, 5), torch.bfloat16, g)
    if ON_CUDA and backend == "triton":
        store_paged.store_kv_paged(ks[2], vs[2], loc, k, v, backend=backend)
        torch.cuda.synchronize()
        # token `rows` of the last layer would be past the buffer; row 0 is written
        kr, vr = page_major_views(before, **geo)
        store_paged.store_kv_paged(kr[2], vr[2], loc[:1], k[:1], v[:1], backend="torch")
        assert torch.equal(buf, before)
        return
    with pytest.raises(IndexOutOfRange, match=str(rows)):
        store_paged.store_kv_paged(ks[2], vs[2], loc, k, v, backend=backend)
    assert torch.equal(buf, before)


def test_paged_out_of_range_masked_in_kernel():
    """Layer 0's view: out-of-range tokens would land in layer 0/1 bytes of other pages."""
    g = gen(13)
    buf, geo = _page_major(torch.float32, g)
    ks, vs = page_major_views(buf, **geo)
    ref = buf.clone()
    kr, vr = page_major_views(ref, **geo)
    rows = geo["num_pages"] * geo["page_size"]
    loc = torch.tensor([rows, 1, -1, rows + 3, 6], device=DEVICE)
    k, v = rand((5, 2, 3), torch.float32, g), rand((5, 2, 5), torch.float32, g)
    keep = torch.tensor([1, 4], device=DEVICE)
    store_paged.store_kv_paged(kr[0], vr[0], loc[keep], k[keep], v[keep], backend="torch")
    store_paged._launch(ks[0], vs[0], loc, k, v, rows)
    assert torch.equal(buf, ref)


def test_paged_invalid_arguments():
    g = gen(14)
    buf, geo = _page_major(torch.float16, g)
    ks, vs = page_major_views(buf, **geo)
    loc = torch.tensor([0, 1], device=DEVICE)
    k, v = rand((2, 2, 3), torch.float16, g), rand((2, 2, 5), torch.float16, g)
    with pytest.raises(ShapeMismatch, match="4-D"):
        store_paged.store_kv_paged(ks[0][0], vs[0], loc, k, v)
    with pytest.raises(ShapeMismatch, match="shape"):
        store_paged.store_kv_paged(ks[0], vs[0], loc, v, v)
    with pytest.raises(InvalidArgument, match="contiguous"):
        store_paged.store_kv_paged(ks[0].transpose(2, 3), vs[0], loc, k, v)
    with pytest.raises(InvalidArgument, match="v_view is None"):
        store_paged.store_kv_paged(ks[0], None, loc, k, v)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_paged_num_tokens_bounds_ids_inside_the_last_page(backend):
    """num_tokens < the views' capacity: ids in [num_tokens, capacity) sit inside the last
    page but are refused (host-checked paths) / masked off (CUDA kernel) like any other."""
    g = gen(15)
    buf, geo = _page_major(torch.bfloat16, g)
    ks, vs = page_major_views(buf, **geo)
    ref = buf.clone()
    kr, vr = page_major_views(ref, **geo)
    rows = geo["num_pages"] * geo["page_size"]
    limit = rows - 3
    k, v = rand((3, 2, 3), torch.bfloat16, g), rand((3, 2, 5), torch.bfloat16, g)
    good = torch.tensor([0, limit - 1], device=DEVICE)
    store_paged.store_kv_paged(ks[1], vs[1], good, k[:2], v[:2], backend=backend, num_tokens=limit)
    store_paged.store_kv_paged(kr[1], vr[1], good, k[:2], v[:2], backend="torch")
    assert torch.equal(buf, ref)
    for bad in (limit, rows - 1):
        loc = torch.tensor([2, bad, 5], device=DEVICE)
        if ON_CUDA and backend == "triton":
            store_paged.store_kv_paged(ks[1], vs[1], loc, k, v, backend=backend, num_tokens=limit)
            torch.cuda.synchronize()
            keep = torch.tensor([0, 2], device=DEVICE)
            store_paged.store_kv_paged(kr[1], vr[1], loc[keep], k[keep], v[keep], backend="torch")
        else:
            with pytest.raises(IndexOutOfRange, match=f"{bad}, outside \\[0, {limit}\\)"):
                store_paged.store_kv_paged(
                    ks[1], vs[1], loc, k, v, backend=backend, num_tokens=limit
                )
        assert torch.equal(buf, ref)
    with pytest.raises(InvalidArgument, match="num_tokens"):
        store_paged.store_kv_paged(ks[1], vs[1], good, k[:2], v[:2], num_tokens=rows + 1)
