"""Heterogeneous-TP KV moves on CPU, real engines over UCX loopback (one process, one engine
per rank): what wins for an NHD page layout, against the equal-TP write of the same bytes.

Per request (``--tokens`` tokens of ``--layers`` layers, K and V, ``--heads`` KV heads of
``--head-dim`` bf16 elements, ``--page-size``-token pages; every prefill→decode pair of the
ratio moves concurrently; ``kvxfer.disagg.tp_plan`` plans every byte):

* ``nhd-strided``: NHD pages, one RawWrite run per token per descriptor (SGLang's slice path);
* ``nhd-staged``: NHD pages, gather the head slice into registered staging memory
  (``tp_plan.gather_items``: one strided numpy copy per descriptor), ONE RawWrite per pair
  into the decode's landing buffer, scatter there (``tp_plan.scatter_items``); gather and
  scatter are inside the timed span;
* ``hnd``: HND pages (``[heads, page, dim]``): one run per page per descriptor;
* ``equal-tp``: ItemWrite of whole pages of a group whose page is exactly the pair's slice
  (what equal TP would move: the same bytes, one run per descriptor).

Every method's decode bytes are checked against the prefill ranks' heads. Run::

    PYTHONPATH=. python bench/tp_slice.py [--tokens 1024 4096] [--ratios 1:2 2:1]

Prints a markdown table: median ms and GB/s per request over ``--iters`` rounds (the
methods alternate within a round), ops per request, and the ratio to equal-TP. Results: bench/results/tp-slice-cpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Dict, List

import numpy as np

from kvxfer.config import EngineConfig
from kvxfer.disagg import tp_plan as tp
from kvxfer.engine import ItemWrite, RawWrite, TransferEngine


class Rank:
    """One rank's engine and buffers: ``kv`` (2L descriptors of ``pages`` pages), ``stage``
    (one staging / landing descriptor) and ``eq`` (2L descriptors of slice-sized pages)."""

    def __init__(self, name, heads, pages, a, stage_bytes, eq_item):
        self.name, self.heads, self.pages = name, heads, pages
        self.item = a.page_size * heads * a.head_bytes
        n = 2 * a.layers
        self.kv = [np.zeros(pages * self.item, np.uint8) for _ in range(n)]
        self.stage = np.zeros(stage_bytes, np.uint8)
        self.eq = [np.zeros(pages * eq_item, np.uint8) for _ in range(n)]
        self.eq_item = eq_item
        self.unit = a.head_bytes  # common item length: hetero groups differ in page size
        self.engine = TransferEngine(
            EngineConfig(secret=b"tp-slice", name=name, warn_slow_lanes=False)
        )
        reg = self.engine.register
        reg("kv", [b.ctypes.data for b in self.kv], [b.nbytes for b in self.kv], [self.unit] * n)
        reg("stage", [self.stage.ctypes.data], [self.stage.nbytes], [self.unit])
        reg("eq", [b.ctypes.data for b in self.eq], [b.nbytes for b in self.eq], [eq_item] * n)

    def view(self, d: int, layout: str) -> np.ndarray:
        """Descriptor ``d`` as ``[pages, page, heads, bytes]`` (nhd) or ``[pages, heads, page,
        bytes]`` (hnd)."""
        ps = self.item // (self.heads * self.unit)
        shape = (ps, self.heads) if layout == "nhd" else (self.heads, ps)
        return self.kv[d].reshape(self.pages, *shape, self.unit)


def geoms(a, heads_total: int, tp_size: int, layout: str):
    make = tp.nhd_item if layout == "nhd" else tp.hnd_item
    return [make(a.page_size, a.head_bytes, heads_total, tp_size)] * (2 * a.layers)


async def run_ratio(a, tp_p: int, tp_d: int, tokens: int) -> List[Dict]:
    pages = tokens // a.page_size
    H = a.heads
    hp, hd = H // tp_p, H // tp_d
    pairs = [(p, d) for d in range(tp_d) for p in tp.decode_peers(d, tp_p, tp_d)]
    slice_heads = min(hp, hd)
    pair_bytes = 2 * a.layers * pages * a.page_size * slice_heads * a.head_bytes
    eq_item = a.page_size * slice_heads * a.head_bytes
    k = max(1, tp_p // tp_d)  # landing areas per decode rank (one per prefill peer)
    pre = [
        Rank(f"P{p}", hp, pages, a, pair_bytes * max(1, tp_d // tp_p), eq_item) for p in range(tp_p)
    ]
    dec = [Rank(f"D{d}", hd, pages, a, pair_bytes * k, eq_item) for d in range(tp_d)]
    rng = np.random.default_rng(0)
    for r in pre:
        for b in r.kv + r.eq:
            b[:] = rng.integers(0, 256, b.size, dtype=np.uint8)
    for r in pre + dec:
        await r.engine.start()
    peers = {}
    for p, d in pairs:
        peers[(p, d)] = await pre[p].engine.connect(*dec[d].engine.address)
    src_pages = dst_pages = np.arange(pages)

    def plan(p, d, layout):
        return tp.plan_pages(
            geoms(a, H, tp_p, layout),
            geoms(a, H, tp_d, layout),
            p,
            d,
            tp_p,
            tp_d,
            src_pages,
            dst_pages,
        )

    def verify(layout):
        axis = 2 if layout == "nhd" else 1
        for p, d in pairs:
            (sl,) = [s for s in tp.plan_axis(H, tp_p, tp_d).receives(d) if s.prefill_rank == p]
            for i in range(2 * a.layers):
                got = np.take(dec[d].view(i, layout), range(*sl.dst), axis=axis)
                want = np.take(pre[p].view(i, layout), range(*sl.src), axis=axis)
                if not np.array_equal(got, want):
                    raise AssertionError(f"{layout}: pair {p}->{d} descriptor {i} differs")
        for r in dec:
            for b in r.kv:
                b[:] = 0

    async def strided(layout):
        t0 = time.perf_counter()
        plans = {pd: plan(*pd, layout) for pd in pairs}
        t_plan = time.perf_counter() - t0
        await asyncio.gather(*(peers[pd].write([plans[pd].raw_write("kv")]) for pd in pairs))
        return time.perf_counter() - t0, t_plan, sum(len(x) for x in plans.values())

    async def staged():
        t0 = time.perf_counter()
        sg, dg = geoms(a, H, tp_p, "nhd")[0], geoms(a, H, tp_d, "nhd")[0]
        runs = {(p, d): tp.item_runs(sg, dg, p, d, tp_p, tp_d) for p, d in pairs}
        t_plan = time.perf_counter() - t0

        async def one(p, d):
            (ro, rd, rn), src, dst = runs[(p, d)], pre[p], dec[d]
            s_off = d % max(1, tp_d // tp_p) * pair_bytes  # this pair's staging area
            l_off = p % k * pair_bytes  # and landing area
            off = s_off
            for i in range(2 * a.layers):  # the gather "kernel": one strided copy each
                off += tp.gather_items(src.kv[i], sg.item_bytes, src_pages, ro, rn, src.stage[off:])
            await peers[(p, d)].write([RawWrite("stage", s_off, l_off, pair_bytes)])
            per = pair_bytes // (2 * a.layers)
            for i in range(2 * a.layers):
                land = dst.stage[l_off + i * per :]
                tp.scatter_items(dst.kv[i], dg.item_bytes, dst_pages, rd, rn, land)

        await asyncio.gather(*(one(*pd) for pd in pairs))
        return time.perf_counter() - t0, t_plan, len(pairs)

    async def equal():
        t0 = time.perf_counter()
        ws = {pd: peers[pd].write([ItemWrite("eq", src_pages, dst_pages)]) for pd in pairs}
        stats = await asyncio.gather(*ws.values())
        return time.perf_counter() - t0, 0.0, sum(s.ops for s in stats)

    methods = {
        "nhd-strided": (lambda: strided("nhd"), "nhd"),
        "nhd-staged": (staged, "nhd"),
        "hnd": (lambda: strided("hnd"), "hnd"),
        "equal-tp": (equal, None),
    }
    total = pair_bytes * len(pairs)
    times: Dict[str, List[float]] = {m: [] for m in methods}
    plans: Dict[str, List[float]] = {m: [] for m in methods}
    ops: Dict[str, int] = {}
    for it in range(a.iters + 1):  # round-robin: load changes hit every method alike
        for name, (fn, layout) in methods.items():
            dt, t_plan, ops[name] = await fn()
            if layout is not None:
                verify(layout)
            if it:  # the first round warms up (registrations, connections, caches)
                times[name].append(dt)
                plans[name].append(t_plan)
    rows = []
    for name in methods:
        t = statistics.median(times[name])
        rows.append(
            dict(
                ratio=f"{tp_p}:{tp_d}",
                tokens=tokens,
                method=name,
                ms=t * 1e3,
                plan_ms=statistics.median(plans[name]) * 1e3,
                gbps=total / t / 1e9,
                ops=ops[name],
                mib=total / 2**20,
            )
        )
    eq = rows[-1]["gbps"]
    for r in rows:
        r["vs_eq"] = r["gbps"] / eq
    for r in pre + dec:
        await r.engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--ratios", nargs="+", default=["1:2", "2:1"])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    a.head_bytes = a.head_dim * 2  # bf16
    print(
        "| ratio | tokens | method | MiB/request | ops/request | plan ms | ms | GB/s | vs equal-TP |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for ratio in a.ratios:
        tp_p, tp_d = (int(x) for x in ratio.split(":"))
        for tokens in a.tokens:
            for r in asyncio.run(run_ratio(a, tp_p, tp_d, tokens)):
                print(
                    f"| {r['ratio']} | {r['tokens']} | {r['method']} | {r['mib']:.0f} | "
                    f"{r['ops']} | {r['plan_ms']:.1f} | {r['ms']:.1f} | {r['gbps']:.2f} | "
                    f"{r['vs_eq']:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
