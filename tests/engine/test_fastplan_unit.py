"""The plain-Python planner for tiny writes agrees with kvxfer.plan.plan_items: same ops
(as a set: order within a write is free), same error types for the same bad input."""

import random

import numpy as np
import pytest
from fastplan_pairs import group_pair, reference_ops

from kvxfer import plan
from kvxfer.engine import fastplan
from kvxfer.errors import IndexOutOfRange, InvalidArgument

pytestmark = pytest.mark.timeout(60)


def _small(g, src, dst):
    out = ([], [], [], [], [])
    n = fastplan.plan_small(g, src, dst, out)
    return n, sorted(zip(*out))


@pytest.mark.parametrize("item_lens", [(48,), (64, 32, 16)])
def test_matches_numpy_planner_on_every_small_case(item_lens):
    lg, rg, g, memh, ridx = group_pair(item_lens)
    rng = random.Random(5)
    cases = [
        ([], []),
        ([0], [0]),
        ([11], [8]),
        ([3, 4, 5], [6, 7, 8]),
        ([5, 4, 3], [8, 7, 6]),
        ([1, 2, 3], [4, 5, 7]),
        ([2, 2], [0, 1]),
        ([0, 1, 2, 3], [3, 2, 1, 0]),
    ]
    for _ in range(400):
        k = rng.randint(1, fastplan.SMALL_IDS)
        cases.append(([rng.randrange(12) for _ in range(k)], rng.sample(range(9), min(k, 9))))
        if len(cases[-1][0]) != len(cases[-1][1]):
            cases[-1] = (cases[-1][0][: len(cases[-1][1])], cases[-1][1])
    for src, dst in cases:
        n, got = _small(g, src, dst)
        assert got == sorted(reference_ops(lg, rg, memh, ridx, src, dst)), (src, dst)
        assert n == len(got)


@pytest.mark.parametrize(
    "src,dst,err,text",
    [
        ([12], [0], IndexOutOfRange, "item id 12"),
        ([-1], [0], IndexOutOfRange, "item id -1"),
        ([0], [9], IndexOutOfRange, "item id 9"),
        ([0, 1], [3, 3], InvalidArgument, "destination item 3 appears 2 times"),
        ([0, 1], [3], InvalidArgument, "2 source ids but 1 destination ids"),
    ],
)
def test_same_errors_as_numpy_planner(src, dst, err, text):
    lg, rg, g, memh, ridx = group_pair()
    with pytest.raises(err, match=text):
        plan.plan_items(lg, rg, src, dst)
    out = ([], [], [], [], [])
    with pytest.raises(err, match=text):
        fastplan.plan_small(g, src, dst, out)
    assert out == ([], [], [], [], [])  # nothing appended before the error


def test_only_short_lists_of_plain_ints_take_the_fast_path():
    assert fastplan.small_ids([1, 2]) == [1, 2] and fastplan.small_ids((3,)) == [3]
    assert fastplan.small_ids(7) == [7]
    # short 1-D integer arrays too (what the PD protocol hands the engine), as plain ints
    for arr in (np.array([1, 5]), np.array([1, 5], np.int32), np.array([1, 5], np.uint64)):
        got = fastplan.small_ids(arr)
        assert got == [1, 5] and all(type(v) is int for v in got), arr
    for other in (
        [True],
        [1.0],
        np.array([[1]]),
        np.array([True]),
        np.array([1.0]),
        np.arange(fastplan.SMALL_IDS + 1),
        [np.int64(1)],
        list(range(fastplan.SMALL_IDS + 1)),
        "ab",
        None,
    ):
        assert fastplan.small_ids(other) is None, other


def test_op_limit_appends_nothing():
    lg, rg, g, memh, ridx = group_pair((8,) * 4)
    out = ([], [], [], [], [])
    assert fastplan.plan_small(g, [0, 2, 4], [0, 2, 4], out, max_ops=11) == -1  # 3 runs x 4
    assert out == ([], [], [], [], [])
    assert fastplan.plan_small(g, [0, 2, 4], [0, 2, 4], out, max_ops=12) == 12


def test_incompatible_layouts_are_rejected_when_resolved():
    lg = plan.make_group("g", [0x1000], [640], [64])
    rg = plan.make_group("g", [0x9000], [320], [32])
    with pytest.raises(InvalidArgument, match="item_lens"):
        fastplan.GroupPair.make(lg, rg, [1], [0])
