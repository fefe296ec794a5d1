"""store_rows_multi: one launch over up to four (cache, source) pairs vs the torch reference
and vs store_kv applied pair by pair."""

import pytest
import torch
from _kernels_testlib import DEVICE, ON_CUDA, distinct, gen, rand, raw

from kvxfer.kernels import store, store_multi
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

pytestmark = pytest.mark.timeout(60)

# (trailing shape, dtype) per buffer: main K/V bf16 [2, 8], index K/V fp32 / fp8 [1, 3]
LAYOUTS = {
    "3buf": [((2, 8), torch.bfloat16), ((2, 8), torch.bfloat16), ((1, 3), torch.float32)],
    "4buf": [
        ((2, 8), torch.bfloat16),
        ((2, 6), torch.bfloat16),
        ((1, 3), torch.uint8),
        ((1, 5), torch.uint8),
    ],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_matches_reference_and_per_pair_stores(name):
    g = gen(len(name))
    rows, n = 30, 11
    spec = LAYOUTS[name]
    caches = [rand((rows, *t), d, g) for t, d in spec]
    sources = [rand((n, *t), d, g) for t, d in spec]
    loc = distinct(n, rows, g, torch.int32)
    ref = [c.clone() for c in caches]
    per_pair = [c.clone() for c in caches]
    store_multi.store_rows_multi(caches, loc, sources, backend="triton")
    store_multi.store_rows_multi(ref, loc, sources, backend="torch")
    for c, s in zip(per_pair, sources):
        store.store_kv(c, None, loc, s, None, backend="torch")
    for a, b, c in zip(caches, ref, per_pair):
        assert torch.equal(raw(a), raw(b)) and torch.equal(raw(a), raw(c))


def test_bounds_and_arguments():
    g = gen(3)
    caches = [rand((8, 1, 4), torch.float16, g), rand((8, 1, 2), torch.float16, g)]
    before = [c.clone() for c in caches]
    src = [rand((2, 1, 4), torch.float16, g), rand((2, 1, 2), torch.float16, g)]
    for backend in ["torch"] if ON_CUDA else ["torch", "triton"]:
        with pytest.raises(IndexOutOfRange, match="8"):
            store_multi.store_rows_multi(
                caches, torch.tensor([0, 8], device=DEVICE), src, backend=backend
            )
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(caches, before))
    with pytest.raises(ShapeMismatch):
        store_multi.store_rows_multi(caches, torch.tensor([0, 1], device=DEVICE), src[::-1])
    with pytest.raises(InvalidArgument):
        store_multi.store_rows_multi(caches * 3, torch.tensor([0, 1], device=DEVICE), src * 3)
    with pytest.raises(ShapeMismatch, match="rows"):
        store_multi.store_rows_multi(
            [caches[0], caches[1][:4]], torch.tensor([0], device=DEVICE), [s[:1] for s in src]
        )
    store_multi.store_rows_multi(
        caches,
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
        [s[:0] for s in src],
        backend="triton",
    )
