"""Diagnostic (GPU machine): is the host time of posting a large device-lane copy
proportional to its bytes? The TP rows' stages put ~500 µs between "planned" and "posted"
of an equal-TP 125 MiB request (10 runs) on an H100, where a copy of those bytes takes
~100 µs on the device.

A child process allocates the destination and exports it by CUDA IPC (as a decode peer's
pool); this process maps it and times, per size and run count, the host time of the
enqueue (``cuMemcpyDtoDAsync`` per run, then an event record), of the
:class:`~kvxfer.engine.devcopy.DeviceLane` launch the engine makes, and of a ``copy_`` of
the same bytes into local memory; then the time until each completes. Medians of
``--iters``.

    python3 bench/gpu/lane_post.py [--iters 20] [--sizes-mib 1,16,64,125,256] [--runs 1,10]
        [--gap-ms 2]    # idle before each enqueue: its host time after the thread slept
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

MIB = 1 << 20


def child(conn, nbytes: int) -> None:
    import torch

    from kvxfer.kernels.cuda_driver import ipc_export

    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    conn.send((ipc_export(dst.data_ptr()), dst.data_ptr()))
    conn.recv()  # parent done


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sizes-mib", default="1,16,64,125,256")
    ap.add_argument("--runs", default="1,10")
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="idle this long before each timed enqueue (the thread, and on a VM its vCPU, "
        "go to sleep as between requests; bench/gpu/awake_ab.sh)",
    )
    a = ap.parse_args()
    sizes = [int(float(s) * MIB) for s in a.sizes_mib.split(",")]
    top = max(sizes)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    p = ctx.Process(target=child, args=(there, top), daemon=True)
    p.start()
    blob, rbase = here.recv()

    import torch

    from kvxfer.engine.devcopy import DeviceLane
    from kvxfer.kernels.cuda_driver import memcpy_dtod_async

    torch.cuda.init()
    src = torch.empty(top, dtype=torch.uint8, device="cuda:0").fill_(7)
    loc = torch.empty(top, dtype=torch.uint8, device="cuda:0")
    lane = DeviceLane(0, [blob], [rbase], [top], [0])
    image = int(lane.mapped[0])
    stream = torch.cuda.Stream(0)
    h = stream.cuda_stream
    print(f"# {torch.cuda.get_device_name(0)}, lane native={lane.native}")
    print("| what | MiB | runs | enqueue µs p50 | enqueue µs max | complete µs p50 | GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")

    def timed(fn, sync):
        enq, done = [], []
        for i in range(a.iters + 2):
            torch.cuda.synchronize()
            if a.gap_ms > 0:
                time.sleep(a.gap_ms / 1e3)  # (the idle gap under test, not a synchronisation)
            t0 = time.perf_counter()
            ev = fn()
            t1 = time.perf_counter()
            sync(ev)
            t2 = time.perf_counter()
            if i >= 2:
                enq.append((t1 - t0) * 1e6)
                done.append((t2 - t0) * 1e6)
        return statistics.median(enq), max(enq), statistics.median(done)

    def ev_sync(ev):
        ev.synchronize()

    def cases(n: int, runs: int):
        step = n // runs
        offs = [k * step for k in range(runs)]
        laddr = np.array([src.data_ptr() + o for o in offs], dtype=np.uint64)
        raddr = np.array([rbase + o for o in offs], dtype=np.uint64)
        nb = np.full(runs, step, dtype=np.uint64)
        ridx = np.zeros(runs, dtype=np.uint32)

        def memcpy(base: int):
            def go():
                for o in offs:
                    memcpy_dtod_async(base + o, src.data_ptr() + o, step, h)
                ev = torch.cuda.Event()
                ev.record(stream)
                return ev

            return go

        def copy_():
            with torch.cuda.stream(stream):
                loc[:n].copy_(src[:n])
                ev = torch.cuda.Event()
                ev.record(stream)
            return ev

        out = [
            ("memcpy → IPC-mapped", memcpy(image)),
            ("memcpy → local", memcpy(loc.data_ptr())),
            ("DeviceLane.launch → IPC-mapped", lambda: lane.launch(laddr, raddr, nb, ridx)),
        ]
        return out + ([("copy_ → local (one op)", copy_)] if runs == 1 else [])

    for n in sizes:
        for runs in [int(r) for r in a.runs.split(",")]:
            for name, fn in cases(n, runs):
                e50, emax, c50 = timed(fn, ev_sync)
                print(
                    f"| {name} | {n / MIB:.0f} | {runs} | {e50:.1f} | {emax:.1f} | {c50:.1f} "
                    f"| {n / (c50 / 1e6) / 1e9:.1f} |",
                    flush=True,
                )
    lane.close()
    here.send(None)
    p.join(10)


if __name__ == "__main__":
    main()
