"""Offload/restore over every pool kind: bytes, pages/slots remapping, chunking, validation."""

import asyncio

import numpy as np
import pytest
import torch
from offload_helpers import (
    ALL_KINDS,
    DEVICE,
    KV_KINDS,
    PAGE_SIZE,
    assert_same,
    clobber_rows,
    expected_after_restore,
    make_pool,
    randomize,
    snapshot,
    views,
)

from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, OutOfMemory, ShapeMismatch
from kvxfer.pools.offload import OffloadManager, OffloadState

pytestmark = pytest.mark.timeout(90)


def _has_kv(kind):
    return not kind.startswith("mamba_")


def _has_state(kind):
    return kind not in KV_KINDS


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_restore_into_different_pages_and_slots(kind):
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(kind)
    randomize(pool, gen)
    _, nkv = views(pool)
    src = [3, 4, 5, 9, 2, 14] if _has_kv(kind) else []
    dst = [20, 7, 8, 1, 10, 11] if _has_kv(kind) else []
    ssrc, sdst = ([2, 5], [6, 1]) if _has_state(kind) else ([], [])
    with OffloadManager(pool, num_host_pages=8, num_host_slots=2 if ssrc else 0) as mgr:
        orig = snapshot(pool)
        h = mgr.offload(src, ssrc)
        h.wait()
        assert h.state is OffloadState.OFFLOADED and h.num_pages == len(src)
        assert mgr.host.used_pages == len(src) and mgr.host.used_slots == len(ssrc)
        clobber_rows(pool, nkv, src + dst, ssrc + sdst, gen)  # the device copies are gone
        before = snapshot(pool)
        mgr.restore(h, torch.tensor(dst), np.array(sdst, dtype=np.int32)).wait()
        assert h.state is OffloadState.RESTORED and mgr.host.is_empty
        # targets hold the offloaded bytes; every other row of every buffer is untouched
        assert_same(
            snapshot(pool), expected_after_restore(before, orig, nkv, src, dst, ssrc, sdst), kind
        )


