"""Kill matrix: each side (prefill, decode) killed (SIGKILL) or frozen (SIGSTOP, SIGCONT after
the survivor gave up) while the pair has one room in each state:

* ``Bootstrapping`` — decode survivor: a receiver not yet ``init()``-ed (it bootstraps towards
  the dead peer's entry right after the signal); prefill survivor: a sender whose decode is
  connected but has not sent its metadata;
* ``WaitingForInput`` — both ends know each other, prefill has sent nothing;
* ``Transferring`` — the first of 3 chunks landed (decode polled ``Transferring``);
* ``mid-write`` — a 2048-page (32 MiB) final chunk handed to ``send()`` just before the
  signal (decode survivor: how many pages had fully landed is reported as evidence);
* ``after Success`` — finished and released on both sides before the signal.

A third column closes the victim's KVManager gracefully instead (``close()``, the process and
its pools stay): the victim itself must then release everything, and no byte may land in its
freed items afterwards (the survivor may still be writing into them).

Per group (victim side x signal) the survivor must: fail every unfinished room and run its
``on_done`` within the state's bound (below) after the signal — except decode facing a frozen
prefill, which must fail the room within that bound but *hold* it (``on_done`` not run,
``held`` in the cell) until the resumed prefill answered (``released_s`` after SIGCONT,
within the resumed victim's bound) — leave the ``Success`` room
alone, run every ``on_done`` exactly once, get every page, slot and aux row back and keep
every free item's sentinel (no late write, also after the frozen peer resumed). Then a peer is
served byte-exact by the same survivor process: after SIGKILL / close a restarted victim that
registers under the same bootstrap key; after SIGCONT the resumed victim itself (the pair
reconnects without a restart). A resumed victim must itself release everything.

Bounds (seconds after the signal, for ``on_done``): Bootstrapping ``bootstrap_s``; a room
with a live link ``heartbeat_timeout_s + heartbeat_interval_s`` (the peer closing is noticed
sooner); a prefill room with a write in flight also ``transfer_s`` (the write's own deadline);
decode adds ``decode_grace_s + abort_ack_s`` (it may wait for prefill's ack). A resumed
victim: its longest state deadline plus the same additions.

``python -m kvxfer.testing.reliability kill --json``
"""

from __future__ import annotations

import random
import signal
import time
from typing import Dict, List, Optional

from kvxfer import procs
from kvxfer.testing.reliability.cluster import MATRIX_SPEC, Worker, ensure_secret

MATRIX_TIMEOUTS = dict(
    bootstrap_s=4.0,
    waiting_s=10.0,
    transfer_s=10.0,
    heartbeat_interval_s=0.25,
    heartbeat_timeout_s=3.0,
    abort_ack_s=3.0,
    decode_grace_s=1.0,
)
#: allowance on top of every bound for a loaded 2-core machine (stated in the report)
SLACK_S = 3.0
BIG = 2048
STATES = ("Bootstrapping", "WaitingForInput", "Transferring", "mid-write", "after Success")
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}
#: the columns: SIGKILL, SIGSTOP (then SIGCONT), and a graceful ``KVManager.close()``
KINDS = ("KILL", "STOP", "CLOSE")


#: a frozen (SIGSTOP) peer's link is fenced before its rooms are released: the engine's close
#: of that peer waits out its goodbye, its RMA quiesce and its close handshake, each bounded by
#: ``EngineConfig.close_timeout_s`` (default 2 s), since a stopped process answers none of them
FENCE_S = 3 * 2.0


def bound_s(state: str, survivor: str, t: dict = MATRIX_TIMEOUTS, sig: str = "KILL") -> float:
    hb = t["heartbeat_timeout_s"] + t["heartbeat_interval_s"]
    b = t["bootstrap_s"] if state == "Bootstrapping" else hb
    if survivor == "prefill" and state in ("Transferring", "mid-write"):
        b = max(b, t["transfer_s"])
    if survivor == "decode":
        b = max(b, hb) + t["decode_grace_s"] + t["abort_ack_s"]
    if sig == "STOP" and state != "Bootstrapping":
        b = max(b, hb + FENCE_S)
    return b


def resume_bound_s(t: dict = MATRIX_TIMEOUTS) -> float:
    return (
        max(t["waiting_s"], t["transfer_s"])
        + t["bootstrap_s"]
        + t["decode_grace_s"]
        + t["abort_ack_s"]
    )


