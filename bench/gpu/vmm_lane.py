"""Engine writes into a CUDA VMM-backed pool: the device lane (kvxfer.engine.vmm_share) vs
UCX's emulated PUTs, beside the same writes into ``cudaMalloc`` memory, same run.

Two processes on this GPU: A registers one per-layer kv group twice (a VMM range with
POSIX-FD handles, as the pools' post-capture backing makes it; and ordinary memory), B
writes into both over real UCX on loopback from two engines: ``lane`` (device lane on,
``device_min_ops=1``: every write copies on the lane) and ``ucx`` (``device_copy="off"``:
cuda_ipc PUTs into ordinary memory, emulated PUTs into VMM memory). Per case the median of
``--iters`` writes (B's ``Peer.write``: post + flush + notify), GB/s, and × the same bytes'
D2D ``copy_`` in one contiguous block (this process, same GPU), plus the first write's
bytes checked. Prints a markdown table; ``--json`` writes the rows.

    python3 bench/gpu/vmm_lane.py [--iters 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

from kvxfer.bench.engine_node import EngineNode
from kvxfer.procs import Worker

SECRET = b"vmm-lane-bench"
DESCS, ITEM, ITEMS = 16, 32 << 10, 1024  # 16 per-layer buffers of 32 KiB pages: 512 MiB


def groups(vmm: bool):
    return {"kv": {"item_lens": [ITEM] * DESCS, "items": ITEMS, "contiguous": True, "vmm": vmm}}


def eng(name, g, **kw):
    cfg = dict(secret=SECRET, name=name, connect_timeout_s=30.0, transfer_timeout_s=120.0, **kw)
    return {"config": cfg, "groups": g, "device": "cuda:0"}


def copy_rate(nbytes: int, iters: int = 20) -> float:
    """GB/s of one D2D ``copy_`` of ``nbytes`` (CUDA events)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(iters):
        b.copy_(a)
    e.record()
    e.synchronize()
    return nbytes * iters / (s.elapsed_time(e) / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--emulated-iters", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.zeros(1, device="cuda:0")
    a = Worker(
        EngineNode,
        {"engines": {"vmm": eng("A-vmm", groups(True)), "plain": eng("A-plain", groups(False))}},
        name="A",
    )
    b = Worker(
        EngineNode,
        {
            "engines": {
                "lane": eng("B-lane", groups(False), device_min_ops=1),
                "ucx": eng("B-ucx", groups(False), device_copy="off"),
            }
        },
        name="B",
    )
    rows = []
    try:
        ports = a.start().proxy(EngineNode).ports()
        b.start()
        pa, pb = a.proxy(EngineNode), b.proxy(EngineNode)
        conn = {}
        for src in ("lane", "ucx"):
            for dst in ("vmm", "plain"):
                res = pb.connect(src, "127.0.0.1", ports[dst])
                assert "ok" in res, res
                conn[src, dst] = res["ok"]
        pb.fill("lane", "kv", 1)
        pb.fill("ucx", "kv", 1)
        rng = np.random.default_rng(0)
        cases = [
            ("1 page", [3], [17]),
            ("32 random pages", *[rng.choice(ITEMS, 32, replace=False).tolist() for _ in "ab"]),
            ("256 random pages", *[rng.choice(ITEMS, 256, replace=False).tolist() for _ in "ab"]),
            ("512 contiguous pages", list(range(512)), list(range(256, 768))),
        ]
        for label, src, dst in cases:
            nbytes = len(src) * DESCS * ITEM
            ref = copy_rate(nbytes)
            for path, dst_kind in (
                ("lane", "vmm"),
                ("ucx", "vmm"),
                ("lane", "plain"),
                ("ucx", "plain"),
            ):
                n = args.emulated_iters if (path, dst_kind) == ("ucx", "vmm") else args.iters
                times, dev_bytes = [], 0
                ok = None
                for i in range(n + 1):  # the first is a warm-up (and checked)
                    res = pb.write(path, conn[path, dst_kind], [("kv", src, dst)], b"w")
                    assert "ok" in res, res
                    pa.messages(dst_kind, 1, 60.0)
                    st = res["ok"]
                    if i == 0:
                        if len(src) <= 32:
                            ok = pa.items(dst_kind, "kv", dst) == pb.items(path, "kv", src)
                        continue
                    times.append(st["post_s"] + st["complete_s"])
                    dev_bytes = st["device_bytes"]
                t = statistics.median(times)
                rows.append(
                    {
                        "case": label,
                        "bytes": nbytes,
                        "ops": len(src) * DESCS,
                        "into": "VMM" if dst_kind == "vmm" else "cudaMalloc",
                        "path": "device lane" if path == "lane" else "UCX PUTs",
                        "device_bytes": dev_bytes,
                        "median_us": t * 1e6,
                        "gbps": nbytes / t / 1e9,
                        "x_copy": nbytes / t / 1e9 / ref,
                        "copy_gbps": ref,
                        "checked": ok,
                    }
                )
    finally:
        b.close()
        a.close()
    print("| case | MiB | ops | into | path | on the lane | median µs | GB/s | × copy_ | bytes |")
    print("|---|---:|---:|---|---|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['bytes'] / 2**20:.1f} | {r['ops']} | {r['into']} | {r['path']} | "
            f"{'all' if r['device_bytes'] == r['bytes'] else r['device_bytes']} | "
            f"{r['median_us']:.0f} | {r['gbps']:.1f} | {r['x_copy']:.2f} | "
            f"{'exact' if r['checked'] else '—' if r['checked'] is None else 'DIFFER'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
