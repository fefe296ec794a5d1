"""SGLang backend, heterogeneous TP: the engine writes kvxfer's SGLang backend issues for one
request (kvxfer.integrations.sglang.tp_pairs plans, SGLang's per-layer NHD pages), against
equal TP moving the same decode bytes, every byte checked. One process per side
(kvxfer.bench.engine_node over UCX on loopback; ``--device cuda``: torch CUDA buffers, the
device lane where it applies).

Rows: ``1:1`` (ItemWrite of every page: the equal-TP reference), ``2:1`` (two prefill ranks,
concurrent PatternWrites into one decode rank), ``1:2`` (one prefill rank into two decode
ranks, one after the other), and both again staged, as the backend sends them to a peer
without a device lane (``SliceWrite``: gather into the staging slot, one PUT per landing-slot
chunk, scatter at decode by the runs decode derived itself, registered before each write;
the engines configured as the backend configures them, ``settings.TP_STAGE_ENGINE``). Per row: bytes, PUTs (ops) and device-lane runs, the writes' time
(``post_s + complete_s``; 2:1: the slower rank's; 1:2: the sum) and GB/s on it.

    python3 bench/sgl_htp.py [--layers 8] [--heads 8] [--head-dim 128] [--page 16]
        [--tokens 4096] [--iters 3] [--device cpu] [--out FILE.md] [--check-pages K]
        [--no-staged]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvxfer.bench.engine_node import start_tp_topology, write_concurrently
from kvxfer.integrations.sglang.settings import TP_STAGE_ENGINE
from kvxfer.integrations.sglang.tp_pairs import decode_sides, pair_plan, shape

SECRET = b"sgl-htp-bench"


def _cfg(name, staged):
    stage = dict(TP_STAGE_ENGINE, stage_slice_min_ops=1) if staged else {}
    return dict(
        secret=SECRET,
        name=name,
        connect_timeout_s=20.0,
        transfer_timeout_s=120.0,
        device_min_ops=1,
        **stage,
    )


def _group(layers, item, pages):
    return {"kv": {"item_lens": [item] * (2 * layers), "items": pages, "loose": True}}


def _runs(plan):
    r = plan.kv_runs
    return [(s.tolist(), d.tolist(), n.tolist()) for s, d, n in zip(r.src, r.dst, r.lens)]


def _sides(sides):
    return [(o.tolist(), n.tolist()) for o, n in sides]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8, help="total KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--check-pages", type=int, default=0, help="check the first K pages only (0: all)"
    )
    ap.add_argument("--no-staged", action="store_true", help="leave the staged rows out")
    a = ap.parse_args()
    hb = a.head_dim * 2  # bf16
    L, H, ps = a.layers, a.heads, a.page
    n = -(-a.tokens // ps)
    pool = n + 8
    it1, it2 = ps * H * hb, ps * (H // 2) * hb  # TP 1 / TP 2 page of one descriptor

    def eng(name, item):
        cfg = _cfg(name, not a.no_staged)
        return {"config": cfg, "groups": _group(L, item, pool), "device": a.device}

    workers, nodes, conn = start_tp_topology(lambda k: eng(k, it1 if k[1] == "1" else it2))
    try:
        D, P0, P1 = nodes["decode"], nodes["p0"], nodes["p1"]
        P0.fill("p1", "kv", 1)
        P0.fill("p2_0", "kv", 2)
        P1.fill("p2_1", "kv", 3)
        rng = np.random.default_rng(0)
        src = rng.permutation(pool)[:n].tolist()
        dst = rng.permutation(pool)[:n].tolist()
        k = a.check_pages or n
        src_c, dst_c = src[:k], dst[:k]  # the pages whose bytes are checked

        def plan(tp_p, rp, tp_d, rd):
            ip, idd = (it1 if tp_p == 1 else it2), (it1 if tp_d == 1 else it2)
            return pair_plan(
                shape(tp_p, rp, ps, [ip] * 2 * L, H), shape(tp_d, rd, ps, [idd] * 2 * L, H)
            )

        def pages(node, key, ids, heads):
            """[descriptors, pages, ps, heads, hb] of those items."""
            raw = np.frombuffer(node.items(key, "kv", ids), dtype=np.uint8)
            return raw.reshape(2 * L, len(ids), ps, heads, hb)

        rows = []

        def timed(parts):  # [(node, key, dst engine, write parts)] concurrently
            return write_concurrently(conn, parts)

        def row(name, runs, check):
            ts, st = [], None
            for _ in range(a.iters):
                for k in ("d1", "d2_0", "d2_1"):
                    D.zero(k, "kv")
                out = runs()
                ts.append(out[0])
                st = out[1]
            check()
            t = statistics.median(ts)
            rows.append((name, st["bytes"], st["ops"], st["device_ops"], t, st["bytes"] / t / 1e9))

        # 1:1 reference
        def r11():
            (s,) = timed([(P0, "p1", "d1", [("kv", src, dst)])])
            return s["post_s"] + s["complete_s"], s

        def c11():
            assert D.items("d1", "kv", dst_c) == P0.items("p1", "kv", src_c)

        row("1:1 (equal TP, ItemWrite)", r11, c11)

        w20 = [("kv", src, dst, _runs(plan(2, 0, 1, 0)))]
        w21 = [("kv", src, dst, _runs(plan(2, 1, 1, 0)))]

        def r21():
            s0, s1 = timed([(P0, "p2_0", "d1", w20), (P1, "p2_1", "d1", w21)])
            tot = {k: s0[k] + s1[k] for k in ("bytes", "ops", "device_ops")}
            return max(s["post_s"] + s["complete_s"] for s in (s0, s1)), tot

        def c21():
            want = np.concatenate(
                [pages(P0, "p2_0", src_c, H // 2), pages(P1, "p2_1", src_c, H // 2)], axis=3
            )
            assert (pages(D, "d1", dst_c, H) == want).all()

        row("2:1 (2 prefill ranks, PatternWrite each)", r21, c21)

        def r12():
            s0, s1 = (
                timed([(P0, "p1", f"d2_{r}", [("kv", src, dst, _runs(plan(1, 0, 2, r)))])])[0]
                for r in range(2)
            )
            tot = {k: s0[k] + s1[k] for k in ("bytes", "ops", "device_ops")}
            return sum(s["post_s"] + s["complete_s"] for s in (s0, s1)), tot

        def c12():
            full = pages(P0, "p1", src_c, H)
            for r in range(2):
                got = pages(D, f"d2_{r}", dst_c, H // 2)
                assert (got == full[:, :, :, r * H // 2 : (r + 1) * H // 2]).all()

        row("1:2 (into 2 decode ranks, PatternWrite each)", r12, c12)
        if not a.no_staged:
            names = D.peer_names("d1"), D.peer_names("d2_0"), D.peer_names("d2_1")
            ids = {
                (k, nm): pid for k, m in zip(("d1", "d2_0", "d2_1"), names) for pid, nm in m.items()
            }

            def expect(dk, pk, tp_p, rp, tp_d, rd):
                it = it1 if tp_d == 1 else it2
                sides = decode_sides(shape(tp_d, rd, ps, [it] * 2 * L, H), tp_p, rp)
                r = D.expect_slices(dk, ids[(dk, pk)], 1, "kv", dst, _sides(sides))
                assert "ok" in r, r

            def sw(tp_p, rp, tp_d, rd):
                return [("slice", "kv", src, dst, _sides(plan(tp_p, rp, tp_d, rd).src_sides), 1)]

            def r21s():
                expect("d1", "p2_0", 2, 0, 1, 0)
                expect("d1", "p2_1", 2, 1, 1, 0)
                s0, s1 = timed(
                    [(P0, "p2_0", "d1", sw(2, 0, 1, 0)), (P1, "p2_1", "d1", sw(2, 1, 1, 0))]
                )
                tot = {k: s0[k] + s1[k] for k in ("bytes", "ops", "device_ops")}
                return max(s["post_s"] + s["complete_s"] for s in (s0, s1)), tot

            row("2:1 staged (2 prefill ranks, SliceWrite each)", r21s, c21)

            def r12s():
                out = []
                for r in range(2):
                    expect(f"d2_{r}", "p1", 1, 0, 2, r)
                    out += timed([(P0, "p1", f"d2_{r}", sw(1, 0, 2, r))])
                tot = {k: out[0][k] + out[1][k] for k in ("bytes", "ops", "device_ops")}
                return sum(s["post_s"] + s["complete_s"] for s in out), tot

            row("1:2 staged (into 2 decode ranks, SliceWrite each)", r12s, c12)
    finally:
        for w in workers:
            w.close()
    head = (
        f"# SGLang backend, heterogeneous TP writes ({a.device}, {time.strftime('%F')})\n\n"
        f"{L} layers x K/V per-layer NHD buffers, {H} KV heads x {a.head_dim} dims bf16, "
        f"page {ps}, {a.tokens} tokens ({n} pages, random page ids), median of {a.iters}; "
        f"{'every byte' if k == n else f'every byte of {k} pages'} checked. `python3 bench/sgl_htp.py {' '.join(_argv())}`\n\n"
        "| row | bytes | PUTs | lane runs | time ms | GB/s |\n|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4] * 1e3:.2f} | {r[5]:.2f} |\n" for r in rows
    )
    text = head + body
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


def _argv():
    import sys

    return [x for x in sys.argv[1:]]


if __name__ == "__main__":
    main()
