"""Idle CPU of connected engines / managers and the channel round trip, old vs new channel
wait (``KVXFER_CHANNEL_WAIT=yield`` vs ``native``), alternating, fresh processes per run;
medians go to bench/results/quiet-cpu.md (kvxfer issue 15).

    PYTHONPATH=$PWD python bench/quiet_idle.py [--rounds 3] [--device cpu|cuda] [--md OUT.md]

Per run and mode: an engine pair in one process (two SyncEngines, connected, a message each
way, then a 1 s idle window: each loop thread's CPU clock and the process's), a KVManager
pair (the demo's prefill and decode worker processes after one room: each manager's loop
thread and its process over 1 s), and the median / p90 of 500 one-message round trips on
one UcxChannel pair (one loop, listener and connector in one process)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def one(mode: str, device: str) -> dict:
    from kvxfer.pd_demo.pair import Pair
    from kvxfer.pd_demo.spec import ModelSpec
    from kvxfer.pd_demo.worker import PDWorker
    from kvxfer.procs import Worker
    from kvxfer.testing.idle_checks import IdleNode
    from kvxfer.testing.transport_checks import TransportNode

    env = {"KVXFER_CHANNEL_WAIT": mode}
    out: dict = {"mode": mode}
    w = Worker(IdleNode, "peer", name=f"idle-{mode}", env=env).start()
    try:
        node = w.proxy(IdleNode, timeout=60.0)
        node.ping()
        out["engines"] = node.idle_cpu(1.0)
    finally:
        w.close()
    w = Worker(TransportNode, name=f"rtt-{mode}", env=env).start()
    try:
        out["rtt"] = w.proxy(TransportNode, timeout=60.0).channel_rtt(500)
    finally:
        w.close()
    spec = ModelSpec(pool_tokens=1024, mamba_slots=8, aux_rows=16, device=device).as_dict()
    import secrets

    opts = {"deadline_s": 60.0, "error_mode": "none", "secret": secrets.token_bytes(32)}
    pair = Pair(PDWorker, spec, opts, timeout=90.0, env=env)
    try:
        warm = [(1, 16)]
        pair.both((pair.prefill.prefill, warm, 256), (pair.decode.decode, warm))
        cp, cd = pair.both((pair.prefill.loop_cpu, 1.0), (pair.decode.loop_cpu, 1.0))
        out["managers"] = {"prefill": cp, "decode": cd}
    finally:
        pair.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    runs = []
    for r in range(a.rounds):
        for mode in ("yield", "native") if r % 2 == 0 else ("native", "yield"):
            res = one(mode, a.device)
            print(json.dumps(res), flush=True)
            runs.append(res)

    def med(mode, f):
        return statistics.median(f(x) for x in runs if x["mode"] == mode)

    rows = [
        ("engine pair: process (cores)", lambda x: x["engines"]["process"]),
        ("engine pair: loop A (cores)", lambda x: x["engines"]["loop_a"]),
        ("engine pair: loop B (cores)", lambda x: x["engines"]["loop_b"]),
        ("prefill manager: process (cores)", lambda x: x["managers"]["prefill"]["process"]),
        ("prefill manager: loop (cores)", lambda x: x["managers"]["prefill"]["loop"]),
        ("decode manager: process (cores)", lambda x: x["managers"]["decode"]["process"]),
        ("decode manager: loop (cores)", lambda x: x["managers"]["decode"]["loop"]),
        ("channel round trip p50 (µs)", lambda x: x["rtt"]["p50_us"]),
        ("channel round trip p90 (µs)", lambda x: x["rtt"]["p90_us"]),
    ]
    lines = [
        f"idle 1 s windows and channel round trips, device {a.device}, {a.rounds} runs per "
        "mode (alternating, fresh processes), medians",
        "",
        "| measure | yield (old) | native (new) |",
        "|---|---|---|",
    ]
    for name, f in rows:
        lines.append(f"| {name} | {med('yield', f):.3g} | {med('native', f):.3g} |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(text + "\n")
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(runs, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
