"""Probe: how the driver reports CUDA VMM extents (pointer range attributes,
cuMemGetAddressRange, retained handles) for the pools' VMM backing, and whether torch's
expandable segments are VMM memory the device lane can map (``cuda_driver.vmm_extents``).
Diagnostics for kvxfer.engine.vmm_share (bench/results/vmm-lane-h200.md).

    python3 bench/gpu/vmm_probe.py            # the pools' backing
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/gpu/vmm_probe.py --torch
"""

import sys

import torch

from kvxfer.kernels import cuda_driver


def backing() -> None:
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
        rel = None if rng is None else (hex(rng[0] - b.address), rng[1])
        r2s = (hex(int(r2[1]) - b.address), int(r2[2])) if r2[0] == cuda_driver._OK else r2[0]
        print(f"off {off:#x}: pointer range attrs {rel}, cuMemGetAddressRange {r2s}")
    found = cuda_driver.vmm_extents(b.address, 10 * g)
    print(
        "vmm_extents(first 10 granules):",
        found and [(hex(x - b.address), n) for x, n in found[0]],
        found and found[1],
    )
    print("vmm_extents(across the hole):", cuda_driver.vmm_extents(b.address, 21 * g))


def expandable() -> None:
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
    a = x.data_ptr()
    print("PYTORCH_CUDA_ALLOC_CONF expandable segments: tensor at", hex(a))
    print("  legacy-IPC capable:", cuda_driver.ipc_capable(a))
    found = cuda_driver.vmm_extents(a, x.numel())
    print(
        "  vmm_extents:",
        None if found is None else (len(found[0]), "extents, granularity", found[1]),
    )
    if found is None:
        cu = cuda_driver.driver()
        with cuda_driver.device_context(0):
            err, h = cu.cuMemRetainAllocationHandle(a)
            if err == cuda_driver._OK:
                err2, prop = cu.cuMemGetAllocationPropertiesFromHandle(h)
                print(
                    "  requested handle types:",
                    prop.requestedHandleTypes if err2 == cuda_driver._OK else err2,
                )
                cu.cuMemRelease(h)
            else:
                print("  cuMemRetainAllocationHandle:", err)


if __name__ == "__main__":
    expandable() if "--torch" in sys.argv else backing()
