"""``python -m kvxfer.testing.reliability {soak,kill,netns} [options] [--json]``

Runs one scenario of docs/RELIABILITY.md, prints its summary (one JSON object on the last
line with ``--json``) and exits 0 only when every count that must be zero is zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def figure(s: dict) -> str:
    """The one-line figure docs/RELIABILITY.md quotes for a summary."""
    if s.get("skipped"):
        return f"skipped: {s['skipped']}"
    if s["scenario"] == "kill_matrix":
        cells = [c for g in s["groups"] for c in g["cells"].values()]
        bad = [
            f"{g['victim']}/{g['signal']}/{st}"
            for g in s["groups"]
            for st, c in g["cells"].items()
            if not c.get("ok")
        ]
        groups_bad = [f"{g['victim']}/{g['signal']}" for g in s["groups"] if not g["ok"]]
        worst = max((c["t_s"] for c in cells if c.get("t_s") is not None), default=0.0)
        held = [c for c in cells if c.get("held")]
        rel = max((c.get("released_s") or 0.0 for c in held), default=0.0)
        n_groups = len(s["groups"])
        return (
            f"{len(cells) - len(bad)}/{len(cells)} cells ok, {n_groups - len(groups_bad)}"
            f"/{n_groups} groups ok (failing: {', '.join(bad + groups_bad) or '-'}); "
            f"slowest failure {worst:.2f} s after the signal (on_done; Failed for a held "
            f"room, {len(held)} held, released {rel:.2f} s after SIGCONT at most); "
            f"{s['wall_s']:.0f} s"
        )
    c = s["counts"]
    rss = "; ".join(f"{k} RSS {v[0]:.0f}->{v[1]:.0f} MiB" for k, v in s["rss_mib"].items())
    extra = (
        f"; {s['impairment']}; dropped: {s.get('dropped')}"
        if s["scenario"].startswith("netns")
        else ""
    )
    return (
        f"{s['requests']} requests: {s['succeeded']} ok, {s['aborted']} aborted, "
        f"unexpected {c['unexpected_outcomes']}, corrupt rooms {c['corrupt_rooms']} "
        f"({s['pages_verified']} pages verified), late writes {c['late_writes']}, guard hits "
        f"{c['guard_hits']}, on_done twice {c['on_done_twice']}, unreleased "
        f"{c['unreleased']}, hung {c['hung']}, leaked {c['leaked']}; {rss}; "
        f"{s['soak_s']:.0f} s soak / {s['wall_s']:.0f} s wall{extra}"
    )


def _print(summary: dict, as_json: bool) -> None:
    print(f"figure: {figure(summary)}", flush=True)
    if as_json:
        print(json.dumps(summary, sort_keys=True, default=str), flush=True)
    else:
        print(json.dumps(summary, sort_keys=True, indent=1, default=str), flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvxfer.testing.reliability", description=__doc__.splitlines()[0]
    )
    sub = ap.add_subparsers(dest="scenario", required=True)
    s = sub.add_parser("soak", help="random sizes, chunking and aborts between one pair")
    s.add_argument("--requests", type=int, default=10000)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--window", type=int, default=16, help="rooms open per side")
    s.add_argument("--max-pages", type=int, default=16)
    s.add_argument("--abort-rate", type=float, default=0.1)
    s.add_argument("--error-mode", choices=("peer", "none"), default="peer")
    k = sub.add_parser("kill", help="SIGKILL / SIGSTOP+SIGCONT a peer in each room state")
    k.add_argument("--victims", default="prefill,decode")
    k.add_argument(
        "--signals",
        default="KILL,STOP,CLOSE",
        help="KILL (SIGKILL), STOP (SIGSTOP, later SIGCONT), CLOSE (graceful)",
    )
    k.add_argument("--error-mode", choices=("peer", "none"), default="peer")
    n = sub.add_parser("netns", help="prefill and decode in two network namespaces (veth)")
    n.add_argument("--requests", type=int, default=500)
    n.add_argument(
        "--impair",
        action="store_true",
        help="tc netem delay + loss on the veth pair (or the fallback, see docs)",
    )
    n.add_argument("--seed", type=int, default=0)
    for p in (s, k, n):
        p.add_argument("--json", action="store_true", help="one JSON line")
    a = ap.parse_args(argv)
    if a.scenario == "soak":
        from kvxfer.testing.reliability.soak import run_soak

        out = run_soak(
            requests=a.requests,
            seed=a.seed,
            window=a.window,
            max_pages=a.max_pages,
            abort_rate=a.abort_rate,
            error_mode=a.error_mode,
        )
    elif a.scenario == "kill":
        from kvxfer.testing.reliability.kill_matrix import run_matrix

        out = run_matrix(
            victims=a.victims.split(","), signals=a.signals.split(","), error_mode=a.error_mode
        )
    else:
        from kvxfer.testing.reliability.netns import run_netns

        out = run_netns(requests=a.requests, impair=a.impair, seed=a.seed)
    _print(out, a.json)
    return 0 if out.get("ok") or out.get("skipped") else 1


if __name__ == "__main__":
    sys.exit(main())
