"""Torch-free arithmetic of the offload path: run merging and the host extent allocator."""

import random

import numpy as np
import pytest

from kvxfer.kernels.errors import DoubleFree, IndexOutOfRange, InvalidArgument, OutOfMemory
from kvxfer.pools.offload.extents import ExtentAllocator
from kvxfer.pools.offload.runs import (
    as_id_array,
    check_ids,
    contiguous_runs,
    expand_extents,
    pair_runs,
)

pytestmark = pytest.mark.timeout(60)


def _expand_runs(runs):
    src = [s + i for s, _, n in runs.tolist() for i in range(n)]
    dst = [d + i for _, d, n in runs.tolist() for i in range(n)]
    return src, dst


@pytest.mark.parametrize("seed", range(30))
def test_contiguous_runs_reproduce_pairing_and_are_maximal(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 40))
    # build inputs with deliberate runs: concatenation of short ascending stretches
    src, dst = [], []
    while len(src) < n:
        k = int(rng.integers(1, 6))
        s0, d0 = int(rng.integers(0, 100)), int(rng.integers(0, 100))
        src += list(range(s0, s0 + k))
        dst += list(range(d0, d0 + k))
    src, dst = np.array(src[:n], dtype=np.int64), np.array(dst[:n], dtype=np.int64)
    runs = contiguous_runs(src, dst)
    assert runs.shape[1] == 3 and (runs[:, 2] >= 1).all() and runs[:, 2].sum() == n
    s, d = _expand_runs(runs)
    assert s == src.tolist() and d == dst.tolist()
    # maximal: two neighbouring runs could not have been merged
    for a, b in zip(runs[:-1].tolist(), runs[1:].tolist()):
        assert not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1])


def test_contiguous_runs_examples():
    assert contiguous_runs(np.array([3, 4, 5]), np.array([0, 1, 2])).tolist() == [[3, 0, 3]]
    # device contiguous but host split -> split
    runs = contiguous_runs(np.array([3, 4, 5]), np.array([0, 1, 7]))
    assert runs.tolist() == [[3, 0, 2], [5, 7, 1]]
    # descending is never a run
    assert contiguous_runs(np.array([5, 4]), np.array([0, 1])).tolist() == [[5, 0, 1], [4, 1, 1]]
    assert contiguous_runs(np.zeros(0), np.zeros(0)).shape == (0, 3)
    with pytest.raises(InvalidArgument):
        contiguous_runs(np.array([1, 2]), np.array([1]))


def test_expand_extents():
    assert expand_extents([(5, 2), (0, 1), (9, 3)]).tolist() == [5, 6, 0, 9, 10, 11]
    assert expand_extents([]).tolist() == []


def test_id_arrays_and_checks():
    import torch

    assert as_id_array(torch.tensor([1, 2], dtype=torch.int32), "p").dtype == np.int64
    assert as_id_array([], "p").size == 0
    with pytest.raises(InvalidArgument, match="integers"):
        as_id_array([1.5], "p")
    with pytest.raises(InvalidArgument, match="integers"):
        as_id_array(torch.tensor([1.0]), "p")
    with pytest.raises(InvalidArgument, match="1-D"):
        as_id_array([[1, 2]], "p")
    with pytest.raises(IndexOutOfRange, match=r"pages\[1\] = 9"):
        check_ids(np.array([1, 9]), 1, 9, "pages")
    with pytest.raises(IndexOutOfRange, match="= 0"):
        check_ids(np.array([0]), 1, 9, "pages")
    with pytest.raises(InvalidArgument, match="repeats id 3"):
        check_ids(np.array([3, 4, 3]), 1, 9, "pages")


def test_check_ids_against_an_oracle():
    """Every id list of length <= 4 over [0, 6) (bounds [1, 5)): accepted exactly when all
    ids lie in bounds and none repeats; the error names the first offender of its kind."""
    import itertools

    for n in range(5):
        for ids in itertools.product(range(6), repeat=n):
            arr = np.array(ids, dtype=np.int64)
            out = [i for i, x in enumerate(ids) if not 1 <= x < 5]
            rep = sorted(x for x in set(ids) if ids.count(x) > 1)
            if out:
                with pytest.raises(IndexOutOfRange, match=rf"p\[{out[0]}\] = {ids[out[0]]} "):
                    check_ids(arr, 1, 5, "p")
            elif rep:
                with pytest.raises(InvalidArgument, match=f"repeats id {rep[0]}$"):
                    check_ids(arr, 1, 5, "p")
            else:
                check_ids(arr, 1, 5, "p")


def test_pair_runs_is_contiguous_runs_of_the_expanded_extents():
    """Every unique id list of length <= 4 over [0, 7), against every split of its host ids
    into one or two extents: pair_runs (with check_ids' answer) equals the general path."""
    import itertools

    for n in range(5):
        for ids in itertools.permutations(range(7), n):
            arr = np.array(ids, dtype=np.int64)
            up = check_ids(arr, 0, 7, "p")
            assert up == (list(ids) == sorted(ids))
            for ext in [[(3, n)]] + [[(9, k), (2, n - k)] for k in range(1, n)]:
                got = pair_runs(arr, ext, up)
                want = contiguous_runs(arr, expand_extents(ext))
                assert got.dtype == np.int64 and got.shape[1:] == (3,)
                np.testing.assert_array_equal(got, want.reshape(-1, 3))


def test_extent_allocator_prefers_one_extent_best_fit():
    a = ExtentAllocator(20)
    x = a.alloc(5)  # [0,5)
    y = a.alloc(3)  # [5,8)
    a.alloc(4)  # [8,12)
    a.free(x)  # free: [0,5) and [12,20)
    assert a.alloc(4) == [(0, 4)]  # best fit: the 5-extent, not the 8-extent
    assert a.alloc(7) == [(12, 7)]
    a.free(y)
    a.check_invariants()
    # free now: [4,5) [5,8) coalesced -> [4,8), [19,20): 5 ids in two extents
    assert a.free_extents() == [(4, 4), (19, 1)]
    got = a.alloc(5)
    assert sorted(got) == [(4, 4), (19, 1)] and a.free_count == 0
    with pytest.raises(OutOfMemory, match="0 free"):
        a.alloc(1)


def test_extent_allocator_errors_take_nothing():
    a = ExtentAllocator(8)
    x = a.alloc(3)
    with pytest.raises(OutOfMemory):
        a.alloc(6)
    assert a.free_count == 5
    a.free(x)
    with pytest.raises(DoubleFree):
        a.free(x)
    with pytest.raises(DoubleFree):
        a.free([(0, 1), (0, 1)])
    with pytest.raises(InvalidArgument):
        a.free([(7, 3)])
    with pytest.raises(InvalidArgument):
        a.alloc(-1)
    assert a.free_count == 8
    a.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_extent_allocator_random_against_set_model(seed):
    rng = random.Random(seed)
    a = ExtentAllocator(64)
    live = []
    used = set()
    for _ in range(400):
        if live and rng.random() < 0.45:
            ext = live.pop(rng.randrange(len(live)))
            a.free(ext)
            for s, n in ext:
                used -= set(range(s, s + n))
        else:
            n = rng.randint(1, 12)
            if n > 64 - len(used):
                with pytest.raises(OutOfMemory):
                    a.alloc(n)
                continue
            ext = a.alloc(n)
            ids = {i for s, k in ext for i in range(s, s + k)}
            assert len(ids) == n and not (ids & used) and max(ids) < 64
            used |= ids
            live.append(ext)
        a.check_invariants()
        assert a.used_count == len(used)
    for ext in live:
        a.free(ext)
    assert a.free_extents() == [(0, 64)]
