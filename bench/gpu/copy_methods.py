"""Which way of issuing a same-GPU copy of N runs reaches the copy limit (issue 15's large
requests), in one process, no UCX: the device lane's candidates, each timed from the first
host call to its event observed complete (spin), best and median of ``--iters``:

- ``copy_``: torch ``copy_`` of the same bytes as one contiguous block (the limit the
  benchmarks divide by, there with ``synchronize``);
- ``memcpy``: one ``cuMemcpyDtoDAsync`` per run (cuda-bindings);
- ``batch``: one ``cuMemcpyBatchAsync`` for all runs (:func:`kvxfer.kernels.cuda_driver.
  memcpy_batch_async`);
- ``kernel``: the lane's Triton ``copy_tasks`` launch (tile table built and uploaded).

    python3 bench/gpu/copy_methods.py [--device 0] [--iters 20] [--gap-ms 0] [--json FILE]

Shapes: one contiguous run of 16/128/512 MiB, 16 runs (per-layer contiguous), and random
64 KiB / 1 MiB runs of 16 and 128 MiB. ``--gap-ms``: sleep between iterations (a thread that
slept pays cold caches, as a serving loop does)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvxfer.kernels import cuda_driver  # noqa: E402

MiB = 1 << 20


def shapes(rng):
    out = []
    for total in (16 * MiB, 128 * MiB, 512 * MiB):
        out.append((f"{total // MiB} MiB x1", [0], [0], [total]))
        n = total // 16
        out.append((f"{total // MiB} MiB x16 contiguous", *_runs(range(16), range(16), n)))
    for total, run in ((16 * MiB, 64 << 10), (128 * MiB, 64 << 10), (128 * MiB, MiB)):
        k = total // run
        pool = 2048 if run == MiB else 8192
        src = rng.choice(pool, k, replace=False)
        dst = rng.choice(pool, k, replace=False)
        out.append((f"{total // MiB} MiB x{k} random {run >> 10} KiB", *_runs(src, dst, run)))
    return out


def _runs(src, dst, n):
    s = [int(i) * n for i in src]
    d = [int(i) * n for i in dst]
    return s, d, [n] * len(s)


def timed(fn, stream, iters, gap):
    post, total = [], []
    for i in range(iters + 2):
        if gap:
            time.sleep(gap)
        t0 = time.perf_counter()
        fn()
        ev = torch.cuda.Event()
        ev.record(stream)
        t1 = time.perf_counter()
        while not ev.query():
            pass
        t2 = time.perf_counter()
        if i >= 2:
            post.append((t1 - t0) * 1e6)
            total.append((t2 - t0) * 1e6)
    return {
        "post_p50_us": statistics.median(post),
        "best_us": min(total),
        "p50_us": statistics.median(total),
    }


def methods(sa, da, na, flat_s, flat_d, h):
    """The candidates for one shape, as closures (``h``: the stream handle)."""
    from kvxfer.engine.devcopy import _tasks, _tile
    from kvxfer.kernels.piece_copy import TaskLauncher, copy_tasks
    from kvxfer.pools.offload.pieces import split_by_alignment

    launcher = _LAUNCHERS.get(h)
    if launcher is None:
        launcher = _LAUNCHERS[h] = TaskLauncher(torch.cuda.current_device())

    def copy_():
        flat_d.copy_(flat_s)

    def memcpy():
        for x, y, z in zip(da.tolist(), sa.tolist(), na.tolist()):
            cuda_driver.memcpy_dtod_async(x, y, z, h)

    def batch():
        cuda_driver.memcpy_batch_async(da, sa, na, h, torch.cuda.current_device())

    def kernel():  # the lane's tiles, Triton's launch, the table uploaded
        for align, part in split_by_alignment(_tasks(sa, da, na)):
            t = torch.from_numpy(part).to("cuda", non_blocking=True)
            copy_tasks(t, align, host_tasks=part)

    def native():  # the lane's native path: one row per run, tiles cut by the kernel
        if launcher.launch_pieces(sa, da, na, _tile(na), h) is None:
            launcher.launch(split_by_alignment(_tasks(sa, da, na)), h)

    def native_host():  # cuLaunchKernel, tiles cut on the host (the uneven-runs fallback)
        launcher.launch(split_by_alignment(_tasks(sa, da, na)), h)

    return {
        "copy_": copy_,
        "memcpy": memcpy,
        "batch": batch,
        "kernel": kernel,
        "native": native,
        "native-host-tiles": native_host,
    }


_LAUNCHERS: dict = {}  # stream handle -> TaskLauncher (one ring per stream)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.cuda.set_device(a.device)
    span = 2 * 1024 * MiB
    src_t = torch.randint(0, 256, (span,), dtype=torch.uint8, device="cuda")
    dst_t = torch.zeros(span, dtype=torch.uint8, device="cuda")
    sbase, dbase = src_t.data_ptr(), dst_t.data_ptr()
    stream = torch.cuda.Stream()
    h = stream.cuda_stream
    rng = np.random.default_rng(0)
    rows = []
    with torch.cuda.stream(stream):
        for name, s, d, n in shapes(rng):
            sa = np.asarray(s, dtype=np.uint64) + np.uint64(sbase)
            da = np.asarray(d, dtype=np.uint64) + np.uint64(dbase)
            na = np.asarray(n, dtype=np.uint64)
            total = int(na.sum())
            flat_s, flat_d = src_t[:total], dst_t[:total]

            fns = methods(sa, da, na, flat_s, flat_d, h)
            row = {"shape": name, "runs": len(s), "bytes": total}
            for mname, fn in fns.items():
                if mname == "memcpy" and len(s) > 256:
                    continue
                try:
                    dst_t[:total].zero_()
                    r = timed(fn, stream, a.iters, a.gap_ms / 1e3)
                    stream.synchronize()
                    # copy_ moves the same bytes as one contiguous block, not the shape's runs
                    ok = (
                        bool((flat_d == flat_s).all())
                        if mname == "copy_"
                        else _check(src_t, dst_t, s, d, n)
                    )
                    r["ok"] = ok
                except Exception as exc:  # noqa: BLE001 - a method the driver refuses
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                row[mname] = r
            rows.append(row)
            _print_row(row)
    rows += host_rows(a, src_t, stream)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gap_ms": a.gap_ms, "rows": rows}, f, indent=1)
    return 0


def host_rows(a, dev_t, stream):
    """Offload's shapes: device -> pinned host and back, runs of one buffer per layer (64
    buffers of 32 layers K/V) or scattered, against one pinned ``copy_`` of the same bytes."""
    host_t = torch.empty(512 * MiB, dtype=torch.uint8, pin_memory=True)
    back_t = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    h = stream.cuda_stream
    dev = torch.cuda.current_device()
    rows = []
    for total, runs in ((16 * MiB, 64), (16 * MiB, 128), (64 * MiB, 64), (256 * MiB, 2048)):
        n = total // runs
        sa = np.arange(runs, dtype=np.uint64) * np.uint64(2 * n) + np.uint64(dev_t.data_ptr())
        ha = np.arange(runs, dtype=np.uint64) * np.uint64(n) + np.uint64(host_t.data_ptr())
        ba = np.arange(runs, dtype=np.uint64) * np.uint64(2 * n) + np.uint64(back_t.data_ptr())
        na = np.full(runs, n, dtype=np.uint64)
        views = [
            (dev_t[i * 2 * n : i * 2 * n + n], host_t[i * n : (i + 1) * n]) for i in range(runs)
        ]

        def fns(sa=sa, ha=ha, ba=ba, na=na, views=views, total=total):
            return {
                "d2h copy_": lambda: host_t[:total].copy_(dev_t[:total], non_blocking=True),
                "d2h per-run copy_": lambda: [hv.copy_(dv, non_blocking=True) for dv, hv in views],
                "d2h batch": lambda: cuda_driver.memcpy_batch_async(
                    ha, sa, na, h, dev, dst_host=True
                ),
                "h2d copy_": lambda: back_t[:total].copy_(host_t[:total], non_blocking=True),
                "h2d batch": lambda: cuda_driver.memcpy_batch_async(
                    ba, ha, na, h, dev, src_host=True
                ),
            }

        row = {"shape": f"host {total // MiB} MiB x{runs}", "runs": runs, "bytes": total}
        with torch.cuda.stream(stream):
            for mname, fn in fns().items():
                try:
                    r = timed(fn, stream, a.iters, a.gap_ms / 1e3)
                    stream.synchronize()
                    r["ok"] = True
                except Exception as exc:  # noqa: BLE001
                    r = {"error": f"{type(exc).__name__}: {exc}"}
                row[mname] = r
        stream.synchronize()
        last = 2 * n * (runs - 1)
        ok = bool((back_t[:n] == dev_t[:n]).all()) and bool(
            (back_t[last : last + n] == dev_t[last : last + n]).all()
        )
        row["roundtrip_ok"] = ok
        rows.append(row)
        parts = [f"{row['shape']:<24}"]
        for m, r in row.items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                parts.append(f"{m} ERR {r['error'][:60]}")
            else:
                parts.append(
                    f"{m} best {r['best_us']:.0f} p50 {r['p50_us']:.0f} post {r['post_p50_us']:.0f} µs {total / r['best_us'] / 1e3:.1f} GB/s"
                )
        print(" | ".join(parts) + f" | round trip {'ok' if ok else 'WRONG'}", flush=True)
    return rows


def _check(src_t, dst_t, s, d, n) -> bool:
    for x, y, z in list(zip(s, d, n))[:8]:
        if not bool((dst_t[y : y + z] == src_t[x : x + z]).all()):
            return False
    return True


def _print_row(row):
    lim = row["copy_"].get("best_us")
    parts = [f"{row['shape']:<32}"]
    for m in ("copy_", "memcpy", "batch", "kernel", "native", "native-host-tiles"):
        r = row.get(m)
        if r is None:
            parts.append(f"{m} -")
        elif "error" in r:
            parts.append(f"{m} ERR {r['error'][:60]}")
        else:
            gbps = row["bytes"] / r["best_us"] / 1e3
            ratio = lim / r["best_us"] if lim else float("nan")
            parts.append(
                f"{m} best {r['best_us']:.0f} p50 {r['p50_us']:.0f} post {r['post_p50_us']:.0f} "
                f"µs {gbps:.0f} GB/s x{ratio:.2f}{'' if r['ok'] else ' WRONG'}"
            )
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
