"""Pattern launch diagnostics on one GPU (issue 16): where a heterogeneous-TP PatternWrite's
time goes, for the bench's 2 -> 1 NHD geometry (4 layers x K/V, 16-token pages, 4 of 8 KV
heads of 64 dims in bf16: 512-byte runs, 128 per page, 1000 pages = 62.5 MiB per rank).

Prints, each as the median of many: the host cost of the launch's parts (the item-pair table
upload, ``copy_pattern``'s Python launch, the event), the kernel's GPU time (CUDA events) for
the shipped launch parameters and for a sweep of variants (rows per program, warps, a 2-D
tile kernel that issues all of a program's rows at once), against ``copy_`` of the same
bytes (contiguous: the copy limit) and torch's own strided copy of the same head slices, and
the wait for completion: spinning on ``Event.query`` vs ``Event.synchronize`` in a thread.

Then the launch's host time (wall and thread CPU) alone and next to each suspect of the PD
workers' 5-8x slower launches (bench/results/tp-pattern-h200.md): a Python thread holding the
GIL, a thread polling a CUDA event, another process's GPU work (``--contention-only``: just
that part, a few seconds).

    python3 bench/gpu/pattern_diag.py [--pages 1000] [--layers 4] [--heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np
import torch
import triton
import triton.language as tl

from kvxfer.kernels.pattern_copy import _copy_pattern_kernel, copy_pattern, pattern_rows


@triton.jit
def _tile_kernel(rows, items, n_rows, ROWS: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Program (i, k): rows i*ROWS .. +ROWS of item pair k as one [ROWS, BLOCK] tile per step."""
    k = tl.program_id(1).to(tl.int64)
    sid = tl.load(items + 2 * k)
    did = tl.load(items + 2 * k + 1)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < n_rows
    base = rows + r * 5
    s = tl.load(base, mask=rm, other=0) + sid * tl.load(base + 3, mask=rm, other=0)
    d = tl.load(base + 1, mask=rm, other=0) + did * tl.load(base + 4, mask=rm, other=0)
    n = tl.load(base + 2, mask=rm, other=0)
    if ALIGN > 1:
        s = tl.multiple_of(s, ALIGN)
        d = tl.multiple_of(d, ALIGN)
    offs = tl.arange(0, BLOCK)
    longest = tl.max(n, axis=0)
    for b in range(0, tl.cdiv(longest, BLOCK)):
        o = b * BLOCK + offs
        m = (o[None, :] < n[:, None]) & rm[:, None]
        sp = (s[:, None] + o[None, :]).to(tl.pointer_type(tl.int8))
        dp = (d[:, None] + o[None, :]).to(tl.pointer_type(tl.int8))
        x = tl.load(sp, mask=m)
        tl.store(dp, x, mask=m)


