"""How long waking a sleeping thread takes on this host: the floor under every hand-over
of kvxfer's path that is not spun on (bench/results/issue15-status.md).

Three hand-overs, each timed one way on CLOCK_MONOTONIC (one clock for all processes of a
host), ``--n`` times after each idle gap of ``--gaps`` ms (the waker sleeps that long before
it stamps and signals, so the sleeper has been idle at least that long):

* ``process → asyncio loop``: another process writes to a pipe that an asyncio loop watches
  with ``add_reader`` (decode's loop taking a notification from the completion queue's
  eventfd, a channel frame);
* ``thread → asyncio loop``: ``loop.call_soon_threadsafe`` from another thread of the same
  process (a scheduler's hand-over of ``send()`` to the manager's loop);
* ``thread → blocked thread``: ``queue.Queue.put`` to a thread blocked in ``get()`` (an
  ``on_done`` callback waking the scheduler's thread).

Usage: ``python3 bench/wake_latency.py [--n 200] [--gaps 0,0.1,1,10] [--json PATH]``;
prints a markdown table of p50 / p90 / p99 µs per hand-over and gap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import statistics
import struct
import threading
import time
from typing import Dict, List

from kvxfer.pd_demo.run import percentile


def _pipe_waker(wfd: int, ack_fd: int, n: int, gap_s: float) -> None:
    """Child process: after each ack (the loop took the last stamp), sleep ``gap_s``, then
    write the stamp."""
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        os.write(wfd, struct.pack("<q", time.monotonic_ns()))
        os.read(ack_fd, 1)


def process_to_loop(n: int, gap_s: float) -> List[float]:
    r, w = os.pipe()
    ack_r, ack_w = os.pipe()
    ctx = mp.get_context("fork")  # the pipes are inherited; no thread runs yet
    child = ctx.Process(target=_pipe_waker, args=(w, ack_r, n, gap_s), daemon=True)
    child.start()
    out: List[float] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_readable() -> None:
            t = time.monotonic_ns()
            (t0,) = struct.unpack("<q", os.read(r, 8))
            out.append((t - t0) / 1e3)
            os.write(ack_w, b"x")
            if len(out) >= n and not done.done():
                done.set_result(None)

        loop.add_reader(r, on_readable)
        try:
            await asyncio.wait_for(done, 60 + n * (gap_s + 0.01))
        finally:
            loop.remove_reader(r)

    try:
        asyncio.run(run())
    finally:
        child.join(10)
        for fd in (r, w, ack_r, ack_w):
            os.close(fd)
    return out


def thread_to_loop(n: int, gap_s: float) -> List[float]:
    out: List[float] = []

    async def run() -> None:
        loop = asyncio.get_running_loop()
        ack = threading.Event()

        def took(t0: int) -> None:
            out.append((time.monotonic_ns() - t0) / 1e3)
            ack.set()

        def waker() -> None:
            for _ in range(n):
                if gap_s:
                    time.sleep(gap_s)
                ack.clear()
                loop.call_soon_threadsafe(took, time.monotonic_ns())
                ack.wait(10)

        await asyncio.to_thread(waker)

    asyncio.run(run())
    return out


def thread_to_thread(n: int, gap_s: float) -> List[float]:
    q: "queue.Queue[int]" = queue.Queue()
    ack: "queue.Queue[None]" = queue.Queue()
    out: List[float] = []

    def sleeper() -> None:
        for _ in range(n):
            t0 = q.get(timeout=60)
            out.append((time.monotonic_ns() - t0) / 1e3)
            ack.put(None)

    th = threading.Thread(target=sleeper, daemon=True)
    th.start()
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        q.put(time.monotonic_ns())
        ack.get(timeout=60)
    th.join(10)
    return out


KINDS = {
    "process → asyncio loop (pipe, add_reader)": process_to_loop,
    "thread → asyncio loop (call_soon_threadsafe)": thread_to_loop,
    "thread → blocked thread (queue.Queue)": thread_to_thread,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="hand-overs per gap (default 200)")
    ap.add_argument("--gaps", default="0,0.1,1,10", help="idle gaps, ms (default 0,0.1,1,10)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    gaps = [float(g) for g in a.gaps.split(",")]
    rows: List[Dict[str, object]] = []
    print(f"wake latency, {os.cpu_count()} CPUs, {a.n} hand-overs per gap (µs, one way)\n")
    print("| hand-over | idle gap ms | p50 | p90 | p99 |")
    print("|---|---:|---:|---:|---:|")
    for name, fn in KINDS.items():
        for g in gaps:
            xs = fn(a.n, g / 1e3)
            row = {
                "kind": name,
                "gap_ms": g,
                "n": len(xs),
                "p50_us": statistics.median(xs),
                "p90_us": percentile(xs, 90),
                "p99_us": percentile(xs, 99),
            }
            rows.append(row)
            print(
                f"| {name} | {g:g} | {row['p50_us']:.1f} | {row['p90_us']:.1f} "
                f"| {row['p99_us']:.1f} |",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpus": os.cpu_count(), "n": a.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
