"""Where the device lane beats UCX PUTs (GPU machine; issue 15, ``device_min_ops``).

Two processes on one GPU: a target with one 1 GiB CUDA descriptor (group ``flat``), an
initiator with two engines connected to it, one with the device lane for every write
(``device_min_ops=1``; writes of <= 4 runs are copy-engine memcpys, more runs one native
kernel launch) and one without (``device_copy="off"``: one cuda_ipc PUT per run). For each
(runs, bytes per run) of the sweep, a RawWrite of that many runs at random, non-overlapping
offsets on both sides (the same runs for both engines), timed until its flush completed, the
two engines alternating in every iteration (same machine conditions); prints p50 and best µs
of each and lane / PUTs as a ratio of p50 times (< 1: the lane is faster). ``--rule``: the
first engine keeps the default rule (:func:`kvxfer.engine.devcopy.lane_wanted`), so the
ratio shows what the rule's choice gains or loses against PUTs (``path``: what it chose).

    python3 bench/gpu/lane_rule.py [--iters 12] [--runs 2,4,8,16,32,64,127]
        [--sizes-kib 64,256,1024,2048,4096,8192] [--rule]

Results: bench/results/lane-rule-h200.md."""

from __future__ import annotations

import argparse
import statistics
import time

from kvxfer.bench.transfer import SECRET, BenchNode
from kvxfer.procs import Worker

ITEM = 64 << 10
ITEMS = 16384  # 1 GiB per side


class RuleNode(BenchNode):
    def sweep(self, pids, runs, sizes, iters, seed=0):
        import numpy as np

        from kvxfer.engine import RawWrite

        peers = {k: self.engines[k].peers()[pid]._peer for k, pid in pids.items()}
        rng = np.random.default_rng(seed)
        out = []

        async def timed(peer, w):
            t0 = time.perf_counter()
            st = await peer.write(w)
            return time.perf_counter() - t0, (st.device_ops, st.ops)

        def one(n, size):
            slots = (ITEMS * ITEM) // size
            src = rng.choice(slots, n, replace=False).astype(np.uint64) * np.uint64(size)
            dst = rng.choice(slots, n, replace=False).astype(np.uint64) * np.uint64(size)
            w = [RawWrite("flat", src, dst, np.full(n, size, np.uint64))]
            times = {k: [] for k in peers}
            lanes = {}
            for i in range(iters + 2):
                order = list(peers) if i % 2 else list(reversed(list(peers)))
                for k in order:  # each engine's write runs on its own loop, timed there
                    dt, lanes[k] = self.engines[k]._run(timed(peers[k], w), 120)
                    if i >= 2:  # two warm-ups
                        times[k].append(dt)
            return times, lanes

        for size in sizes:
            for n in runs:
                if n * size > (512 << 20):
                    continue
                times, lanes = one(n, size)
                row = {"runs": n, "size": size}
                for k, v in times.items():
                    row[k + "_p50"] = statistics.median(v) * 1e6
                    row[k + "_best"] = min(v) * 1e6
                row["lane_ops"] = lanes["lane"]
                row["ratio"] = row["lane_p50"] / row["puts_p50"]
                out.append(row)
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--runs", default="2,4,8,16,32,64,127")
    ap.add_argument("--sizes-kib", default="64,256,1024,2048,4096,8192")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no lane)")
    ap.add_argument(
        "--rule",
        action="store_true",
        help="the lane engine with the default rule (devcopy.lane_wanted), not every write",
    )
    a = ap.parse_args()
    runs = [int(x) for x in a.runs.split(",")]
    sizes = [int(x) << 10 for x in a.sizes_kib.split(",")]
    groups = {"flat": {"item_lens": [ITEM], "items": ITEMS}}
    cfg = dict(secret=SECRET, transfer_timeout_s=120.0, warn_slow_lanes=False)
    target = Worker(
        RuleNode,
        {"engines": {"t": {"config": dict(cfg, name="t"), "groups": groups, "device": a.device}}},
        name="target",
    )
    try:
        port = target.start(120).proxy(RuleNode).ports()["t"]
        engines = {
            "lane": dict(cfg, name="lane")
            if a.rule
            else dict(cfg, name="lane", device_min_ops=1, device_small_ops=0),
            "puts": dict(cfg, name="puts", device_copy="off"),
        }
        init = Worker(
            RuleNode,
            {
                "engines": {
                    k: {"config": c, "groups": groups, "device": a.device}
                    for k, c in engines.items()
                }
            },
            name="init",
        )
        try:
            node = init.start(120).proxy(RuleNode)
            pids = {k: node.connect(k, "127.0.0.1", port)["ok"] for k in engines}
            rows = node.sweep(pids, runs, sizes, a.iters, timeout=540)
        finally:
            init.close()
    finally:
        target.close()
    what = "default rule" if a.rule else "lane"
    print(f"| bytes per run | runs | {what} p50 (best) µs | PUTs p50 (best) µs | ratio | path |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['size'] >> 10} KiB | {r['runs']} | {r['lane_p50']:.0f} ({r['lane_best']:.0f}) "
            f"| {r['puts_p50']:.0f} ({r['puts_best']:.0f}) | {r['ratio']:.2f} "
            f"| {'lane' if r['lane_ops'][0] == r['lane_ops'][1] else 'PUTs' if not r['lane_ops'][0] else r['lane_ops']} |"
        )


if __name__ == "__main__":
    main()
