"""SGLang backend latency: a small request (1 page, or ``--pages N``) through kvxfer's SGLang
classes, against the raw engine write of the same bytes, in the same run.

Real parts as in ``make test-sglang`` (tests/sglang_pd: sglang's pools, ``KVArgs``, metadata
buffers, ``get_kv_class(TransferBackend("kvxfer"), ...)``; one process per role over UCX on
loopback, CPU pools). Figures (µs):

- ``sgl``: prefill's ``KVSender.send`` → decode's manager makes the room Success (SglDone
  handled), one request at a time (the next once prefill's manager made the last Success);
- ``raw``: the backend's own planner and peer write the same items (``EngineLoop.run`` from
  the scheduler-like thread, as any handed-over call), until the write settled;
- ``raw + notify``: the same with a ``Ping`` notification, until decode handled it;
- requests/s: every room of a batch (200) sent back to back, first send → decode's last
  Success.

``--decode-tp 2``: heterogeneous TP instead (4 KV heads, one prefill rank into two decode
ranks, the backend's 1 → 2 PatternWrites of each rank's heads; CPU pools, so PUTs), one
request at a time: prefill's send → the last decode rank's Success, and → prefill's own
Success (its scheduler may free the pages), plus the share of sends run as the engine
loop's guest. No raw or throughput rows there.

Run in the SGLang environment (``make test-sglang`` builds it):

    .venv-sglang/bin/python bench/sgl_latency.py [--requests 500] [--throughput 500]
        [--json] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "tests", "sglang_pd")


def _paths() -> None:
    """tests/sglang_pd (the nodes) and this folder on sys.path (spawned children inherit it),
    with the torchvision stand-in where torchvision does not import (tests/sglang_pd/conftest)."""
    if importlib.util.find_spec("sglang") is None:
        sys.exit("sglang is not importable: run this with .venv-sglang/bin/python")
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, os.path.join(TESTS, "_stubs"))
    for p in (TESTS, HERE):
        if p not in sys.path:
            sys.path.insert(0, p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500, help="requests timed")
    ap.add_argument("--throughput", type=int, default=500, help="requests sent back to back")
    ap.add_argument("--batch", type=int, default=50, help="rooms opened at a time")
    ap.add_argument("--pages", type=int, default=1, help="pages per request (1..60)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    ap.add_argument("--decode-tp", type=int, default=1, choices=(1, 2), help="2: 1 → 2 TP")
    args = ap.parse_args(argv)
    _paths()
    if args.decode_tp == 2:
        return _tp_main(args)
    import sgl_latency_nodes as B
    import sgl_nodes as N
    from sgl_harness import ENV

    from kvxfer.pd_demo.run import percentile as pct
    from kvxfer.procs import Worker

    workers = [
        Worker(N.BootstrapServers, 1, name="bootstrap", env=ENV),
        Worker(B.bench_node, "prefill", name="prefill", env=ENV, timeout=300),
        Worker(B.bench_node, "decode", name="decode", env=ENV, timeout=300),
    ]
    try:
        port = _launch(workers)
        pf = workers[1].proxy(B.BenchPrefill)
        dc = workers[2].proxy(B.BenchDecode)
        pf.add("mha", "mha", port, timeout=120)
        dc.add("mha", "mha", port, timeout=120)
        pf.setup("mha")
        dc.setup("mha")
        next_room = [1]

        def open_rooms(n):
            rooms = list(range(next_room[0], next_room[0] + n))
            next_room[0] += n
            pf.open_many("mha", rooms, port)
            dc.open_many("mha", rooms, port, args.pages)
            pf.arm_many("mha", rooms, pages=args.pages)
            return rooms

        def run_latency(n):
            lat = []
            while n > 0:
                rooms = open_rooms(min(n, args.batch))
                sent = pf.latency(rooms, pages=args.pages)
                got = dc.wait_all(rooms)
                bad = [r for r in rooms if got[r] <= 0]
                if bad:
                    raise RuntimeError(f"rooms {bad[:5]} did not succeed at decode")
                lat += [(got[r] - sent[r]) / 1e3 for r in rooms]
                pf.clear_many(rooms)
                dc.clear_many(rooms)
                n -= len(rooms)
            return lat

        run_latency(2 * args.batch)  # warm-up
        pf.direct_sends()
        lat = run_latency(args.requests)
        direct = pf.direct_sends()
        (room,) = open_rooms(1)
        raw = pf.raw("mha", room, args.requests, False, pages=args.pages)
        rawn = pf.raw("mha", room, args.requests, True, pages=args.pages)
        rx = dc.raw_receipts()
        pf.latency([room], pages=args.pages)
        dc.wait_all([room])
        raw_us = [(b - a) / 1e3 for a, b, _ in raw]
        rawn_us = [(rx[s] - a) / 1e3 for a, _, s in rawn if s in rx]
        rates = []
        left = args.throughput
        while left > 0:
            rooms = open_rooms(min(left, 200))
            t = pf.throughput(rooms, pages=args.pages)
            got = dc.wait_all(rooms)
            if t["failed"] or min(got.values()) <= 0:
                raise RuntimeError(f"throughput rooms failed (prefill: {t['failed']})")
            rates.append(len(rooms) / ((max(got.values()) - t["t0"]) / 1e9))
            pf.clear_many(rooms)
            dc.clear_many(rooms)
            left -= len(rooms)
        row = dict(
            pages=args.pages,
            requests=len(lat),
            sgl_p50_us=pct(lat, 50),
            sgl_p99_us=pct(lat, 99),
            raw_p50_us=pct(raw_us, 50),
            raw_notify_p50_us=pct(rawn_us, 50),
            raw_notify_p99_us=pct(rawn_us, 99),
            req_per_s=statistics.median(rates),
            direct_share=direct / max(1, len(lat)),
            over_1ms=sum(1 for x in lat if x > 1000.0) / max(1, len(lat)),
        )
        row["sgl_over_raw_notify"] = row["sgl_p50_us"] / row["raw_notify_p50_us"]
    finally:
        for w in reversed(workers):
            w.close()
    return _emit(
        args,
        row,
        [
            "| figure | value |",
            "|---|---|",
            f"| SGLang {args.pages}-page send → decode Success p50 µs | {row['sgl_p50_us']:.1f} |",
            f"| SGLang p99 µs | {row['sgl_p99_us']:.1f} |",
            f"| share of SGLang requests over 1 ms | {row['over_1ms']:.3f} |",
            f"| raw write p50 µs | {row['raw_p50_us']:.1f} |",
            f"| raw write + notify until decode has it, p50 µs | {row['raw_notify_p50_us']:.1f} |",
            f"| raw write + notify p99 µs | {row['raw_notify_p99_us']:.1f} |",
            f"| SGLang p50 / (raw + notify) p50 | {row['sgl_over_raw_notify']:.2f} |",
            f"| requests/s (back to back until decode's last Success, median of batches) | {row['req_per_s']:.0f} |",
            f"| share of the timed sends run direct (loop's guest) | {row['direct_share']:.2f} |",
        ],
    )


def _emit(args, row: dict, lines) -> int:
    """Print ``row`` (``--json``) or its table ``lines``; append the table to ``--out``."""
    table = "\n".join(lines)
    print(json.dumps(row) if args.json else table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")
    return 0


def _launch(workers) -> int:
    """Start the workers (bootstrap first in the list), wait until each is built; returns
    the bootstrap server's port."""
    import sgl_nodes as N

    for w in workers:
        w.launch()
    for w in workers:
        w.ready(300)
    (port,) = workers[0].proxy(N.BootstrapServers).ports()
    return port


