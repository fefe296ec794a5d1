"""KvCopyTable / move_kv: one launch moves rows in every layer's K and V."""

import pytest
import torch
from _kernels_testlib import (
    DEVICE,
    DTYPE_IDS,
    DTYPES,
    ON_CUDA,
    gen,
    guarded,
    page_major_views,
    rand,
    raw,
)

from kvxfer.kernels import copy as kcopy
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(60)


def _moves(n, rows, g, dtype=torch.int64):
    """Disjoint targets and sources (the Triton path's documented precondition)."""
    perm = torch.randperm(rows, generator=g)
    return perm[:n].to(dtype).to(DEVICE), perm[n : 2 * n].to(dtype).to(DEVICE)


def _per_layer(dtype, g, layers=3, rows=40, heads=2, dim=3, vdim=5):
    ks = [rand((rows, heads, dim), dtype, g) for _ in range(layers)]
    vs = [rand((rows, heads, vdim), dtype, g) for _ in range(layers)]
    return ks + vs


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [1, 7, 17])
def test_move_per_layer_buffers(dtype, n):
    g = gen(n)
    bufs = _per_layer(dtype, g)
    refs = [b.clone() for b in bufs]
    tgt, src = _moves(n, 40, g, torch.int32 if n == 7 else torch.int64)
    table = kcopy.KvCopyTable(bufs)
    table.move(tgt, src, backend="triton")
    kcopy.move_reference(refs, tgt, src)
    for b, r in zip(bufs, refs):
        assert torch.equal(raw(b), raw(r))
    assert torch.equal(raw(refs[4][tgt.long()]), raw(refs[4][src.long()]))  # really moved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=["bf16", "u8"])
def test_move_page_major_views_across_layers(dtype):
    g = gen(21)
    layers, num_pages, ps = 3, 6, 4
    isz = torch.empty(0, dtype=dtype).element_size()
    geo = dict(
        layers=layers,
        num_pages=num_pages,
        page_size=ps,
        heads=2,
        head_dim=3,
        v_head_dim=5,
        dtype=dtype,
    )
    buf = rand((num_pages * layers * ps * 2 * 8 * isz,), torch.uint8, g)
    ref = buf.clone()
    ks, vs = page_major_views(buf, **geo)
    kr, vr = page_major_views(ref, **geo)
    tgt, src = _moves(9, num_pages * ps, g)
    kcopy.move_kv(ks + vs, tgt, src, backend="triton")
    kcopy.move_kv(kr + vr, tgt, src, backend="torch")
    assert torch.equal(buf, ref)
    for view in kr + vr:
        assert torch.equal(raw(view[tgt // ps, tgt % ps]), raw(view[src // ps, src % ps]))


def test_move_mixed_buffer_kinds_in_one_table():
    """3-D per-layer buffers (fp32) and 4-D paged views (fp16) share one launch."""
    g = gen(22)
    flat = _per_layer(torch.float32, g, layers=1, rows=24, heads=1, dim=4, vdim=2)
    buf = rand((6 * 2 * 4 * 1 * (4 + 6) * 2,), torch.uint8, g)
    ks, vs = page_major_views(
        buf,
        layers=2,
        num_pages=6,
        page_size=4,
        heads=1,
        head_dim=4,
        v_head_dim=6,
        dtype=torch.float16,
    )
    bufs = flat + ks + vs
    refs = [b.clone() for b in flat]
    ref_buf = buf.clone()
    kr, vr = page_major_views(
        ref_buf,
        layers=2,
        num_pages=6,
        page_size=4,
        heads=1,
        head_dim=4,
        v_head_dim=6,
        dtype=torch.float16,
    )
    tgt, src = _moves(8, 24, g)
    table = kcopy.KvCopyTable(bufs)
    assert len(table) == 6 and table.rows == 24
    table.move(tgt, src, backend="triton")
    kcopy.move_reference(refs + kr + vr, tgt, src)
    assert torch.equal(buf, ref_buf)
    for b, r in zip(flat, refs):
        assert torch.equal(raw(b), raw(r))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_move_empty_and_out_of_range(backend):
    g = gen(23)
    guards = [guarded((10, 1, 4), torch.float16, g) for _ in range(2)]
    bufs = [view for _, view in guards]
    before = [raw(full).clone() for full, _ in guards]
    table = kcopy.KvCopyTable(bufs)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    table.move(empty, empty, backend=backend)
    tgt = torch.tensor([1, 10], device=DEVICE)
    src = torch.tensor([2, 3], device=DEVICE)
    if ON_CUDA and backend == "triton":
        table.move(tgt, src, backend=backend)
        torch.cuda.synchronize()
        for (full, _), b in zip(guards, before):
            expect = b.view(18, -1).clone()
            expect[4 + 1] = expect[4 + 2]  # the in-range pair moved, the other never wrote
            assert torch.equal(raw(full).view(18, -1), expect)
        return
    with pytest.raises(IndexOutOfRange, match="10"):
        table.move(tgt, src, backend=backend)
    with pytest.raises(IndexOutOfRange, match="-4"):
        table.move(src, torch.tensor([0, -4], device=DEVICE), backend=backend)
    for (full, _), b in zip(guards, before):
        assert torch.equal(raw(full), b)


def test_move_out_of_range_masked_in_kernel():
    g = gen(24)
    guards = [guarded((10, 2, 2), torch.bfloat16, g) for _ in range(3)]
    bufs = [view for _, view in guards]
    expects = []
    for full, _ in guards:
        e = raw(full).clone().view(18, -1)
        e[4 + 0] = e[4 + 9]
        expects.append(e)
    tgt = torch.tensor([0, 10, -1, 3, 4], device=DEVICE)
    src = torch.tensor([9, 1, 2, -2, 12], device=DEVICE)
    kcopy.KvCopyTable(bufs)._launch(tgt, src)
    for (full, _), e in zip(guards, expects):
        assert torch.equal(raw(full).view(18, -1), e)


def test_copy_table_invalid_arguments():
    g = gen(25)
    bufs = _per_layer(torch.float16, g, layers=1, rows=8)
    with pytest.raises(InvalidArgument, match="at least one"):
        kcopy.KvCopyTable([])
    with pytest.raises(ShapeMismatch, match="3-D"):
        kcopy.KvCopyTable([bufs[0][0]])
    with pytest.raises(InvalidArgument, match="contiguous"):
        kcopy.KvCopyTable([bufs[0].transpose(1, 2)])
    table = kcopy.KvCopyTable(bufs)
    assert "buffers=2" in repr(table)
    with pytest.raises(ShapeMismatch, match="differ"):
        table.move(torch.tensor([1, 2], device=DEVICE), torch.tensor([3], device=DEVICE))
    with pytest.raises(InvalidArgument, match="int32 or int64"):
        table.move(torch.tensor([1.0], device=DEVICE), torch.tensor([3], device=DEVICE))
