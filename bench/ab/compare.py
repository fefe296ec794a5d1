"""Before/after table from ``bench/ab/run_ab.sh``'s JSON files: ``python3 compare.py DIR``.

For each benchmark row (PD: per lane mode; transfer: per lane config × layout × page set ×
size) it prints the old and new figure as the median over rounds, and new/old. Same-run
ratios (× raw, × memcpy/copy_) are what a refactor must keep; absolute figures drift with the
machine, which is why the trees alternate within one run.
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple

PD_KEYS = (
    ("p50_us", "1-page p50 µs"),
    ("raw_p50_us", "raw 1-page p50 µs"),
    ("req_per_s", "req/s"),
    ("pd_gbps_median", "large GB/s (median)"),
    ("ratio_median", "large × raw (median)"),
)
TR_KEYS = (("GBps", "GB/s"), ("vs_raw", "× raw"), ("vs_memcpy", "× copy"))


def _load(pattern: str) -> Dict[str, List[dict]]:
    by_side: Dict[str, List[dict]] = {"old": [], "new": []}
    for path in sorted(glob.glob(pattern)):
        side = os.path.basename(path).split("-")[2]
        by_side[side].append(json.load(open(path)))
    return by_side


def _table(by_side: Dict[str, List[dict]], key_of, keys) -> List[str]:
    vals: Dict[Tuple, Dict[str, List[float]]] = {}
    for side, runs in by_side.items():
        for run in runs:
            for row in run["rows"]:
                for k, _ in keys:
                    if row.get(k) is not None:
                        vals.setdefault((key_of(row), k), {"old": [], "new": []})[side].append(
                            row[k]
                        )
    out = ["| row | figure | old | new | new/old |", "|---|---|---|---|---|"]
    for (row, k), sides in sorted(vals.items(), key=lambda kv: kv[0]):
        if not sides["old"] or not sides["new"]:
            continue
        o, n = statistics.median(sides["old"]), statistics.median(sides["new"])
        label = dict(keys)[k]
        out.append(
            f"| {row} | {label} | {o:.4g} | {n:.4g} | {n / o:.2f} |"
            if o
            else f"| {row} | {label} | {o:.4g} | {n:.4g} | - |"
        )
    return out


def main(d: str) -> None:
    pd = _load(os.path.join(d, "ab-pd-*.json"))
    tr = _load(os.path.join(d, "ab-transfer-*.json"))
    print(
        f"## kvxfer bench pd: old vs new (median of {len(pd['old'])} and {len(pd['new'])} rounds)"
    )
    print("\n".join(_table(pd, lambda r: r["mode"], PD_KEYS)))
    print()
    print(
        f"## kvxfer bench transfer: old vs new (median of {len(tr['old'])} and {len(tr['new'])} rounds)"
    )
    print(
        "\n".join(
            _table(
                tr,
                lambda r: (
                    f"{r['mode']} dev={r['device_copy']} {r['layout']} {r['pageset']} {r['pages']}p"
                ),
                TR_KEYS,
            )
        )
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ab_out")
