"""Probe: how the driver reports CUDA VMM extents (pointer range attributes, cuMemGetAddressRange,
retained handles) and whether UCX registers such memory. Diagnostics for the VMM device lane."""

import torch

from kvxfer.kernels import cuda_driver
from kvxfer.pools.backing.cuda import CudaVmmProvider

torch.zeros(1, device="cuda:0")
cu = cuda_driver.driver()
p = CudaVmmProvider(0, handle_types=("posix_fd",))
g = p.granularity
b = p.reserve(64 * g, max_extent_bytes=4 * g)
b.commit(0, 10 * g)  # extents of 4, 4, 2 granules
b.commit(20 * g, 3 * g)
print("granularity", g, "base", hex(b.address), "extents", b.extents)
for off in (0, g, 4 * g - 1, 4 * g, 9 * g, 20 * g, 22 * g):
    a = b.address + off
    rng = cuda_driver.alloc_range(a)
    with p.current():
        r2 = cu.cuMemGetAddressRange(a)
        h = cu.cuMemRetainAllocationHandle(a)
        hv = int(h[1]) if h[0] == cuda_driver._OK else None
        if hv is not None:
            pr = cu.cuMemGetAllocationPropertiesFromHandle(h[1])
            ht = pr[1].requestedHandleTypes if pr[0] == cuda_driver._OK else pr[0]
            gr = cu.cuMemGetAllocationGranularity(
                pr[1], cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            )
            cu.cuMemRelease(h[1])
        else:
            ht = gr = None
    rel = None if rng is None else (hex(rng[0] - b.address), rng[1])
    r2s = (r2[0], hex(int(r2[1]) - b.address), int(r2[2])) if r2[0] == cuda_driver._OK else r2[0]
    print(
        f"off {off:#x}: attr range {rel} getAddressRange {r2s} handle {hv} types {ht} gran {gr}",
        "ipc_capable",
        cuda_driver.ipc_capable(a),
        "ordinal",
        cuda_driver.device_ordinal(a),
    )
a = b.address + 30 * g
print("unbacked:", cuda_driver.alloc_range(a))
