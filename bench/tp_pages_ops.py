"""RMA ops per request for heterogeneous TP x page sizes x decode prefix: pure arithmetic,
what the protocol's planners give (``tp_plan.plan_pages`` for whole pages — equal page
sizes and a page-aligned prefix —, else ``tp_tokens.TokenPlan.runs``), summed over every
prefill → decode pair, against the equal shape (same TP sizes, equal pages, no prefix) and
equal TP (1:1, same page sizes and prefix). No transfer: bench/results/tp-pages-cpu.md has
the measured GB/s (``kvxfer bench pd``) next to these counts. Run::

    PYTHONPATH=. python bench/tp_pages_ops.py [--tokens 4096] [--layers 32]

Prints a markdown table per page placement (contiguous ids; scattered: no two destination
pages adjacent)."""

from __future__ import annotations

import argparse
import itertools

import numpy as np

from kvxfer.disagg.tp_plan import hnd_item, nhd_item, page_major_item, plan_pages, replicated_item
from kvxfer.disagg.tp_tokens import TokenPlan

RATIOS = ((1, 1), (1, 2), (2, 1), (1, 4), (4, 1), (2, 4))


def geoms(kind: str, ps: int, tp: int, layers: int, heads: int, hb: int):
    if kind == "nhd":
        return [nhd_item(ps, hb, heads, tp)] * (2 * layers)
    if kind == "hnd":
        return [hnd_item(ps, hb, heads, tp)] * (2 * layers)
    if kind == "page_major":
        return [page_major_item(layers, ps, hb, hb, heads, tp)]
    return [replicated_item(ps * 576 * 2)] * layers  # MLA latent (512 + 64) bf16


def ops(kind, tp_p, tp_d, ps, pd, tokens, prefix, layers, heads, hb, scattered) -> int:
    n_src, n_dst = -(-tokens // ps), -(-tokens // pd)
    src = np.arange(n_src)
    dst = np.arange(n_dst) * (2 if scattered else 1)
    total = 0
    for p, d in itertools.product(range(tp_p), range(tp_d)):
        sg = geoms(kind, ps, tp_p, layers, heads, hb)
        dg = geoms(kind, pd, tp_d, layers, heads, hb)
        if ps == pd and prefix % ps == 0:  # whole pages (what the protocol does)
            skip = prefix // ps
            total += len(plan_pages(sg, dg, p, d, tp_p, tp_d, src[skip:], dst[skip:]))
        else:
            plan = TokenPlan(tuple(sg), tuple(dg), ps, pd, p, d, tp_p, tp_d)
            total += len(plan.runs(src, dst, prefix, tokens))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    hb = 2 * a.head_dim
    t = a.tokens
    shapes = [  # (prefill page, decode page, decode prefix, tokens)
        (64, 64, 0, t),
        (16, 64, 0, t),
        (64, 16, 0, t),
        (64, 64, 1024, t),
        (64, 64, 1000, t - 7),
        (16, 64, 1000, t - 7),
        (64, 16, 1000, t - 7),
    ]
    print(
        f"{a.layers} layers, {a.heads} KV heads x {a.head_dim} bf16, {t}-token requests "
        "(t - 7 with an unaligned prefix: a partial last page); ops per request over all pairs\n"
    )
    for scattered in (False, True):
        print(f"### {'scattered' if scattered else 'contiguous'} destination pages\n")
        head = "| layout | pages P→D | prefix | tokens | " + " | ".join(
            f"{x}:{y}" for x, y in RATIOS
        )
        print(head + " |")
        print("|---" * (4 + len(RATIOS)) + "|")
        for kind in ("nhd", "hnd", "page_major", "mla"):
            for ps, pd, k, n in shapes:
                h = 1 if kind == "mla" else a.heads
                row = [ops(kind, x, y, ps, pd, n, k, a.layers, h, hb, scattered) for x, y in RATIOS]
                print(
                    f"| {kind} | {ps}→{pd} | {k} | {n} | " + " | ".join(map(str, row)) + " |",
                    flush=True,
                )
        print()


if __name__ == "__main__":
    main()
