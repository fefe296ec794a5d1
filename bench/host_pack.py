"""The host lane's two ways to hand short strided local runs to ``process_vm_writev``
(kvxfer.engine.hostcopy): one local iovec per run, or the runs packed first into a
per-thread buffer (``_rma.gather``) and written as one local iovec per call. Same process
pair, same runs, one thread and two threads (two target processes) at once.

``python bench/host_pack.py [--mib 64] [--runs 256,512,2048,4096,16384] [--segment 0]``
(``--segment N``: the destination is scattered N-byte segments instead of one range; every
run is half of a row of twice its length on the source side, as head slices of NHD rows are).
Prints a markdown table of the best of ``--reps`` repetitions (ms)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

import numpy as np

from kvxfer.engine import hostcopy
from kvxfer.transport.ucx_lib import load_ucx


def _target(q, ev, size):
    b = np.ones(size, dtype=np.uint8)  # (faulted in)
    q.put(b.ctypes.data)
    ev.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", default="256,512,2048,4096,16384")
    ap.add_argument("--segment", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    gather = load_ucx()[1].gather
    pvw = hostcopy._CALLS[1]
    size = a.mib << 20
    ctx = mp.get_context("fork")
    procs, evs, addrs = [], [], []
    for _ in range(2):
        q, ev = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=_target, args=(q, ev, size))
        p.start()
        procs.append(p)
        evs.append(ev)
        addrs.append(q.get())
    src = np.ones(2 * size, dtype=np.uint8)

    def job(i: int, run: int, pack: bool) -> float:
        n = size // run
        la = np.uint64(src.ctypes.data + i * run) + np.arange(n, dtype=np.uint64) * np.uint64(
            2 * run
        )
        ra = np.uint64(addrs[i]) + np.arange(n, dtype=np.uint64) * np.uint64(run)
        if a.segment:
            per = max(1, a.segment // run)
            segs = n // per
            pos = np.random.default_rng(i).permutation(segs).astype(np.uint64) * np.uint64(
                per * run
            )
            ra = np.uint64(addrs[i]) + np.repeat(pos, per)
            ra += np.tile(np.arange(per, dtype=np.uint64) * np.uint64(run), segs)
        nb = np.full(n, run, dtype=np.uint64)
        buf = np.empty(hostcopy.BOUNCE_BYTES, dtype=np.uint8)
        t = time.perf_counter()
        for c in hostcopy.calls(la, ra, nb, pack=pack, bounce=buf.size):
            liov = c.liov
            if liov is None:
                gather(buf.ctypes.data, buf.size, la[c.first : c.end], nb[c.first : c.end])
                liov = np.array([[buf.ctypes.data, c.nbytes]], dtype=np.uint64)
            got = pvw(procs[i].pid, liov.ctypes.data, len(liov), c.riov.ctypes.data, len(c.riov), 0)
            assert got == c.nbytes, got
        return time.perf_counter() - t

    print(
        f"{a.mib} MiB per target, destination {'segments of %d B' % a.segment if a.segment else 'one range'}, best of {a.reps}"
    )
    print()
    print(
        "| run B | iovecs, 1 thread | packed, 1 thread | iovecs, 2 threads | packed, 2 threads | packed / iovecs (1 / 2 threads) |"
    )
    print("|---|---|---|---|---|---|")
    for run in (int(x) for x in a.runs.split(",")):
        res = {}
        for pack in (False, True):
            one, two = [], []
            for _ in range(a.reps):
                one.append(job(0, run, pack))
                out = [0.0, 0.0]

                def r(i, out=out, pack=pack, run=run):
                    out[i] = job(i, run, pack)

                ts = [threading.Thread(target=r, args=(i,)) for i in range(2)]
                t = time.perf_counter()
                for x in ts:
                    x.start()
                for x in ts:
                    x.join()
                two.append(time.perf_counter() - t)
            res[pack] = (min(one) * 1e3, min(two) * 1e3)
        (i1, i2), (p1, p2) = res[False], res[True]
        print(
            f"| {run} | {i1:.1f} | {p1:.1f} | {i2:.1f} | {p2:.1f} | {p1 / i1:.2f} / {p2 / i2:.2f} |"
        )
    for ev in evs:
        ev.set()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
