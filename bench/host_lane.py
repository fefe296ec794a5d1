"""Host lane vs UCX PUTs by runs and bytes per run (kvxfer.engine.hostcopy), same run.

Two processes on this host (kvxfer.procs workers, kvxfer.bench.engine_node engines over
numpy host memory, UCX loopback). The initiator has two engines to the same target: one
with the host lane (``host_copy="auto"``) and one without (``"off"``: one UCX PUT per run).
For each cell (runs x bytes per run) both write the same ids (every other item, so no two
runs merge: one run per item) ``--iters`` times, alternating, and the table gives the p50
write time (post to flush complete, ``TransferStats.total_s``) of each and their ratio;
every write's bytes are checked at the target once per cell. It is what
``EngineConfig.host_min_ops`` is chosen from (bench/results/host-lane-cpu.md).

    .venv/bin/python bench/host_lane.py [--mode none|peer] [--iters 15] [--runs 16,32,...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

SECRET = b"host-lane-bench"


def main() -> int:
    from kvxfer.bench.engine_node import EngineNode
    from kvxfer.procs import Worker

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="none", choices=("none", "peer"))
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--runs", default="8,16,32,64,128,512,2048,8192")
    ap.add_argument("--sizes", default="256,4096,65536")
    ap.add_argument("--max-mib", type=int, default=128, help="largest cell, MiB")
    args = ap.parse_args()
    runs = [int(x) for x in args.runs.split(",")]
    sizes = [int(x) for x in args.sizes.split(",")]
    cap = args.max_mib << 20

    def groups():
        return {
            f"g{b}": {"item_lens": [b], "items": 2 * max(r for r in runs if r * b <= cap)}
            for b in sizes
        }

    def eng(name, **kw):
        cfg = dict(secret=SECRET, name=name, error_mode=args.mode, transfer_timeout_s=60.0, **kw)
        return {"config": cfg, "groups": groups(), "device": "cpu"}

    a = Worker(EngineNode, {"engines": {"main": eng("target")}}, name="target")
    b = Worker(
        EngineNode,
        {"engines": {"lane": eng("lane"), "puts": eng("puts", host_copy="off")}},
        name="initiator",
    )
    rows = []
    try:
        port = a.start().proxy(EngineNode).ports()["main"]
        ap_, bp = a.proxy(EngineNode), b.start().proxy(EngineNode)
        peers = {k: bp.connect(k, "127.0.0.1", port)["ok"] for k in ("lane", "puts")}
        t0 = time.time()
        for size in sizes:
            g = f"g{size}"
            for key in ("lane", "puts"):
                bp.fill(key, g, 7)
            for n in runs:
                if n * size > cap:
                    continue
                ids = list(range(0, 2 * n, 2))
                times = {"lane": [], "puts": []}
                host_ops = {}
                for it in range(args.iters + 1):  # the first of each is a warm-up
                    for key in ("lane", "puts") if it % 2 == 0 else ("puts", "lane"):
                        if it == 0:
                            ap_.zero("main", g)
                        res = bp.write(key, peers[key], [(g, ids, ids)])
                        st = res["ok"]
                        if it == 0:
                            assert ap_.items("main", g, ids) == bp.items(key, g, ids), key
                            host_ops[key] = st["host_ops"]
                            continue
                        times[key].append((st["post_s"] + st["complete_s"]) * 1e6)
                lane, puts = (statistics.median(times[k]) for k in ("lane", "puts"))
                rows.append((n, size, host_ops["lane"], host_ops["puts"], lane, puts))
                print(
                    f"runs {n:6d} x {size:6d} B: lane {lane:9.1f} µs (host ops "
                    f"{host_ops['lane']}), PUTs {puts:9.1f} µs, lane/PUTs {lane / puts:.2f}",
                    file=sys.stderr,
                    flush=True,
                )
        took = time.time() - t0
    finally:
        b.close()
        a.close()
    print(
        f"Host lane vs UCX PUTs, error mode {args.mode!r}, p50 of {args.iters} writes each "
        f"(alternating), one run per item ({took:.1f} s)\n"
    )
    print("| runs | bytes/run | MiB | host-lane ops | lane p50 µs | PUTs p50 µs | lane / PUTs |")
    print("|---|---|---|---|---|---|---|")
    for n, size, hl, _, lane, puts in rows:
        print(
            f"| {n} | {size} | {n * size / 2**20:.2f} | {hl} | {lane:.1f} | {puts:.1f} | "
            f"{lane / puts:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
