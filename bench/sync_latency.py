"""SyncEngine 1-item write latency from the caller's thread, two ways in one run.

Two spawned processes (error mode ``--mode``, host memory, UCX loopback): B writes one item
(8 descriptors x 4 KiB = 8 runs, 32 KiB) to A with ``SyncPeer.write`` from its RPC thread,
one at a time with a 0.5 ms pause between writes (the loop idles, as between a scheduler's
requests), without and with a notification. Each round alternates the two ways of starting
the write: ``submit_here`` (the default: its first step on the caller's thread as the
loop's guest, kvxfer.loop_thread.LoopThread.submit_here) and ``handed over`` (the loop
thread runs it: ``LoopThread.submit``, as SyncEngine did before). Prints per way the p50 /
p90 of each round, the share of writes already done when ``write_async`` returned, and the
TransferStats medians (post, post → flush completed, µs).

    PYTHONPATH=. .venv/bin/python bench/sync_latency.py [--mode none|peer] [--rounds 4]

Results: bench/results/guest-writes-cpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvxfer.bench.engine_node import EngineNode
from kvxfer.procs import Worker


def _engine(name: str, mode: str) -> dict:
    return {
        "config": dict(secret=b"sync-latency-bench", name=name, error_mode=mode),
        "groups": {"kv": {"item_lens": [4096] * 8, "items": 64}},
        "device": "cpu",
    }


class LatencyNode(EngineNode):
    def latency(self, key: str, peer_id: str, n: int, notify: bool, handed_over: bool) -> dict:
        """``n`` writes of item 1 to item 2 (the first 20 dropped as warm-up)."""
        eng = self.engines[key]
        start = eng._start
        if handed_over:
            eng._start = lambda coro: eng._lt.submit(coro)
        try:
            peer = self._peer(key, peer_id)
            w = self._writes([("kv", [1], [2])])
            times, done_now, post, flush = [], [], [], []
            for _ in range(n):
                time.sleep(0.0005)
                t0 = time.perf_counter()
                p = peer.write_async(w, b"n" if notify else None, 10.0)
                done_now.append(p.poll())
                st = p.result()
                times.append((time.perf_counter() - t0) * 1e6)
                post.append(st.post_s * 1e6)
                flush.append(st.flush_s * 1e6)
        finally:
            eng._start = start
        times = times[20:]
        return {
            "p50": statistics.median(times),
            "p90": sorted(times)[int(len(times) * 0.9)],
            "done_at_return": sum(done_now) / len(done_now),
            "post": statistics.median(post),
            "flush": statistics.median(flush),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="none", choices=["none", "peer"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--writes", type=int, default=400)
    args = ap.parse_args()
    a = Worker(EngineNode, {"engines": {"m": _engine("A", args.mode)}}, name="A").start()
    b = Worker(LatencyNode, {"engines": {"m": _engine("B", args.mode)}}, name="B").start()
    try:
        pa, pb = a.proxy(EngineNode), b.proxy(LatencyNode)
        pid = pb.connect("m", "127.0.0.1", pa.ports()["m"])["ok"]
        res: dict = {}
        for _ in range(args.rounds):
            for notify in (False, True):
                for handed in (True, False):
                    r = pb.latency("m", pid, args.writes, notify, handed)
                    res.setdefault((notify, handed), []).append(r)
        print(
            "| mode | notify | started | p50 µs per round | p90 µs | done at return | post / flush µs |"
        )
        print("|---|---|---|---|---|---|---|")
        for (notify, handed), rs in sorted(res.items()):
            way = "handed over" if handed else "submit_here"
            fmt = lambda k, f, rs=rs: " ".join(f.format(r[k]) for r in rs)  # noqa: E731
            post = statistics.median(r["post"] for r in rs)
            flush = statistics.median(r["flush"] for r in rs)
            print(
                f"| {args.mode} | {notify} | {way} | {fmt('p50', '{:.0f}')} | {fmt('p90', '{:.0f}')}"
                f" | {fmt('done_at_return', '{:.2f}')} | {post:.1f} / {flush:.1f} |"
            )
    finally:
        b.close()
        a.close()


if __name__ == "__main__":
    main()
