"""Host memory accounting (leak test), abort/discard, stream ordering on CUDA."""

import random

import pytest
import torch
from offload_helpers import DEVICE, is_page_locked, make_pool, randomize, snapshot, views

from kvxfer.kernels.errors import OutOfMemory
from kvxfer.pools.offload import OffloadManager, OffloadState

pytestmark = pytest.mark.timeout(120)


def _rows(pool, nkv, pages, slots):
    out = []
    for i, v in enumerate(views(pool)[0]):
        ids = pages if i < nkv else slots
        out.append(v[torch.as_tensor(list(ids), device=v.device, dtype=torch.long)].cpu().clone())
    return out


@pytest.mark.parametrize(
    "kind,seed,staging",
    [
        ("hybrid_envelope", 0, None),
        ("hybrid_per_layer", 1, 4096),
        ("page_major", 2, None),
        ("mha", 3, 2048),
    ],
)
def test_host_pool_returns_to_empty_after_any_sequence(kind, seed, staging):
    """Random offload / restore / discard / abort (discard while possibly in flight), with
    the real page and slot allocators; host usage always equals what live handles hold,
    every restore is byte-exact, and the host pool ends empty."""
    from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator
    from kvxfer.pools.mamba_alloc import MambaSlotAllocator

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_pages, num_slots = 40, 10
    pool = make_pool(kind, num_pages=num_pages, num_slots=num_slots)
    randomize(pool, gen)
    nviews, nkv = views(pool)
    has_state = len(nviews) > nkv
    pages_alloc = PagedTokenToKVPoolAllocator((num_pages - 1) * 4, 4)
    slots_alloc = MambaSlotAllocator(num_slots - 1) if has_state else None
    extra = (
        {}
        if staging is None  # default paths (fused on CUDA for fragmented requests)
        else dict(staging_bytes=staging, min_chunk_bytes=1 << 30, fused=False)
    )
    mgr = OffloadManager(pool, num_host_pages=16, num_host_slots=4 if has_state else 0, **extra)
    live = {}  # handle -> expected rows
    counts = {"restore": 0, "discard": 0, "abort": 0, "oom": 0}
    for step in range(120):
        op = rng.random()
        if op < 0.45 or not live:
            n = rng.randint(1, 7)
            pages = pages_alloc.alloc_pages(n)
            if pages is None:
                continue
            slots = (slots_alloc.alloc(1) or []) if has_state and rng.random() < 0.7 else []
            pages = pages.tolist()
            rng.shuffle(pages)
            want = _rows(pool, nkv, pages, slots)
            used = (mgr.host.used_pages, mgr.host.used_slots)
            try:
                h = mgr.offload(pages, slots)
            except OutOfMemory:
                counts["oom"] += 1
                assert (mgr.host.used_pages, mgr.host.used_slots) == used
            else:
                if rng.random() < 0.15:  # abort right away: the copy may still be in flight
                    mgr.abort(h)
                    counts["abort"] += 1
                    assert h.state is OffloadState.DISCARDED
                else:
                    live[h] = want
                    # the scheduler frees device pages once the offload is ordered
                    h.order_before()
            pages_alloc.free_pages(torch.tensor(pages))
            if slots:
                slots_alloc.free(slots)
        elif op < 0.75:
            h = rng.choice(list(live))
            new_pages = pages_alloc.alloc_pages(h.num_pages)
            new_slots = slots_alloc.alloc(h.num_slots) if h.num_slots else []
            if new_pages is None or new_slots is None:
                if new_pages is not None:
                    pages_alloc.free_pages(new_pages)
                continue
            mgr.restore(h, new_pages, new_slots).wait()
            got = _rows(pool, nkv, new_pages.tolist(), new_slots)
            for a, b in zip(got, live.pop(h)):
                assert torch.equal(a, b), f"step {step}: restored bytes differ"
            counts["restore"] += 1
            fill = int(torch.randint(0, 256, (1,), generator=gen))  # the pages get rewritten
            for i, v in enumerate(views(pool)[0]):
                ids = new_pages.tolist() if i < nkv else new_slots
                if ids:
                    v[torch.as_tensor(ids, device=v.device)] = fill
            pages_alloc.free_pages(new_pages)
            if new_slots:
                slots_alloc.free(new_slots)
        else:
            h = rng.choice(list(live))
            del live[h]
            mgr.discard(h)
            counts["discard"] += 1
        mgr.host.check_invariants()
        assert mgr.host.used_pages == sum(h.num_pages for h in live)
        assert mgr.host.used_slots == sum(h.num_slots for h in live)
        assert set(mgr.live_handles) == set(live)
    assert counts["restore"] and counts["discard"] and counts["abort"]
    if staging is not None:
        assert mgr.stats["staged"] > 0  # fragmented requests took the staged path
    mgr.close()
    assert mgr.host.is_empty and all(h.state is OffloadState.DISCARDED for h in live)


def _big_pool():
    return make_pool("mha", num_pages=320, head_dim=256, layers=4)


def test_offload_sees_writes_queued_before_it_and_restore_orders_reads():
    pool = _big_pool()
    kv, nkv = views(pool)
    src, dst = list(range(1, 129)), list(range(150, 278))
    mgr = OffloadManager(pool, num_host_pages=128)
    idx = torch.as_tensor(src, device=kv[0].device)
    for i, v in enumerate(kv):  # queued on the current stream just before the offload
        v[idx] = (i + 7) % 256
    h = mgr.offload(src)
    for v in kv:  # queued after: must not leak into the host copy once ordered after it
        h.order_before()
        v[idx] = 0
    mgr.restore(h, dst)
    h.order_before()  # reads on the current stream see the restored pages
    didx = torch.as_tensor(dst, device=kv[0].device)
    sums = [v[didx].to(torch.int64).sum() for v in kv]
    for i, (s, v) in enumerate(zip(sums, kv)):
        assert int(s) == (i + 7) % 256 * len(dst) * v.shape[1]


