"""kvxfer.kernels.ids.sorted_unique against np.unique, exhaustively over small arrays."""

import itertools

import numpy as np
import pytest

from kvxfer.kernels.ids import sorted_unique

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", range(0, 6))
def test_matches_np_unique_for_every_small_array(n):
    for values in itertools.product(range(-1, 3), repeat=n):
        a = np.array(values, dtype=np.int64)
        got = sorted_unique(a)
        assert got.dtype == a.dtype
        assert np.array_equal(got, np.unique(a)), values


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint64])
def test_large_arrays_and_dtypes(dtype):
    rng = np.random.default_rng(7)
    for a in (
        rng.permutation(50_000)[:4_000],  # distinct: a request's pages
        rng.integers(0, 300, 20_000),  # repeats: tokens // page size
        np.arange(1_000),  # already sorted
    ):
        a = a.astype(dtype)
        assert np.array_equal(sorted_unique(a), np.unique(a))


def test_never_returns_the_input():
    for a in (np.array([5], dtype=np.int64), np.array([1, 2, 3], dtype=np.int64)):
        out = sorted_unique(a)
        out[0] = -7
        assert a[0] != -7
