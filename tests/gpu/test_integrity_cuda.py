"""CUDA-only checks of the integrity check's memory handling (skipped without CUDA): every
descriptor is checksummed where its memory lives - by the Triton kernel for device memory
(``cudaMalloc`` and VMM-backed post-capture pools), by the numpy path for host memory (pageable
or page-locked) - and the sums equal the oracle whatever the mix.

Run on the GPU machine: ``KVXFER_TEST_DEVICE=cuda python -m pytest -q tests/gpu/test_integrity_cuda.py``
(``bench/gpu/integrity.sh`` does it, with the PD tests and the benchmarks).
"""

import numpy as np
import pytest
import torch

from kvxfer.disagg.integrity import ItemSums
from kvxfer.kernels import cuda_driver
from kvxfer.kernels.checksum import checksum_items_reference
from kvxfer.kernels.errors import BackingError

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(120),
]

IDS = [5, 0, 63, 17]


def _sums(views, ids=IDS):
    """ItemSums over ``views`` (one per descriptor, items on dim 0) and where it ran each."""
    g = ItemSums(
        [v.data_ptr() for v in views],
        [v.numel() * v.element_size() for v in views],
        [v[0].numel() * v.element_size() for v in views],
    )
    return g, g.sums(np.asarray(ids))


def _random(n=4, shape=(64, 4096), seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=gen)
        for _ in range(n)
    ]


@pytest.mark.parametrize("where", ["device", "pinned", "pageable", "mixed"])
def test_each_buffer_is_summed_where_it_lives(where):
    dev = _random()
    views = {
        "device": dev,
        "pinned": [v.cpu().pin_memory() for v in dev],
        "pageable": [v.cpu() for v in dev],
        "mixed": [dev[0], dev[1].cpu().pin_memory(), dev[2], dev[3].cpu()],
    }[where]
    g, got = _sums(views)
    np.testing.assert_array_equal(got, checksum_items_reference(views, IDS))
    on_host = [not v.is_cuda for v in views]
    assert g.host.tolist() == on_host
    assert sorted(g.devices) == ([] if all(on_host) else [torch.cuda.current_device()])


@pytest.mark.parametrize("kind", ["mha", "page_major"])
def test_vmm_backed_pools_go_to_the_kernel(kind):
    from kvxfer.pools.mha import MHATokenToKVPool
    from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

    cls = MHATokenToKVPool if kind == "mha" else PageMajorMHATokenToKVPool
    try:
        pool = cls(1024, 16, torch.bfloat16, 2, 64, 1, "cuda:0", post_capture_active=True)
    except BackingError as exc:
        pytest.skip(f"no VMM backing here: {exc}")
    try:
        pool.finalize_backing(1024)
        views = pool.get_item_views()
        gen = torch.Generator(device="cuda").manual_seed(1)
        for v in views:
            v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device="cuda", generator=gen))
        assert cuda_driver.kernel_device(views[0].data_ptr()) == 0
        ids = [1, 7, 40, 63]
        g, got = _sums(views, ids)
        assert not g.host.any()  # never read by the CPU
        np.testing.assert_array_equal(got, checksum_items_reference(views, ids))
    finally:
        pool.close()


def test_a_flipped_byte_on_the_device_changes_only_its_item():
    dev = _random(2)
    _, before = _sums(dev)
    dev[1][63, 4095] ^= 1
    _, after = _sums(dev)
    assert (before != after).tolist() == [False, False, True, False]
