"""The device lane's wire part and arithmetic (no GPU needed); the lane itself runs in
tests/engine/test_engine.py with KVXFER_TEST_DEVICE=cuda (same-host CUDA peers)."""

import pytest

from kvxfer.engine.groups import parse_ipc
from kvxfer.errors import ProtocolError
from kvxfer.kernels import cuda_driver

pytestmark = pytest.mark.timeout(30)
BLOB = bytes(cuda_driver.IPC_BLOB_BYTES)


def test_parse_ipc_accepts():
    assert parse_ipc(None, 3) == []
    assert parse_ipc([b"", BLOB, bytearray(BLOB)], 3) == [b"", BLOB, BLOB]


@pytest.mark.parametrize(
    "raw",
    [
        [b""],
        [b"", b"", b"", b""],
        "abc",
        [b"", b"x", b""],
        [b"", None, b""],
        [b"", BLOB + b"!", b""],
    ],
)
def test_parse_ipc_rejects(raw):
    with pytest.raises(ProtocolError, match="region_ipc"):
        parse_ipc(raw, 3)


def test_driver_queries_answer_none_for_host_memory():
    import numpy as np

    a = np.zeros(64, np.uint8)
    assert cuda_driver.ipc_export(a.ctypes.data) is None
    assert cuda_driver.device_ordinal(a.ctypes.data) is None
    assert cuda_driver.alloc_range(a.ctypes.data) is None
    with pytest.raises(ValueError):
        cuda_driver.ipc_open(b"short")


def test_blob_round_trip_keeps_every_byte():
    """The 64 handle bytes survive packing and unpacking, NULs included."""
    raw = bytes([0, 7, 0, 0, 255] + list(range(59)))
    h, _ = cuda_driver.unpack_blob(raw + bytes(8))
    blob = cuda_driver.pack_blob(h, 12345)
    assert len(blob) == cuda_driver.IPC_BLOB_BYTES and blob[:64] == raw
    h2, off = cuda_driver.unpack_blob(blob)
    assert off == 12345 and h2 == raw


def test_lane_profile_parts_and_summary():
    """$KVXFER_LANE_PROFILE's record of pattern launches: each part is the gap between two
    stamps, the total their span, the CPU time kept apart; the summary gives p50s."""
    import types

    from kvxfer.engine.devcopy import DeviceLane

    prof: dict = {}
    for base in (0.0, 1.0, 2.0):  # stamps in seconds: parts of 1, 2, 3, 4, 5 µs
        t = [base + x * 1e-6 for x in (0, 1, 3, 6, 10, 15)]
        DeviceLane._profile(prof, 0.0, *t)
    assert [round(v, 6) for v in prof["context"]] == [2.0] * 3
    assert [round(v, 6) for v in prof["total"]] == [15.0] * 3
    assert set(prof) == {
        "total cpu",
        "table",
        "context",
        "upload",
        "kernel launch",
        "event",
        "total",
    }
    prof["misses"], prof["apart"] = 2, 1
    text = DeviceLane.profile_summary(types.SimpleNamespace(profile=prof))
    assert text.startswith("3 pattern launches, p50 µs: ")
    assert "kernel launch 4.0" in text and "event 5.0" in text
    assert text.endswith("table misses 2; parts launched apart 1")


class _FakeEvent:
    """A CUDA event stand-in: done after ``n`` queries, or when synchronize() runs."""

    def __init__(self, n):
        self.n, self.queries, self.synced = n, 0, None

    def query(self):
        self.queries += 1
        return self.queries > self.n

    def synchronize(self):
        import threading

        self.synced = threading.current_thread().name


@pytest.mark.parametrize("n", [0, 3, 50])
def test_lane_wait_polls_on_the_loop_until_done(n):
    """A launch that completes while polled (inline, then once per loop iteration) is seen
    on the loop thread: no executor hop, other callbacks ran between the loop polls."""
    import asyncio

    from kvxfer.engine.devcopy import DeviceLane

    async def main():
        ev, ticks = _FakeEvent(n), []
        loop = asyncio.get_running_loop()

        def tick():
            ticks.append(1)
            if len(ticks) < 1000:
                loop.call_soon(tick)

        loop.call_soon(tick)
        await DeviceLane.wait(ev, spin_s=0.0, poll_s=5.0)
        return ev, len(ticks)

    ev, ticks = asyncio.run(main())
    assert ev.synced is None and ev.queries == n + 1
    assert ticks >= max(0, n - 2)  # the loop kept running while it polled


def test_lane_wait_falls_back_to_a_thread():
    """An event still pending after the polling window is waited for in the executor."""
    import asyncio
    import threading

    from kvxfer.engine.devcopy import DeviceLane

    ev = _FakeEvent(10**9)
    asyncio.run(DeviceLane.wait(ev, spin_s=0.0, poll_s=0.0))
    assert ev.synced is not None and ev.synced != threading.main_thread().name


@pytest.mark.parametrize(
    "ops,sizes,min_ops,small,min_bytes,want",
    [
        (0, [], 1, 4, 1, False),  # nothing to copy
        (128, [1] * 128, 128, 0, 0, True),  # scattered: many runs
        (127, [1] * 127, 128, 0, 0, False),
        (2, [1, 1], 128, 4, 0, True),  # small writes (device_small_ops)
        (5, [1] * 5, 128, 4, 0, False),
        (1, [16 << 20], 128, 0, 0, False),  # large, min_bytes off
        (1, [16 << 20], 128, 0, 4 << 20, True),  # large contiguous
        (16, [1 << 20] * 16, 128, 0, 16 << 20, True),  # exactly min_bytes
        (16, [1 << 20] * 16, 128, 0, (16 << 20) + 1, False),
        (31, [64 << 10] * 31, 32, 0, 0, False),  # the default min_ops
        (32, [1 << 20] * 32, 32, 0, 0, True),
    ],
)
def test_lane_wanted(ops, sizes, min_ops, small, min_bytes, want):
    import numpy as np

    from kvxfer.engine.devcopy import lane_wanted

    nbytes = np.asarray(sizes, dtype=np.uint64)
    assert lane_wanted(ops, nbytes, min_ops, small, min_bytes) is want


def test_batch_copy_checks_its_arrays_before_the_driver():
    """Mismatched or empty arrays are an InvalidArgument, with or without a CUDA driver."""
    import numpy as np

    from kvxfer.errors import InvalidArgument

    one, two = np.zeros(1, np.uint64), np.zeros(2, np.uint64)
    for args in ((one, one, two), (two, one, two), (one[:0], one[:0], one[:0])):
        with pytest.raises(InvalidArgument, match="lengths"):
            cuda_driver.memcpy_batch_async(*args, stream=1)
