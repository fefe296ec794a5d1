"""``kvxfer bench layerwise``: layer-wise streaming against whole-chunk sends, end to end.

One prefill and one decode process (the demo's workers and synthetic model, no Mamba state
unless ``--mamba-layout``) per (kv layout, layer count). Per request (one chunk of
``--tokens`` tokens, one at a time, decode's metadata already at prefill): prefill runs a
synthetic forward pass of ``L`` layers — on CPU a timed wait per layer of ``--per-layer-ms``
or ``--per-token-us`` x tokens, whichever is longer; with ``--device cuda`` (pools on the GPU)
``--matmul-reps`` bf16 matmuls of ``--matmul-n`` squared per layer — and either

* ``whole``: sends the chunk once every layer is computed (``send``), or
* ``layer`` / ``groupG``: declares each layer as it finishes (``begin_chunk`` +
  ``layer_ready``; CUDA: with an event recorded after the layer's kernels), writes of
  1 / G layers (``--max-inflight N``: layer writes of a room on the wire at once, default 1).

end to end = decode's ``Success`` (its ``on_done``) - the first layer's start, both
CLOCK_MONOTONIC; compute = the last layer's end - the first layer's start (CUDA: after a
synchronize). One layer's transfer ``t1`` is measured in the ``layer`` runs: from a layer's
``layer_ready`` to decode's loop holding its ``LayerDone`` (median over the writes that
carried one layer). Target of issue 17: streaming end to end <= compute + 1.1 x t1, i.e. the
*tail* (end to end - that run's own compute, median per mode) <= 1.1 x t1; the whole-chunk
tail is the whole request's transfer.
Nothing is verified here (the demo and tests/disagg do).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Dict, List, Optional

from kvxfer import clitools
from kvxfer.pd_demo.worker import PDWorker


class LayerBenchWorker(PDWorker):
    """The demo's worker plus one timed request per call (see the module docstring)."""

    def __init__(self, role: str, spec: dict, bootstrap: str, opts: dict) -> None:
        from kvxfer.disagg import layerwise

        layerwise.MAX_INFLIGHT_WRITES = int(opts.get("max_inflight", 1))
        super().__init__(role, spec, bootstrap, opts)

    def _wait_room(self, room: int) -> float:
        while True:
            item = self._next_done(True)
            if item[0] == room:
                self._settle(item)
                return item[3]
            self._settle(item)

    # ------------------------------------------------------------------ prefill
    def p_one(self, room: int, tokens: int, mode: str, per_layer_s: float, mm: dict) -> dict:
        import torch

        m = self.model
        n_layers = len(m.attn_ids)
        res = self._alloc(m.pages_for(tokens))
        m.write_aux(room, res["row"])
        h = self._open_sender(room, tokens, res)
        self.open[room] = {"res": res, "length": tokens, "h": h}
        state = [res["slot"]] if res["slot"] is not None else None
        end = time.monotonic() + 30
        while h.poll().name != "WaitingForInput":  # decode's metadata is here
            if time.monotonic() > end:
                raise RuntimeError(f"room {room}: still {h.poll().name}")
            time.sleep(0.0002)
        cuda = m.pages.device.type == "cuda"
        evs: list = []
        if cuda:
            n = int(mm["n"])
            x = torch.randn(n, n, device=m.pages.device, dtype=torch.bfloat16)
            w = torch.randn(n, n, device=m.pages.device, dtype=torch.bfloat16) / n**0.5
            torch.cuda.synchronize(m.pages.device)
            ev0 = torch.cuda.Event(enable_timing=True)
        stream = mode != "whole"
        group = int(mode[5:]) if mode.startswith("group") else 1
        t_ready: List[float] = []
        t0 = time.monotonic()
        if cuda:  # the GPU is idle: this event completes at ~t0 (the clock of the layer ends)
            ev0.record(torch.cuda.current_stream(m.pages.device))
        if stream:
            h.begin_chunk(res["pages"], state, layers_per_write=group)
        for i in range(n_layers):
            ev = None
            if cuda:
                for _ in range(int(mm["reps"])):
                    x = x @ w
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(m.pages.device))
                evs.append(ev)
            else:
                _wait_until(time.monotonic() + per_layer_s)
            t_ready.append(time.monotonic())
            if stream:
                h.layer_ready(i, ev)
        if cuda:
            torch.cuda.synchronize(m.pages.device)
            # a layer is ready when its kernels ended on the GPU, not when they were queued
            t_ready = [t0 + ev0.elapsed_time(ev) / 1e3 for ev in evs]
            t_compute = t_ready[-1]
        else:
            t_compute = time.monotonic()
        if not stream:
            h.send(res["pages"], state)
        t_done = self._wait_room(room)
        trace = [t for t in self.mgr.drain_trace() if t.get("room") == room]
        return {
            "t0": t0,
            "t_compute": t_compute,
            "t_ready": t_ready,
            "t_done": t_done,
            "state": self.finished[room]["state"],
            "trace": trace[0] if trace else None,
        }

    # ------------------------------------------------------------------ decode
    def d_one(self, room: int, tokens: int) -> dict:
        from kvxfer.disagg.layerwise import unpack_mask

        m = self.model
        res = self._alloc(m.pages_for(tokens))
        self.open[room] = {"res": res, "length": tokens, "verify": False}
        h = self._open_receiver(room, res, tokens)
        self.open[room]["h"] = h
        seen: List[tuple] = []
        ready, add = h.layers, h.layers.add
        n_layers = len(m.attn_ids)

        def stamp(mask: bytes) -> None:  # the loop thread: LayerDone handled
            seen.append((time.monotonic(), unpack_mask(mask, n_layers)))
            add(mask)

        ready.add = stamp  # type: ignore[method-assign]
        t_done = self._wait_room(room)
        return {"t_done": t_done, "layers": seen, "state": self.finished[room]["state"]}