def _tp_main(args) -> int:
    """``--decode-tp 2``: one prefill rank (TP 1) into two decode ranks (TP 2), 4 KV heads."""
    import sgl_latency_nodes as B
    import sgl_nodes as N
    from sgl_harness import ENV

    from kvxfer.pd_demo.run import percentile as pct
    from kvxfer.procs import Worker

    workers = [
        Worker(N.BootstrapServers, 1, name="bootstrap", env=ENV),
        Worker(B.bench_node, "prefill", name="prefill", env=ENV, timeout=300),
        Worker(B.bench_node, "decode", name="decode-0", env=ENV, timeout=300),
        Worker(B.bench_node, "decode", name="decode-1", env=ENV, timeout=300),
    ]
    try:
        port = _launch(workers)
        pf = workers[1].proxy(B.BenchPrefill)
        dcs = [w.proxy(B.BenchDecode) for w in workers[2:]]
        pf.add("p1d2", "mha", port, tp=(1, 0), heads=4, timeout=120)
        for r, dc in enumerate(dcs):
            dc.add("p1d2", "mha", port, tp=(2, r), heads=4, timeout=120)
        pf.setup("p1d2")
        for dc in dcs:
            dc.setup("p1d2")
        next_room = [1]

        def run(n):
            out = []
            while n > 0:
                rooms = list(range(next_room[0], next_room[0] + min(n, args.batch)))
                next_room[0] += len(rooms)
                pf.open_many("p1d2", rooms, port)
                for dc in dcs:
                    dc.open_many("p1d2", rooms, port, args.pages)
                pf.arm_many("p1d2", rooms, pages=args.pages)
                sent = pf.latency(rooms, pages=args.pages)
                got = [dc.wait_all(rooms) for dc in dcs]
                mine = pf.success_stamps(rooms)
                for r in rooms:
                    if min(g[r] for g in got) <= 0 or mine[r] <= 0:
                        raise RuntimeError(f"room {r} did not succeed everywhere")
                    out.append(
                        ((max(g[r] for g in got) - sent[r]) / 1e3, (mine[r] - sent[r]) / 1e3)
                    )
                pf.clear_many(rooms)
                for dc in dcs:
                    dc.clear_many(rooms)
                n -= len(rooms)
            return out

        run(2 * args.batch)  # warm-up
        pf.direct_sends()
        got = run(args.requests)
        direct = pf.direct_sends()
    finally:
        for w in reversed(workers):
            w.close()
    dec, pre = [g[0] for g in got], [g[1] for g in got]
    row = dict(
        pages=args.pages,
        requests=len(got),
        tp="1->2",
        sgl_p50_us=pct(dec, 50),
        sgl_p99_us=pct(dec, 99),
        prefill_p50_us=pct(pre, 50),
        prefill_p99_us=pct(pre, 99),
        direct_share=direct / max(1, len(got)),
    )
    return _emit(
        args,
        row,
        [
            "| figure (SGLang backend, TP 1 → 2, 4 KV heads) | value |",
            "|---|---|",
            f"| {args.pages}-page send → last decode rank's Success p50 µs | {row['sgl_p50_us']:.1f} |",
            f"| … p99 µs | {row['sgl_p99_us']:.1f} |",
            f"| send → prefill's Success p50 µs | {row['prefill_p50_us']:.1f} |",
            f"| … p99 µs | {row['prefill_p99_us']:.1f} |",
            f"| share of the timed sends run direct (loop's guest) | {row['direct_share']:.2f} |",
        ],
    )


if __name__ == "__main__":
    raise SystemExit(main())
