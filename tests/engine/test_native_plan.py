"""The extension's planner (``_rma.plan_items``) gives exactly the Python planner's plan —
the same five columns in the same order (parts of at most SMALL_OPS ops first) and the same
byte count — for every write it takes, small or large, and hands back (None, nothing
planned) everything it does not take, so that bad input still gets the Python planner's
typed error."""

import random

import numpy as np
import pytest
from fastplan_pairs import planner_of_three

from kvxfer.engine import fastplan, writeplan
from kvxfer.engine.types import ItemWrite, RawWrite
from kvxfer.errors import IndexOutOfRange, InvalidArgument, UnknownGroup
from kvxfer.transport.ucx_lib import native_helper

pytestmark = pytest.mark.timeout(60)

#: (group, local items, remote items) of planner_of_three
GROUPS = [("kv", 120, 130), ("st", 16, 16), ("aux", 8, 8)]


@pytest.fixture(scope="module")
def native():
    fn = native_helper("plan_items")
    assert fn is not None, "the native extension lacks plan_items: rebuild it"
    return fn


def _direct(native, planner, writes, max_ids=writeplan.NATIVE_MAX_IDS):
    """plan_items called as the planner calls it (its pairs resolved first)."""
    for w in writes:
        if isinstance(w, ItemWrite) and w.group in planner._local.groups:
            planner._pair(w)
    return native(ItemWrite, np.ndarray, planner._native_pairs, max_ids, fastplan.SMALL_OPS, writes)


def _same(a, b):
    for x, y in zip(a[:5], b[:5]):
        assert x.dtype == y.dtype == np.uint64 and x.ndim == y.ndim == 1
        assert x.tolist() == y.tolist()
    assert list(a[5:9]) == list(b[5:9])
    assert a[9] == b[9]


def _part(rng, n_src, n_dst, k):
    """Ids of one part: consecutive on both sides, in order with gaps, or scattered (repeated
    sources allowed), as a list, tuple, int64 or int32 array (one id sometimes as an int)."""
    conv = rng.choice(
        [list, tuple, lambda v: np.array(v, np.int64), lambda v: np.array(v, np.int32)]
    )
    shape = rng.random()
    if shape < 0.3:  # consecutive on both sides: one run
        s0, d0 = rng.randrange(n_src - k + 1), rng.randrange(n_dst - k + 1)
        src, dst = list(range(s0, s0 + k)), list(range(d0, d0 + k))
    elif shape < 0.6:  # increasing with a few breaks (a request's pages after some churn)
        src = sorted(rng.sample(range(n_src), k)) if k <= n_src else list(range(k))
        dst = sorted(rng.sample(range(n_dst), k))
        if rng.random() < 0.5:
            src = list(range(src[0] if src else 0, (src[0] if src else 0) + k))
            if src and src[-1] >= n_src:
                src = list(range(k))
    else:
        src = [rng.randrange(n_src) for _ in range(k)]
        dst = rng.sample(range(n_dst), k)
    src, dst = conv(src), conv(dst)
    if k == 1 and rng.random() < 0.3:
        src, dst = int(src[0]), int(dst[0])
    return src, dst


def test_same_plan_as_python_for_random_writes(native):
    fast, _, _ = planner_of_three(native=native)
    slow, _, _ = planner_of_three()
    rng = random.Random(11)
    taken = 0
    for _ in range(1500):
        writes = []
        for _ in range(rng.randint(0, 4)):
            g, n_src, n_dst = rng.choice(GROUPS)
            k = rng.choice([rng.randint(0, min(16, n_dst)), rng.randint(0, min(n_src, n_dst))])
            writes.append(ItemWrite(g, *_part(rng, n_src, n_dst, k)))
        want = slow.plan(writes)
        taken += _direct(native, fast, writes) is not None
        _same(fast.plan(writes), want)
    assert taken == 1500  # every one of them planned natively


def test_known_plan():
    planner, _, _ = planner_of_three(native=native_helper("plan_items"))
    planner.plan([ItemWrite("st", [0], [0])])  # resolves the pair
    cols = planner.plan([ItemWrite("st", [9, 3, 4], [1, 5, 6])])
    # st: 2 descriptors of 16 items of 64 B; local base 1<<36, remote 1<<37; memh/ridx 10+i/i
    lb, rb, step = 1 << 36, 1 << 37, 16 * 64
    assert cols[0].tolist() == [lb + 3 * 64, lb + 9 * 64, lb + step + 3 * 64, lb + step + 9 * 64]
    assert cols[1].tolist() == [rb + 5 * 64, rb + 1 * 64, rb + step + 5 * 64, rb + step + 1 * 64]
    assert cols[2].tolist() == [128, 64, 128, 64]
    assert cols[3].tolist() == [10, 10, 11, 11] and cols[4].tolist() == [0, 0, 1, 1]
    assert cols[9] == 384


def test_large_parts_after_small_ones(native):
    """A part of more than SMALL_OPS ops (21 scattered kv pages x 8 descriptors) goes after
    the small parts, as the Python planner orders them."""
    fast, _, _ = planner_of_three(native=native)
    slow, _, _ = planner_of_three()
    w = [
        ItemWrite("kv", np.arange(0, 63, 3), np.arange(21)),
        ItemWrite("st", [1], [2]),
        ItemWrite("kv", np.arange(100, 110), np.arange(40, 50)),
    ]
    got = fast.plan(w)
    _same(got, slow.plan(w))
    assert got[0].size == 2 + 8 + 21 * 8 and got[2][:2].tolist() == [64, 64]  # st first