def _wait_until(t: float) -> None:
    """A timed wait (the scheduler's 'compute' on CPU): a sleep, which releases the GIL as
    a GPU scheduler waiting on its stream would (a spin would hold it from the loop)."""
    time.sleep(max(0.0, t - time.monotonic()))


def _layer_time(p: dict, d: dict) -> Optional[float]:
    """Median of LayerDone arrival - layer_ready over the writes carrying one layer."""
    xs = []
    for t, bits in d["layers"]:
        if bits and bits & (bits - 1) == 0:
            i = bits.bit_length() - 1
            xs.append(t - p["t_ready"][i])
    return statistics.median(xs) if xs else None


def run(a) -> List[dict]:
    from kvxfer.pd_demo.run import start_pair
    from kvxfer.pd_demo.spec import ModelSpec

    rows: List[dict] = []
    modes = a.modes.split(",")
    tokens_list = [int(x) for x in a.tokens.split(",")]
    ps = a.page_size
    pool = (-(-max(tokens_list) // ps) + 2) * ps
    room = 1
    for layout in a.kv_layout.split(","):
        for n_layers in [int(x) for x in a.layers.split(",")]:
            spec = ModelSpec(
                kv_layout=layout,
                mamba_layout=a.mamba_layout,
                attn_layers=n_layers,
                mamba_layers=2,
                heads=a.heads,
                head_dim=a.head_dim,
                page_size=ps,
                pool_tokens=pool,
                mamba_slots=4,
                aux_rows=8,
                device=a.device,
            )
            pair = start_pair(
                spec,
                {
                    "error_mode": a.error_mode,
                    "deadline_s": 60.0,
                    "max_inflight": a.max_inflight,
                    "trace": True if a.stages else None,
                },
                LayerBenchWorker,
            )
            try:
                info = pair.prefill.info()
                mm = {"n": a.matmul_n, "reps": a.matmul_reps}
                for tokens in tokens_list:
                    per: Dict[str, List[dict]] = {mode: [] for mode in modes}
                    for it in range(a.iters + 1):  # the first: warm-up, not counted
                        for mode in modes:
                            p, d = pair.both(
                                (
                                    pair.prefill.p_one,
                                    room,
                                    tokens,
                                    mode,
                                    max(a.per_layer_ms, a.per_token_us * tokens / 1e3) / 1e3,
                                    mm,
                                ),
                                (pair.decode.d_one, room, tokens),
                            )
                            room += 1
                            if p["state"] != "Success" or d["state"] != "Success":
                                raise RuntimeError(f"{mode}: prefill {p}, decode {d}")
                            if it:
                                per[mode].append({"p": p, "d": d})
                    rows.append(_row(layout, n_layers, tokens, info, per))
                    rows[-1]["device_lanes"] = pair.prefill.device_lanes()
                    if a.progress:
                        print(_fmt_row(rows[-1], modes), file=sys.stderr, flush=True)
            finally:
                pair.close()
    return rows


def _row(layout: str, n_layers: int, tokens: int, info: dict, per: Dict[str, List[dict]]) -> dict:
    med = statistics.median
    out: dict = {
        "kv_layout": layout,
        "layers": n_layers,
        "tokens": tokens,
        "layer_bytes": info["page_bytes"] * (-(-tokens // info["page_size"])) // n_layers,
        "e2e_ms": {},
        "compute_ms": {},
        "tail_ms": {},
    }
    for mode, runs in per.items():
        out["e2e_ms"][mode] = med([(r["d"]["t_done"] - r["p"]["t0"]) * 1e3 for r in runs])
        out["compute_ms"][mode] = med([(r["p"]["t_compute"] - r["p"]["t0"]) * 1e3 for r in runs])
        out["tail_ms"][mode] = med([(r["d"]["t_done"] - r["p"]["t_compute"]) * 1e3 for r in runs])
    t1 = [x for r in per.get("layer", []) if (x := _layer_time(r["p"], r["d"])) is not None]
    out["t1_ms"] = med(t1) * 1e3 if t1 else None
    stages = [x for r in per.get("layer", []) for x in _layer_stages(r["p"], r["d"])]
    if stages:
        out["layer_stages_us"] = {k: med([x[k] for x in stages]) for k in STAGES}
    return out


#: one single-layer write, in µs (``--stages``): ``event`` layer's end on the GPU (or the
#: scheduler's layer_ready) -> the loop saw it; ``hop`` -> ``Peer.write`` called; ``post`` /
#: ``flush`` the engine's stages; ``write`` the whole ``Peer.write``; ``receipt`` -> decode's
#: loop handled the LayerDone; ``ops`` / ``device_ops`` of the write (counts, not µs)
STAGES = ("event", "hop", "post", "flush", "write", "receipt", "ops", "device_ops")


def _layer_stages(p: dict, d: dict) -> List[dict]:
    tr = p.get("trace") or {}
    seen, writes = tr.get("layer_seen", {}), tr.get("layer_writes", [])
    done = {}
    for t, bits in d["layers"]:
        if bits and bits & (bits - 1) == 0:
            done[bits.bit_length() - 1] = t
    out = []
    for w in writes:
        if len(w["layers"]) != 1 or w["layers"][0] not in done:
            continue
        i = w["layers"][0]
        ready = p["t_ready"][i] * 1e9
        t_seen = seen.get(i, ready)  # no event: layer_ready's call is when the loop may see it
        out.append(
            {
                "event": (t_seen - ready) / 1e3,
                "hop": (w["call"] - t_seen) / 1e3,
                "post": w["post_us"],
                "flush": w["flush_us"],
                "write": (w["ret"] - w["call"]) / 1e3,
                "receipt": (done[i] * 1e9 - w["ret"]) / 1e3,
                "ops": w["ops"],
                "device_ops": w["device_ops"],
            }
        )
    return out


def stage_table(rows: List[dict]) -> str:
    head = ["kv layout", "layers", "tokens"] + [f"{k} µs" for k in STAGES[:6]] + list(STAGES[6:])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        st = r.get("layer_stages_us")
        if not st:
            continue
        cells = [r["kv_layout"], str(r["layers"]), str(r["tokens"])]
        cells += [f"{st[k]:.0f}" for k in STAGES]
        out.append("| " + " | ".join(cells) + " |")
    lanes = sorted({f"{k}: {v}" for r in rows for k, v in r.get("device_lanes", {}).items()})
    out += ["", "prefill's device lanes: " + ("; ".join(lanes) or "-")]
    return "\n".join(out)


def _fmt_row(r: dict, modes: List[str]) -> str:
    t1 = r.get("t1_ms")
    cells = [
        r["kv_layout"],
        str(r["layers"]),
        str(r["tokens"]),
        f"{r['layer_bytes'] / 1024:.0f}",
        f"{r['compute_ms'].get('whole', 0.0):.1f}",
    ]
    cells += [f"{r['e2e_ms'][m]:.1f}" for m in modes]
    cells += [f"{r['tail_ms'][m]:.2f}" for m in modes]
    cells.append("-" if t1 is None else f"{t1:.2f}")
    best = min((r["tail_ms"][m] for m in modes if m != "whole"), default=None)
    cells.append("-" if t1 is None or best is None else f"{best / t1:.2f}")
    return "| " + " | ".join(cells) + " |"


def table(rows: List[dict], modes: List[str]) -> str:
    head = ["kv layout", "layers", "tokens", "KiB/layer", "compute ms (whole)"]
    head += [f"{m} e2e ms" for m in modes]
    head += [f"{m} tail ms" for m in modes]
    head += ["t1 ms", "best stream tail / t1"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += [_fmt_row(r, modes) for r in rows]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = clitools.parser("kvxfer bench layerwise", __doc__.splitlines()[0])
    ap.add_argument("--kv-layout", default="page_major,per_layer", help="comma list")
    ap.add_argument("--mamba-layout", default="none", choices=("none", "envelope", "per_layer"))
    ap.add_argument("--layers", default="8,32", help="kv layer counts, comma list")
    ap.add_argument("--tokens", default="256,2048,8192", help="request sizes, comma list")
    ap.add_argument("--modes", default="whole,layer,group4", help="whole, layer, groupG")
    ap.add_argument(
        "--per-layer-ms", type=float, default=1.0, help="CPU: compute per layer, at least"
    )
    ap.add_argument(
        "--per-token-us",
        type=float,
        default=0.5,
        help="CPU: compute per layer per token (the larger of the two is used)",
    )
    ap.add_argument("--matmul-n", type=int, default=4096, help="CUDA: matmul size per layer")
    ap.add_argument("--matmul-reps", type=int, default=1, help="CUDA: matmuls per layer")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--error-mode", choices=("peer", "none"), default="none")
    ap.add_argument(
        "--max-inflight",
        type=int,
        default=1,
        help="layer writes of a room on the wire at once (layerwise.MAX_INFLIGHT_WRITES)",
    )
    ap.add_argument("--progress", action="store_true", help="print each row when measured")
    ap.add_argument(
        "--stages",
        action="store_true",
        help="trace both managers and print the stages of the single-layer writes",
    )
    clitools.add_json_args(ap)
    a = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = run(a)
    print(table(rows, a.modes.split(",")), flush=True)
    if a.stages:
        print("\nStages of a single-layer write (medians, `layer` mode):", flush=True)
        print(stage_table(rows), flush=True)
    clitools.emit_json(a, {"rows": rows, "args": vars(a)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
