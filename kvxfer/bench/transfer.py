"""``kvxfer bench transfer``: KV transfer bandwidth over UCX against raw UCX and memcpy.

Spawned processes on this host: a target holding the destination pools, and one initiator
process per engine configuration connected to it. The configurations are ``error_mode="peer"``
and ``"none"`` (the lane configurations), times the device lane, flush progress and path
settings. For each lane config × layout (per-layer: 2·L descriptors; page-major: one) ×
request size (pages, random page ids on both sides) it times, in the same run:

* ``Peer.write`` of the pages (validate → plan → one native batch → flush), end to end,
  for random page ids on both sides (about one run per page) and for contiguous ones (one
  run: the ops equal the descriptors);
* a raw single PUT of the same number of bytes from one contiguous buffer into one
  contiguous remote buffer over the same endpoint (1 op);
* single-thread memcpy of the same bytes in the initiator (numpy ``copyto``; on CUDA a
  device-to-device ``copy_``).

Each lane config runs twice when ``--paths direct,staged``: an engine that never stages and
one with the staged path (parts needing more than ``--stage-min-ops`` PUTs are gathered into
a staging slot, PUT as one op per landing slot and scattered at the target before the
completion); the ``path`` column says which path a row took and ``ops/req`` then shows the
PUTs posted (and, in parentheses, what the direct path would have needed).

``--device-copy auto,off`` runs engines with and without the same-host device lane
(:mod:`kvxfer.engine.devcopy`; CUDA only, rows that used it say ``path=device``; their
``raw 1-PUT`` column is then the same 1-op write through the device lane).
``--flush auto,event`` adds one engine per flush-progress setting (EngineConfig.flush_progress;
the ``flush`` column says which one ran and whether it spun); ``wake µs`` is the median time
from UCX reporting the flush complete to the write returning (event-loop wake-up).

The raw PUT and the item write alternate within one loop (same machine conditions); GB/s =
bytes / best time of ``--iters`` (after a warm-up; medians are in the JSON), 1 GB = 1e9 B.
The time of a write runs until the flush completed (bytes visible at the target).
Targets (issue 5): ≥ 0.95× raw for requests ≥ 64 MiB on the same lanes; ops per request =
runs × descriptors (page-major 2·L× fewer than per-layer).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import sys
import time

from kvxfer import clitools
from kvxfer.bench.engine_node import EngineNode
from kvxfer.config import EngineConfig
from kvxfer.procs import Worker

SECRET = b"kvxfer-bench"


class BenchNode(EngineNode):
    """EngineNode plus timing loops run inside the engine's event loop."""

    def bench_pair(
        self, key, peer_id, group, src, dst, raw_group, nbytes, iters, timeout=300.0, inflight=1
    ):
        """Alternate (raw 1-op PUT of ``nbytes``, item write) ``iters`` times after a warm-up,
        so both see the same machine conditions; returns the best and median of each.
        ``inflight`` > 1: each timed step is that many writes in flight at once (per-write
        time = batch time / inflight), as ucx_perftest keeps a window of PUTs in flight."""
        from kvxfer.engine import ItemWrite, RawWrite

        sync = self.engines[key]
        peer = sync.peers()[peer_id]._peer
        items = [ItemWrite(group, src, dst)]
        raw = [RawWrite(raw_group, 0, 0, nbytes)]

        async def loop():
            t_raw, t_items, wake, stats = [], [], [], None
            for i in range(iters + 1):
                t0 = time.perf_counter()
                await asyncio.gather(*(peer.write(raw) for _ in range(inflight)))
                t1 = time.perf_counter()
                stats = (await asyncio.gather(*(peer.write(items) for _ in range(inflight))))[-1]
                t2 = time.perf_counter()
                if i:
                    t_raw.append((t1 - t0) / inflight)
                    t_items.append((t2 - t1) / inflight)
                    wake.append(stats.complete_s - stats.flush_s)
            return t_raw, t_items, wake, stats

        t_raw, t_items, wake, st = sync._run(loop(), timeout)
        return {
            "items_best": min(t_items),
            "items_med": statistics.median(t_items),
            "raw_best": min(t_raw),
            "raw_med": statistics.median(t_raw),
            "ops": st.ops,
            "bytes": st.bytes,
            "lanes": st.lanes,
            "post_s": st.post_s,
            "staged": st.staged,
            "direct_ops": st.staged_direct_ops or st.ops,
            "spin": peer.spin,
            "wake_med": statistics.median(wake),
            "device_bytes": st.device_bytes,
        }

    def bench_memcpy(self, nbytes, iters, device):
        times = []  # best of iters (after a warm-up)
        if device == "cpu":
            np = self.np
            a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            for _ in range(iters + 1):
                t0 = time.perf_counter()
                np.copyto(b, a)
                times.append(time.perf_counter() - t0)
        else:
            import torch

            a = torch.ones(nbytes, dtype=torch.uint8, device=device)
            b = torch.zeros_like(a)
            for _ in range(iters + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.copy_(a)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        return min(times[1:])


def _groups(layers, page, pages):
    return {
        "kv": {"item_lens": [page] * (2 * layers), "items": pages, "contiguous": True},
        "pm": {"item_lens": [2 * layers * page], "items": pages},
    }


def run(args, progress=None) -> dict:
    import numpy as np

    page = args.page_kib << 10
    groups = _groups(args.layers, page, args.pages)
    cfg = dict(secret=SECRET, transfer_timeout_s=120.0, warn_slow_lanes=False)
    target = Worker(
        BenchNode,
        {
            "engines": {
                "t": {
                    # landing rings exist only on an engine with staging on (stage_min_ops > 0)
                    "config": dict(
                        cfg,
                        name="target",
                        stage_slot_bytes=args.stage_slot_mib << 20,
                        stage_host_memory=True,
                        stage_min_ops=args.stage_min_ops if "staged" in args.paths else 0,
                        stage_slots=max(8, 4 * len(args.modes)),
                    ),
                    "groups": groups,
                    "device": args.device,
                }
            }
        },
        name="target",
    )
    # one initiator engine per (lane config, path config, flush progress, device lane), each
    # in its own process: a deployment runs one engine per worker process, and engines that
    # share a process contend for the GIL (UCXX polls pending requests from every event loop)
    # "direct" never stages (stage_min_ops=0), "staged" stages parts above --stage-min-ops PUTs
    keys = [
        (m, p, f, d)
        for m in args.modes
        for p in args.paths
        for f in args.flush
        for d in args.device_copy
    ]
    inits = {
        "/".join(k): Worker(
            BenchNode,
            {
                "engines": {
                    "/".join(k): {
                        "config": dict(
                            cfg,
                            name="init-" + "-".join(k),
                            error_mode=k[0],
                            flush_progress=k[2],
                            device_copy=k[3],
                            stage_min_ops=0 if k[1] == "direct" else args.stage_min_ops,
                            stage_host_memory=True,
                            stage_slot_bytes=args.stage_slot_mib << 20,
                        ),
                        "groups": groups,
                        "device": args.device,
                    }
                }
            },
            name="initiator-" + "-".join(k),
        )
        for k in keys
    }
    rows: list = []
    report = {"args": vars(args), "rows": rows}
    try:
        port = target.start(120).proxy(BenchNode).ports()["t"]
        peers = {}
        nodes = {k: init.start(120).proxy(BenchNode) for k, init in inits.items()}
        for k, init in nodes.items():
            res = init.connect(k, "127.0.0.1", port)
            if "ok" not in res:
                raise RuntimeError(f"connect ({k}): {res}")
            peers[k] = res["ok"]
            init.fill(k, "kv", 1)
            init.fill(k, "pm", 2)
        rng = np.random.default_rng(0)
        for n in args.sizes:
            if n > args.pages:
                continue
            # int64 arrays, as a scheduler hands page ids over (lists cost ~0.1 ms per 2048
            # ids to convert; see kvxfer.plan.as_ids)
            sets = {
                "random": (
                    rng.choice(args.pages, n, replace=False),
                    rng.choice(args.pages, n, replace=False),
                ),
                "contiguous": (np.arange(n), np.arange(args.pages - n, args.pages)),
            }
            nbytes = n * 2 * args.layers * page
            first = next(iter(nodes.values()))
            memcpy_s = first.bench_memcpy(nbytes, args.iters, args.device, timeout=300)
            for m, p, f, dc in keys:
                k = "/".join((m, p, f, dc))
                init = nodes[k]
                for (layout, group), pset in itertools.product(
                    (("per-layer", "kv"), ("page-major", "pm")), args.pagesets
                ):
                    src, dst = sets[pset]
                    r = init.bench_pair(
                        k,
                        peers[k],
                        group,
                        src,
                        dst,
                        "pm",
                        nbytes,
                        args.iters,
                        600,
                        args.inflight,
                        timeout=600,
                    )
                    assert r["bytes"] == nbytes
                    rows.append(
                        {
                            "mode": m,
                            "lanes": ",".join(r["lanes"]),
                            "layout": layout,
                            "flush": f"{f} ({'spin' if r['spin'] else 'event'})",
                            "wake_us": r["wake_med"] * 1e6,
                            "config": p,
                            "device_copy": dc,
                            "path": (
                                "staged"
                                if r["staged"]
                                else "device"
                                if r["device_bytes"] == nbytes
                                else "direct"
                            ),
                            "direct_ops": r["direct_ops"],
                            "pageset": pset,
                            "pages": n,
                            "MiB": nbytes / 2**20,
                            "ops": r["ops"],
                            "GBps": nbytes / r["items_best"] / 1e9,
                            "GBps_median": nbytes / r["items_med"] / 1e9,
                            "raw_GBps": nbytes / r["raw_best"] / 1e9,
                            "raw_GBps_median": nbytes / r["raw_med"] / 1e9,
                            "memcpy_GBps": nbytes / memcpy_s / 1e9,
                            "vs_raw": r["raw_best"] / r["items_best"],
                            "vs_memcpy": memcpy_s / r["items_best"],
                            "post_ms": r["post_s"] * 1e3,
                        }
                    )
                    print(_row(rows[-1]), flush=True)
                    if progress is not None:
                        progress.step(f"{m}/{p} {layout} {pset} {n} pages")
    finally:
        for init in inits.values():
            init.close()
        target.close()
    return report


_HEAD = (
    "| lanes (mode) | flush | layout | page ids | pages | MiB | path | ops/req | GB/s "
    "| raw 1-PUT GB/s | memcpy GB/s | × raw | × memcpy | post ms | wake µs |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def _row(r) -> str:
    # wake: UCX flush completion -> write returned; only direct writes flush at the end
    wake = f"{r['wake_us']:.0f}" if r["path"] == "direct" else "-"
    return (
        f"| {r['lanes']} ({r['mode']}, dev {r.get('device_copy', 'off')}) | {r['flush']} | {r['layout']} | {r['pageset']} | {r['pages']} | {r['MiB']:.1f} | "
        f"{r['path']} | {r['ops']}{'' if r['path'] == 'direct' else ' (%d)' % r['direct_ops']} | {r['GBps']:.2f} | {r['raw_GBps']:.2f} | {r['memcpy_GBps']:.2f} | "
        f"{r['vs_raw']:.2f} | {r['vs_memcpy']:.2f} | {r['post_ms']:.2f} | {wake} |"
    )


def _plot(report, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["mode"], r["layout"], r.get("config", "direct")) for r in report["rows"]})
    for mode, layout, cfg in keys:
        rs = [
            r
            for r in report["rows"]
            if r["mode"] == mode
            and r["layout"] == layout
            and r["pageset"] == "random"
            and r.get("config", "direct") == cfg
        ]
        if not rs:
            continue
        ax.plot(
            [r["MiB"] for r in rs],
            [r["GBps"] for r in rs],
            marker="o",
            ls="-" if cfg == "direct" else ":",
            label=f"{layout}, {mode} ({rs[0]['lanes']}), {cfg}",
        )
    for mode in sorted({k[0] for k in keys}):
        rs = [
            r
            for r in report["rows"]
            if r["mode"] == mode
            and r["layout"] == "page-major"
            and r["pageset"] == "random"
            and r.get("config", "direct") == keys[0][2]
        ]
        ax.plot(
            [r["MiB"] for r in rs], [r["raw_GBps"] for r in rs], ls="--", label=f"raw 1 PUT, {mode}"
        )
    ax.set_xscale("log")
    ax.set_xlabel("request MiB")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = clitools.parser("kvxfer bench transfer", __doc__)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (torch device of the pools)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--page-kib", type=int, default=16, help="bytes per page per K or V, KiB")
    ap.add_argument("--pages", type=int, default=1024, help="pages in each pool")
    ap.add_argument("--sizes", default="8,64,512,1024", help="request sizes in pages")
    ap.add_argument("--modes", default="peer,none", help="error modes (lane configurations)")
    ap.add_argument(
        "--pagesets",
        default="random,contiguous",
        help="page ids: random (runs ~ pages) and/or contiguous (one run)",
    )
    ap.add_argument(
        "--paths",
        default="direct,staged",
        help="engine configs: direct (stage_min_ops=0) and/or staged "
        "(--stage-min-ops); the path column says which one ran",
    )
    ap.add_argument(
        "--flush",
        default="auto",
        help="flush progress configs (EngineConfig.flush_progress): auto, spin, event",
    )
    ap.add_argument(
        "--device-copy",
        default="off",
        help="device lane configs (EngineConfig.device_copy): auto and/or off; "
        "rows that took it show path=device",
    )
    ap.add_argument(
        "--stage-min-ops",
        type=int,
        default=256,
        help="staged config: stage parts needing more PUTs than this",
    )
    ap.add_argument(
        "--stage-slot-mib",
        type=int,
        default=EngineConfig.stage_slot_bytes >> 20,
        help="staging/landing slot size, MiB",
    )
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument(
        "--inflight",
        type=int,
        default=1,
        help="writes in flight per timed step (1: one request at a time; >1: "
        "throughput with a window, like ucx_perftest)",
    )
    clitools.add_json_args(ap, json_out_default="transfer.json")
    ap.add_argument("--plot", default="transfer.png", help="plot file (needs matplotlib)")
    args = ap.parse_args(argv)
    args.sizes = [int(x) for x in args.sizes.split(",")]
    args.modes = [m.strip() for m in args.modes.split(",")]
    args.pagesets = [p.strip() for p in args.pagesets.split(",")]
    args.paths = [p.strip() for p in args.paths.split(",")]
    args.flush = [f.strip() for f in args.flush.split(",")]
    args.device_copy = [d.strip() for d in args.device_copy.split(",")]
    if not set(args.paths) <= {"direct", "staged"}:
        ap.error(f"--paths {args.paths}: expected direct and/or staged")
    print(
        f"kvxfer bench transfer: device={args.device} layers={args.layers} "
        f"page={args.page_kib} KiB/desc pool={args.pages} pages, best of {args.iters}, "
        f"{args.inflight} write(s) in flight"
    )
    print(_HEAD, flush=True)
    n_sizes = sum(1 for n in args.sizes if n <= args.pages)
    total = (
        n_sizes
        * len(args.modes)
        * len(args.paths)
        * len(args.flush)
        * len(args.device_copy)
        * 2
        * len(args.pagesets)
    )
    with clitools.Progress(total, "bench transfer", enabled=False if args.json else None) as pr:
        report = run(args, pr)
    if args.json_out:
        print(f"\nJSON: {args.json_out}")
    if _plot(report, args.plot):
        print(f"plot: {args.plot}")
    else:
        print("plot: skipped (matplotlib not installed)")
    clitools.emit_json(args, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
