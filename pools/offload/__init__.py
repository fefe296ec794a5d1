"""CPU offload and restore of retracted requests: a bounded host pool and the manager.

Typical use in a decode scheduler (any pool kind: per-layer MHA, page-major, MLA, hybrid)::

    mgr = OffloadManager(pool, num_host_pages=4096, num_host_slots=64)  # pinned on CUDA
    h = mgr.offload(req_pages, [req_mamba_slot])   # async on CUDA; OutOfMemory when full
    h.order_before()                                # before the freed pages are rewritten
    allocator.free_pages(req_pages)
    ...
    mgr.restore(h, new_pages, [new_slot])           # different pages/slots, same counts
    h.order_before()                                # next forward sees the restored KV
    # or: await h / h.wait() / h.done() / h.poll();  mgr.discard(h) on abort

Modules: ``runs``, ``extents`` and ``pieces`` (torch-free arithmetic), ``host_pool`` (the
bounded, page-granular host arena, device-mapped when pinned), ``copier`` (direct and staged
copy_ paths), ``fused`` (one Triton launch over every piece of a request,
:mod:`kvxfer.kernels.piece_copy`, or the pieces through ``cuMemcpyBatchAsync``), ``handle`` (state
machine), ``views`` (a pool's item views and geometry), ``manager`` (validation, path
choice, streams, events, accounting). Contract, paths and figures: docs/offload.md.
"""

from .handle import OffloadHandle, OffloadState
from .host_pool import HostBlock, HostPool
from .manager import OffloadManager, pool_geometry, pool_views

__all__ = [
    "HostBlock",
    "HostPool",
    "OffloadHandle",
    "OffloadManager",
    "OffloadState",
    "pool_geometry",
    "pool_views",
]
