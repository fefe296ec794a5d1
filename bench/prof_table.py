"""A cProfile dump as a table of µs per call of an entry function:
``python3 bench/prof_table.py FILE [ENTRY] [N] [own|cum]``.

ENTRY (default ``_send``) names the function whose call count divides every figure (e.g. the
bench's sends); rows are the N (default 25) functions with the most own time (``cum``: the
most cumulative time). cProfile's own
overhead inflates every figure; compare rows of one dump, or two dumps of one tree.
"""

from __future__ import annotations

import pstats
import sys


def table(path: str, entry: str = "_send", n: int = 25, key: str = "own") -> str:
    st = pstats.Stats(path).stats  # type: ignore[attr-defined]
    calls = max((v[1] for k, v in st.items() if k[2] == entry), default=0)
    if not calls:
        return f"{path}: no calls of {entry}"
    col = 3 if key == "cum" else 2
    rows = sorted(st.items(), key=lambda kv: -kv[1][col])[:n]
    out = [
        f"{calls} calls of {entry}; per call of it:",
        "",
        "| function | calls | own µs | cumulative µs |",
        "|---|---:|---:|---:|",
    ]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows:
        where = fn if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line} {fn}"
        out.append(
            f"| `{where}` | {nc / calls:.1f} | {tt / calls * 1e6:.1f} | {ct / calls * 1e6:.1f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    a = sys.argv[1:]
    print(
        table(
            a[0],
            a[1] if len(a) > 1 else "_send",
            int(a[2]) if len(a) > 2 else 25,
            a[3] if len(a) > 3 else "own",
        )
    )
