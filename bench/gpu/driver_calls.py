"""Host cost of the CUDA driver calls kvxfer makes, per call: cuda-bindings (what
:mod:`kvxfer.kernels.cuda_driver` uses) against the same call through ctypes (what the engine
used before the one driver layer; rebuilt here for the comparison only).

    python3 bench/gpu/driver_calls.py [--device 0] [--calls 20000] [--json FILE]

``memcpy_dtod_async`` is the device lane's hot path (one call per run of a few-run write);
the copies are 256 bytes so the host side of the call is what is measured, with a stream
synchronise every 256 calls so the queue never fills. The pointer queries run once per
registration, not per write; they are listed so a regression there is visible too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kvxfer.kernels import cuda_driver  # noqa: E402

SYNC_EVERY = 256


def _ctypes_driver():
    lib = ctypes.CDLL("libcuda.so.1")
    cp = lib.cuMemcpyDtoDAsync_v2
    cp.argtypes = [ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.c_size_t, ctypes.c_void_p]
    cp.restype = ctypes.c_int
    attr = lib.cuPointerGetAttribute
    attr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong]
    attr.restype = ctypes.c_int

    def memcpy(dst, src, n, stream):
        if cp(dst, src, n, stream) != 0:
            raise RuntimeError("cuMemcpyDtoDAsync")

    def range_start(addr):  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR
        out = ctypes.c_ulonglong(0)
        return out.value if attr(ctypes.byref(out), 11, addr) == 0 else None

    return memcpy, range_start


def per_call_us(fn, calls: int, stream: torch.cuda.Stream | None = None) -> float:
    """Median over 5 rounds of the mean µs per call."""
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(calls):
            fn()
            if stream is not None and i % SYNC_EVERY == SYNC_EVERY - 1:
                stream.synchronize()
        if stream is not None:
            stream.synchronize()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(rounds)[len(rounds) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.cuda.set_device(a.device)
    src = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    stream = torch.cuda.Stream()
    h, s, d = stream.cuda_stream, src.data_ptr(), dst.data_ptr()
    old_memcpy, old_range_start = _ctypes_driver()
    new_memcpy = cuda_driver.memcpy_dtod_async
    with torch.cuda.stream(stream):
        rows = {
            "memcpy_dtod_async, cuda-bindings": per_call_us(
                lambda: new_memcpy(d, s, 256, h), a.calls, stream
            ),
            "memcpy_dtod_async, ctypes": per_call_us(
                lambda: old_memcpy(d, s, 256, h), a.calls, stream
            ),
        }
    rows.update(
        {
            "pointer attribute, cuda-bindings": per_call_us(
                lambda: cuda_driver._attr("RANGE_START_ADDR", s), a.calls
            ),
            "pointer attribute, ctypes": per_call_us(lambda: old_range_start(s), a.calls),
            "ipc_capable (3 queries), cuda-bindings": per_call_us(
                lambda: cuda_driver.ipc_capable(s), a.calls
            ),
        }
    )
    import cuda.bindings

    print(
        f"{torch.cuda.get_device_name(a.device)}, cuda-bindings {cuda.bindings.__version__}, "
        f"{a.calls} calls x 5 rounds (median)"
    )
    print("| call | µs per call |\n| --- | ---: |")
    for k, v in rows.items():
        print(f"| {k} | {v:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(a.device),
                    "cuda_bindings": cuda.bindings.__version__,
                    "calls": a.calls,
                    "us_per_call": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
