"""The pools through the Triton kernels (the GPU path; on CPU under TRITON_INTERPRET=1) give
byte-identical buffers to the same pools through the torch reference kernels."""

import pytest
import torch
from testenv import DEVICE

from kvxfer.kernels.dispatch import force_backend
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.mla import MLATokenToKVPool
from kvxfer.pools.noop import MHATokenToKOnlyPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

pytestmark = pytest.mark.timeout(120)

SIZE, PS, H, D, DV, L = 8, 4, 2, 4, 2, 2


def make(kind, dtype):
    if kind in ("nhd", "hnd"):
        return MHATokenToKVPool(SIZE, PS, dtype, H, D, L, DEVICE, v_head_dim=DV, layout=kind)
    if kind == "page_major":
        return PageMajorMHATokenToKVPool(SIZE, PS, dtype, H, D, L, DEVICE, v_head_dim=DV)
    if kind == "mla":
        return MLATokenToKVPool(SIZE, PS, dtype, 6, 2, L, DEVICE)
    return MHATokenToKOnlyPool(SIZE, PS, dtype, H, D, L, DEVICE)


def rnd(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def workload(pool):
    """Plain, masked and prefix-valid writes, then a move of all layers."""
    dt = pool.dtype
    loc = torch.tensor([4, 5, 6, 9], device=DEVICE)
    mask = torch.tensor([True, False, True, True], device=DEVICE)
    for layer in range(L):
        if isinstance(pool, MLATokenToKVPool):
            pool.set_mla_kv_buffer(layer, loc, rnd((4, 1, 6), dt, layer), rnd((4, 1, 2), dt, 9))
            pool.set_kv_buffer(layer, loc + 1, rnd((4, 1, 8), dt, 3), None, mask=mask)
        elif isinstance(pool, MHATokenToKOnlyPool):
            pool.set_kv_buffer(layer, loc, rnd((4, H, D), dt, layer), None)
            pool.set_kv_buffer(layer, loc + 2, rnd((4, H, D), dt, 5), None, mask=mask)
        else:
            pool.set_kv_buffer(layer, loc, rnd((4, H, D), dt, layer), rnd((4, H, DV), dt, 7))
            pool.set_kv_buffer(
                layer, loc + 2, rnd((4, H, D), dt, 8), rnd((4, H, DV), dt, 6), mask=mask
            )
            pool.set_kv_buffer_prefix_valid(
                layer,
                torch.tensor([[1, 2], [3, 11]], device=DEVICE),
                torch.tensor([1, 2], dtype=torch.int32, device=DEVICE),
                rnd((4, H, D), dt, 10),
                rnd((4, H, DV), dt, 11),
            )
    pool.move_kv_cache(
        torch.tensor([0, 10, 2], device=DEVICE), torch.tensor([4, 5, 9], device=DEVICE)
    )


@pytest.mark.parametrize("kind", ["nhd", "hnd", "page_major", "mla", "k_only"])
def test_triton_and_torch_kernels_agree_through_the_pools(kind):
    dtype = (
        torch.float8_e4m3fn
        if kind == "page_major" and hasattr(torch, "float8_e4m3fn")
        else torch.bfloat16
    )
    results = {}
    for backend in ("torch", "triton"):
        pool = make(kind, dtype)
        with force_backend(backend):
            workload(pool)
        results[backend] = [v.clone() for v in pool.get_item_views()]
    for a, b in zip(results["torch"], results["triton"]):
        assert a.any() and torch.equal(a, b)
