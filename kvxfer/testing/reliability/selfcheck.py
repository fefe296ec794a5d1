"""The instruments of the scenarios, shown to fire: one pair of workers, and behind the
transfer layer's back one changed byte per check — a source page after prefill filled it
(decode must report the room corrupt), a free page, a free state slot and a free aux row on
decode (late writes), a guard item of each group (guard hits) — plus a room left open
(leak, unreleased). ``run_self_check()`` returns what each check reported."""

from __future__ import annotations

import random

from kvxfer.testing.reliability.cluster import SOAK_SPEC, Worker
from kvxfer.testing.reliability.soak import SOAK_TIMEOUTS


def run_self_check(seed: int = 0) -> dict:
    from kvxfer.testing.reliability.node import bootstrap_server

    rng = random.Random(seed)
    bs = bootstrap_server()
    opts = dict(timeouts=SOAK_TIMEOUTS)
    p = d = None
    out = {}
    try:
        p = Worker("prefill", SOAK_SPEC, bs.address, opts)
        d = Worker("decode", SOAK_SPEC, None, opts)
        p.ready()
        d.ready()
        addr = bs.address
        clean = d.node.check()
        out["clean"] = {
            k: clean[k]
            for k in ("late_writes", "guard_hits", "corrupt_rooms", "leaks", "unreleased")
        }
        # corruption: one byte of a source page changed after the pattern was written
        r1 = rng.randrange(1, 1 << 62)
        d.node.open(r1, 4, True, True, addr)
        p.node.open(r1, 4)
        p.node.poke("kv", p.node.ids(r1)["kv"][2])
        p.node.send(r1, 0, 4)
        res = d.node.wait(r1, 30.0)
        out["corrupt"] = {
            "state": res["state"],
            "bad_items": res["bad"],
            "corrupt_rooms": d.node.check()["corrupt_rooms"],
        }
        # late writes: one byte in a free item of each group; guards: one per group
        free = d.node.ids(r1)  # released, so free again
        d.node.poke("kv", free["kv"][0])
        d.node.poke("state", free["state"])
        d.node.poke("aux", free["aux"])
        for group, item in (("kv", 0), ("state", 0), ("aux", 0)):
            d.node.poke(group, item)
        c = d.node.check()
        out["late_writes"], out["guard_hits"] = c["late_writes"], c["guard_hits"]
        # leak: a room nobody finishes
        r2 = rng.randrange(1, 1 << 62)
        d.node.open(r2, 3, False, False, addr)
        c = d.node.check()
        out["open_room"] = {"leaks": c["leaks"], "unreleased": c["unreleased"]}
        d.node.abort(r2)
        d.node.wait(r2, 30.0)
    finally:
        for w in (p, d):
            if w is not None:
                w.stop()
        bs.stop_thread()
    return out
