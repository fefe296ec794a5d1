"""Host cost of one offload, step by step (issue 15): wraps the steps of
``OffloadManager.offload`` with perf_counter accumulators (no profiler) on a per-layer MHA pool
(32 layers x K/V = 64 buffers, 16-token pages), then the floor of the same copy through the
driver alone (events + one cuMemcpyBatchAsync, tasks planned beforehand) next to one pinned
``copy_`` — each from an idle device, as ``kvxfer bench offload`` times them.
``PYTHONPATH=<tree> python3 bench/gpu/offload_prof.py [pages ...]`` (default 8 32: 16, 64 MiB)."""

import collections
import statistics
import sys
import time

import numpy as np
import torch

import kvxfer.kernels.cuda_driver as cd
import kvxfer.pools.offload.fused as fu
import kvxfer.pools.offload.handle as hd
import kvxfer.pools.offload.manager as man
from kvxfer.bench.offload import make_pool
from kvxfer.pools.offload import OffloadManager
from kvxfer.pools.offload.runs import contiguous_runs, expand_extents

acc = collections.Counter()


def wrap(obj, name, label):
    f = getattr(obj, name, None)
    if f is None:  # an older tree without this step
        return None

    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, name, w)
    return f


def med_us(xs):
    return statistics.median(xs) * 1e6


def one_size(pages: int, n: int = 200) -> None:
    pool = make_pool(
        "mha",
        2 * pages + 4,
        page_size=16,
        layers=32,
        heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        device="cuda",
        mamba_slots=4,
    )
    mgr = OffloadManager(pool, num_host_pages=pages)
    src = list(range(1, 1 + pages))
    nbytes = pages * mgr.host.page_bytes
    h = mgr.offload(src).wait()
    print(f"\n## {pages} pages = {nbytes / 2**20:.0f} MiB, path {h.path}, {h.num_chunks} pieces")
    h.discard()
    # 1. wall of offload().wait() vs copy_ + sync, alternating, from an idle device
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    t_off, t_cp, t_call = [], [], []
    for i in range(n + 20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        h = mgr.offload(src)
        t3 = time.perf_counter()
        h.wait()
        t4 = time.perf_counter()
        h.discard()
        if i >= 20:
            t_cp.append(t1 - t0)
            t_off.append(t4 - t2)
            t_call.append(t3 - t2)
    print(
        f"copy_+sync p50 {med_us(t_cp):.1f} us; offload().wait() p50 {med_us(t_off):.1f} us "
        f"(x{statistics.median(t_cp) / statistics.median(t_off):.2f}); offload() call alone "
        f"p50 {med_us(t_call):.1f} us"
    )
    # 2. the floor: driver events + one cuMemcpyBatchAsync of the same planned pieces
    cu = cd.driver()
    d2h = torch.cuda.Stream()
    s = d2h.cuda_stream
    ev_a = cd.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "ev")
    ev_b = cd.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "ev")
    kv, _ = mgr._views
    blk = mgr.host.alloc(pages, 0)
    runs = contiguous_runs(np.asarray(src, dtype=np.int64), expand_extents(blk.pages))
    parts = [(kv, mgr.host.page_views, runs)]
    if hasattr(mgr._fused_out, "pieces"):
        p_dst, p_src, p_n = mgr._fused_out.pieces(parts)
    else:  # an older tree
        t = mgr._fused_out.plan(parts, whole=True)[0]
        p_dst, p_src, p_n = (np.ascontiguousarray(t[:, i]) for i in (1, 0, 2))
    t_fl, t_post = [], []
    for i in range(n + 20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cur = torch.cuda.current_stream().cuda_stream
        cu.cuEventRecord(ev_a, cur)
        cu.cuStreamWaitEvent(s, ev_a, 0)
        cd.memcpy_batch_async(p_dst, p_src, p_n, s, 0, dst_host=True)
        cu.cuEventRecord(ev_b, s)
        t1 = time.perf_counter()
        cu.cuEventSynchronize(ev_b)
        t2 = time.perf_counter()
        if i >= 20:
            t_fl.append(t2 - t0)
            t_post.append(t1 - t0)
    mgr.host.free(blk)
    print(
        f"floor (driver events + batch, planned): p50 {med_us(t_fl):.1f} us "
        f"(x{statistics.median(t_cp) / statistics.median(t_fl):.2f} of copy_), post {med_us(t_post):.1f} us"
    )
    # 3. the manager's steps (wrapped), offload() call only
    saved = [
        (man, "as_id_array", wrap(man, "as_id_array", "as_id_array")),
        (OffloadManager, "_target_views", wrap(OffloadManager, "_target_views", "_target_views")),
        (man, "check_ids", wrap(man, "check_ids", "check_ids")),
        (type(mgr.host), "alloc", wrap(type(mgr.host), "alloc", "host.alloc")),
        (man, "expand_extents", wrap(man, "expand_extents", "expand_extents")),
        (man, "pair_runs", wrap(man, "pair_runs", "pair_runs")),
        (OffloadManager, "_checked", wrap(OffloadManager, "_checked", "_checked (views + ids)")),
        (type(mgr.host), "live_fences", wrap(type(mgr.host), "live_fences", "live_fences")),
        (man, "contiguous_runs", wrap(man, "contiguous_runs", "contiguous_runs")),
        (hd.OffloadHandle, "__init__", wrap(hd.OffloadHandle, "__init__", "OffloadHandle()")),
        (fu.FusedCopier, "plan", wrap(fu.FusedCopier, "plan", "fused.plan")),
        (fu.FusedCopier, "pieces", wrap(fu.FusedCopier, "pieces", "fused.pieces")),
        (fu, "memcpy_batch_async", wrap(fu, "memcpy_batch_async", "memcpy_batch_async")),
        (
            getattr(cd, "StreamLink", None),
            "order",
            wrap(getattr(cd, "StreamLink", None), "order", "StreamLink.order"),
        ),
        (
            OffloadManager,
            "_current_stream",
            wrap(OffloadManager, "_current_stream", "_current_stream"),
        ),
        (fu, "copy_tasks", wrap(fu, "copy_tasks", "copy_tasks (check+launch)")),
        (torch.cuda.Stream, "wait_stream", wrap(torch.cuda.Stream, "wait_stream", "wait_stream")),
        (torch.cuda.Event, "record", wrap(torch.cuda.Event, "record", "Event.record")),
        (torch.cuda, "current_stream", wrap(torch.cuda, "current_stream", "current_stream")),
        (torch.cuda, "stream", wrap(torch.cuda, "stream", "torch.cuda.stream()")),
        (OffloadManager, "_issue", wrap(OffloadManager, "_issue", "_issue (total)")),
        (OffloadManager, "offload", wrap(OffloadManager, "offload", "offload (total)")),
    ]
    acc.clear()
    for _ in range(n):
        torch.cuda.synchronize()
        mgr.offload(src).wait().discard()
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:32s} {v / n * 1e6:8.1f} us")
    for obj, name, f in saved:
        if f is not None:
            setattr(obj, name, f)
    mgr.close()


if __name__ == "__main__":
    print(f"# offload host path ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    for p in [int(a) for a in sys.argv[1:]] or [8, 32]:
        one_size(p)