_OUT = [
    [ItemWrite("kv", [0], [200])],  # destination out of range
    [ItemWrite("kv", [-1], [0])],
    [ItemWrite("kv", np.array([5, 120]), np.array([0, 1]))],  # source out of range
    [ItemWrite("kv", [0, 1], [3, 3])],  # a duplicate destination
    [ItemWrite("kv", np.arange(40), np.zeros(40, np.int64))],
    [ItemWrite("kv", [0, 1], [3])],  # counts differ
    [ItemWrite("kv", [True], [0])],  # not exactly an int
    [ItemWrite("kv", [1 << 70], [0])],
    [ItemWrite("kv", np.array([0], np.uint64), np.array([0], np.uint64))],  # (Python plans it)
    [ItemWrite("kv", np.array([[0]]), np.array([[0]]))],
    [ItemWrite("nope", [0], [0])],  # an unknown group
    [ItemWrite("st", [0], [0]), RawWrite("aux", 0, 0, 8, 0)],  # not only ItemWrites
    [ItemWrite("st", 0.0, 0.0)],
    [ItemWrite("st", np.array([]), np.array([]))],  # float64 (empty: Python plans nothing)
]


@pytest.mark.parametrize("writes", _OUT)
def test_hands_back_what_it_does_not_take(native, writes):
    planner, _, _ = planner_of_three(native=native)
    assert _direct(native, planner, writes) is None


def test_takes_repeated_sources_not_an_iterator_nor_too_many_ids(native):
    planner, _, _ = planner_of_three(native=native)
    w = [ItemWrite("kv", [0, 2, 4, 6, 8, 10, 12, 14] * 2, list(range(16)))]
    assert _direct(native, planner, w) is not None
    assert _direct(native, planner, iter(w)) is None  # not a list or tuple
    assert _direct(native, planner, w, max_ids=15) is None


@pytest.mark.parametrize(
    "write, err, text",
    [
        (ItemWrite("kv", [0], [200]), IndexOutOfRange, "item id 200"),
        (ItemWrite("kv", np.arange(40), np.zeros(40, np.int64)), InvalidArgument, "appears"),
        (ItemWrite("kv", [0, 1], [3]), InvalidArgument, "destination"),
        (ItemWrite("nope", [0], [0]), UnknownGroup, "nope"),
    ],
)
def test_bad_input_gets_the_python_error(native, write, err, text):
    planner, _, _ = planner_of_three(native=native)
    planner.plan([ItemWrite("kv", [0], [0])])
    with pytest.raises(err, match=text):
        planner.plan([ItemWrite("st", [0], [0]), write])


def test_strided_and_int32_ids(native):
    fast, _, _ = planner_of_three(native=native)
    slow, _, _ = planner_of_three()
    a = np.arange(120)[::-3][:30]  # a strided view, decreasing
    b = np.arange(130, dtype=np.int32)[1::4][:30]
    w = [ItemWrite("kv", a, b)]
    assert _direct(native, fast, w) is not None
    _same(fast.plan(w), slow.plan(w))


def test_distinct_destinations_in_a_large_pool(native):
    """Against a pool too large for the bitmap of destinations, distinctness is checked by a
    sort: a repeated destination is still refused, the rest planned as in Python."""
    from fastplan_pairs import _group, _Side

    from kvxfer.engine.writeplan import WritePlanner

    local = _Side({"kv": _group("kv", 2, 1 << 12, 64, 1 << 30)}, 10)
    remote = _Side({"kv": _group("kv", 2, 1 << 22, 64, 1 << 40)}, 0)
    fast = WritePlanner(local, remote, "x", lambda g: False, native=native)
    slow = WritePlanner(local, remote, "x", lambda g: False)
    rng = np.random.default_rng(3)
    for _ in range(50):
        k = int(rng.integers(2, 300))
        src = rng.permutation(1 << 12)[:k]
        dst = rng.choice(1 << 22, size=k, replace=False)
        w = [ItemWrite("kv", src, dst)]
        assert _direct(native, fast, w) is not None
        _same(fast.plan(w), slow.plan(w))
        dst[int(rng.integers(1, k))] = dst[0]
        assert _direct(native, fast, [ItemWrite("kv", src, dst)]) is None
        with pytest.raises(InvalidArgument, match="appears"):
            fast.plan([ItemWrite("kv", src, dst)])


def test_env_switch(monkeypatch):
    """``KVXFER_NATIVE_PLAN`` (read when a peer is made): 1 by default, 0 keeps the Python
    planners, anything else is refused by name."""
    from kvxfer import config

    monkeypatch.delenv("KVXFER_NATIVE_PLAN", raising=False)
    assert config.native_plan() is True
    monkeypatch.setenv("KVXFER_NATIVE_PLAN", "0")
    assert config.native_plan() is False
    monkeypatch.setenv("KVXFER_NATIVE_PLAN", "yes")
    with pytest.raises(InvalidArgument, match="KVXFER_NATIVE_PLAN"):
        config.native_plan()
