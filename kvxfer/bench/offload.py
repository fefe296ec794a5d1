"""``kvxfer bench offload``: offload / restore bandwidth of retracted requests.

For every (layout, request size, page pattern) it times, in the same run and interleaved:

* **offload**: ``manager.offload(pages).wait()`` -- device pages -> host pool;
* **restore**: ``manager.restore(handle, other_pages).wait()`` -- host pool -> other pages;
* **baseline**: one ``copy_`` of the same number of bytes between one contiguous device
  buffer and one pinned host buffer (each direction). On a CPU-only run the "device" is the
  CPU and the baseline is memcpy (``copy_`` of one contiguous buffer).

The ``path`` column says how the manager moved the request (offload / restore):
``fused`` (one Triton launch over every piece, straight into the mapped host pool),
``batch`` (the pieces through ``cuMemcpyBatchAsync``, CUDA, pieces averaging at least
``--batch-min-piece-kib``; ``--batch-first N`` pieces in its first call), ``direct`` (one
``copy_`` per piece) or ``staged`` (through the device staging buffer); ``chunks`` counts the
pieces (fused, batch) or bus copies.
``--fused on|off`` forces the choice.

Each figure is the median over ``--repeat`` timed repetitions (after one warm-up), wall time
from submission to completion (Python submission overhead included, as the caller pays it),
reported as GB/s (1e9 bytes/s) and as a ratio to the baseline (the median of the per-round
ratios). Output: a markdown report on
stdout and, with ``--out``, in a file.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time

import numpy as np
import torch

from kvxfer import clitools

LAYOUTS = ("mha", "mha_hnd", "page_major", "mla", "hybrid")
PATTERNS = ("contig", "runs4", "scatter")


def make_pool(
    layout: str,
    num_pages: int,
    *,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    mamba_slots: int = 0,
):
    """A real pool with ``num_pages`` item rows (page 0 = padding page included)."""
    size = (num_pages - 1) * page_size
    if layout in ("mha", "mha_hnd"):
        from kvxfer.pools.mha import MHATokenToKVPool

        return MHATokenToKVPool(
            size,
            page_size,
            dtype,
            heads,
            head_dim,
            layers,
            device,
            layout="hnd" if layout == "mha_hnd" else "nhd",
        )
    if layout == "page_major":
        from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

        return PageMajorMHATokenToKVPool(size, page_size, dtype, heads, head_dim, layers, device)
    if layout == "mla":
        from kvxfer.pools.mla import MLATokenToKVPool

        return MLATokenToKVPool(size, page_size, dtype, 512, 64, layers, device)
    if layout == "hybrid":
        return make_hybrid_pool(
            size,
            page_size=page_size,
            layers=layers,
            heads=heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            mamba_slots=max(mamba_slots, 4),
        )
    raise SystemExit(f"unknown layout {layout!r}; choose from {LAYOUTS}")


def make_hybrid_pool(
    size: int,
    *,
    page_size: int,
    layers: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    mamba_slots: int,
    mamba_layout: str = "per_layer",
):
    """Hybrid pool: full attention on every 4th layer, Mamba state on the others."""
    from kvxfer.pools.hybrid import HybridLinearKVPool
    from kvxfer.pools.mamba import MambaPool
    from kvxfer.pools.mamba_spec import MambaStateSpec
    from kvxfer.pools.mha import MHATokenToKVPool

    attn = [i for i in range(layers) if i % 4 == 3] or [layers - 1]
    mamba = [i for i in range(layers) if i not in attn]
    kv = MHATokenToKVPool(size, page_size, dtype, heads, head_dim, len(attn), device)
    spec = MambaStateSpec(
        conv_shapes=((4 * head_dim, 3),),
        temporal_shape=(heads, head_dim, 16),
        conv_dtype=dtype,
        temporal_dtype=torch.float32,
        layer_ids=tuple(mamba),
    )
    mp = MambaPool(mamba_slots, spec, device, layout=mamba_layout)
    return HybridLinearKVPool(kv, mp, attn)


def page_pattern(pattern: str, n: int, base: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` distinct page ids inside ``[base, base + 2n + 8)`` laid out per ``pattern``."""
    if pattern == "contig":
        return np.arange(base, base + n)
    if pattern == "scatter":  # every page its own run
        return base + 2 * rng.permutation(n)
    if pattern == "runs4":  # runs of 4 pages separated by gaps, in shuffled order
        k = -(-n // 4)
        starts = base + 8 * rng.permutation(k)
        return (starts[:, None] + np.arange(4)).reshape(-1)[:n]
    raise SystemExit(f"unknown pattern {pattern!r}; choose from {PATTERNS}")


def _time(fn, sync) -> float:
    """Wall seconds of ``fn()`` from an idle device to completion."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bench_one(layout, pages, pattern, args, device) -> dict:
    from kvxfer.pools.offload import OffloadManager, pool_views

    rng = np.random.default_rng(0)
    # source pages in [1, 1 + side), targets in [1 + side, 1 + 2 side): disjoint
    side = 2 * pages + 8  # room for every pattern's spread
    pool = make_pool(
        layout,
        2 * side + 1,
        page_size=args.page_size,
        layers=args.layers,
        heads=args.heads,
        head_dim=args.head_dim,
        dtype=args.torch_dtype,
        device=device,
        mamba_slots=4,
    )
    has_state = bool(pool_views(pool)[1])
    src = page_pattern(pattern, pages, 1, rng)
    dst = page_pattern(pattern, pages, 1 + side, rng)
    slots_src, slots_dst = ([1], [2]) if has_state else ([], [])
    extra = {} if args.staging_mib is None else {"staging_bytes": int(args.staging_mib * 2**20)}
    extra["fused"] = {"auto": None, "on": True, "off": False}[args.fused]
    if args.batch_min_piece_kib is not None:
        extra["batch_min_piece_bytes"] = int(args.batch_min_piece_kib) << 10
    if args.batch_first is not None:
        extra["batch_first_pieces"] = int(args.batch_first)
    mgr = OffloadManager(pool, num_host_pages=pages, num_host_slots=len(slots_src), **extra)
    for v in pool.get_item_views() + (pool.get_state_item_views() if has_state else []):
        v.random_(0, 256)  # real bytes everywhere (untouched memory would read as zero pages)
    nbytes = pages * mgr.host.page_bytes + len(slots_src) * mgr.host.slot_bytes

    cuda = device.startswith("cuda")
    dev_buf = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda).fill_(7)  # resident
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def offload():
        mgr.offload(src, slots_src).wait().discard()

    restore_path = []

    def restore():
        h = mgr.offload(src, slots_src).wait()
        t0 = time.perf_counter()
        mgr.restore(h, dst, slots_dst).wait()
        dt = time.perf_counter() - t0
        restore_path[:] = [h.path]
        return dt

    t_off, t_d2h, t_res, t_h2d = [], [], [], []
    for _ in range(args.repeat + 1):  # the first round is a warm-up
        t_d2h.append(_time(functools.partial(host_buf.copy_, dev_buf, non_blocking=cuda), sync))
        t_off.append(_time(offload, sync))
        t_h2d.append(_time(functools.partial(dev_buf.copy_, host_buf, non_blocking=cuda), sync))
        sync()
        t_res.append(restore())
    h = mgr.offload(src, slots_src).wait()
    chunks, path = h.num_chunks, f"{h.path} / {restore_path[0]}"
    h.discard()
    assert mgr.host.is_empty
    mgr.close()
    med = lambda xs: statistics.median(xs[1:])  # noqa: E731
    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    r = dict(
        layout=layout,
        pages=pages,
        pattern=pattern,
        mib=nbytes / 2**20,
        chunks=chunks,
        path=path,
        off=gbs(med(t_off)),
        d2h=gbs(med(t_d2h)),
        res=gbs(med(t_res)),
        h2d=gbs(med(t_h2d)),
    )
    # ratios: median of per-round ratios (each round times both back to back, so a noisy
    # neighbour slows both sides of the same ratio)
    r["off_ratio"] = statistics.median(b / t for b, t in zip(t_d2h[1:], t_off[1:]))
    r["res_ratio"] = statistics.median(b / t for b, t in zip(t_h2d[1:], t_res[1:]))
    del pool, dev_buf, host_buf
    return r


def _parse(argv):
    p = clitools.parser("kvxfer bench offload", __doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--pages", default=None, help="request sizes in pages, comma separated")
    p.add_argument("--patterns", default="contig,runs4", help=f"any of {PATTERNS}")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument(
        "--staging-mib",
        type=float,
        default=None,
        help="offload staging buffer per direction (default: the manager's)",
    )
    p.add_argument(
        "--fused",
        default="auto",
        choices=("auto", "on", "off"),
        help="the one-launch fused path: the manager's choice, always, never",
    )
    p.add_argument(
        "--batch-min-piece-kib",
        type=int,
        default=None,
        help="OffloadManager(batch_min_piece_bytes=) in KiB; 0: never the batch copy "
        "(default: the manager's)",
    )
    p.add_argument(
        "--batch-first",
        type=int,
        default=None,
        help="OffloadManager(batch_first_pieces=): pieces in the batch copy's first driver "
        "call; 0: one call (default: the manager's)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (CPU copies); default: torch's own choice",
    )
    p.add_argument("--out", default=None, help="also write the markdown report here")
    clitools.add_json_args(p)
    a = p.parse_args(argv)
    if a.device is None:
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = a.device.startswith("cuda")
    a.layers = a.layers or (32 if cuda else 8)
    a.repeat = a.repeat or (10 if cuda else 5)
    a.pages = [int(x) for x in (a.pages or ("8,32,128,512" if cuda else "4,16,64")).split(",")]
    a.torch_dtype = getattr(torch, a.dtype)
    return a


def main(argv=None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.threads:
        torch.set_num_threads(args.threads)
    base = "pinned copy_" if args.device.startswith("cuda") else "memcpy (copy_)"
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# kvxfer bench offload",
        "",
        f"device: {args.device} ({name}, {os.cpu_count()} CPUs, load average {load:.1f} at "
        f"start), torch {torch.__version__}; model: {args.layers} layers, "
        f"{args.heads} kv heads x {args.head_dim}, {args.dtype}, page_size {args.page_size}; "
        f"median of {args.repeat}; fused path: {args.fused}; torch threads {torch.get_num_threads()}; GB/s = 1e9 B/s; "
        f"baseline = one {base} of the same bytes.",
        "",
        "| layout | pages | pattern | MiB | path | chunks | offload GB/s | D2H base | ratio "
        "| restore GB/s | H2D base | ratio |",
        "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    layouts, patterns = args.layouts.split(","), args.patterns.split(",")
    progress = clitools.Progress(
        len(layouts) * len(patterns) * len(args.pages),
        "bench offload",
        enabled=False if args.json else None,
    )
    for layout in layouts:
        for pattern in patterns:
            for pages in args.pages:
                progress.show(f"{layout} {pattern} {pages} pages")
                try:
                    r = bench_one(layout, pages, pattern, args, args.device)
                except ImportError as exc:  # a pool kind this checkout does not have
                    print(f"| {layout} | skipped: {exc} |", flush=True)
                    break
                rows.append(r)
                line = (
                    f"| {layout} | {pages} | {pattern} | {r['mib']:.1f} | {r['path']} | "
                    f"{r['chunks']} | "
                    f"{r['off']:.2f} | {r['d2h']:.2f} | {r['off_ratio']:.2f} | "
                    f"{r['res']:.2f} | {r['h2d']:.2f} | {r['res_ratio']:.2f} |"
                )
                lines.append(line)
                progress.step(f"{layout} {pattern} {pages} pages")
                print(line, flush=True)
    if rows:
        big = [r for r in rows if r["pattern"] == "contig" and r["pages"] == max(args.pages)]
        tail = [
            "",
            "Largest contiguous request per layout (ratio offload / restore): "
            + ", ".join(f"{r['layout']} {r['off_ratio']:.2f} / {r['res_ratio']:.2f}" for r in big),
        ]
        lines += tail
        print("\n".join(tail))
    progress.close()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    clitools.emit_json(
        args, {"args": {k: v for k, v in vars(args).items() if k != "torch_dtype"}, "rows": rows}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
