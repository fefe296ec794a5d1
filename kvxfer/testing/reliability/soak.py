"""Soak: thousands of requests between one prefill and one decode worker, random sizes and
chunking, about 10% aborted from either side at any point (see :mod:`.plan`).

Each worker runs the plan as its own scheduler (:meth:`RelNode.soak`); afterwards both
scan every free and guard item (:meth:`RelNode.check`). The summary counts, per failure
kind: requests that were not aborted but did not succeed on both sides, corrupted rooms (any
byte of a page, state slot or aux row differing from the pattern at decode's ``Success``),
late writes (bytes changed in an item after its room's ``on_done``), guard hits, ``on_done``
called twice, rooms never released, allocator / room-table leaks; and RSS at start / end.

``python -m kvxfer.testing.reliability soak --requests 10000 --json``
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from kvxfer import procs
from kvxfer.testing.reliability.cluster import SOAK_SPEC, Worker, ensure_secret
from kvxfer.testing.reliability.plan import make_plan

SOAK_TIMEOUTS = dict(
    bootstrap_s=15.0,
    waiting_s=30.0,
    transfer_s=30.0,
    heartbeat_interval_s=0.5,
    heartbeat_timeout_s=15.0,
    abort_ack_s=10.0,
)


def run_soak(
    requests: int = 10000,
    seed: int = 0,
    window: int = 16,
    max_pages: int = 16,
    abort_rate: float = 0.1,
    timeouts: Optional[dict] = None,
    error_mode: str = "peer",
    placement: Optional[dict] = None,
    deadline_s: float = 60.0,
) -> dict:
    """Run the soak; returns the summary (``ok`` True when every count that must be zero is).

    ``placement`` (used by the netns scenario): ``{"prefill": opts, "decode": opts}`` merged
    into each worker's options; a prefill with ``serve_bootstrap`` hosts the bootstrap server.
    """
    t0 = time.monotonic()
    ensure_secret()  # before the bootstrap server below, which needs it as the workers do
    placement = placement or {}
    opts = dict(timeouts=dict(timeouts or SOAK_TIMEOUTS), error_mode=error_mode)
    p_opts = dict(opts, **placement.get("prefill", {}))
    d_opts = dict(opts, **placement.get("decode", {}))
    bs = None
    if not p_opts.get("serve_bootstrap"):
        from kvxfer.testing.reliability.node import bootstrap_server

        bs = bootstrap_server()
    p = d = None
    try:
        p = Worker("prefill", SOAK_SPEC, bs.address if bs else None, p_opts)
        d = Worker("decode", SOAK_SPEC, None, d_opts)
        p.ready()
        d.ready()
        addr = p.info["bootstrap"]
        t_up = time.monotonic() - t0
        plan_kw = dict(requests=requests, seed=seed, max_pages=max_pages, abort_rate=abort_rate)
        budget = deadline_s * 4 + requests * 1.0  # answer bound; the workers' own
        # decode announces up to ``window`` rooms ahead; prefill works on a quarter of that,
        # so its rooms meet decode's metadata in every order (before / after init, mid-send)
        d_soak = procs.post(d.node.soak, plan_kw, window, deadline_s, addr)  # deadlines end
        p_soak = procs.post(p.node.soak, plan_kw, max(1, window // 4), deadline_s, addr)  # sooner
        ps, ds = p_soak.result(budget), d_soak.result(budget)
        pc, dc = p.node.check(deadline_s), d.node.check(deadline_s)
    finally:
        for w in (p, d):
            if w is not None:
                w.stop()
        if bs is not None:
            bs.stop_thread()
    return summarize(make_plan(**plan_kw), ps, ds, pc, dc, t_up, time.monotonic() - t0)


def summarize(plan, ps: dict, ds: dict, pc: dict, dc: dict, t_up: float, wall: float) -> dict:
    kinds: collections.Counter = collections.Counter()
    unexpected: collections.Counter = collections.Counter()
    ok_rooms = aborted = 0
    for q in plan:
        po, do = ps["outcomes"].get(q.room, "Unreleased"), ds["outcomes"].get(q.room, "Unreleased")
        if q.abort is None:
            if po == do == "Success":
                ok_rooms += 1
            else:
                unexpected[f"prefill {po} / decode {do}"] += 1
        else:
            aborted += 1
            kinds[f"{q.abort[0]} aborts: prefill {po} / decode {do}"] += 1
            if "Unreleased" in (po, do):
                unexpected[f"aborted by {q.abort[0]}: prefill {po} / decode {do}"] += 1

    def total(key):
        return sum(sum(c[key].values()) if isinstance(c[key], dict) else c[key] for c in (pc, dc))

    leaks = {"prefill": pc["leaks"], "decode": dc["leaks"]}
    aborts = {q.room: q.abort for q in plan}
    counts = {
        "unexpected_outcomes": sum(unexpected.values()),
        "corrupt_rooms": dc["corrupt_rooms"],
        "corrupt_items": dc["corrupt_items"],
        "late_writes": total("late_writes"),
        "guard_hits": total("guard_hits"),
        "on_done_twice": total("on_done_twice"),
        "unreleased": total("unreleased"),
        "hung": ps["n_hung"] + ds["n_hung"],
        "stuck": int(bool(ps["stuck"] or ds["stuck"])),
        "leaked": sum(v for side in leaks.values() for v in side.values()),
    }
    return {
        "scenario": "soak",
        "ok": not any(counts.values()),
        "counts": counts,
        "requests": len(plan),
        "succeeded": ok_rooms,
        "aborted": aborted,
        "pages_verified": dc["pages_verified"],
        "rooms_verified": dc["rooms_verified"],
        "unexpected": dict(unexpected.most_common(10)),
        "abort_outcomes": dict(sorted(kinds.items())),
        "aborted_in_state": {"prefill": ps["aborted_in"], "decode": ds["aborted_in"]},
        "late_writes": {"prefill": pc["late_writes"], "decode": dc["late_writes"]},
        "late_examples": [
            dict(x, last_room_abort=aborts.get(x["last_room"]))
            for x in pc["late_examples"] + dc["late_examples"]
        ],
        "late_calls": dc["late_calls"],
        "late_by": {"prefill": pc["late_by"], "decode": dc["late_by"]},
        "stuck": [ps["stuck"], ds["stuck"]],
        "hung_rooms": ps["hung"] + ds["hung"],
        "leaks": leaks,
        "rss_mib": {
            "prefill": [ps["rss_mib"][0], pc["rss_mib"][1]],
            "decode": [ds["rss_mib"][0], dc["rss_mib"][1]],
        },
        "fds": {"prefill": pc["fds"], "decode": dc["fds"]},
        "lanes": sorted(set(pc["lanes"]) | set(dc["lanes"])),
        "soak_s": round(max(ps["wall_s"], ds["wall_s"]), 2),
        "startup_s": round(t_up, 2),
        "wall_s": round(wall, 2),
    }