@triton.jit
def _tile32_kernel(rows, items, n_rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """As _tile_kernel in 4-byte words (every address and size a multiple of 4)."""
    k = tl.program_id(1).to(tl.int64)
    sid = tl.load(items + 2 * k)
    did = tl.load(items + 2 * k + 1)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = r < n_rows
    base = rows + r * 5
    s = tl.load(base, mask=rm, other=0) + sid * tl.load(base + 3, mask=rm, other=0)
    d = tl.load(base + 1, mask=rm, other=0) + did * tl.load(base + 4, mask=rm, other=0)
    n = tl.load(base + 2, mask=rm, other=0) // 4
    s = tl.multiple_of(s, 16)
    d = tl.multiple_of(d, 16)
    offs = tl.arange(0, BLOCK)
    longest = tl.max(n, axis=0)
    for b in range(0, tl.cdiv(longest, BLOCK)):
        o = b * BLOCK + offs
        m = (o[None, :] < n[:, None]) & rm[:, None]
        sp = (s[:, None] + 4 * o[None, :]).to(tl.pointer_type(tl.int32))
        dp = (d[:, None] + 4 * o[None, :]).to(tl.pointer_type(tl.int32))
        x = tl.load(sp, mask=m)
        tl.store(dp, x, mask=m)


def med_us(f, n=40, sync=True):
    out = []
    for _ in range(n):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


def gpu_us(f, n=30):
    f()
    torch.cuda.synchronize()
    out = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return statistics.median(out)


def _launch_parts(rows, items_host, host, dev, stream):
    """One pattern launch as DeviceLane.launch_pattern does it; wall and thread CPU µs."""
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        items = torch.from_numpy(items_host).to(dev, non_blocking=True)
        items.record_stream(stream)
        copy_pattern(rows, items, 16, host_rows=host)
        ev = torch.cuda.Event()
        ev.record(stream)
    return (time.perf_counter() - t0) * 1e6, (time.thread_time() - c0) * 1e6, ev


def _gpu_neighbour(stop, ready):  # another process with its own context, copying all along
    import torch as t

    a = t.empty(1 << 28, dtype=t.uint8, device="cuda:0")
    b = t.empty_like(a)
    ready.set()
    while not stop.is_set():
        b.copy_(a)
        t.cuda.synchronize()


def contention(rows, items, host, pairs, dev) -> None:
    """The launch's host time (wall / thread CPU, p50 of 40, launches 1 ms apart) alone and
    next to each suspect of the PD workers: a Python thread holding the GIL, a thread polling
    a CUDA event (as UCX's cuda_ipc progress does), another process's GPU work."""
    import multiprocessing as mp
    import sys
    import threading

    sys.setswitchinterval(0.0005)  # as in the PD workers (kvxfer.pd_demo.worker)
    stream = torch.cuda.Stream(dev)

    def measure(tag):
        walls, cpus = [], []
        for _ in range(40):
            w, c, ev = _launch_parts(rows, pairs, host, dev, stream)
            walls.append(w)
            cpus.append(c)
            ev.synchronize()
            time.sleep(0.001)
        print(
            f"{tag}: launch wall {statistics.median(walls):.1f} µs, "
            f"thread CPU {statistics.median(cpus):.1f} µs"
        )

    print("\n## launch host time under contention")
    measure("alone")
    stop = threading.Event()

    def py_spin():
        x = 0
        while not stop.is_set():
            x += 1

    def ev_poll():
        ev = torch.cuda.Event()
        ev.record()
        while not stop.is_set():
            ev.query()

    for name, fn in (
        ("a Python thread spinning (GIL)", py_spin),
        ("a thread polling Event.query", ev_poll),
    ):
        stop.clear()
        th = threading.Thread(target=fn, daemon=True)
        th.start()
        measure(f"with {name}")
        stop.set()
        th.join()
    # the PD workers' shape: the launch runs ON the manager's loop thread, whose loop never
    # sleeps while a UCXX receive is pending (wait_yield: ``await asyncio.sleep(0)``)
    import asyncio

    async def on_busy_loop(n_spinners):
        spin = True

        async def spinner():
            while spin:
                await asyncio.sleep(0)

        tasks = [asyncio.ensure_future(spinner()) for _ in range(n_spinners)]
        await asyncio.sleep(0.01)
        walls, cpus = [], []
        for _ in range(40):
            w, c, ev = _launch_parts(rows, pairs, host, dev, stream)
            walls.append(w)
            cpus.append(c)
            ev.synchronize()
            await asyncio.sleep(0.001)
        spin = False
        await asyncio.gather(*tasks)
        print(
            f"on an asyncio loop with {n_spinners} sleep(0) spinner(s): launch wall "
            f"{statistics.median(walls):.1f} µs, thread CPU {statistics.median(cpus):.1f} µs"
        )

    for n in (0, 1, 2):
        asyncio.run(on_busy_loop(n))
    measure("alone, again (warm-up drift)")
    # UCX in the process: its memory hooks (mmap/munmap/brk, CUDA allocation hooks) and, once
    # an engine pair is connected, two loop threads spinning in UCXX's wait_yield
    from kvxfer.config import EngineConfig
    from kvxfer.sync import SyncEngine

    a_eng, b_eng = (
        SyncEngine(EngineConfig(secret=b"diag", name="diag-a")),
        SyncEngine(EngineConfig(secret=b"diag", name="diag-b")),
    )
    measure("after UCX init in this process (two engines, not connected)")
    host_addr, port = a_eng.start()
    b_eng.start()
    b_eng.connect(host_addr, port)
    measure("with a connected engine pair in this process (main thread)")
    b_eng.close()
    a_eng.close()
    measure("after the engines closed")
    ctx = mp.get_context("spawn")
    pstop, ready = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_gpu_neighbour, args=(pstop, ready), daemon=True)
    proc.start()
    if ready.wait(60):
        measure("with another process copying on the GPU")
    pstop.set()
    proc.join(30)


