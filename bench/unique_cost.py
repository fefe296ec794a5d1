"""What a request's release costs in the paged allocator, and ``np.unique`` against the
sort-based :func:`kvxfer.kernels.ids.sorted_unique` on the same ids:
``python3 bench/unique_cost.py [PAGES ...]`` (default 1 16 1000 16000). µs per call, best of
five rounds of 200 calls; page ids drawn at random from a 65536-page pool (distinct, as a
request's pages are).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvxfer.kernels.ids import sorted_unique
from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator


def best_us(fn, n: int = 200, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


def main(argv) -> None:
    sizes = [int(a) for a in argv] or [1, 16, 1000, 16000]
    ps, pool = 16, 65536
    alloc = PagedTokenToKVPoolAllocator(pool * ps, ps, "cpu")
    print(f"numpy {np.__version__}; µs per call (best of 5 x 200)")
    print(
        "| pages | np.unique | sorted_unique | alloc + free_pages (numpy ids) | free(token ids) |"
    )
    print("|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n in sizes:
        print(row(alloc, n, ps, rng.permutation(np.arange(1, pool + 1))[:n].astype(np.int64)))


def row(alloc: PagedTokenToKVPoolAllocator, n: int, ps: int, ids: np.ndarray) -> str:
    """One table row: ``n`` random distinct page ids ``ids``."""
    u = best_us(lambda: np.unique(ids))
    s = best_us(lambda: sorted_unique(ids))

    def cycle() -> None:
        got = alloc.alloc(n * ps)
        alloc.free_pages(got[::ps].numpy() // ps)

    def cycle_tokens() -> None:
        alloc.free(alloc.alloc(n * ps))

    c = best_us(cycle, n=50)
    t = best_us(cycle_tokens, n=50)
    return f"| {n} | {u:.1f} | {s:.1f} | {c:.1f} | {t:.1f} |"


if __name__ == "__main__":
    main(sys.argv[1:])
