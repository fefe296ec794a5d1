"""Shared helpers for the offload tests: small real pools of every kind, byte snapshots."""

from __future__ import annotations

import torch
from testenv import DEVICE

PAGE_SIZE = 4
KV_KINDS = ("mha", "mha_hnd", "page_major", "mla")
STATE_KINDS = ("mamba_per_layer", "mamba_envelope", "hybrid_per_layer", "hybrid_envelope")
ALL_KINDS = KV_KINDS + STATE_KINDS


def mamba_pool(num_slots: int, layout: str, device: str = DEVICE, layer_ids=(0, 2)):
    from kvxfer.pools.mamba import MambaPool
    from kvxfer.pools.mamba_spec import MambaStateSpec

    spec = MambaStateSpec(
        conv_shapes=((8, 3), (4, 3)),
        temporal_shape=(2, 4, 4),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
        layer_ids=tuple(layer_ids),
    )
    return MambaPool(num_slots - 1, spec, device, layout=layout)


def make_pool(
    kind: str,
    num_pages: int = 24,
    num_slots: int = 8,
    device: str = DEVICE,
    *,
    head_dim: int = 8,
    layers: int = 2,
):
    """A real pool whose item views have ``num_pages`` rows (state: ``num_slots`` rows)."""
    size = (num_pages - 1) * PAGE_SIZE
    dt = torch.bfloat16
    if kind in ("mha", "mha_hnd"):
        from kvxfer.pools.mha import MHATokenToKVPool

        return MHATokenToKVPool(
            size,
            PAGE_SIZE,
            dt,
            2,
            head_dim,
            layers,
            device,
            layout="hnd" if kind == "mha_hnd" else "nhd",
        )
    if kind == "page_major":
        from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

        return PageMajorMHATokenToKVPool(size, PAGE_SIZE, dt, 2, head_dim, layers, device)
    if kind == "mla":
        from kvxfer.pools.mla import MLATokenToKVPool

        return MLATokenToKVPool(size, PAGE_SIZE, dt, 16, 8, layers, device)
    if kind.startswith("mamba_"):
        return mamba_pool(num_slots, kind.split("_", 1)[1], device)
    if kind.startswith("hybrid_"):
        from kvxfer.pools.hybrid import HybridLinearKVPool
        from kvxfer.pools.mha import MHATokenToKVPool

        kv = MHATokenToKVPool(size, PAGE_SIZE, dt, 2, head_dim, 1, device)
        mp = mamba_pool(num_slots, kind.split("_", 1)[1], device, layer_ids=(0, 2))
        return HybridLinearKVPool(kv, mp, [1])
    raise ValueError(kind)


def views(pool):
    from kvxfer.pools.offload import pool_views

    kv, st = pool_views(pool)
    return kv + st, len(kv)


def randomize(pool, gen: torch.Generator) -> None:
    """Fill every registered byte with random values (through the item views)."""
    for v in views(pool)[0]:
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=gen))


def snapshot(pool) -> list[torch.Tensor]:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return [v.detach().cpu().clone() for v in views(pool)[0]]


def expected_after_restore(before, orig, nkv, src, dst, ssrc=(), sdst=()):
    """``before`` with rows ``dst`` (``sdst`` in state views) replaced by ``orig``'s rows
    ``src`` (``ssrc``)."""
    out = [t.clone() for t in before]
    for i, t in enumerate(out):
        s, d = (src, dst) if i < nkv else (ssrc, sdst)
        if len(s):
            t[torch.as_tensor(list(d))] = orig[i][torch.as_tensor(list(s))]
    return out


def assert_same(a, b, what=""):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            rows = (x != y).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"{what}: view {i} differs in rows {rows[:10]}")


def clobber_rows(pool, nkv, pages, slots, gen):
    for i, v in enumerate(views(pool)[0]):
        ids = pages if i < nkv else slots
        if len(ids):
            idx = torch.as_tensor(list(ids), device=v.device)
            v[idx] = torch.randint(
                0, 256, (len(ids), v.shape[1]), dtype=torch.uint8, generator=gen
            ).to(v.device)


def is_page_locked(t: torch.Tensor) -> bool:
    """Whether the driver sees ``t``'s memory as page-locked host memory.

    ``Tensor.is_pinned()`` only recognises memory from torch's own pinned allocator on some
    releases; memory page-locked with ``cudaHostRegister`` is asked about through the runtime."""
    if t.is_pinned():
        return True
    from kvxfer.kernels import cuda_driver

    return cuda_driver.memory_type(t.data_ptr()) == cuda_driver.MEMORYTYPE_HOST
