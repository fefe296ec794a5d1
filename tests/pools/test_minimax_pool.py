"""MiniMaxSparseKVPool: layer routing, the fused store giving the same bytes as the separate
stores (K/V and K-only index groups, Triton and torch), registration of main + index buffers,
one-launch moves over all of them, host copy -> restore into other slots, and KVWriteLoc."""

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
from kvxfer.pools.minimax import MiniMaxSparseKVPool
from kvxfer.pools.write_loc import KVWriteLoc, unwrap_write_loc

pytestmark = pytest.mark.timeout(90)

SIZE, PS, H, D, DI = 16, 4, 2, 8, 4
DENSE, SPARSE, NO_V = [0, 2], [1, 3, 4], [3]


def make(**kw):
    kw.setdefault("disable_value_sparse_layer_ids", NO_V)
    return MiniMaxSparseKVPool(SIZE, PS, torch.bfloat16, H, D, DI, DENSE, SPARSE, DEVICE, **kw)


def rnd(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


def inputs(n, seed):
    return (
        rnd((n, H, D), seed),
        rnd((n, H, D), seed + 1),
        rnd((n, 1, DI), seed + 2),
        rnd((n, 1, DI), seed + 3),
    )


def test_layer_routing_and_sub_pools():
    p = make(start_layer=None)
    assert (p.start_layer, p.layer_num) == (0, 5)
    assert p.dense_layer_ids == DENSE and p.sparse_layer_ids == SPARSE
    assert p.index_kv_layer_id_mapping == {1: 0, 4: 1} and p.index_k_layer_id_mapping == {3: 0}
    assert p.index_kv_pool.layer_num == 2 and p.index_k_pool.layer_num == 1
    k, v, ik, iv = inputs(2, 1)
    p.set_kv_buffer(2, loc([5, 6]), k, v)  # dense: main only
    assert torch.equal(p.get_key_buffer(2)[[5, 6]], k.to(torch.bfloat16))
    p.set_index_kv_buffer(4, loc([5, 6]), ik, iv)
    assert torch.equal(p.get_index_kv_buffer(4)[1][[5, 6]], iv.to(torch.bfloat16))
    assert torch.equal(p.get_index_k_buffer(4)[[5, 6]], ik.to(torch.bfloat16))
    p.set_index_k_buffer(3, loc([7]), ik[:1])
    assert torch.equal(p.get_index_k_buffer(3)[7], ik[0].to(torch.bfloat16))
    with pytest.raises(InvalidArgument, match="index V"):
        p.get_index_kv_buffer(3)
    with pytest.raises(InvalidArgument, match="K-only"):
        p.set_index_k_buffer(1, loc([7]), ik[:1])
    with pytest.raises(InvalidArgument):
        p.get_index_k_buffer(0)  # dense layer
    with pytest.raises(IndexOutOfRange):
        p.get_key_buffer(5)
    with pytest.raises(InvalidArgument, match="idx_v"):
        p.set_fused_kv_index_buffer(3, loc([1]), k[:1], v[:1], ik[:1], iv[:1])
    with pytest.raises(InvalidArgument, match="idx_v"):
        p.set_fused_kv_index_buffer(1, loc([1]), k[:1], v[:1], ik[:1])


def test_construction_errors():
    with pytest.raises(InvalidArgument, match="both"):
        MiniMaxSparseKVPool(SIZE, PS, torch.float16, H, D, DI, [0, 1], [1], DEVICE)
    with pytest.raises(InvalidArgument, match="gaps"):
        MiniMaxSparseKVPool(SIZE, PS, torch.float16, H, D, DI, [0], [2], DEVICE)
    with pytest.raises(InvalidArgument, match="not sparse"):
        MiniMaxSparseKVPool(
            SIZE, PS, torch.float16, H, D, DI, [0], [1], DEVICE, disable_value_sparse_layer_ids=[0]
        )
    # a pipeline stage: only layers 2..4 are local
    p = MiniMaxSparseKVPool(
        SIZE, PS, torch.float16, H, D, DI, DENSE, SPARSE, DEVICE, start_layer=2, end_layer=4
    )
    assert p.layer_num == 3 and p.dense_layer_ids == [2] and p.sparse_layer_ids == [3, 4]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_store_equals_separate_stores(backend):
    fused, separate = make(kernel_backend=backend), make(kernel_backend=backend, fuse_store=False)
    assert fused.can_fuse_store(1) and not separate.can_fuse_store(1)
    for p in (fused, separate):
        k, v, ik, iv = inputs(3, 10)
        p.set_fused_kv_index_buffer(1, loc([4, 9, 17]), k, v, ik, iv)  # index K/V layer
        k, v, ik, _ = inputs(2, 20)
        p.set_fused_kv_index_buffer(3, KVWriteLoc(loc([5, 6])), k, v, ik)  # K-only layer
    views_f, views_s = fused.get_item_views(), separate.get_item_views()
    for a, b in zip(views_f, views_s):
        assert torch.equal(a, b)
    touched = [i for i, v in enumerate(views_f) if bool(v.any())]
    names = [d.name for d in fused.get_buffer_descs()]
    assert [names[i] for i in touched] == [
        "main.k1",
        "main.k3",
        "main.v1",
        "main.v3",
        "index_kv.k0",
        "index_kv.v0",
        "index_k.k0",
    ]
    k, v, ik, iv = inputs(3, 10)
    assert torch.equal(fused.get_index_kv_buffer(1)[0][[4, 9, 17]], ik.to(torch.bfloat16))
    assert torch.equal(fused.get_value_buffer(1)[[4, 9, 17]], v.to(torch.bfloat16))


def test_fused_store_bounds_write_nothing():
    p = make()
    k, v, ik, iv = inputs(2, 30)
    if ON_CUDA:  # no raise, no sync: row 1 is written everywhere, the out-of-range row nowhere
        p.set_fused_kv_index_buffer(1, loc([1, SIZE + PS]), k, v, ik, iv)
        twin = make()
        twin.set_fused_kv_index_buffer(1, loc([1]), k[:1], v[:1], ik[:1], iv[:1])
        assert_same_views(p.get_item_views(), twin.get_item_views())
        assert any(bool(x.any()) for x in twin.get_item_views())  # row 1 landed
    before = views_snapshot(p.get_item_views())
    if not ON_CUDA:
        with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
            p.set_fused_kv_index_buffer(1, loc([1, SIZE + PS]), k, v, ik, iv)
    with pytest.raises(ShapeMismatch):
        p.set_fused_kv_index_buffer(1, loc([1, 2]), k, v, ik[:, :, :2], iv)
    assert all(torch.equal(a, b) for a, b in zip(before, p.get_item_views()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_fused_and_separate_paths_refuse_bad_index_input_before_any_write(dtype):
    """fuse_store=False must not write the main K/V rows when an index input is refused:
    both paths leave identical bytes after good writes AND after each refusal."""
    pools = [
        MiniMaxSparseKVPool(
            SIZE,
            PS,
            dtype,
            H,
            D,
            DI,
            DENSE,
            SPARSE,
            DEVICE,
            disable_value_sparse_layer_ids=NO_V,
            fuse_store=fuse,
        )
        for fuse in (True, False)
    ]
    k, v, ik, iv = inputs(3, 90)
    ids = loc([4, 9, 17])
    bad_calls = [  # (layer, k, v, idx_k, idx_v)
        (1, k, v, rnd((3, 1, DI + 1), 91), iv),  # index K of the wrong width
        (1, k, v, ik, iv[:2]),  # index V: 2 rows for 3 ids
        (3, k, v, rnd((3, 2, DI), 92), None),  # K-only index K with the wrong head count
    ]
    for p in pools:
        p.set_fused_kv_index_buffer(1, loc([2, 3, 5]), *inputs(3, 93))  # some prior content
        before = views_snapshot(p.get_item_views())
        for layer, *args in bad_calls:
            with pytest.raises(ShapeMismatch):
                p.set_fused_kv_index_buffer(layer, ids, *args)
            assert_same_views(p.get_item_views(), before)
        if not ON_CUDA:
            with pytest.raises(IndexOutOfRange, match=str(SIZE + PS)):
                p.set_fused_kv_index_buffer(3, loc([1, 2, SIZE + PS]), k, v, ik)
            assert_same_views(p.get_item_views(), before)
        p.set_fused_kv_index_buffer(3, ids, k, v, ik)
    assert_same_views(pools[0].get_item_views(), pools[1].get_item_views())


def test_registration_lists_main_then_index_buffers():
    p = make()
    views = check_registration(p)
    names = [d.name for d in p.get_buffer_descs()]
    assert names == [f"main.k{i}" for i in range(5)] + [f"main.v{i}" for i in range(5)] + [
        "index_kv.k0",
        "index_kv.k1",
        "index_kv.v0",
        "index_kv.v1",
        "index_k.k0",
    ]
    ptrs, lens, items = p.get_contiguous_buf_infos()
    mp, ml, mi = p.get_main_buf_infos()
    ip, il, ii = p.get_index_buf_infos()
    assert (mp + ip, ml + il, mi + ii) == (ptrs, lens, items)
    assert mi == [PS * H * D * 2] * 10 and ii == [PS * DI * 2] * 5
    assert all(v.shape[0] == views[0].shape[0] for v in views)  # same page ids everywhere
    d = p.describe()
    assert d["kind"] == "minimax_sparse" and d["k_only_sparse_layer_ids"] == NO_V
    assert d["sparse_layer_ids"] == SPARSE and d["idx_head_dim"] == DI
    assert p.get_kv_size_bytes() == sum(lens)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_move_covers_main_and_index_buffers(backend):
    p = make(kernel_backend=backend)
    src, tgt = loc([4, 5]), loc([14, 19])
    for layer in SPARSE:
        k, v, ik, iv = inputs(2, 40 + layer)
        p.set_fused_kv_index_buffer(layer, src, k, v, ik, None if layer in NO_V else iv)
    for layer in DENSE:
        k, v, _, _ = inputs(2, 50 + layer)
        p.set_kv_buffer(layer, src, k, v)
    snap = [v.clone() for v in p.get_item_views()]
    p.move_kv_cache(tgt, src)
    bufs = [t for t, _ in p._registered()]
    for before, buf in zip(snap, bufs):
        rows = before.view(-1).view(buf.dtype).view(buf.shape)  # the pre-move bytes
        assert torch.equal(buf[tgt], rows[src]) and torch.equal(buf[src], rows[src])


def test_copy_restore_into_other_slots():
    p = make()
    src, dst = loc([4, 5, 6]), loc([16, 1, 11])
    for layer in SPARSE:
        k, v, ik, iv = inputs(3, 60 + layer)
        p.set_fused_kv_index_buffer(layer, src, k, v, ik, None if layer in NO_V else iv)
    bufs = [t for t, _ in p._registered()]
    want = [b[src].clone() for b in bufs]
    copy = p.get_cpu_copy(src)
    assert len(copy.tensors) == len(bufs)
    for layer in SPARSE:  # a new owner of src
        k, v, ik, iv = inputs(3, 70 + layer)
        p.set_fused_kv_index_buffer(layer, src, k, v, ik, None if layer in NO_V else iv)
    p.load_cpu_copy(copy, dst)
    for b, w in zip(bufs, want):
        assert torch.equal(b[dst], w)


def test_kv_write_loc():
    a = loc([3, 4])
    w = KVWriteLoc(a, swa_loc=loc([7, 8, 9]), full_loc=loc([1, 2]))
    assert w.swa_loc.tolist() == [7, 8] and len(w) == 2
    assert unwrap_write_loc(w) == (w.loc, w.swa_loc, w.full_loc)
    assert unwrap_write_loc(a) == (a, None, None)
    with pytest.raises(ShapeMismatch, match="full_loc"):
        KVWriteLoc(a, full_loc=loc([1]))
    with pytest.raises(ShapeMismatch):
        KVWriteLoc(loc([[1, 2]]))
    with pytest.raises(InvalidArgument):
        KVWriteLoc([1, 2])
    with force_backend("torch"):
        p = make()
        k, v, _, _ = inputs(2, 80)
        p.set_kv_buffer(0, w, k, v)
        assert torch.equal(p.get_key_buffer(0)[a], k.to(torch.bfloat16))
