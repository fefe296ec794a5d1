"""Metadata (aux) rows: where prefill hands decode the first token and the room stamp.

Every aux row of the *first* aux buffer starts with a 16-byte header owned by kvxfer::

    [0:8)   room id            (uint64, little-endian)
    [8:16)  room id ^ CHECK    (uint64) - a torn / stale / garbage row never validates

Prefill stamps the header of its own row right before the final write that copies the row to
decode; decode clears its row when it sends its metadata and, once the completion message
arrived (so the bytes are visible), accepts the room only if the header names it.
:class:`MetadataBuffer` is a ready-made host buffer with a row allocator and a first-token
slot at ``[16:24)``; users with their own aux buffers only need to leave the header alone.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import numpy as np

from kvxfer.errors import DoubleFree, IndexOutOfRange, InvalidArgument

HEADER_BYTES = 16
CHECK = 0x9E3779B97F4A7C15
#: room ids are non-negative int63 (SGLang's ``bootstrap_room`` range).
MAX_ROOM = (1 << 63) - 1
_CLEARED = (1 << 64) - 1


def check_room(room) -> int:
    if isinstance(room, bool) or not isinstance(room, (int, np.integer)):
        raise InvalidArgument(f"room id must be an int, got {type(room).__name__} {room!r}")
    room = int(room)
    if not 0 <= room <= MAX_ROOM:
        raise InvalidArgument(f"room id {room} outside [0, 2**63)")
    return room


class AuxRows:
    """uint64 view over the headers of a host aux buffer given by pointer (no copy)."""

    def __init__(self, ptr: int, nbytes: int, row_bytes: int) -> None:
        if row_bytes % 8:
            raise InvalidArgument(f"aux row_bytes {row_bytes} must be a multiple of 8")
        raw = (ctypes.c_uint8 * nbytes).from_address(ptr)
        self._rows = nbytes // row_bytes
        self._u64 = np.frombuffer(memoryview(raw), dtype="<u8").reshape(self._rows, row_bytes // 8)

    @property
    def rows(self) -> int:
        return self._rows

    def _check(self, row: int) -> int:
        if not 0 <= row < self._rows:
            raise IndexOutOfRange(f"aux index {row} not in [0, {self._rows})")
        return row

    def stamp(self, row: int, room: int) -> None:
        r = self._check(row)
        self._u64[r, 0] = room
        self._u64[r, 1] = room ^ CHECK

    def clear(self, row: int) -> None:
        r = self._check(row)
        self._u64[r, 0] = _CLEARED
        self._u64[r, 1] = _CLEARED

    def read_room(self, row: int) -> Optional[int]:
        """The room stamped in ``row``, or None when the header is cleared / inconsistent."""
        r = self._check(row)
        room, chk = int(self._u64[r, 0]), int(self._u64[r, 1])
        if room > MAX_ROOM or room ^ CHECK != chk:
            return None
        return room


class MetadataBuffer:
    """A host ``[rows, row_bytes]`` uint8 buffer with a row allocator (the "aux" group).

    Row layout: header ``[0:16)`` (kvxfer's), first output token ``[16:24)`` (int64), the rest
    free for the application (``payload``).
    """

    FIRST_TOKEN = slice(16, 24)

    def __init__(self, rows: int, row_bytes: int = 64) -> None:
        if rows <= 0 or row_bytes < 24 or row_bytes % 8:
            raise InvalidArgument(f"MetadataBuffer(rows={rows}, row_bytes={row_bytes})")
        self.data = np.zeros((rows, row_bytes), dtype=np.uint8)
        self.rows, self.row_bytes = rows, row_bytes
        self._free: List[int] = list(range(rows - 1, -1, -1))
        self._used = np.zeros(rows, dtype=bool)

    def buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        return [int(self.data.ctypes.data)], [int(self.data.nbytes)], [self.row_bytes]

    def alloc(self) -> Optional[int]:
        if not self._free:
            return None
        row = self._free.pop()
        self._used[row] = True
        return row

    def free(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise IndexOutOfRange(f"aux row {row} not in [0, {self.rows})")
        if not self._used[row]:
            raise DoubleFree(f"aux row {row} is already free")
        self._used[row] = False
        self._free.append(row)

    def available(self) -> int:
        return len(self._free)

    def set_output(self, row: int, first_token: int, payload: bytes = b"") -> None:
        if len(payload) > self.row_bytes - 24:
            raise InvalidArgument(f"payload of {len(payload)} bytes > {self.row_bytes - 24}")
        self.data[row, self.FIRST_TOKEN] = np.frombuffer(
            np.int64(first_token).tobytes(), dtype=np.uint8
        )
        self.data[row, 24 : 24 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)

    def first_token(self, row: int) -> int:
        return int(self.data[row, self.FIRST_TOKEN].view(np.int64)[0])

    def payload(self, row: int, n: int) -> bytes:
        return self.data[row, 24 : 24 + n].tobytes()
