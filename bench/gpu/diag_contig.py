"""Diagnostic (GPU machine): why is a 1-op contiguous item write slower than the raw 1-op
write of the same bytes in ``kvxfer bench transfer``? Times sequences of writes on one
engine pair (CUDA pools, two processes): raw only, items only, alternating, alternating
with a 5 ms gap, and prints per-write total / post / flush (UCX-reported) / complete."""

import asyncio
import sys
import time

from kvxfer.bench.transfer import SECRET, BenchNode, _groups
from kvxfer.procs import Worker


class DiagNode(BenchNode):
    def diag(self, key, peer_id, n, pool, page_bytes, iters):
        from kvxfer.engine import ItemWrite, RawWrite

        sync = self.engines[key]
        peer = sync.peers()[peer_id]._peer
        nbytes = n * page_bytes
        raw = [RawWrite("pm", 0, 0, nbytes)]
        raw_hi = [RawWrite("pm", 0, (pool - n) * page_bytes, nbytes)]
        items = [ItemWrite("pm", list(range(n)), list(range(pool - n, pool)))]
        kinds = {"r": raw, "R": raw_hi, "i": items}

        async def seq(pattern, gap):
            out = []
            for k in pattern:
                t0 = time.perf_counter()
                st = await peer.write(kinds[k])
                t1 = time.perf_counter()
                out.append((k, t1 - t0, st.post_s, st.flush_s, st.complete_s, st.ops))
                if gap:
                    await asyncio.sleep(gap)
            return out

        res = {}
        for name, pattern, gap in (
            ("raw only", "r" * iters, 0),
            ("items only", "i" * iters, 0),
            ("raw-hi only", "R" * iters, 0),
            ("alternate r,i", "ri" * iters, 0),
            ("alternate i,r", "ir" * iters, 0),
            ("alternate r,i + 5ms gaps", "ri" * iters, 0.005),
        ):
            sync._run(seq("ri", 0), 120)  # warm
            res[name] = sync._run(seq(pattern, gap), 300)
        return res


def main():
    layers, page_kib, pool = 8, 64, 2048
    flush = sys.argv[1] if len(sys.argv) > 1 else "auto"
    page = 2 * layers * (page_kib << 10)
    groups = _groups(layers, page_kib << 10, pool)
    cfg = dict(secret=SECRET, transfer_timeout_s=120.0, warn_slow_lanes=False, flush_progress=flush)
    target = Worker(
        DiagNode,
        {"engines": {"t": {"config": dict(cfg, name="t"), "groups": groups, "device": "cuda"}}},
        name="target",
    )
    init = Worker(
        DiagNode,
        {"engines": {"i": {"config": dict(cfg, name="i"), "groups": groups, "device": "cuda"}}},
        name="init",
    )
    try:
        port = target.start(120).proxy(DiagNode).ports()["t"]
        node = init.start(120).proxy(DiagNode)
        pid = node.connect("i", "127.0.0.1", port)["ok"]
        for n in (512, 2048):
            res = node.diag("i", pid, n, pool, page, 4, timeout=600)
            print(f"\n### n={n} pages ({n * page / 2**20:.0f} MiB), flush_progress={flush}")
            for name, rows in res.items():
                txt = " ".join(
                    f"{k}:{n * page / t / 1e9:.0f}GB/s(p{p * 1e3:.2f},f{f * 1e3:.2f},c{c * 1e3:.2f})"
                    for k, t, p, f, c, _ in rows
                )
                print(f"{name:26s} {txt}")
    finally:
        init.close()
        target.close()


if __name__ == "__main__":
    main()
