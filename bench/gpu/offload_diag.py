"""Where the time of a 16-64 MiB offload goes on the GPU (issue 15): for a per-layer MHA
pool (64 buffers), contiguous pages, device -> pinned host, host wall time (idle device to
completion, median of 20) of: one pinned ``copy_`` of the same bytes (the baseline); the
manager's ``offload().wait()``; its pieces alone — the fused kernel with a pre-uploaded table,
``torch._foreach_copy_`` of the 64 runs, ``cuMemcpyBatchAsync`` of the 64 runs, and a
``copy_`` per run. ``PYTHONPATH=<tree> python3 bench/gpu/offload_diag.py``."""

import statistics
import time

import numpy as np
import torch

from kvxfer.bench.offload import make_pool
from kvxfer.kernels.piece_copy import copy_tasks
from kvxfer.pools.offload import OffloadManager


def timed(fn, n=20):
    ts = []
    for _ in range(n + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:])


def batch_fn(dsts, srcs, sizes, stream):
    from cuda.bindings import driver as cu

    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    n = len(dsts)
    tries = [
        lambda: cu.cuMemcpyBatchAsync(dsts, srcs, sizes, n, [attr], [0], 1, stream),
        lambda: cu.cuMemcpyBatchAsync(dsts, srcs, sizes, n, [attr], [0], 1, cu.CUstream(stream)),
    ]
    for f in tries:
        try:
            r = f()
        except TypeError as exc:
            last = exc
            continue
        err = r[0] if isinstance(r, tuple) else r
        if int(err) != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
        return f
    raise last


def run(pages):
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
    views = list(pool.get_item_views())
    nbytes = pages * sum(int(v.shape[1]) for v in views)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    blk = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # the same 64 runs into one pinned host block (run b: view b rows [1, 1+pages))
    dpieces, hpieces, off = [], [], 0
    for v in views:
        n = pages * int(v.shape[1])
        dpieces.append(v[1 : 1 + pages].reshape(-1))
        hpieces.append(blk[off : off + n])
        off += n
    tasks = np.array(
        [[d.data_ptr(), h.data_ptr(), d.numel()] for d, h in zip(dpieces, hpieces)], dtype=np.int64
    )
    # split into 1 MiB tiles like the manager
    tiles = []
    for s, d, n in tasks.tolist():
        for o in range(0, n, 1 << 20):
            tiles.append([s + o, d + o, min(1 << 20, n - o)])
    tiles_np = np.array(tiles, dtype=np.int64)
    tdev = torch.from_numpy(tiles_np).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    res = {}
    res["copy_ (1 op, baseline)"] = timed(lambda: host.copy_(dev, non_blocking=True))
    res["manager offload().wait()"] = timed(lambda: mgr.offload(src).wait().discard())
    res["kernel alone (table on device)"] = timed(lambda: copy_tasks(tdev, 16, host_tasks=tiles_np))
    res["_foreach_copy_ of the runs"] = timed(
        lambda: torch._foreach_copy_(hpieces, dpieces, non_blocking=True)
    )
    res["copy_ per run"] = timed(
        lambda: [h.copy_(d, non_blocking=True) for h, d in zip(hpieces, dpieces)]
    )
    try:
        f = batch_fn(
            [int(x) for x in tasks[:, 1]],
            [int(x) for x in tasks[:, 0]],
            [int(x) for x in tasks[:, 2]],
            stream,
        )
        res["cuMemcpyBatchAsync of the runs"] = timed(f)
        bi = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            bi.append(time.perf_counter() - t0)
        print(f"cuMemcpyBatchAsync issue-only {statistics.median(bi) * 1e6:.1f} us")
        assert torch.equal(blk[: dpieces[0].numel()].cpu(), dpieces[0].cpu())
    except Exception as exc:  # noqa: BLE001
        print("cuMemcpyBatchAsync unusable:", type(exc).__name__, exc)

    iss = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        copy_tasks(tdev, 16, host_tasks=tiles_np)
        iss.append(time.perf_counter() - t0)
    iss = statistics.median(iss)
    base = res["copy_ (1 op, baseline)"]
    print(
        f"\n{nbytes / 2**20:.0f} MiB, {len(views)} buffers, {len(tiles)} tiles; kernel issue-only {iss * 1e6:.1f} us"
    )
    print("| what | µs | GB/s | × copy_ |\n|---|---:|---:|---:|")
    for k, t in res.items():
        print(f"| {k} | {t * 1e6:.1f} | {nbytes / t / 1e9:.1f} | {base / t:.2f} |")
    mgr.close()
    torch.cuda.empty_cache()


for pages in (8, 32, 128):
    run(pages)
