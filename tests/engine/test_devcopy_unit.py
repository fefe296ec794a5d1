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
