"""Post-capture backing on one CUDA device: what it costs and what it backs.

    python3 bench/gpu/backing_bench.py [--device 0] [--fraction 0.5] [--out DIR]

Reports the VMM handle-type probe, then for three pool shapes (per-layer buffers each in its own
range, per-layer buffers in one range, one page-major buffer) reserving 1.5x the free device
memory and finalizing ``--fraction`` of it: construction time (reserve + page 0), finalize time
(commit + zero-fill), requested vs backed bytes vs what the driver says the device lost, write
bandwidth into the pool vs an ordinary ``torch.empty`` tensor, release_beyond and close times and
the memory they give back. Writes backing.json (and prints markdown) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvxfer.pools.backing import BackedBuffers  # noqa: E402
from kvxfer.pools.backing.cuda import HANDLE_TYPE_ORDER, CudaVmmProvider  # noqa: E402
from kvxfer.pools.layout import PageMajorGeometry, per_layer_descs  # noqa: E402

GiB = 1 << 30
PS = 16


def free_bytes(dev: int) -> int:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)[0]


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def write_bw(views) -> float:
    """GB/s of fill_ over the views (best of 3, CUDA events)."""
    nbytes = sum(v.numel() * v.element_size() for v in views)
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for v in views:
            v.fill_(1)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return nbytes / best / 1e9


def probe(dev: int) -> dict:
    t = time.perf_counter()
    p = CudaVmmProvider(dev)
    info = {**p.info(), "probe_s": round(time.perf_counter() - t, 4)}
    attrs = {}
    for h in HANDLE_TYPE_ORDER:
        try:
            q = CudaVmmProvider(dev, handle_types=(h,))
        except Exception as exc:  # noqa: BLE001 - a report, not a failure
            attrs[h] = f"unavailable: {exc}"
            continue
        b = q.reserve(q.granularity)
        b.commit(0, q.granularity)
        attrs[h] = {
            a: b.pointer_attribute(f"CU_POINTER_ATTRIBUTE_{a}")
            for a in ("IS_LEGACY_CUDA_IPC_CAPABLE", "ALLOWED_HANDLE_TYPES")
        }
        b.close()
        q.close()
    info["pointer_attributes"] = attrs
    p.close()
    return info


def case(name: str, dev: int, make, fraction: float) -> dict:
    base = free_bytes(dev)
    owner, t_ctor = timed(make)
    r = {
        "case": name,
        "buffers": len(owner.descs),
        "reserved_bytes": owner.reserved_bytes,
        "ctor_s": t_ctor,
        "page0_backed_bytes": owner.backed_bytes,
        "page0_device_used": base - free_bytes(dev),
    }
    # the largest n whose spans fit ``fraction`` of the free memory
    per_token = sum(d.row_bytes / d.tokens_per_row for d in owner.descs)
    n = min(owner.reserved_num_tokens, int(base * fraction / per_token) // PS * PS)
    _, r["finalize_s"] = timed(lambda: owner.finalize(n))
    r.update(
        num_tokens=n,
        requested_bytes=owner.requested_bytes,
        backed_bytes=owner.backed_bytes,
        device_used=base - free_bytes(dev),
    )
    r["finalize_GBps"] = owner.backed_bytes / r["finalize_s"] / 1e9
    views = owner.backed_views()
    r["pool_write_GBps"] = write_bw(views)
    del views
    before = owner.backed_bytes
    freed, r["release_s"] = timed(lambda: owner.release_beyond(n // 4))
    r.update(released_bytes=freed, device_used_after_release=base - free_bytes(dev))
    assert before - freed == owner.backed_bytes
    _, r["close_s"] = timed(owner.close)
    r["device_used_after_close"] = base - free_bytes(dev)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    dev = args.device
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    report = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "probe": probe(dev),
    }
    try:
        import cuda.bindings as cb

        report["cuda_bindings"] = cb.__version__
    except Exception:  # noqa: BLE001
        report["cuda_bindings"] = "?"

    L, H, D = args.layers, 8, 128  # bf16 rows of 2 KiB, 2L buffers
    free = free_bytes(dev)
    rows = int(1.5 * free / (2 * L * H * D * 2)) // PS * PS + PS
    descs = per_layer_descs("k", L, (rows, H, D), 2, 1) + per_layer_descs(
        "v", L, (rows, H, D), 2, 1
    )
    kw = dict(
        store_dtype=torch.bfloat16,
        device=f"cuda:{dev}",
        page_size=PS,
        reserved_num_tokens=rows - PS,
    )
    geo = PageMajorGeometry.for_pool(
        size=rows - PS, page_size=PS, layer_num=L, head_num=H, head_dim=D, v_head_dim=D, itemsize=2
    )
    cases = [
        ("per-layer, range per buffer", lambda: BackedBuffers(descs, **kw)),
        ("per-layer, one range", lambda: BackedBuffers(descs, one_range=True, **kw)),
        (
            "page-major, one buffer",
            lambda: BackedBuffers([geo.buffer_desc()], **{**kw, "store_dtype": torch.uint8}),
        ),
    ]
    report["cases"] = [case(name, dev, make, args.fraction) for name, make in cases]

    plain = torch.empty(4 * GiB, dtype=torch.uint8, device=dev)
    report["plain_write_GBps"] = write_bw([plain])
    del plain

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "backing.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    p = report["probe"]
    print(
        f"device {report['device']}, torch {report['torch']} (CUDA {report['cuda']}), "
        f"cuda-bindings {report['cuda_bindings']}"
    )
    print(
        f"handle type chosen: **{p['handle_type']}** (probe: "
        + ", ".join(f"{h}: {r}" for h, r in p["handle_probe"])
        + f"); granularity {p['granularity']}; GPUDirect RDMA on VMM {p['gpu_direct_rdma']}"
    )
    print(f"pointer attributes per handle type: {p['pointer_attributes']}")
    print(f"ordinary torch.empty write: {report['plain_write_GBps']:.0f} GB/s\n")
    cols = [
        ("case", "{}"),
        ("buffers", "{}"),
        ("reserved GiB", "{:.1f}"),
        ("ctor s", "{:.3f}"),
        ("page0 MiB", "{:.0f}"),
        ("tokens", "{}"),
        ("requested GiB", "{:.3f}"),
        ("backed GiB", "{:.3f}"),
        ("device used GiB", "{:.3f}"),
        ("finalize s", "{:.3f}"),
        ("finalize GB/s", "{:.0f}"),
        ("write GB/s", "{:.0f}"),
        ("release s", "{:.3f}"),
        ("released GiB", "{:.3f}"),
        ("close s", "{:.3f}"),
        ("left after close MiB", "{:.1f}"),
    ]
    print("| " + " | ".join(c for c, _ in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in report["cases"]:
        vals = [
            r["case"],
            r["buffers"],
            r["reserved_bytes"] / GiB,
            r["ctor_s"],
            r["page0_backed_bytes"] / 2**20,
            r["num_tokens"],
            r["requested_bytes"] / GiB,
            r["backed_bytes"] / GiB,
            r["device_used"] / GiB,
            r["finalize_s"],
            r["finalize_GBps"],
            r["pool_write_GBps"],
            r["release_s"],
            r["released_bytes"] / GiB,
            r["close_s"],
            r["device_used_after_close"] / 2**20,
        ]
        print("| " + " | ".join(f.format(v) for (_, f), v in zip(cols, vals)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