@pytest.mark.parametrize("kind", ["mha", "mha_hnd", "page_major", "mla", "hybrid_envelope"])
def test_partial_last_page_tokens_survive(kind):
    """A request of 2.5 pages written through the pool API reads back token-exact from its
    new pages (the oracle is the pool's own token-level ``get_cpu_copy``)."""
    gen = torch.Generator().manual_seed(2)
    pool = make_pool(kind)
    kv_pool = getattr(pool, "full_kv_pool", pool)
    n_tok = 2 * PAGE_SIZE + PAGE_SIZE // 2
    src_pages, dst_pages = [5, 6, 7], [12, 3, 9]

    def tokens(pages):
        t = [p * PAGE_SIZE + i for p in pages for i in range(PAGE_SIZE)]
        return torch.tensor(t[:n_tok], dtype=torch.int64)

    k_shape = tuple(kv_pool.get_key_buffer(kv_pool.start_layer).shape)
    for layer in range(kv_pool.start_layer, kv_pool.start_layer + kv_pool.layer_num):
        if kind == "mla":
            k = torch.randn((n_tok, 1, 24), generator=gen).to(torch.bfloat16)
            kv_pool.set_kv_buffer(layer, tokens(src_pages).to(DEVICE), k.to(DEVICE), None)
        else:
            H, D = kv_pool.head_num, kv_pool.head_dim
            k = torch.randn((n_tok, H, D), generator=gen).to(torch.bfloat16)
            v = torch.randn((n_tok, H, kv_pool.v_head_dim), generator=gen).to(torch.bfloat16)
            kv_pool.set_kv_buffer(layer, tokens(src_pages).to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    want = kv_pool.get_cpu_copy(tokens(src_pages))
    with OffloadManager(pool, num_host_pages=4, num_host_slots=1 if _has_state(kind) else 0) as mgr:
        h = mgr.offload(src_pages)
        h.order_before()  # the scheduler's duty before the pages are rewritten
        randomize(pool, gen)  # clobber everything on the device
        mgr.restore(h, dst_pages).wait()
        got = kv_pool.get_cpu_copy(tokens(dst_pages))
    assert len(got.tensors) == len(want.tensors) and len(want.tensors) > 0
    for a, b in zip(got.tensors, want.tensors):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert k_shape  # the pool really has layer buffers


@pytest.mark.parametrize(
    "kind", ["mha", "mha_hnd", "page_major", "mla", "hybrid_per_layer", "hybrid_envelope"]
)
def test_chunking_one_copy_per_run_per_buffer(kind):
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(kind, num_pages=40)
    randomize(pool, gen)
    nviews, nkv = views(pool)
    nbuf_kv, nbuf_st = nkv, len(nviews) - nkv
    if kind == "page_major":
        assert nbuf_kv == 1  # one chunk per page run across all layers
    with OffloadManager(
        pool,
        num_host_pages=12,
        num_host_slots=2 if _has_state(kind) else 0,
        staging_bytes=0,
        fused=False,
    ) as mgr:  # counts copy_ calls
        # one device run into one host extent: one chunk per buffer
        h1 = mgr.offload(list(range(10, 16)))
        assert h1.num_chunks == nbuf_kv and h1.block.pages == [(0, 6)]
        # three device runs (10..11, 30, 20..22) into one host extent
        h2 = mgr.offload([30, 31, 5, 20, 21, 22])
        assert h2.block.pages == [(6, 6)]
        assert h2.num_chunks == 3 * nbuf_kv
        mgr.discard(h1)  # host free: [0, 6)
        h3 = mgr.offload([1, 2, 3, 4])  # best fit into the 6-hole -> one run
        assert h3.block.pages == [(0, 4)] and h3.num_chunks == nbuf_kv
        # only 2 + ... free host pages in one extent [4, 6): a 2-page request stays one chunk
        h4 = mgr.offload([24, 25])
        assert h4.block.pages == [(4, 2)] and h4.num_chunks == nbuf_kv
        mgr.discard(h3)  # free: [0, 4)
        mgr.discard(h2)  # free: [0, 4) and [6, 12) -> a 7-page run must split into 2 host extents
        orig = snapshot(pool)
        src = list(range(32, 39))
        h5 = mgr.offload(src, [3] if nbuf_st else [])
        assert sorted(h5.block.pages) == [(0, 1), (6, 6)] or len(h5.block.pages) == 2
        assert h5.num_chunks == 2 * nbuf_kv + nbuf_st
        h5.wait()
        clobber_rows(pool, nkv, src, [3] if nbuf_st else [], gen)
        before = snapshot(pool)
        dst = [1, 2, 3, 4, 5, 6, 7]  # contiguous target: host split is the only boundary
        mgr.restore(h5, dst, [1] if nbuf_st else []).wait()
        assert h5.num_chunks == 2 * nbuf_kv + nbuf_st
        assert_same(
            snapshot(pool),
            expected_after_restore(
                before, orig, nkv, src, dst, [3] if nbuf_st else [], [1] if nbuf_st else []
            ),
        )
        mgr.discard(h4)
        assert mgr.host.is_empty


@pytest.mark.parametrize(
    "kind", ["mha", "mha_hnd", "page_major", "mla", "hybrid_per_layer", "hybrid_envelope"]
)
def test_concurrent_offloads_restored_out_of_order(kind):
    gen = torch.Generator().manual_seed(4)
    pool = make_pool(kind, num_pages=40, num_slots=8)
    randomize(pool, gen)
    _, nkv = views(pool)
    st = _has_state(kind)
    reqs = [([1, 2, 3], [1]), ([7, 5], [2]), ([10, 11, 12, 13, 30], [3]), ([20], [4])]
    targets = [([31, 32, 33], [5]), ([2, 1], [6]), ([14, 15, 16, 17, 18], [7]), ([3], [1])]
    with OffloadManager(pool, num_host_pages=11, num_host_slots=4 if st else 0) as mgr:
        orig = snapshot(pool)
        handles = [mgr.offload(p, s if st else []) for p, s in reqs]  # all in flight together
        assert len(mgr.live_handles) == 4

        async def wait_all():
            return await asyncio.gather(*handles)

        assert asyncio.run(asyncio.wait_for(wait_all(), 30)) == handles
        assert all(h.done() for h in handles)
        with pytest.raises(OutOfMemory):
            mgr.offload([25])  # 11 pages all held
        randomize(pool, gen)
        before = snapshot(pool)
        expected = before
        for i in (3, 1, 0, 2):
            p, s = targets[i]
            mgr.restore(handles[i], p, s if st else [])
            expected = expected_after_restore(
                expected, orig, nkv, reqs[i][0], p, reqs[i][1] if st else [], s if st else []
            )
        for h in handles:
            h.wait()
        assert_same(snapshot(pool), expected)
        assert mgr.host.is_empty and not mgr.live_handles


def test_validation_errors_write_nothing():
    gen = torch.Generator().manual_seed(5)
    pool = make_pool("hybrid_per_layer")
    randomize(pool, gen)
    mgr = OffloadManager(pool, num_host_pages=4, num_host_slots=1)
    h = mgr.offload([3, 4], [2]).wait()
    clobber_rows(pool, views(pool)[1], [3, 4], [2], gen)
    snap = snapshot(pool)
    with pytest.raises(ShapeMismatch, match="2 pages and 1 slots"):
        mgr.restore(h, [5, 6, 7], [1])
    with pytest.raises(ShapeMismatch):
        mgr.restore(h, [5, 6], [])
    with pytest.raises(IndexOutOfRange, match=r"new_pages\[1\] = 24"):
        mgr.restore(h, [5, 24], [1])
    with pytest.raises(IndexOutOfRange, match="= 0"):
        mgr.restore(h, [0, 5], [1])
    with pytest.raises(InvalidArgument, match="repeats id 5"):
        mgr.restore(h, [5, 5], [1])
    with pytest.raises(IndexOutOfRange, match="new_slots"):
        mgr.restore(h, [5, 6], [8])
    with pytest.raises(InvalidArgument, match="integers"):
        mgr.restore(h, [5.0, 6.0], [1])
    # a pool of another geometry (other head_dim, or other mamba layout)
    for other in (
        make_pool("hybrid_per_layer", head_dim=16),
        make_pool("hybrid_envelope"),
        make_pool("mha"),
    ):
        other_snap = snapshot(other)
        with pytest.raises(ShapeMismatch):
            mgr.restore(h, [5, 6], [1], pool=other)
        assert_same(snapshot(other), other_snap, "other pool")
    assert_same(snapshot(pool), snap, "validation wrote bytes")
    assert h.state is OffloadState.OFFLOADED and mgr.host.used_pages == 2
    # same geometry, different capacity: allowed
    twin = make_pool("hybrid_per_layer", num_pages=30, num_slots=12)
    mgr.restore(h, [25, 26], [10], pool=twin).wait()
    with pytest.raises(InvalidArgument, match="restored"):
        mgr.restore(h, [5, 6], [1])
    # offload-side errors take nothing
    with pytest.raises(IndexOutOfRange):
        mgr.offload([1, 99])
    with pytest.raises(OutOfMemory):
        mgr.offload([1, 2, 3, 4, 5])
    with pytest.raises(OutOfMemory):
        mgr.offload([1], [1, 2])
    with pytest.raises(InvalidArgument, match="nothing"):
        mgr.offload([])
    assert mgr.host.is_empty
    other_mgr = OffloadManager(make_pool("hybrid_per_layer"), num_host_pages=1, num_host_slots=1)
    h2 = other_mgr.offload([1]).wait()
    with pytest.raises(InvalidArgument, match="does not belong"):
        mgr.restore(h2, [1])
    with pytest.raises(InvalidArgument, match="does not belong"):
        mgr.discard(h2)
    h2.discard()
    h2.discard()  # idempotent
    with pytest.raises(InvalidArgument, match="discarded"):
        other_mgr.restore(h2, [1])
    assert other_mgr.host.is_empty


def test_kv_only_pool_rejects_state_and_host_geometry_checked():
    pool = make_pool("mha")
    mgr = OffloadManager(pool, num_host_pages=2)
    with pytest.raises(InvalidArgument, match="no such buffers"):
        mgr.offload([1], [1])
    from kvxfer.pools.offload import HostPool

    with pytest.raises(ShapeMismatch):
        OffloadManager(pool, HostPool([7], 2))
    shared = HostPool.for_views(views(pool)[0], num_pages=3)
    a, b = OffloadManager(pool, shared), OffloadManager(make_pool("mha"), shared)
    ha, hb = a.offload([1, 2]), b.offload([5])
    assert shared.used_pages == 3
    with pytest.raises(OutOfMemory):
        a.offload([3])
    a.discard(ha)
    b.close()  # discards hb, keeps the shared pool open
    assert shared.is_empty and hb.state is OffloadState.DISCARDED


@pytest.mark.parametrize("kind", ["mha", "page_major", "hybrid_envelope", "mla"])
def test_staged_path_for_fragmented_requests(kind):
    """Short runs go through the bounded staging buffer: batch by batch, split host extents,
    same bytes as the direct path; contiguous requests still copy directly."""
    gen = torch.Generator().manual_seed(6)
    pool = make_pool(kind, num_pages=40)
    randomize(pool, gen)
    nviews, nkv = views(pool)
    row = sum(int(v.shape[1]) for v in nviews[:nkv])
    st = _has_state(kind)
    mgr = OffloadManager(
        pool,
        num_host_pages=12,
        num_host_slots=2 if st else 0,
        staging_bytes=3 * row + 5,
        min_chunk_bytes=1 << 30,
        fused=False,
    )
    hold = mgr.offload([1, 2])  # host [0, 2)
    filler = mgr.offload([3])  # host [2, 3)
    mgr.discard(hold)  # free host: [0, 2) and [3, 12): the next 10-page request splits
    src = [30, 12, 14, 16, 5, 6, 7, 21, 38, 9]  # mostly one-page runs
    dst = [1, 3, 5, 7, 9, 11, 13, 15, 17, 19]
    orig = snapshot(pool)
    h = mgr.offload(src, [4] if st else [])
    assert h.staged and sorted(h.block.pages) == [(0, 1), (3, 9)]
    # batches of 3 pages: host ids [0,3,4] [5,6,7] [8,9,10] [11] -> 2+1+1+1 host runs
    assert h.num_chunks == 5 * nkv + (1 if st else 0) * (len(nviews) - nkv)
    h.wait()
    clobber_rows(pool, nkv, src + dst, [4, 6] if st else [], gen)
    before = snapshot(pool)
    mgr.restore(h, dst, [6] if st else []).wait()
    assert h.staged
    assert_same(
        snapshot(pool),
        expected_after_restore(before, orig, nkv, src, dst, [4] if st else [], [6] if st else []),
    )
    h2 = mgr.offload(list(range(20, 29)))  # one run: direct even with staging available
    assert h2.block.pages == [(3, 9)] and not h2.staged and h2.num_chunks == nkv
    mgr.close()
    assert mgr.host.is_empty and filler.state is OffloadState.DISCARDED


def test_failed_copy_launch_leaks_no_host_memory(monkeypatch):
    from kvxfer.pools.offload import copier

    pool = make_pool("mha")
    mgr = OffloadManager(pool, num_host_pages=4, fused=False)  # the copy_ path fails

    def boom(*a, **k):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(copier.Copier, "copy", boom)
    with pytest.raises(RuntimeError, match="launch failed"):
        mgr.offload([1, 2, 3])
    assert mgr.host.is_empty and not mgr.live_handles
    monkeypatch.undo()
    h = mgr.offload([1, 2, 3, 4])  # the whole pool is usable again
    assert h.block.pages == [(0, 4)]
