"""Equal TP, different page sizes / an unaligned decode prefix: what one request costs as
byte runs (``page_map.plan_runs``: one PUT per run, the RawWrite) against PatternWrites
(``page_map.plan_patterns``: one per piece class, one device-lane launch each on a same-host
CUDA pair). Pure arithmetic plus the planning time on this machine (the median of
``--reps`` plans of the whole request, patterns' per-class runs cached as on a live link).
No transfer: the H200 measures that (``bench/gpu/pattern.sh`` with ``PAT_PAGES=1``). Run::

    PYTHONPATH=. python bench/eq_patterns.py [--tokens 16000] [--layers 4] [--heads 8]
        [--scattered]

The default model is ``kvxfer bench pd``'s at ``--tp-heads 8`` (4 layers, 8 KV heads x 64
bf16: 125 MiB of NHD / HND per 16000-token request); pages are consecutive on both sides
(fresh allocators: the fewest runs), or with ``--scattered`` no two destination pages
adjacent (a long-running allocator's worst case)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import List

import numpy as np

from kvxfer.disagg.page_map import TokenGeometry, plan_patterns, plan_runs

SHAPES = ((16, 64, 37), (64, 16, 37), (16, 16, 37), (16, 64, 0))


def segments(kind: str, layers: int, heads: int, hb: int) -> List[List[int]]:
    """Per kv descriptor, the token-row bytes of each segment (docs/shapes.md)."""
    if kind == "nhd":
        return [[heads * hb]] * (2 * layers)
    if kind == "hnd":
        return [[hb] * heads] * (2 * layers)
    if kind == "page_major":
        return [[heads * hb] * (2 * layers)]
    return [[576 * 2]] * layers  # MLA latent (512 + 64) bf16


def timed(fn, args: tuple, reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--scattered", action="store_true")
    a = ap.parse_args()
    hb, n = 2 * a.head_dim, a.tokens
    print(
        f"{a.layers} layers, {a.heads} KV heads x {a.head_dim} bf16, {n}-token requests, "
        "equal TP; one plan of the whole request ("
        + ("no two destination pages adjacent" if a.scattered else "pages consecutive")
        + ")\n"
    )
    print(
        "| layout | pages P→D | prefix | MiB | runs (PUTs) | PatternWrites | runs per item, "
        "summed | plan runs ms | plan patterns ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in ("nhd", "hnd", "page_major", "mla"):
        geom = TokenGeometry.of(segments(kind, a.layers, a.heads, hb))
        assert geom is not None
        for ps, pd, k in SHAPES:
            src, dst = np.arange(-(-n // ps)), np.arange(-(-n // pd)) * (2 if a.scattered else 1)
            args = (geom, src, ps, dst, pd, k, n)
            runs, pats = plan_runs(*args), plan_patterns(*args)
            t_runs, t_pats = timed(plan_runs, args, a.reps), timed(plan_patterns, args, a.reps)
            per_item = sum(pr.runs_per_item for _, _, pr in pats)
            moved = sum(pr.bytes_per_item * s.size for s, _, pr in pats)
            assert moved == runs.total_bytes
            print(
                f"| {kind} | {ps}→{pd} | {k} | {runs.total_bytes / 2**20:.1f} | {len(runs)} | "
                f"{len(pats)} | {per_item} | {t_runs * 1e3:.2f} | {t_pats * 1e3:.2f} |"
            )


if __name__ == "__main__":
    main()
