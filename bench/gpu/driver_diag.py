"""Pointer queries of the old (ctypes, ``kvxfer.transport.cuda_driver``) and the new
(cuda-bindings, ``kvxfer.kernels.cuda_driver``) driver layer on one CUDA tensor, with their
host cost: ``PYTHONPATH=<tree> python3 bench/gpu/driver_diag.py old|new`` (see
bench/results/structure-ab/README.md: both layers must answer the same for the engine's
registrations to be the same)."""

import sys
import time

import torch

which = sys.argv[1]
if which == "old":
    from kvxfer.transport import cuda_driver as cd
else:
    from kvxfer.kernels import cuda_driver as cd

t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
p = t[1 << 20 :].data_ptr()
print(which, "allocation base", hex(t.data_ptr()), "query at", hex(p))
for name in ("alloc_range", "ipc_capable", "device_ordinal", "memory_type", "device_pointer"):
    f = getattr(cd, name, None)
    if f is None:
        print(which, name, "absent")
        continue
    try:
        t0 = time.perf_counter()
        r = f(p)
        dt = (time.perf_counter() - t0) * 1e6
    except Exception as e:  # noqa: BLE001
        print(which, name, "raised", repr(e)[:200])
        continue
    shown = tuple(hex(x) if isinstance(x, int) else x for x in r) if isinstance(r, tuple) else r
    print(which, name, shown, f"{dt:.1f} µs")
