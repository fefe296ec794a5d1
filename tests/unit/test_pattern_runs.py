"""PatternRuns (the byte plan of a PatternWrite): validation, and expand() against a brute
force byte map over random plans and item pairs."""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.engine.slices import PatternRuns
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(60)


def _random_plan(rng, sil, dil):
    runs = []
    for s_len, d_len in zip(sil, dil):
        k = int(rng.integers(0, 5))
        cuts = np.sort(rng.choice(np.arange(1, d_len), 2 * k, replace=False)) if k else []
        do = np.asarray(cuts[0::2], dtype=np.int64)
        n = np.minimum(np.asarray(cuts[1::2], dtype=np.int64) - do, s_len)
        so = np.array([int(rng.integers(0, s_len - x + 1)) for x in n], dtype=np.int64)
        runs.append((so, do, n))
    return runs


def _bytes_map(runs, sil, dil, src, dst):
    """{(desc, dst byte offset): src byte offset} the plan implies, brute force."""
    out = {}
    for d, (so, do, n) in enumerate(runs):
        for s, t in zip(src, dst):
            for x, y, k in zip(so, do, n):
                for i in range(int(k)):
                    key = (d, t * dil[d] + int(y) + i)
                    assert key not in out
                    out[key] = s * sil[d] + int(x) + i
    return out


@pytest.mark.parametrize("seed", range(40))
def test_expand_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    nd = int(rng.integers(1, 4))
    sil = [int(rng.integers(8, 40)) for _ in range(nd)]
    dil = [int(rng.integers(8, 40)) for _ in range(nd)]
    runs = _random_plan(rng, sil, dil)
    if not any(len(n) for _, _, n in runs):
        with pytest.raises(InvalidArgument, match="no byte"):
            PatternRuns.make(runs, sil, dil)
        return
    p = PatternRuns.make(runs, sil, dil)
    k = int(rng.integers(0, 6))
    src = rng.choice(10, k, replace=False)
    dst = rng.choice(10, k, replace=False)
    if rng.integers(0, 2):  # consecutive ids: whole neighbouring runs merge
        src, dst = np.arange(2, 2 + k), np.arange(5, 5 + k)
    desc, so, do, nb = p.expand(src, dst)
    got = {}
    for d, x, y, n in zip(desc, so, do, nb):
        for i in range(int(n)):
            got[(int(d), int(y) + i)] = int(x) + i
    assert got == _bytes_map(runs, sil, dil, src.tolist(), dst.tolist())
    assert p.bytes_per_item * k == int(nb.sum())
    assert len(nb) <= p.runs_per_item * k
    # merged runs never continue each other on both sides within a descriptor
    cont = (desc[1:] == desc[:-1]) & (so[1:] == so[:-1] + nb[:-1]) & (do[1:] == do[:-1] + nb[:-1])
    assert not cont.any()


def test_whole_contiguous_items_merge_into_one_run():
    p = PatternRuns.make([([0], [0], [16])], [16], [16])
    desc, so, do, nb = p.expand(np.arange(4, 9), np.arange(0, 5))
    assert (desc.tolist(), so.tolist(), do.tolist(), nb.tolist()) == ([0], [64], [0], [80])


@pytest.mark.parametrize(
    "runs,match",
    [
        ([([0], [0], [0])], "empty run"),
        ([([-1], [0], [4])], "negative"),
        ([([0], [-4], [4])], "negative"),
        ([([14], [0], [4])], "leaves the item"),
        ([([0], [30], [4])], "leaves the item"),
        ([([0, 4], [0, 2], [4, 4])], "overlap"),
        ([([0, 1], [0], [4])], "differ in length"),
        ([([0], [0], [4]), ([0], [0], [4])], "descriptors"),
        ([((), (), ())], "no byte"),
        ([("x", [0], [4])], "malformed"),
    ],
)
def test_make_refuses(runs, match):
    with pytest.raises(InvalidArgument, match=match):
        PatternRuns.make(runs, [16], [32])


def test_arrays_are_read_only():
    p = PatternRuns.make([([0], [4], [4])], [16], [16])
    with pytest.raises(ValueError):
        p.lens[0][0] = 8
