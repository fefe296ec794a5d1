"""``kvxfer bench kernels``: bandwidth of the Triton kernels against ``torch`` ``copy_``.

For every kernel and token count it times, in the same run:

* the Triton kernel (``backend="triton"``);
* the plain-torch reference (``backend="torch"``), i.e. what the fallback path costs;
* ``dst.copy_(src)`` between two contiguous buffers holding exactly the bytes the kernel
  moves (the baseline).

Bandwidth counts bytes read + bytes written (payload only; index tensors are ignored).
The ratio is ``copy_ time / kernel time`` for the same bytes (1.0 = as fast as copy_;
target >= 0.8). Every case is ONE launch against ONE ``copy_`` (the ``move`` cases move
all layers in one launch and copy_ the same total bytes). On CUDA each figure is the median
of ``triton.testing.do_bench`` (L2 flushed between repetitions); the Triton call is run once
(JIT compile) before anything of its case is timed, so no compile-time idle gap precedes a
measurement. Two diagnostic columns help read small-N results:

* ``graph us`` - the same Triton call captured in a CUDA graph and replayed (device time
  without the Python launch path; ``-`` if the call cannot be captured);
* ``host us`` - CPU time per eager call (launcher checks + Triton dispatch), measured over
  a burst of calls without synchronising.

If ``Triton us`` is well above ``graph us`` the gap is launch-side, not kernel time.

The ``checksum`` cases (:mod:`kvxfer.kernels.checksum`, the integrity check's kernel: per-layer
``2 * layers`` descriptors, and ``checksum_paged``: one page-major descriptor) only read:
their GB/s counts the bytes read, the ``copy_`` baseline moves the same traffic (half read,
half written), and the "torch ref" column is the numpy host path over host copies of the
buffers (what a host-memory pool costs). Like the other cases' index tensors, the task table
is built once beforehand (a transfer builds it per request: ``kvxfer bench pd --integrity``
measures that end to end).
On CPU only the torch reference and copy_ run, at tiny sizes, best of a few runs (Triton on
CPU means the interpreter, whose timings are meaningless).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kvxfer import clitools
from kvxfer.kernels import checksum, mla, store, store_paged
from kvxfer.kernels import copy as kcopy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.uint8}
KERNELS = (
    "store",
    "store_masked",
    "store_prefix",
    "store_paged",
    "move",
    "move_paged",
    "mla_store",
    "mla_gather",
    "checksum",
    "checksum_paged",
)
TARGET = 0.8


def _time_cuda(fn: Callable[[], object], rep_ms: int) -> float:
    import triton.testing

    return (
        float(
            triton.testing.do_bench(
                fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"
            )
        )
        * 1e-3
    )


def _time_cuda_graph(fn: Callable[[], object], rep_ms: int) -> float | None:
    """Median device time of ``fn`` captured once in a CUDA graph and replayed; None when
    ``fn`` cannot be captured (e.g. it synchronises with the host)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # noqa: BLE001 - a diagnostic column; report and go on
        print(f"(graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        torch.cuda.synchronize()
        return None
    t = _time_cuda(graph.replay, rep_ms)
    del graph
    return t


def _host_time(fn: Callable[[], object], calls: int = 200) -> float:
    """CPU seconds per call of ``fn`` over a burst of ``calls`` without synchronising (few
    enough that the launch queue never fills, so the device does not throttle the host)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls


def _time_cpu(fn: Callable[[], object], rep_ms: int) -> float:
    fn()
    times, deadline = [], time.perf_counter() + rep_ms * 1e-3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)  # best of N: the least disturbed run on a shared CPU


class _Case:
    """One benchmark case: a Triton call, a torch call and the payload bytes they move."""

    def __init__(
        self,
        name: str,
        tokens: int,
        payload: int,
        triton_fn,
        torch_fn,
        moved: int | None = None,
        keep: tuple = (),
    ):
        self.name, self.tokens, self.payload = name, tokens, payload
        self.keep = keep  # buffers a call reads through raw addresses only
        self.triton_fn, self.torch_fn = triton_fn, torch_fn
        self.moved = 2 * payload if moved is None else moved  # bytes read + written


def _paged_locs(n: int, capacity: int, page_size: int, gen: torch.Generator, device):
    """Token ids of ``n`` tokens on randomly chosen whole pages, plus disjoint ones (for moves)."""
    pages = torch.randperm(capacity // page_size, generator=gen)
    need = -(-n // page_size)
    offs = torch.arange(page_size)
    first = (pages[:need, None] * page_size + offs).reshape(-1)[:n]
    second = (pages[need : 2 * need, None] * page_size + offs).reshape(-1)[:n]
    return first.to(device), second.to(device)


def _page_major(layers, num_pages, ps, heads, dim, dtype, device):
    row = heads * dim
    page_elems = layers * ps * 2 * row
    raw = torch.empty(num_pages * page_elems, dtype=dtype, device=device)
    ks = [
        raw.as_strided((num_pages, ps, heads, dim), (page_elems, row, dim, 1), 2 * l * ps * row)
        for l in range(layers)
    ]
    vs = [
        raw.as_strided(
            (num_pages, ps, heads, dim), (page_elems, row, dim, 1), (2 * l + 1) * ps * row
        )
        for l in range(layers)
    ]
    return raw, ks, vs


def _build(kind: str, n: int, a, device) -> _Case:
    dt, H, D, L, ps = DTYPES[a.dtype], a.heads, a.head_dim, a.layers, a.page_size
    gen = torch.Generator().manual_seed(n)
    cap = 2 * n + 2 * ps
    cap -= cap % ps
    isz = torch.empty(0, dtype=dt).element_size()
    row = H * D * isz
    if kind in ("store", "store_masked", "store_prefix"):
        kc = torch.empty(cap, H, D, dtype=dt, device=device)
        vc = torch.empty(cap, H, D, dtype=dt, device=device)
        k = torch.empty(n, H, D, dtype=dt, device=device)
        v = torch.empty(n, H, D, dtype=dt, device=device)
        loc, _ = _paged_locs(n, cap, ps, gen, device)
        if kind == "store":
            return _Case(
                kind,
                n,
                2 * n * row,
                lambda: store.store_kv(kc, vc, loc, k, v, backend="triton"),
                lambda: store.store_kv(kc, vc, loc, k, v, backend="torch"),
            )
        if kind == "store_masked":
            mask = (torch.rand(n, generator=gen) < 0.5).to(device)
            written = int(mask.sum())
            return _Case(
                kind,
                n,
                2 * written * row,
                lambda: store.store_kv(kc, vc, loc, k, v, mask=mask, backend="triton"),
                lambda: store.store_kv(kc, vc, loc, k, v, mask=mask, backend="torch"),
            )
        T = 8
        B = n // T
        loc_2d = loc[: B * T].view(B, T)
        commit = torch.randint(1, T + 1, (B,), generator=gen).to(device)
        kk, vv = k[: B * T], v[: B * T]
        return _Case(
            kind,
            n,
            2 * int(commit.sum()) * row,
            lambda: store.store_kv_prefix_valid(kc, vc, loc_2d, commit, kk, vv, backend="triton"),
            lambda: store.store_kv_prefix_valid(kc, vc, loc_2d, commit, kk, vv, backend="torch"),
        )
    if kind in ("store_paged", "move_paged"):
        _, ks, vs = _page_major(L, cap // ps, ps, H, D, dt, device)
        if kind == "store_paged":
            k = torch.empty(n, H, D, dtype=dt, device=device)
            v = torch.empty(n, H, D, dtype=dt, device=device)
            loc, _ = _paged_locs(n, cap, ps, gen, device)
            mid = L // 2
            return _Case(
                kind,
                n,
                2 * n * row,
                lambda: store_paged.store_kv_paged(ks[mid], vs[mid], loc, k, v, backend="triton"),
                lambda: store_paged.store_kv_paged(ks[mid], vs[mid], loc, k, v, backend="torch"),
            )
        table = kcopy.KvCopyTable(ks + vs)
        tgt, src = _paged_locs(n, cap, ps, gen, device)
        return _Case(
            kind,
            n,
            2 * L * n * row,
            lambda: table.move(tgt, src, backend="triton"),
            lambda: table.move(tgt, src, backend="torch"),
        )
    if kind in ("checksum", "checksum_paged"):
        pages = torch.randperm(cap // ps, generator=gen)[: -(-n // ps)].numpy()
        shapes = (
            [(cap // ps, ps * row)] * (2 * L)
            if kind == "checksum"
            else [(cap // ps, 2 * L * ps * row)]
        )
        # the table holds raw addresses: the case must own the buffers it points into (a
        # dropped buffer is freed at the next empty_cache(), e.g. by CUDA-graph capture)
        dev = [torch.randint(0, 256, s, dtype=torch.uint8, device=device) for s in shapes]
        host = [d.to("cpu", copy=True) for d in dev]  # the host path's copies
        lens = [d.shape[1] for d in dev]
        read = len(pages) * sum(lens)
        tasks = checksum.item_tasks(
            [d.data_ptr() for d in dev], lens, checksum.word_offsets(lens), pages
        )
        table = torch.from_numpy(tasks).to(device)
        out = torch.zeros(len(pages), dtype=torch.int32, device=device)

        def run_kernel():
            out.zero_()
            checksum.checksum_tasks(table, out, 16, host_tasks=tasks)
            return out

        def run_host():
            return checksum.item_checksums_host([h.data_ptr() for h in host], lens, pages)

        if checksum.kernel_runnable(device):  # the two paths agree before anything is timed
            got = run_kernel().cpu().numpy().view("uint32")
            if not (got == run_host()).all():
                raise RuntimeError(f"{kind}: kernel and host checksums differ")
        return _Case(kind, n, read // 2, run_kernel, run_host, moved=read, keep=(dev, host, table))
    if kind == "move":
        bufs = [torch.empty(cap, H, D, dtype=dt, device=device) for _ in range(2 * L)]
        table = kcopy.KvCopyTable(bufs)
        tgt, src = _paged_locs(n, cap, ps, gen, device)
        return _Case(
            kind,
            n,
            2 * L * n * row,
            lambda: table.move(tgt, src, backend="triton"),
            lambda: table.move(tgt, src, backend="torch"),
        )
    dn, dr = a.mla_nope, a.mla_rope
    cache = torch.empty(cap, 1, dn + dr, dtype=dt, device=device)
    loc, _ = _paged_locs(n, cap, ps, gen, device)
    mla_row = (dn + dr) * isz
    if kind == "mla_store":
        nope = torch.empty(n, 1, dn, dtype=dt, device=device)
        rope = torch.empty(n, 1, dr, dtype=dt, device=device)
        return _Case(
            kind,
            n,
            n * mla_row,
            lambda: mla.store_mla(cache, loc, nope, rope, backend="triton"),
            lambda: mla.store_mla(cache, loc, nope, rope, backend="torch"),
        )
    return _Case(
        kind,
        n,
        n * mla_row,
        lambda: mla.gather_mla(cache, loc, dn, backend="triton"),
        lambda: mla.gather_mla(cache, loc, dn, backend="torch"),
    )


def _measure(case: _Case, device, rep_ms: int, use_triton: bool) -> dict:
    on_cuda = device.type == "cuda"
    timer = _time_cuda if on_cuda else _time_cpu
    if use_triton:  # JIT-compile first: no compile gap right before any timed run
        case.triton_fn()
        torch.cuda.synchronize(device)
    src = torch.empty(case.moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = timer(functools.partial(dst.copy_, src), rep_ms)
    del src, dst
    t_triton = timer(case.triton_fn, rep_ms) if use_triton else None
    t_graph = _time_cuda_graph(case.triton_fn, rep_ms) if use_triton and on_cuda else None
    t_host = _host_time(case.triton_fn) if use_triton and on_cuda else None
    t_torch = timer(case.torch_fn, rep_ms)
    moved = case.moved
    return {
        "kernel": case.name,
        "tokens": case.tokens,
        "bytes": moved,
        "triton_s": t_triton,
        "torch_s": t_torch,
        "copy_s": t_copy,
        "graph_s": t_graph,
        "host_s": t_host,
        "triton_gbps": moved / t_triton / 1e9 if t_triton else None,
        "torch_gbps": moved / t_torch / 1e9,
        "copy_gbps": moved / t_copy / 1e9,
        "ratio": t_copy / t_triton if t_triton else None,
        "torch_ratio": t_copy / t_torch,
    }


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict]) -> str:
    out = [
        "| kernel | tokens | MB moved | Triton us | Triton GB/s | torch ref GB/s "
        "| copy_ GB/s | Triton / copy_ | graph us | host us |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def us(x):
        return _fmt(x and x * 1e6, ".1f")

    for r in rows:
        out.append(
            f"| {r['kernel']} | {r['tokens']} | {r['bytes'] / 1e6:.1f} "
            f"| {us(r['triton_s'])} "
            f"| {_fmt(r['triton_gbps'], '.0f')} | {r['torch_gbps']:.0f} | {r['copy_gbps']:.0f} "
            f"| {_fmt(r['ratio'], '.2f')} | {us(r.get('graph_s'))} | {us(r.get('host_s'))} |"
        )
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = clitools.parser("kvxfer bench kernels", __doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--tokens",
        default=None,
        help="comma-separated token counts (default: 4096,16384,65536 on CUDA, 256,1024 on CPU)",
    )
    p.add_argument("--kernels", default=",".join(KERNELS), help=f"subset of {','.join(KERNELS)}")
    p.add_argument("--layers", type=int, default=None, help="layers (default 32 CUDA, 2 CPU)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--mla-nope", type=int, default=512)
    p.add_argument("--mla-rope", type=int, default=64)
    p.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement")
    clitools.add_json_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_cuda = device.type == "cuda"
    default_tokens = "4096,16384,65536" if on_cuda else "256,1024"
    tokens = [int(t) for t in (a.tokens or default_tokens).split(",") if t]
    a.layers = a.layers or (32 if on_cuda else 2)
    kinds = [k for k in a.kernels.split(",") if k]
    unknown = sorted(set(kinds) - set(KERNELS))
    if unknown:
        print(f"unknown kernels {unknown}; choose from {KERNELS}", file=sys.stderr)
        return 2
    if on_cuda:
        where = f"{torch.cuda.get_device_name(device)}"
    else:
        where = "CPU"
    print(f"# Kernel bandwidth on {where}\n")
    print(
        f"torch {torch.__version__}; dtype {a.dtype}; {a.layers} layers x {a.heads} heads x "
        f"{a.head_dim} dim (K and V); page_size {a.page_size}; MLA {a.mla_nope}+{a.mla_rope}."
    )
    print(
        "GB/s counts bytes read + written; ratio = copy_ time / Triton time for the same "
        f"bytes (target >= {TARGET})."
    )
    if not on_cuda:
        print(
            "\n**CPU run: torch reference and copy_ only, at tiny sizes; the Triton kernels "
            "are benchmarked on a CUDA device.**"
        )
    print()
    rows = []
    with clitools.Progress(
        len(kinds) * len(tokens), "bench kernels", enabled=False if a.json else None
    ) as pr:
        for kind in kinds:
            for n in tokens:
                pr.show(f"{kind} {n} tokens")
                case = _build(kind, n, a, device)
                rows.append(_measure(case, device, a.rep_ms, use_triton=on_cuda))
                del case
                if on_cuda:
                    torch.cuda.empty_cache()
                pr.step(f"{kind} {n} tokens")
    print(_table(rows))
    if on_cuda:
        ratios = [r["ratio"] for r in rows]
        worst = min(rows, key=lambda r: r["ratio"])
        print(
            f"\nworst ratio {worst['ratio']:.2f} ({worst['kernel']}, {worst['tokens']} tokens); "
            f"median {statistics.median(ratios):.2f}; "
            f"{sum(r >= TARGET for r in ratios)}/{len(ratios)} cases >= {TARGET}"
        )
        gaps = [
            f"{r['kernel']}@{r['tokens']} ({r['triton_s'] * 1e6:.1f} vs "
            f"{r['graph_s'] * 1e6:.1f} us)"
            for r in rows
            if r["graph_s"] and r["triton_s"] > 1.25 * r["graph_s"]
        ]
        if gaps:
            print(
                "eager Triton time > 1.25x the graph-replayed time (launch-side, not kernel "
                "time): " + ", ".join(gaps)
            )
    meta = {
        "device": where,
        "torch": torch.__version__,
        "dtype": a.dtype,
        "layers": a.layers,
        "heads": a.heads,
        "head_dim": a.head_dim,
        "page_size": a.page_size,
        "target": TARGET,
    }
    clitools.emit_json(a, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
