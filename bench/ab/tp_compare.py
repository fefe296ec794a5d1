"""Medians per source tree of heterogeneous-TP bench rows (``bench/gpu/trees.sh`` with TP
argument sets): ``python3 tp_compare.py DIR TREE...`` reads ``DIR/<tree>-*.json`` (``kvxfer
bench pd --json-out``) and prints, per row shape (layout, TP, page sizes, prefix), each
tree's median request µs over its runs (decode's side; and prefill's, where the rows have
it), its medians of × N:N and × M:M (each run's row
against the equal-TP rows of the same run), the first tree's µs over the others', and the
prefill rank 0 stage stamps of the heterogeneous rows' legs and decode's (µs after the send, medians of the
runs' p50s).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple

#: stage stamps shown per row (those a row has)
STAGES = (
    "p0.loop",
    "p0.posted",
    "p0.leg1.posted",
    "p0.leg2.posted",
    "p0.leg1.notified",
    "p0.leg2.notified",
    "p0.notified",
    "p0.last_notified",
    "d0.seen",
    "d1.seen",
)


def _key(r: dict) -> Tuple:
    return (
        r["kv_layout"],
        r["prefill_tp"],
        r["decode_tp"],
        r["prefill_page_size"],
        r["decode_page_size"],
        r["decode_prefix"],
    )


def _ratios(rows: List[dict]) -> Dict[Tuple, Tuple[float, float]]:
    """Per row of one run: (× N:N, × M:M) against that run's equal-TP rows of the same
    layout, page sizes and prefix (NaN where the run has none)."""
    us = {_key(r): r["us_median"] for r in rows}
    out = {}
    for r in rows:
        k = _key(r)
        nn = us.get((k[0], k[1], k[1], *k[3:]))
        mm = us.get((k[0], k[2], k[2], *k[3:]))
        out[k] = tuple(float("nan") if b is None else b / r["us_median"] for b in (nn, mm))
    return out


def _med(xs: List[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def table(root: str, trees: List[str]) -> str:
    got: Dict[str, Dict[Tuple, List[Tuple[float, float, float, dict, float]]]] = {}
    for t in trees:
        for path in sorted(glob.glob(os.path.join(root, f"{t}-*.json"))):
            with open(path) as f:
                rows = json.load(f)["rows"]
            ratios = _ratios(rows)
            for r in rows:
                k = _key(r)
                got.setdefault(t, {}).setdefault(k, []).append(
                    (
                        r["us_median"],
                        *ratios[k],
                        r.get("stages") or {},
                        r.get("prefill_us_median", float("nan")),
                    )
                )
    keys = sorted({k for per in got.values() for k in per})
    head = ["layout", "TP", "pages, prefix"]
    for t in trees:
        head += [f"{t} µs (runs)", f"{t} prefill-side µs", f"{t} × N:N / × M:M"]
    head.append(f"{trees[0]} / {trees[1]} µs" if len(trees) > 1 else "")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for k in keys:
        cells = [k[0], f"{k[1]} → {k[2]}", f"{k[3]} → {k[4]}, {k[5]}"]
        meds = []
        for t in trees:
            runs = got.get(t, {}).get(k, [])
            us = _med([x[0] for x in runs])
            meds.append(us)
            cells += [
                f"{us:.0f} ({len(runs)})",
                f"{_med([x[4] for x in runs]):.0f}",
                f"{_med([x[1] for x in runs]):.2f} / {_med([x[2] for x in runs]):.2f}",
            ]
            st = {s: _med([x[3][s] for x in runs if s in x[3]]) for s in STAGES}
            st = {s: v for s, v in st.items() if v == v}
            if k[1] != k[2] and st:
                notes.append(
                    f"- {t}, {k[0]} {k[1]} → {k[2]} ({k[3]} → {k[4]}, {k[5]}): "
                    + ", ".join(f"{s} {v:.0f}" for s, v in st.items())
                )
        cells.append(f"{meds[0] / meds[1]:.2f}" if len(meds) > 1 and meds[1] else "")
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out += [
            "",
            "Stages of prefill rank 0 and decode (µs after the send, median of the runs' p50s):",
            *notes,
        ]
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2:]))
