"""``kvxfer bench pd``: the prefill/decode protocol end to end, two processes on loopback.

Phase 1 — small requests (1 page each, ``--requests`` of them, ``--concurrency`` in flight):
latency of one request = decode's ``send_metadata`` -> decode ``Success`` (metadata reaches
prefill, whose KVSender already holds the computed page; prefill writes page + aux row,
flushes, notifies; decode checks the room stamp). Reports p50/p99 and requests/s.

Phase 2 — large requests (``--large-pages`` pages each): prefill-side time from ``send()`` to
``Success`` (bytes visible at decode) vs the engine's raw ``peer.write`` of the same pages over
the same connection, as GB/s and a ratio (target >= 0.95).

Buffers are plain host numpy arrays shaped like a per-layer (2*L descriptors) or page-major
(1 descriptor) KV pool. Prints a table; ``--json`` prints one JSON object on the last line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
import traceback

import numpy as np

SMALL_BASE, LARGE_BASE = 1_000_000, 2_000_000


def _args_for(a, seed: int):
    from kvxfer.disagg import KVArgs, MetadataBuffer
    pages = max(a.large_pages, 1) + a.concurrency + 8
    n_desc = 1 if a.layout == "page_major" else 2 * a.layers
    item = a.page_bytes * (2 * a.layers if a.layout == "page_major" else 1)
    if a.device == "cpu":
        kv = np.empty((n_desc, pages * item), dtype=np.uint8)
        kv[:] = seed
        ptrs = [int(kv[i].ctypes.data) for i in range(n_desc)]
    else:                                  # KV in device memory (aux rows stay on the host)
        import torch
        kv = torch.full((n_desc, pages * item), seed, dtype=torch.uint8, device=a.device)
        ptrs = [int(kv[i].data_ptr()) for i in range(n_desc)]
    aux = MetadataBuffer(a.concurrency + 8, 64)
    ap, al, ai = aux.buf_infos()
    args = KVArgs(kv_data_ptrs=ptrs,
                  kv_data_lens=[pages * item] * n_desc, kv_item_lens=[item] * n_desc,
                  aux_data_ptrs=ap, aux_data_lens=al, aux_item_lens=ai, page_size=16,
                  dtype="uint8", layout={"kv": {"kind": a.layout, "layers": a.layers}})
    return args, kv, aux, pages


def _timeouts():
    from kvxfer.disagg import Timeouts
    return Timeouts(bootstrap_s=120, waiting_s=300, transfer_s=120, heartbeat_timeout_s=60)


async def _prefill(a, bootstrap: str) -> dict:
    from kvxfer.disagg import KVManager, KVPoll, KVSender
    from kvxfer.engine import ItemWrite
    args, kv, aux, pages = _args_for(a, 7)
    mgr = await KVManager(args, "prefill", bootstrap_addr=bootstrap, error_mode=a.error_mode,
                          timeouts=_timeouts(), name="bench-prefill").start()
    out: dict = {}
    try:
        # phase 1: every sender is ready (page computed) before decode asks for it
        senders = []
        for i in range(a.requests):
            s = KVSender(mgr, bootstrap, SMALL_BASE + i)
            s.init(1, i % a.concurrency)
            s.send([1 + i % a.concurrency])
            senders.append(s)
        for s in senders:
            await s.wait(300)
        st = mgr.stats
        out["small_ops_per_request"] = st["ops"] / max(1, st["writes"])
        out["lanes"] = sorted(st["lanes"])
        # phase 2: large requests, PD protocol vs raw engine write of the same pages
        src = np.arange(1, a.large_pages + 1)
        pd_s, raw_s, nbytes, ops0 = [], [], 0, mgr.stats["ops"]
        for i in range(a.large_reps):
            s = KVSender(mgr, bootstrap, LARGE_BASE + i)
            s.init(a.large_pages, 0)
            while s.poll() == KVPoll.Bootstrapping:      # wait for decode's metadata
                await asyncio.sleep(0.0005)
            t0 = time.perf_counter()
            s.send(src)
            assert await s.wait(300) == KVPoll.Success, s.failure_exception()
            pd_s.append(time.perf_counter() - t0)
            peer = next(iter(mgr.links.values())).peer
            t0 = time.perf_counter()
            stats = await peer.write([ItemWrite("kv", src, src)])
            raw_s.append(time.perf_counter() - t0)
            nbytes = stats.bytes
        small_raw = []
        for _ in range(200):             # the engine alone: 1-page write + flush, no protocol
            t0 = time.perf_counter()
            await peer.write([ItemWrite("kv", [1], [1])])
            small_raw.append(time.perf_counter() - t0)
        small_raw.sort()
        out.update(raw_small_p50_ms=small_raw[len(small_raw) // 2] * 1e3,
                   raw_small_p99_ms=small_raw[int(0.99 * len(small_raw))] * 1e3)
        out.update(large_bytes=nbytes, large_pd_s=statistics.median(pd_s),
                   large_raw_s=statistics.median(raw_s),
                   large_ops_per_request=(mgr.stats["ops"] - ops0) / max(1, a.large_reps))
    finally:
        await mgr.close()
    return out


async def _decode(a, bootstrap: str, conn=None) -> dict:
    from kvxfer.disagg import KVManager, KVPoll, KVReceiver
    args, kv, aux, pages = _args_for(a, 0)
    mgr = await KVManager(args, "decode", error_mode=a.error_mode, timeouts=_timeouts(),
                          name="bench-decode").start()
    lat: list = []
    failed = 0
    try:
        # warm-up connection (lookup + connect + hello) outside the measurement
        await mgr.side._link_future(KVReceiver(mgr, bootstrap, 1).bootstrap_addr)
        queue = list(range(a.requests))

        async def lane(slot: int) -> None:
            nonlocal failed
            while queue:
                i = queue.pop()
                r = KVReceiver(mgr, bootstrap, SMALL_BASE + i)
                r.init()
                t0 = time.perf_counter()
                r.send_metadata([1 + slot + a.concurrency], slot)
                if await r.wait(120) == KVPoll.Success:
                    lat.append(time.perf_counter() - t0)
                else:
                    failed += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(lane(s) for s in range(a.concurrency)))
        wall = time.perf_counter() - t0
        for i in range(a.large_reps):
            r = KVReceiver(mgr, bootstrap, LARGE_BASE + i)
            r.init()
            r.send_metadata(np.arange(1, a.large_pages + 1), 0)
            if await r.wait(300) != KVPoll.Success:
                failed += 1
        lat.sort()
        q = (lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3) if lat else \
            (lambda p: 0.0)
        res = {"requests": a.requests, "failed": failed, "p50_ms": q(0.50), "p99_ms": q(0.99),
               "req_per_s": len(lat) / wall if wall > 0 else 0.0}
        if conn is not None:             # stay connected until prefill's raw writes are done
            conn.send(("ok", res))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        return res
    finally:
        await mgr.close()


def _child(role: str, a, bootstrap: str, conn) -> None:
    try:
        if role == "prefill":
            conn.send(("ok", asyncio.run(_prefill(a, bootstrap))))
        else:
            asyncio.run(_decode(a, bootstrap, conn))
    except BaseException as exc:
        conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run(a) -> dict:
    from kvxfer.disagg import BootstrapServer
    ctx = mp.get_context("spawn")
    bs = BootstrapServer(port=0).start_in_thread()
    procs, conns = [], {}
    try:
        for role in ("prefill", "decode"):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_child, args=(role, a, bs.address, child), daemon=True)
            p.start()
            procs.append(p)
            conns[role] = parent
        res = {}
        for role in ("decode", "prefill"):
            c = conns[role]
            if not c.poll(a.timeout):
                raise TimeoutError(f"bench {role} did not finish within {a.timeout}s")
            kind, val = c.recv()
            if kind == "err":
                raise RuntimeError(f"bench {role} failed:\n{val}")
            res.update(val)
        conns["decode"].send("exit")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        bs.stop_thread()
    gb = res["large_bytes"] / 1e9
    res["large_gbps"] = gb / res["large_pd_s"] if res["large_pd_s"] else 0.0
    res["raw_gbps"] = gb / res["large_raw_s"] if res["large_raw_s"] else 0.0
    res["ratio_to_raw"] = res["large_raw_s"] / res["large_pd_s"] if res["large_pd_s"] else 0.0
    res.update(layout=a.layout, error_mode=a.error_mode, device=a.device, concurrency=a.concurrency,
               large_pages=a.large_pages)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvxfer bench pd", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="1-page requests (phase 1)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--page-bytes", type=int, default=4096, help="bytes of one page of one K or V")
    p.add_argument("--layout", choices=["per_layer", "page_major"], default="page_major")
    p.add_argument("--large-pages", type=int, default=512, help="pages of a large request")
    p.add_argument("--large-reps", type=int, default=5)
    p.add_argument("--error-mode", choices=["peer", "none"], default="none")
    p.add_argument("--device", default="cpu", help="where the KV buffers live: cpu | cuda[:N]")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = run(a)
    print(f"kvxfer bench pd  layout={a.layout} device={a.device} error_mode={a.error_mode} "
          f"lanes={res['lanes']}")
    print(f"  small (1 page, {a.concurrency} in flight): {res['requests']} requests, "
          f"{res['failed']} failed, p50 {res['p50_ms']:.3f} ms, p99 {res['p99_ms']:.3f} ms, "
          f"{res['req_per_s']:.0f} req/s, {res['small_ops_per_request']:.1f} ops/request")
    print(f"  engine alone, 1-page write+flush (no protocol): p50 {res['raw_small_p50_ms']:.3f} ms, "
          f"p99 {res['raw_small_p99_ms']:.3f} ms")
    print(f"  large ({a.large_pages} pages = {res['large_bytes'] / 2**20:.1f} MiB): "
          f"PD {res['large_gbps']:.2f} GB/s, raw engine write {res['raw_gbps']:.2f} GB/s, "
          f"ratio {res['ratio_to_raw']:.3f}, {res['large_ops_per_request']:.1f} ops/request")
    if a.json:
        print(json.dumps(res))
    return 0 if res["failed"] == 0 else 1
