"""The extension's planner (``_rma.plan_items``) gives exactly the Python planner's plan —
the same five columns in the same order and the same byte count — for every write it takes,
and hands back (None, nothing planned) everything it does not take, so that bad input still
gets the Python planner's typed error."""

import random

import numpy as np
import pytest
from fastplan_pairs import planner_of_three

from kvxfer.engine import fastplan
from kvxfer.engine.types import ItemWrite, RawWrite
from kvxfer.errors import IndexOutOfRange, InvalidArgument, UnknownGroup
from kvxfer.transport.ucx_lib import native_helper

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def native():
    fn = native_helper("plan_items")
    assert fn is not None, "the native extension lacks plan_items: rebuild it"
    return fn


def _direct(native, planner, writes):
    """plan_items called as the planner calls it (its pairs resolved first)."""
    for w in writes:
        if isinstance(w, ItemWrite) and w.group in planner._local.groups:
            planner._pair(w)
    return native(
        ItemWrite, np.ndarray, planner._native_pairs, fastplan.SMALL_IDS, fastplan.SMALL_OPS, writes
    )


def _same(a, b):
    for x, y in zip(a[:5], b[:5]):
        assert x.dtype == y.dtype == np.uint64 and x.ndim == y.ndim == 1
        assert x.tolist() == y.tolist()
    assert list(a[5:9]) == list(b[5:9])
    assert a[9] == b[9]


def _ids(rng, k, n, conv):
    return conv(rng.sample(range(n), k))


def test_same_plan_as_python_for_random_small_writes(native):
    fast, _, _ = planner_of_three(native=native)
    slow, _, _ = planner_of_three()
    rng = random.Random(11)
    taken = 0
    for _ in range(2000):
        writes = []
        for _ in range(rng.randint(0, 4)):
            g, n_src, n_dst = rng.choice([("kv", 120, 130), ("st", 16, 16), ("aux", 8, 8)])
            k = rng.randint(0, min(fastplan.SMALL_IDS, n_dst))
            conv = rng.choice([list, tuple, np.array, lambda v: np.array(v, np.int64)])
            if rng.random() < 0.3:  # consecutive on both sides: merged runs
                s0, d0 = rng.randrange(n_src - k + 1), rng.randrange(n_dst - k + 1)
                src, dst = conv(list(range(s0, s0 + k))), conv(list(range(d0, d0 + k)))
            else:  # scattered, repeated sources allowed
                src = conv([rng.randrange(n_src) for _ in range(k)])
                dst = _ids(rng, k, n_dst, conv)
            if k == 1 and rng.random() < 0.3:
                src, dst = int(src[0]), int(dst[0])
            writes.append(ItemWrite(g, src, dst))
        want = slow.plan(writes)
        taken += _direct(native, fast, writes) is not None
        _same(fast.plan(writes), want)
    assert taken > 1500  # the native path did plan most of them (the rest: > SMALL_OPS ops)


def test_known_plan():
    planner, _, _ = planner_of_three(native=native_helper("plan_items"))
    planner.plan([ItemWrite("st", [0], [0])])  # resolves the pair
    cols = planner.plan([ItemWrite("st", [3, 4, 9], [5, 6, 1])])
    # st: 2 descriptors of 16 items of 64 B; local base 1<<36, remote 1<<37; memh/ridx 10+i/i
    lb, rb, step = 1 << 36, 1 << 37, 16 * 64
    assert cols[0].tolist() == [lb + 3 * 64, lb + 9 * 64, lb + step + 3 * 64, lb + step + 9 * 64]
    assert cols[1].tolist() == [rb + 5 * 64, rb + 1 * 64, rb + step + 5 * 64, rb + step + 1 * 64]
    assert cols[2].tolist() == [128, 64, 128, 64]
    assert cols[3].tolist() == [10, 10, 11, 11] and cols[4].tolist() == [0, 0, 1, 1]
    assert cols[9] == 384


_OUT = [
    [ItemWrite("kv", [0], [200])],  # destination out of range
    [ItemWrite("kv", [-1], [0])],
    [ItemWrite("kv", [0, 1], [3, 3])],  # a duplicate destination
    [ItemWrite("kv", [0, 1], [3])],  # counts differ
    [ItemWrite("kv", [True], [0])],  # not exactly an int
    [ItemWrite("kv", [1 << 70], [0])],
    [ItemWrite("kv", np.array([0], np.int32), np.array([0], np.int32))],  # (Python plans it)
    [ItemWrite("kv", np.array([[0]]), np.array([[0]]))],
    [ItemWrite("kv", list(range(17)), list(range(17)))],  # more than SMALL_IDS
    [ItemWrite("nope", [0], [0])],  # an unknown group
    [ItemWrite("st", [0], [0]), RawWrite("aux", 0, 0, 8, 0)],  # not only ItemWrites
    [ItemWrite("st", 0.0, 0.0)],
]


@pytest.mark.parametrize("writes", _OUT)
def test_hands_back_what_it_does_not_take(native, writes):
    planner, _, _ = planner_of_three(native=native)
    assert _direct(native, planner, writes) is None


def test_takes_repeated_sources_and_not_an_iterator(native):
    planner, _, _ = planner_of_three(native=native)
    w = [ItemWrite("kv", [0, 2, 4, 6, 8, 10, 12, 14] * 2, list(range(16)))]  # 16 runs x 8
    assert _direct(native, planner, w) is not None
    assert _direct(native, planner, iter(w)) is None  # not a list or tuple


@pytest.mark.parametrize(
    "write, err, text",
    [
        (ItemWrite("kv", [0], [200]), IndexOutOfRange, "item id 200"),
        (ItemWrite("kv", [0, 1], [3, 3]), InvalidArgument, "appears"),
        (ItemWrite("kv", [0, 1], [3]), InvalidArgument, "destination"),
        (ItemWrite("nope", [0], [0]), UnknownGroup, "nope"),
    ],
)
def test_bad_input_gets_the_python_error(native, write, err, text):
    planner, _, _ = planner_of_three(native=native)
    planner.plan([ItemWrite("kv", [0], [0])])
    with pytest.raises(err, match=text):
        planner.plan([ItemWrite("st", [0], [0]), write])


def test_too_many_ops_goes_to_the_numpy_path(native):
    """A part over SMALL_OPS (16 scattered pages x 8 descriptors = 128 is under; 17 pages are
    over SMALL_IDS) is planned by Python; the plan is the same either way."""
    fast, _, _ = planner_of_three(native=native)
    slow, _, _ = planner_of_three()
    w = [ItemWrite("kv", np.arange(0, 60, 3), np.arange(20))]
    _same(fast.plan(w), slow.plan(w))
