"""Medians per value of ``bench/ab/env_rounds.sh``'s JSON files:
``python3 env_compare.py DIR VAR VALUE...``.

Per PD mode, one column per value: 1-page p50 and p99, req/s, the raw write's p50 and, when
the runs had ``--stages``, every stage's p50 and p99 (µs), each the median over rounds, and
the first value's figure over the others' (same run).
"""

from __future__ import annotations

import glob
import json
import math
import os
import statistics
import sys
from typing import Dict, List

KEYS = (
    ("p50_us", "1-page p50 µs"),
    ("p99_us", "1-page p99 µs"),
    ("req_per_s", "req/s"),
    ("raw_p50_us", "raw 1-page p50 µs"),
    ("raw_receipt_p50_us", "raw + notify until decode has it, p50 µs"),
)


def _median(xs: List[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def table(root: str, var: str, values: List[str]) -> str:
    runs: Dict[str, List[dict]] = {}
    for v in values:
        for path in sorted(glob.glob(os.path.join(root, f"{v}-*.json"))):
            with open(path) as f:
                runs.setdefault(v, []).extend(json.load(f)["rows"])
    modes = sorted({r["mode"] for rows in runs.values() for r in rows})
    out = []
    for mode in modes:
        per = {v: [r for r in runs.get(v, []) if r["mode"] == mode] for v in values}
        n = {v: len(per[v]) for v in values}
        head = " | ".join(f"{var}={v} (n={n[v]})" for v in values)
        ratios = " | ".join(f"{values[0]}/{v}" for v in values[1:])
        out += [
            f"\n### {mode}\n",
            f"| figure | {head} | {ratios} |",
            "|---" * (2 * len(values)) + "|",
        ]
        rows = [
            (label, {v: _median([r.get(k) for r in per[v]]) for v in values}) for k, label in KEYS
        ]
        if any(r.get("stages") for r in per[values[0]]):
            path = "path p50 µs (stages: decode poll sees Success − send stamp)"
            rows.append(
                (
                    path,
                    {
                        v: _median([(r.get("stages") or {}).get("path_p50_us") for r in per[v]])
                        for v in values
                    },
                )
            )
        stages = [
            s["stage"] for r in per[values[0]] for s in (r.get("stages") or {}).get("rows", [])
        ]
        for name in dict.fromkeys(stages):
            for q in ("p50_us", "p99_us"):
                rows.append(
                    (
                        f"{name} {q[:3]}",
                        {
                            v: _median(
                                [
                                    s.get(q)
                                    for r in per[v]
                                    for s in (r.get("stages") or {}).get("rows", [])
                                    if s["stage"] == name
                                ]
                            )
                            for v in values
                        },
                    )
                )
        for label, med in rows:
            a = med[values[0]]
            cells = " | ".join(f"{med[v]:.1f}" for v in values)
            rs = " | ".join(f"{a / med[v]:.2f}" if med[v] else "n/a" for v in values[1:])
            out.append(f"| {label} | {cells} | {rs} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1], sys.argv[2], sys.argv[3:]))