def _victim(victim: str, sig: str, addr: str, opts: dict) -> Worker:
    return Worker(
        victim,
        MATRIX_SPEC,
        addr if victim == "prefill" else None,
        opts,
        name=f"victim-{victim}-{sig}",
    )


def run_group(
    victim: str,
    sig: str,
    survivor: Worker,
    addr: str,
    rng: random.Random,
    opts: dict,
    v: Optional[Worker] = None,
) -> dict:
    """One victim side x one signal (``v``: the victim, when already spawned); see the
    module docstring."""
    surv_role = survivor.role
    v = (v or _victim(victim, sig, addr, opts)).ready()
    P, D = (v, survivor) if victim == "prefill" else (survivor, v)
    rid = lambda: rng.randrange(1, 1 << 62)  # noqa: E731
    before = survivor.node.check()
    rooms: Dict[str, int] = {s: rid() for s in STATES}
    out: dict = {"victim": victim, "signal": sig, "cells": {}}
    partner = None
    try:
        S, W, T, B, M = (
            rooms[s]
            for s in (
                "after Success",
                "WaitingForInput",
                "Transferring",
                "Bootstrapping",
                "mid-write",
            )
        )
        D.node.open(S, 2, True, True, addr)
        P.node.open(S, 2)
        P.node.send(S, 0, 2)
        pre = {S: (D.node.wait(S, 30.0)["state"], P.node.wait(S, 30.0)["state"])}
        D.node.open(W, 3, True, True, addr)
        P.node.open(W, 3)
        pre[W] = (
            D.node.poll_until(W, ["WaitingForInput"]),
            P.node.poll_until(W, ["WaitingForInput"]),
        )
        D.node.open(T, 3, True, True, addr)
        P.node.open(T, 3)
        P.node.send(T, 0, 1)
        pre[T] = (D.node.poll_until(T, ["Transferring"]), P.node.poll(T))
        D.node.open(M, BIG, True, True, addr)
        P.node.open(M, BIG)
        P.node.poll_until(M, ["WaitingForInput"])
        D.node.poll_until(M, ["WaitingForInput"])
        # B last: its Bootstrapping deadline runs from here
        if victim == "prefill":  # decode survivor: receiver not yet init()-ed
            D.node.open(B, 3, False, False, addr)
        else:  # prefill survivor: decode connected, no metadata
            D.node.open(B, 3, True, False, addr)
            D.node.poll_until(B, ["WaitingForInput"])
            P.node.open(B, 3)
        pre[B] = (D.node.poll(B), P.node.poll(B))
        pre[M] = (D.node.poll(M), P.node.poll(M))
        P.node.send(M, 0, BIG)
        landing = D.node.wait_landed(M, 10.0)  # its first page is there: bytes are flowing
        if sig == "CLOSE":  # graceful: KVManager.close() in the victim
            t_sig = time.monotonic()
            closing = procs.post(v.node.close_manager)
        else:
            t_sig = v.signal(SIGNALS[sig])
        if victim == "prefill":
            D.node.init(B)
            D.node.meta(B)
        for state, room in rooms.items():
            d_st, p_st = pre[room]
            out["cells"][state] = {"room": room, "decode_before": d_st, "prefill_before": p_st}
        for state in ("WaitingForInput", "Transferring", "after Success"):
            cell = out["cells"][state]
            cell["reached"] = cell["decode_before"] == state.replace("after ", "")
        out["cells"]["Bootstrapping"]["reached"] = (
            out["cells"]["Bootstrapping"][f"{surv_role}_before"] == "Bootstrapping"
        )
        out["cells"]["mid-write"]["reached"] = (
            out["cells"]["mid-write"]["prefill_before"] == "WaitingForInput" and landing
        )
        # -- the survivor
        ok = True
        #: decode survivor of a frozen prefill: it holds the rooms it gave up on
        holds = sig == "STOP" and surv_role == "decode"
        held_rooms: List[str] = []
        for state in STATES:
            room, cell = rooms[state], out["cells"][state]
            if state == "after Success":
                continue
            bound = bound_s(state, surv_role, sig=sig)
            left = t_sig + bound + SLACK_S - time.monotonic()
            if holds:
                # decode gives up on the frozen prefill, but a room whose metadata reached
                # it stays held (its on_done waits for the resumed prefill's answer): Failed
                # within the bound (t_s: when we looked, an upper bound), released later
                st = survivor.node.poll_until(room, ["Failed"], max(0.1, left))
                t_fail = round(time.monotonic() - t_sig, 2)
                res = survivor.node.results([room])[room]
                cell.update(survivor=surv_role, state=st, t_s=t_fail, bound_s=bound)
                cell.update(held=res["calls"] == 0, landed=res["landed"])
                if st == "Success" and res["calls"] == 1:
                    cell["note"] = "write completed before the signal took effect"
                    cell["ok"] = state == "mid-write" and cell["reached"] and not res["bad"]
                else:
                    if res["calls"] == 0:
                        held_rooms.append(state)
                    cell["ok"] = (
                        cell["reached"]
                        and st == "Failed"
                        and res["calls"] <= 1
                        and t_fail <= bound + SLACK_S
                    )
                ok &= cell["ok"]
                continue
            res = survivor.node.wait(room, max(0.1, left), timeout=max(0.1, left) + 30)
            cell.update(
                survivor=surv_role,
                state=res["state"],
                exc=res["exc"],
                t_s=None if res["t_done"] is None else round(res["t_done"] - t_sig, 2),
                bound_s=bound,
                landed=res["landed"],
                msg=res["msg"],
            )
            if res["state"] == "Success":
                # the 32 MiB write finished before the signal took effect: acceptable only
                # for the mid-write cell, and only byte-exact
                cell["note"] = "write completed before the signal took effect"
                cell["ok"] = (
                    state == "mid-write"
                    and cell["reached"]
                    and res["calls"] == 1
                    and not res["bad"]
                )
            else:
                cell["ok"] = (
                    cell["reached"]
                    and res["state"] == "Failed"
                    and res["calls"] == 1
                    and cell["t_s"] is not None
                    and cell["t_s"] <= bound + SLACK_S
                )
            ok &= cell["ok"]
        s_res = survivor.node.results([S])[S]
        out["cells"]["after Success"].update(
            survivor=surv_role,
            state=s_res["state"],
            calls=s_res["calls"],
            ok=s_res["state"] == "Success"
            and s_res["calls"] == 1
            and out["cells"]["after Success"]["reached"],
        )
        ok &= out["cells"]["after Success"]["ok"]
        after_fail = survivor.node.check() if not held_rooms else None
        if after_fail is not None:
            out["survivor_after_signal"] = _summary(before, after_fail)
        # -- the victim: resumed (STOP) or restarted (KILL)
        if sig == "STOP":
            t_cont = v.signal(signal.SIGCONT)
            for state in held_rooms:  # released once the resumed prefill answered
                cell = out["cells"][state]
                res = survivor.node.wait(cell["room"], resume_bound_s() + SLACK_S)
                cell["released_s"] = (
                    None if res["t_done"] is None else round(res["t_done"] - t_cont, 2)
                )
                cell["ok"] = (
                    cell["ok"]
                    and res["state"] == "Failed"
                    and res["calls"] == 1
                    and cell["released_s"] is not None
                )
                ok &= cell["ok"]
            if held_rooms:
                out["survivor_after_signal"] = _summary(before, survivor.node.check())
            vc = v.node.check(resume_bound_s() + SLACK_S, timeout=resume_bound_s() + 60)
            out["victim_after_resume"] = dict(
                _summary(None, vc), s=round(time.monotonic() - t_cont, 2)
            )
            ok &= _clean(out["victim_after_resume"])
            vres = v.node.results([rooms[s] for s in STATES])
            out["victim_rooms"] = {
                s: f"{vres[rooms[s]]['state']}:{vres[rooms[s]]['exc']}"
                for s in STATES
                if rooms[s] in vres
            }
            partner = v
        else:
            if sig == "CLOSE":
                out["victim_close_s"] = round(closing.result(60.0) - t_sig, 2)
                vc = v.node.check(resume_bound_s() + SLACK_S, timeout=resume_bound_s() + 60)
                out["victim_after_close"] = _summary(None, vc)
                ok &= _clean(out["victim_after_close"])
                v.stop()
            v.worker.proc.join(10)
            partner = Worker(
                victim,
                MATRIX_SPEC,
                addr if victim == "prefill" else None,
                opts,
                name=f"restarted-{victim}",
            ).ready()
        P2, D2 = (partner, survivor) if victim == "prefill" else (survivor, partner)
        R = rid()
        D2.node.open(R, 5, True, True, addr)
        P2.node.open(R, 5)
        P2.node.send(R, 0, 2)
        P2.node.send(R, 2, 5)
        rd, rp = D2.node.wait(R, 30.0), P2.node.wait(R, 30.0)
        out["served_after"] = {
            "peer": "resumed victim" if sig == "STOP" else "restarted victim (same bootstrap key)",
            "decode": rd["state"],
            "prefill": rp["state"],
            "bad": rd["bad"],
            "exc": rd["exc"] or rp["exc"],
        }
        served = rd["state"] == rp["state"] == "Success" and rd["bad"] == 0
        final = survivor.node.check()
        out["survivor_final"] = _summary(before, final)
        pc = partner.node.check(resume_bound_s())
        out["partner_final"] = _summary(None, pc)
        clean = all(_clean(x) for x in (out["survivor_final"], out["partner_final"]))
        out["served_ok"] = served
        out["ok"] = bool(ok and served and clean)
    finally:
        for w in (partner, v):
            if w is not None:
                w.stop(timeout=10.0)
    return out


