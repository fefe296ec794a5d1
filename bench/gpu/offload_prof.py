"""Host cost of one 16 MiB fused offload, step by step (issue 15): wraps the steps of
``OffloadManager.offload`` with perf_counter accumulators (no profiler) on a per-layer MHA pool.
``PYTHONPATH=<tree> python3 bench/gpu/offload_prof.py``."""

import collections
import os
import statistics
import time

import torch

import kvxfer.kernels.piece_copy as pc
import kvxfer.pools.offload.fused as fu
import kvxfer.pools.offload.manager as man
from kvxfer.bench.offload import make_pool
from kvxfer.pools.offload import OffloadManager

acc = collections.Counter()


def wrap(obj, name, label):
    f = getattr(obj, name)

    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t0

    setattr(obj, name, w)


pool = make_pool(
    "mha",
    20,
    page_size=16,
    layers=32,
    heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    device=os.environ.get("DEV", "cuda"),
    mamba_slots=4,
)
mgr = OffloadManager(pool, num_host_pages=8)
src = list(range(1, 9))
wrap(man, "as_id_array", "as_id_array")
wrap(OffloadManager, "_target_views", "_target_views")
wrap(man, "check_ids", "check_ids")
wrap(type(mgr.host), "alloc", "host.alloc")
wrap(man, "expand_extents", "expand_extents")
wrap(type(mgr.host), "live_fences", "live_fences")
wrap(man, "contiguous_runs", "contiguous_runs")
wrap(OffloadManager, "_use_fused", "_use_fused")
wrap(fu.FusedCopier, "plan", "fused.plan")
wrap(fu, "copy_tasks", "copy_tasks (check+launch)")
wrap(pc, "check_alignment", "  check_alignment")
wrap(torch.Tensor, "pin_memory", "pin_memory")
wrap(torch.Tensor, "to", "to(device)")
wrap(torch.cuda.Stream, "wait_stream", "wait_stream")
wrap(torch.cuda.Event, "record", "Event.record")
wrap(torch.cuda, "current_stream", "current_stream")
wrap(torch.cuda, "stream", "torch.cuda.stream()")
wrap(OffloadManager, "_issue", "_issue (total)")
wrap(OffloadManager, "offload", "offload (total)")
for _ in range(50):
    mgr.offload(src).wait().discard()
acc.clear()
calls, n = [], 300
for _ in range(n):
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    h = mgr.offload(src)
    calls.append(time.perf_counter() - t0)
    h.wait().discard()
print(f"offload() call p50 {statistics.median(calls) * 1e6:.1f} us (wrapped)")
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"{k:32s} {v / n * 1e6:8.1f} us")
