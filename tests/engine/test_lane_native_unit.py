"""``DeviceLane.launch`` on the native launcher, without a GPU: the lane's own part — the
translation of every op into the peer's mapped region, the bounds check, and which launcher
call a write takes (a few runs: ``cuMemcpyDtoDAsync`` per run and a recorded event; more: one
row per run with tiles cut on the device; runs too uneven for one grid: tiles cut on the
host, every byte of every run covered once) — with a recording stand-in for
:class:`kvxfer.kernels.piece_copy.TaskLauncher`. The launcher itself runs on the GPU machine
(tests/gpu/test_native_launch.py); the lane end to end in tests/engine/test_engine.py with
KVXFER_TEST_DEVICE=cuda."""

import numpy as np
import pytest

from kvxfer.engine import devcopy
from kvxfer.errors import IndexOutOfRange
from kvxfer.kernels import cuda_driver
from kvxfer.kernels.piece_copy import pieces_grid
from kvxfer.pools.offload.pieces import pick_tile_bytes

pytestmark = pytest.mark.timeout(30)

U = np.uint64
RBASE, RLEN = [1 << 40, 1 << 41], [1 << 30, 1 << 30]  # the peer's regions
MAPPED = [7 << 36, 9 << 36]  # their images here


class Ctx:
    def enter(self):
        return False

    def leave(self, pushed):
        pass


class Launcher:
    """Records what the lane asks of it; returns a marker event."""

    def __init__(self, grid_ok=True):
        self.ctx, self.calls, self.grid_ok = Ctx(), [], grid_ok

    def launch_pieces(self, src, dst, nbytes, tile, stream):
        self.calls.append(("pieces", src.copy(), dst.copy(), nbytes.copy(), tile, stream))
        return "pieces-event" if self.grid_ok else None

    def supports(self, groups):
        return True

    def launch(self, groups, stream):
        self.calls.append(("tiles", groups, stream))
        return "tiles-event"

    def record(self, stream):
        self.calls.append(("record", stream))
        return "record-event"


def _lane(launcher):
    lane = object.__new__(devcopy.DeviceLane)  # no CUDA: only the attributes launch reads
    lane._tasks, lane._stream_h, lane.device = launcher, 1234, 0
    lane._rbase, lane._rlen = np.array(RBASE, dtype=U), np.array(RLEN, dtype=U)
    lane.mapped = np.array(MAPPED, dtype=U)
    return lane


def _ops(n, size, region=1, spread=1 << 20):
    laddr = (np.arange(n, dtype=U) * U(spread)) + U(1 << 35)
    off = np.arange(n, dtype=U)[::-1] * U(spread)
    raddr = U(RBASE[region]) + off
    return laddr, raddr, np.full(n, size, dtype=U), np.full(n, region, dtype=U), off


def test_few_runs_are_driver_copies_then_one_recorded_event(monkeypatch):
    got = []
    monkeypatch.setattr(
        cuda_driver, "memcpy_dtod_async", lambda d, s, n, h: got.append((d, s, n, h))
    )
    t = Launcher()
    laddr, raddr, nbytes, ridx, off = _ops(devcopy.MEMCPY_MAX_RUNS, 4096)
    assert _lane(t).launch(laddr, raddr, nbytes, ridx) == "record-event"
    want = [(int(MAPPED[1] + o), int(s), 4096, 1234) for o, s in zip(off, laddr)]
    assert got == want and t.calls == [("record", 1234)]


def test_many_runs_are_one_row_each_with_device_tiles():
    t = Launcher()
    laddr, raddr, nbytes, ridx, off = _ops(256, 65536)
    assert _lane(t).launch(laddr, raddr, nbytes, ridx) == "pieces-event"
    ((kind, src, dst, n, tile, stream),) = t.calls
    assert kind == "pieces" and stream == 1234
    assert (src == laddr).all() and (dst == U(MAPPED[1]) + off).all() and (n == nbytes).all()
    assert tile == pick_tile_bytes(256 * 65536)


def test_uneven_runs_fall_back_to_host_tiles_covering_every_byte_once():
    t = Launcher(grid_ok=False)
    laddr, raddr, nbytes, ridx, off = _ops(9, 0)
    nbytes[:] = [1 << 20] + [16] * 8  # one large run among small ones
    assert pieces_grid(nbytes, pick_tile_bytes(int(nbytes.sum()))) is None
    assert _lane(t).launch(laddr, raddr, nbytes, ridx) == "tiles-event"
    assert [c[0] for c in t.calls] == ["pieces", "tiles"]
    rows = np.concatenate([g for _, g in t.calls[1][1]])
    for s, d, n in zip(laddr.tolist(), (U(MAPPED[1]) + off).tolist(), nbytes.tolist()):
        mine = rows[(rows[:, 0] >= s) & (rows[:, 0] < s + n)]
        assert int(mine[:, 2].sum()) == n  # every byte once, in tiles
        assert ((mine[:, 1] - d) == (mine[:, 0] - s)).all()  # same offset on both sides


@pytest.mark.parametrize("bad", ["below", "past_end", "too_long"])
def test_an_op_outside_its_region_launches_nothing(bad):
    t = Launcher()
    laddr, raddr, nbytes, ridx, _ = _ops(8, 4096, region=0)
    if bad == "below":
        raddr[3] = U(RBASE[0] - 16)
    elif bad == "past_end":
        raddr[3] = U(RBASE[0] + RLEN[0] + 16)
    else:
        nbytes[3] = U(RLEN[0])
    with pytest.raises(IndexOutOfRange):
        _lane(t).launch(laddr, raddr, nbytes, ridx)
    assert t.calls == []
