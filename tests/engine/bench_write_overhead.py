"""Per-write overhead of a 1-page ``Peer.write`` (3 small ops: one page of a page-major KV
group, one state slot, one aux row, plus the notify), two engines on one event loop over
UCX loopback. Not collected by pytest; run::

    PYTHONPATH=. python tests/engine/bench_write_overhead.py [iterations]

Prints p50/p90 of the whole write (post + flush + notify), of ``Peer.plan`` alone, and a
cProfile of the planning step."""

from __future__ import annotations

import asyncio
import cProfile
import pstats
import sys
import time

import numpy as np


async def main(n: int) -> dict:
    from kvxfer.config import EngineConfig
    from kvxfer.engine import ItemWrite, TransferEngine

    groups = {"kv": 16384, "state": 4096, "aux": 64}
    items = 256
    engines, bufs = [], []
    for name in ("A", "B"):
        e = TransferEngine(
            EngineConfig(secret=b"bench", name=name, warn_slow_lanes=False, stage_min_ops=0)
        )
        for g, il in groups.items():
            b = np.zeros(items * il, np.uint8)
            bufs.append(b)
            e.register(g, [b.ctypes.data], [b.nbytes], [il])
        await e.start()
        engines.append(e)
    a, b = engines
    got = asyncio.Queue()
    a.on_message(lambda p, payload: got.put_nowait(payload))
    peer = await b.connect(*a.address)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, items, size=(n, 3)).tolist()

    def writes(i):
        s, d, x = ids[i]
        return [ItemWrite("kv", [s], [d]), ItemWrite("state", [x], [x]), ItemWrite("aux", [d], [s])]

    for i in range(50):  # warm up
        await peer.write(writes(i), notify=b"w")
    for _ in range(50):
        await got.get()
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        await peer.write(writes(i), notify=b"w")
        lat.append(time.perf_counter() - t0)
        await got.get()
    plan = []
    for i in range(n):
        w = writes(i)
        t0 = time.perf_counter()
        peer.plan(w)
        plan.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        peer._planner.plan(writes(i), 0)
    prof.disable()
    await b.close()
    await a.close()
    pct = lambda v, q: float(np.percentile(np.asarray(v) * 1e6, q))  # noqa: E731
    return {
        "write_p50_us": pct(lat, 50),
        "write_p90_us": pct(lat, 90),
        "plan_p50_us": pct(plan, 50),
        "plan_p90_us": pct(plan, 90),
        "prof": prof,
    }


if __name__ == "__main__":
    out = asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000))
    prof = out.pop("prof")
    print({k: round(v, 1) for k, v in out.items()})
    if "-p" in sys.argv:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