def test_restore_freed_host_pages_reused_by_next_offload():
    """Restore returns host pages at once; an offload reusing them must not overwrite them
    before the pending restore has read them (fence)."""
    gen = torch.Generator().manual_seed(9)
    pool = _big_pool()
    randomize(pool, gen)
    kv, nkv = views(pool)
    a_src, b_src = list(range(1, 101)), list(range(101, 201))
    a_dst, b_dst = list(range(201, 301)), list(range(1, 101))
    orig = snapshot(pool)
    mgr = OffloadManager(pool, num_host_pages=100)
    ha = mgr.offload(a_src)
    mgr.restore(ha, a_dst)  # not waited
    assert mgr.host.is_empty
    hb = mgr.offload(b_src)  # same host pages
    assert hb.block.pages == [(0, 100)]
    mgr.restore(hb, b_dst).wait()
    ha.wait()
    after = snapshot(pool)
    for o, n in zip(orig, after):
        assert torch.equal(n[a_dst], o[a_src])
        assert torch.equal(n[b_dst], o[b_src])


def test_discard_in_flight_then_reuse():
    gen = torch.Generator().manual_seed(10)
    pool = _big_pool()
    randomize(pool, gen)
    orig = snapshot(pool)
    mgr = OffloadManager(pool, num_host_pages=128)
    h = mgr.offload(list(range(1, 129)))
    mgr.discard(h)  # possibly still copying
    assert mgr.host.is_empty and h.done() and h.state is OffloadState.DISCARDED
    h2 = mgr.offload(list(range(129, 257)))
    mgr.restore(h2, list(range(1, 129))).wait()
    after = snapshot(pool)
    for o, n in zip(orig, after):
        assert torch.equal(n[1:129], o[129:257])


@pytest.mark.skipif(DEVICE != "cuda", reason="streams and events exist on CUDA only")
def test_cuda_hot_path_never_synchronizes_the_device(monkeypatch):
    pool = _big_pool()
    mgr = OffloadManager(pool, num_host_pages=64)
    assert mgr.host.pinned and is_page_locked(mgr.host.page_views[0])

    def forbidden(*a, **k):
        raise AssertionError("device-wide synchronize on the hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    h = mgr.offload(list(range(1, 65)))
    assert h.event is not None
    h.poll()
    h2 = mgr.restore(h, list(range(100, 164)))
    h2.order_before()
    h3 = mgr.offload(list(range(200, 232)))
    mgr.discard(h3)
    monkeypatch.undo()
    h.wait()
    assert h.state is OffloadState.RESTORED and mgr.host.is_empty


@pytest.mark.skipif(DEVICE != "cuda", reason="streams and events exist on CUDA only")
@pytest.mark.parametrize("path", ["batch", "fused", "direct"])
def test_copies_wait_for_the_callers_current_stream(path):
    """An offload reads its pages only after the work queued on the caller's current stream
    (a side stream here), and a restore writes its pages only after it: the stream order is
    kept by the manager's driver-event link, whichever path moves the bytes."""
    pool = _big_pool()
    kw = {
        "batch": dict(batch_min_piece_bytes=1),
        "fused": dict(fused=True, batch_min_piece_bytes=0),
    }
    mgr = OffloadManager(pool, num_host_pages=8, **kw.get(path, dict(fused=False)))
    kv = mgr._views[0]
    side = torch.cuda.Stream()
    pages = list(range(1, 9))
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the GPU busy on the caller's stream for a while
        for v in kv:
            v[1:9].fill_(0x5A)  # written last on that stream: the offload must see it
        h = mgr.offload(pages)
    h.wait()
    assert h.path == path
    assert all(bool((hv[:8] == 0x5A).all()) for hv in mgr.host.page_views)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        for v in kv:
            v[9:17].fill_(0x11)  # queued before the restore: the restore must land after it
        mgr.restore(h, list(range(9, 17))).wait()
    torch.cuda.synchronize()
    assert all(bool((v[9:17] == 0x5A).all()) for v in kv)
    mgr.close()


def test_stream_link_needs_a_driver():
    """Without a CUDA driver the link and the driver event are a typed CudaError (the
    manager then orders its streams through torch); with one the event answers as
    torch's does and the link orders a stream after another's queued work."""
    from kvxfer.kernels.cuda_driver import Event, StreamLink
    from kvxfer.kernels.errors import CudaError

    if DEVICE != "cuda":
        for make in (StreamLink, Event):
            with pytest.raises(CudaError):
                make(0)
        return
    link = StreamLink(torch.cuda.current_device())
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    with torch.cuda.stream(a):
        torch.cuda._sleep(20_000_000)
        x.fill_(7)
    ev = Event(torch.cuda.current_device())
    assert ev.query()  # never recorded: nothing to wait for
    ev.record(a)  # a torch stream or a handle
    assert not ev.query()  # the sleep still runs
    link.order(b.cuda_stream, a.cuda_stream)
    link.order(b.cuda_stream, b.cuda_stream)  # the same stream: nothing to do
    with torch.cuda.stream(b):
        y.copy_(x)
    ev.synchronize()
    assert ev.query()
    torch.cuda.synchronize()
    assert bool((y == 7).all())
    link.close()
    link.close()
    ev.close()