def _summary(before, c: dict) -> dict:
    """Counts of a check (as deltas against ``before`` for the cumulative ones)."""
    late = sum(c["late_writes"].values())
    guard = sum(c["guard_hits"].values())
    twice, corrupt = c["on_done_twice"], c["corrupt_rooms"]
    if before is not None:
        late -= sum(before["late_writes"].values())
        guard -= sum(before["guard_hits"].values())
        twice -= before["on_done_twice"]
        corrupt -= before["corrupt_rooms"]
    return {
        "late_writes": late,
        "late_examples": c["late_examples"][-3:],
        "guard_hits": guard,
        "on_done_twice": twice,
        "corrupt_rooms": corrupt,
        "leaks": c["leaks"],
        "unreleased": c["unreleased"],
        "fds": c["fds"],
        "rss_mib": c["rss_mib"],
    }


def _clean(s: dict) -> bool:
    return not (
        s["late_writes"]
        or s["guard_hits"]
        or s["on_done_twice"]
        or s["corrupt_rooms"]
        or s["unreleased"]
        or any(s["leaks"].values())
    )


def run_matrix(
    victims: List[str] = ("prefill", "decode"),
    signals: List[str] = KINDS,
    seed: int = 0,
    error_mode: str = "peer",
) -> dict:
    """Run every (victim, signal) group against long-lived survivors; returns the summary."""
    from kvxfer.testing.reliability.node import bootstrap_server

    ensure_secret()
    t0 = time.monotonic()
    rng = random.Random(seed)
    opts = dict(timeouts=MATRIX_TIMEOUTS, error_mode=error_mode)
    bs_s, bs_v = bootstrap_server(), bootstrap_server()
    survivors: Dict[str, Worker] = {}
    groups = []
    first = None
    try:
        if "decode" in victims:
            survivors["prefill"] = Worker(
                "prefill", MATRIX_SPEC, bs_s.address, opts, name="survivor-prefill"
            )
        if "prefill" in victims:
            survivors["decode"] = Worker("decode", MATRIX_SPEC, None, opts, name="survivor-decode")
        addr_of = {"prefill": bs_v.address, "decode": bs_s.address}
        first = _victim(victims[0], signals[0], addr_of[victims[0]], opts)  # boots alongside
        for w in survivors.values():
            w.ready()
        for victim in victims:
            surv = survivors["decode" if victim == "prefill" else "prefill"]
            for sig in signals:
                t = time.monotonic()
                g = run_group(victim, sig, surv, addr_of[victim], rng, opts, first)
                first = None
                g["s"] = round(time.monotonic() - t, 1)
                groups.append(g)
    finally:
        for w in [*survivors.values(), first]:
            if w is not None:
                w.stop()
        bs_s.stop_thread()
        bs_v.stop_thread()
    return {
        "scenario": "kill_matrix",
        "ok": all(g["ok"] for g in groups),
        "groups": groups,
        "timeouts": MATRIX_TIMEOUTS,
        "slack_s": SLACK_S,
        "wall_s": round(time.monotonic() - t0, 1),
    }