def _geometry(dev, L, ps, Hd, D, P):
    """The bench's 2 -> 1 NHD geometry: (src, dst, host rows, device rows, pair ids, item
    table on the device, source ids, destination ids, bytes per launch)."""
    Hs = Hd // 2
    pool = P + 200
    descs = 2 * L
    src = [torch.randn(pool, ps, Hs, D, device=dev, dtype=torch.bfloat16) for _ in range(descs)]
    dst = [torch.zeros(pool, ps, Hd, D, device=dev, dtype=torch.bfloat16) for _ in range(descs)]
    run, drow = Hs * D * 2, Hd * D * 2
    src_item, dst_item = ps * run, ps * drow
    so, do = np.arange(ps) * run, np.arange(ps) * drow
    runs = [(so, do, np.full(ps, run))] * descs
    host = pattern_rows(
        np.array([t.data_ptr() for t in src], dtype=np.int64),
        np.array([t.data_ptr() for t in dst], dtype=np.int64),
        np.full(descs, src_item),
        np.full(descs, dst_item),
        runs,
    )
    rows = torch.from_numpy(host).to(dev)
    rng = np.random.default_rng(0)
    sids, dids = rng.permutation(pool)[:P], rng.permutation(pool)[:P]
    pairs = np.stack([sids, dids], axis=1).astype(np.int64)
    items = torch.from_numpy(pairs).to(dev)
    return src, dst, host, rows, pairs, items, sids, dids, P * len(host) * run


def _sharer(kind, barrier, q, geo):  # one process of the GPU-sharing phase
    import torch as t

    dev = t.device("cuda:0")
    t.cuda.set_device(dev)
    src, dst, host, rows, _, items, _, _, nbytes = _geometry(dev, *geo)
    a = t.empty(nbytes, dtype=t.uint8, device=dev)
    b = t.empty_like(a)

    def once():
        if kind == "pattern":
            copy_pattern(rows, items, 16, host_rows=host)
        else:
            b.copy_(a)

    once()
    t.cuda.synchronize()
    barrier.wait()
    out = []
    for _ in range(40):
        e0, e1 = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
        w = time.perf_counter()
        e0.record()
        once()
        e1.record()
        e1.synchronize()
        out.append(((time.perf_counter() - w) * 1e6, e0.elapsed_time(e1) * 1e3))
    q.put(out)


