"""``kvxfer demo --pools``, the pools demo (:func:`pools_summary` stays reusable): for every KV pool kind it builds a small pool, writes K/V rows through the
kernels, moves a page of rows, copies two pages to host memory and restores them into
*different* pages, and checks every step against what was written. It then prints the
registration descriptor table (entries, registered bytes, bytes of one item = one page) -- the
numbers the transfer engine registers -- and which checks passed.
"""

from __future__ import annotations

import argparse
import sys
import time

from kvxfer.errors import UnsupportedOperation

__all__ = ["pools_main", "pools_summary"]

#: dtype names of the pools demo; torch (and the pools) load only when the pools demo runs, so
#: the default worker-pair demo's parent process stays light
_DTYPE_NAMES = ("bfloat16", "float16", "float32", "float8_e4m3fn")


def _dtype(name: str):
    import torch

    return getattr(torch, name)


class DemoCheckFailed(RuntimeError):
    """A demo self-check saw different bytes than it wrote (a bug, not a user error)."""


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _check(ok: bool, what: str) -> str:
    if not ok:
        raise DemoCheckFailed(what)
    return what


def _rows(shape, dtype, gen, device):
    import torch

    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _exercise(pool, device) -> list[str]:
    """Write / read, move, host copy -> restore into new pages. Returns the checks passed."""
    import torch

    from kvxfer.pools import MHATokenToKOnlyPool, MLATokenToKVPool

    ps, gen = pool.page_size, torch.Generator().manual_seed(0)
    first = torch.arange(ps, 3 * ps, device=device)  # pages 1-2
    moved = torch.arange(3 * ps, 4 * ps, device=device)  # page 3
    restored = torch.arange(pool.size - ps, pool.size + ps, device=device)  # last two pages
    n = first.numel()
    is_mla = isinstance(pool, MLATokenToKVPool)
    written = []
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        if is_mla:
            nope = _rows((n, 1, pool.kv_lora_rank), pool.dtype, gen, device)
            rope = _rows((n, 1, pool.qk_rope_head_dim), pool.dtype, gen, device)
            pool.set_mla_kv_buffer(layer, first, nope, rope)
            written.append(torch.cat([nope, rope], dim=-1))
        elif isinstance(pool, MHATokenToKOnlyPool):
            k = _rows((n, pool.head_num, pool.head_dim), pool.dtype, gen, device)
            pool.set_kv_buffer(layer, first, k, None)
            written.append(k)
        else:
            k = _rows((n, pool.head_num, pool.head_dim), pool.dtype, gen, device)
            v = _rows((n, pool.head_num, pool.v_head_dim), pool.dtype, gen, device)
            pool.set_kv_buffer(layer, first, k, v)
            written.append(k)
    checks = []

    def key_rows(layer_idx, loc):
        # read back through the public getter, whatever the layout
        buf = pool.get_key_buffer(pool.start_layer + layer_idx)
        if pool.layout == "nhd":
            got = buf[loc]
        elif pool.layout == "hnd":
            got = buf[loc // ps, :, loc % ps]
        else:
            got = buf[loc // ps, loc % ps]
        return got.contiguous().view(torch.uint8)

    def same(loc, src_slice=slice(None)):
        return all(
            torch.equal(key_rows(i, loc), w[src_slice].contiguous().view(torch.uint8))
            for i, w in enumerate(written)
        )

    checks.append(_check(same(first), "write/read"))
    pool.move_kv_cache(moved, first[:ps])
    checks.append(_check(same(moved, slice(0, ps)), "move"))
    copy = pool.get_cpu_copy(first)
    pool.load_cpu_copy(copy, restored)
    checks.append(_check(same(restored), f"host copy ({_human(copy.nbytes)}) -> new pages"))
    return checks


def _refuses_writes(pool, device) -> bool:
    import torch

    k = torch.zeros((1, pool.head_num, pool.head_dim), dtype=pool.dtype, device=device)
    try:
        pool.set_kv_buffer(pool.start_layer, torch.tensor([1], device=device), k, k)
    except UnsupportedOperation:
        return True
    return False


def _build(size, page_size, dtype, layers, heads, head_dim, device):
    from kvxfer.pools import (
        MHATokenToKOnlyPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
        NoOpMHATokenToKVPool,
        PageMajorMHATokenToKVPool,
    )

    common = (size, page_size, dtype)
    return [
        ("MHA per-layer", MHATokenToKVPool(*common, heads, head_dim, layers, device)),
        (
            "MHA per-layer HND",
            MHATokenToKVPool(*common, heads, head_dim, layers, device, layout="hnd"),
        ),
        ("MHA page-major", PageMajorMHATokenToKVPool(*common, heads, head_dim, layers, device)),
        ("MLA latent", MLATokenToKVPool(*common, 4 * head_dim, head_dim // 2, layers, device)),
        ("K-only", MHATokenToKOnlyPool(*common, heads, head_dim, layers, device)),
        ("no-op", NoOpMHATokenToKVPool(*common, heads, head_dim, layers, device)),
    ]


def pools_summary(
    *,
    device: str = "cpu",
    dtype=None,
    size: int = 64,
    page_size: int = 16,
    layers: int = 4,
    heads: int = 2,
    head_dim: int = 8,
) -> str:
    """Run the pools demo and return its printable summary (``dtype``: a torch dtype,
    default bfloat16). Raises :class:`DemoCheckFailed` if any check sees bytes different
    from what was written."""
    from kvxfer.pools import NoOpMHATokenToKVPool

    dtype = _dtype("bfloat16") if dtype is None else dtype
    t0 = time.perf_counter()
    lines = [
        f"KV pools  device={device}  dtype={str(dtype).replace('torch.', '')}  size={size} tokens"
        f"  page_size={page_size}  layers={layers}  heads={heads}  head_dim={head_dim}",
        "",
        f"{'pool':20s} {'layout':11s} {'entries':>7s} {'registered':>11s} {'item (page)':>11s}"
        f"  checks passed",
    ]
    for name, pool in _build(size, page_size, dtype, layers, heads, head_dim, device):
        _, lens, items = pool.get_contiguous_buf_infos()
        if isinstance(pool, NoOpMHATokenToKVPool):
            checks = [_check(_refuses_writes(pool, device), "refuses writes")]
        else:
            checks = _exercise(pool, device)
            views = pool.get_item_views()
            _check(len(views) == len(lens), "one item view per entry")
        item = ", ".join(sorted({_human(i) for i in items})) or "-"
        lines.append(
            f"{name:20s} {pool.layout:11s} {len(lens):7d} {_human(sum(lens)):>11s} "
            f"{item:>11s}  {', '.join(checks)}"
        )
    lines += [
        "",
        f"A run of contiguous pages is one RMA put per entry: {2 * layers} per run for per-layer "
        f"MHA, 1 for page-major.",
        f"all checks passed in {time.perf_counter() - t0:.2f} s",
    ]
    return "\n".join(lines)


def pools_main(argv: list[str] | None = None) -> int:
    """``kvxfer demo --pools``: print :func:`pools_summary`; 1 when a check failed."""
    parser = argparse.ArgumentParser(
        prog="kvxfer demo --pools",
        description="KV pools demo: write/move/copy checks and the registration descriptor table",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="torch device for the pools (cpu, cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=_DTYPE_NAMES)
    args = parser.parse_args(argv)
    try:
        print(pools_summary(device=args.device, dtype=_dtype(args.dtype)))
    except DemoCheckFailed as exc:
        print(f"demo check failed: {exc}", file=sys.stderr)
        return 1
    return 0
