"""SGLang backend, Mamba / hybrid state at different TP: the state writes kvxfer's SGLang
backend issues for one request's slot (kvxfer.integrations.sglang.tp_pairs state plans, one
PatternWrite per state type) against equal TP moving the same slot (one ItemWrite), every
byte checked. One process per side (kvxfer.bench.engine_node over UCX on loopback;
``--device cuda``: torch CUDA buffers, the device lane where it applies).

State shape: Qwen3-Next-like GDN layers as SGLang's ``MambaPool`` holds them - per layer a
conv state ``[conv_dim/tp, K-1]`` bf16 whose dim is ``q | k | v`` (``--key-dim``,
``--key-dim``, ``--value-dim`` channels, each split by TP on its own:
``state_conv_shard_groups``) and a temporal state ``[v_heads/tp, head_k, head_v]`` fp32;
descriptors conv of every layer, then temporal of every layer (SGLang's order).

Rows: ``1:1`` (ItemWrite of the slot), ``2:1`` (two prefill ranks, a PatternWrite each,
concurrently, into one decode rank), ``1:2`` (one prefill rank into two decode ranks, one
after the other). Per row: bytes, PUTs, device-lane runs, time (``post_s + complete_s``;
2:1: the slower rank's; 1:2: the sum), GB/s on it.

    python3 bench/sgl_state_htp.py [--layers 36] [--key-dim 2048] [--value-dim 4096]
        [--v-heads 32] [--head-k 128] [--head-v 128] [--kernel 4] [--iters 5]
        [--device cpu] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvxfer.bench.engine_node import start_tp_topology, write_concurrently
from kvxfer.integrations.sglang.tp_pairs import pair_plan, shape, state_shapes

SECRET = b"sgl-state-htp-bench"
SLOTS = 4


def _cfg(name):
    return dict(
        secret=SECRET,
        name=name,
        connect_timeout_s=20.0,
        transfer_timeout_s=120.0,
        device_min_ops=1,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--key-dim", type=int, default=2048)
    ap.add_argument("--value-dim", type=int, default=4096)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-k", type=int, default=128)
    ap.add_argument("--head-v", type=int, default=128)
    ap.add_argument("--kernel", type=int, default=4)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    L = a.layers
    groups = [a.key_dim, a.key_dim, a.value_dim]
    conv_dim = sum(groups)
    conv_row = (a.kernel - 1) * 2  # bf16
    temp_row = a.head_k * a.head_v * 4  # fp32

    def meta(tp):
        """SGLang's KVArgs state metadata at ``tp``: (item lens, dims, outer, groups)."""
        lens = [conv_dim // tp * conv_row] * L + [a.v_heads // tp * temp_row] * L
        dims = [conv_dim // tp] * L + [a.v_heads // tp] * L
        return lens, dims, [1] * (2 * L), [groups] * L + [None] * L

    def sh(tp, rank):
        lens, dims, outer, grp = meta(tp)
        st = state_shapes([lens], [dims], [outer], [grp])
        return shape(tp, rank, 1, [8 // tp * 4], 8, states=st)

    def runs(tp_p, rp, tp_d, rd):
        (st,) = pair_plan(sh(tp_p, rp), sh(tp_d, rd)).state
        r = st.runs
        return [(s.tolist(), d.tolist(), n.tolist()) for s, d, n in zip(r.src, r.dst, r.lens)]

    def eng(name, tp):
        g = {"state0": {"item_lens": meta(tp)[0], "items": SLOTS, "loose": True}}
        return {"config": _cfg(name), "groups": g, "device": a.device}

    workers, nodes, conn = start_tp_topology(lambda k: eng(k, 1 if k[1] == "1" else 2))
    try:
        D, P0, P1 = nodes["decode"], nodes["p0"], nodes["p1"]
        P0.fill("p1", "state0", 1)
        P0.fill("p2_0", "state0", 2)
        P1.fill("p2_1", "state0", 3)
        src, dst = 2, 1  # the room's slot on prefill / on decode

        def slot(node, key, tp):
            """Per descriptor: the slot's rows as ``[parts...]`` of ``[rows, row bytes]``."""
            raw = np.frombuffer(node.items(key, "state0", [src if key[0] == "p" else dst]), "u1")
            out, off = [], 0
            for i, n in enumerate(meta(tp)[0]):
                item = raw[off : off + n]
                off += n
                if i < L:
                    cuts = np.cumsum([g // tp for g in groups])[:-1] * conv_row
                    out.append([p.reshape(-1, conv_row) for p in np.split(item, cuts)])
                else:
                    out.append([item.reshape(-1, temp_row)])
            return out

        rows = []

        def timed(parts):  # [(node, key, dst engine, write parts)] concurrently
            return write_concurrently(conn, parts)

        def row(name, go, check):
            ts, st = [], None
            for _ in range(a.iters):
                for k in ("d1", "d2_0", "d2_1"):
                    D.zero(k, "state0")
                t, st = go()
                ts.append(t)
            check()
            t = statistics.median(ts)
            rows.append((name, st["bytes"], st["ops"], st["device_ops"], t, st["bytes"] / t / 1e9))

        def total(ss):
            return {k: sum(s[k] for s in ss) for k in ("bytes", "ops", "device_ops")}

        def r11():
            (s,) = timed([(P0, "p1", "d1", [("state0", [src], [dst])])])
            return s["post_s"] + s["complete_s"], s

        def c11():
            assert D.items("d1", "state0", [dst]) == P0.items("p1", "state0", [src])

        row("1:1 (equal TP, ItemWrite of the slot)", r11, c11)

        def r21():
            s0, s1 = timed(
                [
                    (P0, "p2_0", "d1", [("state0", [src], [dst], runs(2, 0, 1, 0))]),
                    (P1, "p2_1", "d1", [("state0", [src], [dst], runs(2, 1, 1, 0))]),
                ]
            )
            return max(s["post_s"] + s["complete_s"] for s in (s0, s1)), total((s0, s1))

        def c21():  # every part: prefill rank 0's rows, then rank 1's
            a0, a1, got = slot(P0, "p2_0", 2), slot(P1, "p2_1", 2), slot(D, "d1", 1)
            for i in range(2 * L):
                for k, part in enumerate(got[i]):
                    assert (part == np.vstack([a0[i][k], a1[i][k]])).all(), (i, k)

        row("2:1 (2 prefill ranks, PatternWrite each)", r21, c21)

        def r12():
            ss = [
                timed([(P0, "p1", f"d2_{r}", [("state0", [src], [dst], runs(1, 0, 2, r))])])[0]
                for r in range(2)
            ]
            return sum(s["post_s"] + s["complete_s"] for s in ss), total(ss)

        def c12():  # every part: decode rank r holds its half of prefill's rows
            full = slot(P0, "p1", 1)
            for r in range(2):
                got = slot(D, f"d2_{r}", 2)
                for i in range(2 * L):
                    for k, part in enumerate(got[i]):
                        n = part.shape[0]
                        assert (part == full[i][k][r * n : (r + 1) * n]).all(), (r, i, k)

        row("1:2 (into 2 decode ranks, PatternWrite each)", r12, c12)
    finally:
        for w in workers:
            w.close()
    head = (
        f"# SGLang backend, Mamba state at different TP ({a.device}, {time.strftime('%F')})\n\n"
        f"{L} GDN layers: conv [{conv_dim}/tp, {a.kernel - 1}] bf16 of parts {groups}, "
        f"temporal [{a.v_heads}/tp, {a.head_k}, {a.head_v}] fp32; one slot, median of "
        f"{a.iters}, every byte checked. `python3 bench/sgl_state_htp.py "
        f"{' '.join(_argv())}`\n\n"
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

    return list(sys.argv[1:])


if __name__ == "__main__":
    main()