def sharing(geo) -> None:
    """One GPU shared by processes, as in the one-GPU PD bench (every rank a process, each
    its own CUDA context, no MPS): the pattern kernel's and a contiguous ``copy_``'s time from
    launch to completion (wall) and between their events (GPU), one process alone vs two
    launching at the same moments."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    print("\n## one GPU shared by processes (p50 of 40; wall: launch to completion)")
    for kind in ("pattern", "copy_"):
        for n in (1, 2):
            barrier, q = ctx.Barrier(n), ctx.Queue()
            procs = [
                ctx.Process(target=_sharer, args=(kind, barrier, q, geo), daemon=True)
                for _ in range(n)
            ]
            for p in procs:
                p.start()
            try:
                res = [q.get(timeout=60) for _ in procs]
            except Exception as exc:  # a child died: say so, go on
                print(f"{kind}, {n} process(es): failed ({exc!r})")
                continue
            finally:
                for p in procs:
                    p.join(10)
                    if p.is_alive():
                        p.terminate()
            walls = [statistics.median(w for w, _ in r) for r in res]
            gpus = [statistics.median(g for _, g in r) for r in res]
            print(
                f"{kind}, {n} process(es): wall "
                + ", ".join(f"{w:.0f}" for w in walls)
                + " µs; GPU "
                + ", ".join(f"{g:.0f}" for g in gpus)
                + " µs"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--contention-only", action="store_true", help="only the launch-under-contention part"
    )
    a = ap.parse_args()
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    L, ps, Hd, D, P = a.layers, a.page_size, a.heads, a.head_dim, a.pages
    Hs = Hd // 2
    src, dst, host, rows, pairs, items, sids, dids, nbytes = _geometry(dev, L, ps, Hd, D, P)
    run = Hs * D * 2
    descs = 2 * L
    print(
        f"geometry: {descs} descs, {len(host)} rows/item of {run} B, {P} item pairs, "
        f"{nbytes / 2**20:.1f} MiB"
    )

    # correctness of the shipped launch and of the variants against torch
    ref = [t.clone() for t in dst]
    si, di = torch.from_numpy(sids).to(dev), torch.from_numpy(dids).to(dev)
    for t, s in zip(ref, src):
        t[di, :, :Hs, :] = s[si]

    def check(tag):
        torch.cuda.synchronize()
        ok = all(torch.equal(x, y) for x, y in zip(dst, ref))
        for t in dst:
            t.zero_()
        return "ok" if ok else "WRONG"

    align = 16
    copy_pattern(rows, items, align, host_rows=host)
    print("shipped copy_pattern:", check("shipped"))
    contention(rows, items, host, pairs, dev)
    sharing((L, ps, Hd, D, P))
    if a.contention_only:
        return

    # host costs
    print("\n## host µs per launch part (median)")
    print(
        f"pairs table upload (pageable, non_blocking): {med_us(lambda: torch.from_numpy(pairs).to(dev, non_blocking=True)):.1f}"
    )
    pin = torch.empty((P, 2), dtype=torch.int64).pin_memory()
    dev_items = torch.empty((P, 2), dtype=torch.int64, device=dev)

    def pinned_upload():
        pin.numpy()[:] = pairs
        dev_items.copy_(pin, non_blocking=True)

    print(f"pairs table upload (pinned, reused): {med_us(pinned_upload):.1f}")
    print(
        f"copy_pattern() call: {med_us(lambda: copy_pattern(rows, items, align, host_rows=host)):.1f}"
    )
    ev_us = med_us(lambda: torch.cuda.Event().record(), sync=False)
    print(f"Event() + record: {ev_us:.1f}")
    s = torch.cuda.Stream()

    def ctx():
        with torch.cuda.device(0), torch.cuda.stream(s):
            pass

    print(f"torch.cuda.device + stream context: {med_us(ctx, sync=False):.1f}")

    # GPU time
    flat_s = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    cp = gpu_us(lambda: flat_d.copy_(flat_s))
    print(f"\n## GPU µs (median), {nbytes / 2**20:.1f} MiB")
    print(f"copy_ contiguous: {cp:.1f} ({nbytes / cp / 1e3:.0f} GB/s)")

    def torch_strided():
        for t, s_ in zip(dst, src):
            t[di, :, :Hs, :] = s_[si]

    ts = gpu_us(torch_strided)
    print(
        f"torch index copy of the head slices (8 launches): {ts:.1f} ({nbytes / ts / 1e3:.0f} GB/s)"
    )
    sh = gpu_us(lambda: copy_pattern(rows, items, align, host_rows=host))
    print(f"shipped copy_pattern: {sh:.1f} ({nbytes / sh / 1e3:.0f} GB/s)")
    n_rows = len(host)
    print("\n## v1 (shipped kernel) sweep: rows per program x warps x block")
    for block in (512, 1024):
        for per in (1, 2, 4, 8, 16, 32):
            for warps in (1, 2, 4):
                grid = (-(-n_rows // per), P)

                def f(per=per, warps=warps, block=block, grid=grid):
                    _copy_pattern_kernel[grid](
                        rows, items, n_rows, ROWS=per, ALIGN=align, BLOCK=block, num_warps=warps
                    )

                g = gpu_us(f)
                print(
                    f"block {block} per {per} warps {warps}: {g:.1f} µs ({nbytes / g / 1e3:.0f} GB/s) {check('v1')}"
                )
    print("\n## tile kernels: rows per program x block x warps")
    for kern in ("tile8", "tile32"):
        for per in (4, 8, 16, 32, 64):
            for block in (128, 256, 512) if kern == "tile8" else (32, 64, 128):
                for warps in (2, 4, 8):
                    grid = (-(-n_rows // per), P)
                    if per * block > 16384 * (4 if kern == "tile32" else 1):
                        continue

                    def f(per=per, warps=warps, block=block, grid=grid, kern=kern):
                        if kern == "tile8":
                            _tile_kernel[grid](
                                rows,
                                items,
                                n_rows,
                                ROWS=per,
                                ALIGN=16,
                                BLOCK=block,
                                num_warps=warps,
                            )
                        else:
                            _tile32_kernel[grid](
                                rows, items, n_rows, ROWS=per, BLOCK=block, num_warps=warps
                            )

                    try:
                        g = gpu_us(f, n=15)
                    except Exception as exc:  # noqa: BLE001
                        print(
                            f"{kern} per {per} block {block} warps {warps}: {type(exc).__name__} {exc}"[
                                :200
                            ]
                        )
                        continue
                    print(
                        f"{kern} per {per} block {block} warps {warps}: {g:.1f} µs ({nbytes / g / 1e3:.0f} GB/s) {check(kern)}"
                    )

    # waiting for completion
    print("\n## completion wait after a launch (host µs from launch to 'done', median)")

    def spin():
        copy_pattern(rows, items, align, host_rows=host)
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass

    print(f"launch + spin on Event.query: {med_us(spin, n=30):.1f}")
    loop = asyncio.new_event_loop()

    async def executor():
        copy_pattern(rows, items, align, host_rows=host)
        ev = torch.cuda.Event()
        ev.record()
        await loop.run_in_executor(None, ev.synchronize)

    print(
        f"launch + Event.synchronize in the default executor: {med_us(lambda: loop.run_until_complete(executor()), n=30):.1f}"
    )

    async def sleeper():
        copy_pattern(rows, items, align, host_rows=host)
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            await asyncio.sleep(0)

    print(
        f"launch + Event.query between loop iterations: {med_us(lambda: loop.run_until_complete(sleeper()), n=30):.1f}"
    )
    loop.close()


if __name__ == "__main__":
    main()
