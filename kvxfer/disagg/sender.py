"""KVSender: the prefill end of one room.

Usage (scheduler): ``s = KVSender(mgr, addr, room, on_done=release)``; poll until
``WaitingForInput`` (decode's metadata arrived; sending earlier is allowed and queued);
``s.init(num_pages, aux_index)``; ``s.send(page_ids)`` per chunk — the chunk that completes
``num_pages`` is the last one and also carries ``state_indices`` and the aux row.
"""

from __future__ import annotations

from typing import Optional

from kvxfer.argcheck import as_int
from kvxfer.disagg.handle import OnDone, RoomHandle, as_ids
from kvxfer.disagg.roles import DisaggMode
from kvxfer.disagg.trace import mark
from kvxfer.errors import IndexOutOfRange, InvalidArgument


class KVSender(RoomHandle):
    _mode = DisaggMode.PREFILL

    def __init__(
        self, mgr, bootstrap_addr: Optional[str], room: int, *, on_done: Optional[OnDone] = None
    ) -> None:
        if mgr.mode is not DisaggMode.PREFILL:
            raise InvalidArgument(
                f"KVSender needs a prefill manager, {mgr.name} is {mgr.mode.value}"
            )
        self.bootstrap_addr = bootstrap_addr
        self._num: Optional[int] = None
        self._sent = 0
        self._done_sending = False
        super().__init__(mgr, room, on_done)

    def init(self, num_kv_indices: int, aux_index: int) -> None:
        """Declare the request's page count and the prefill aux row holding its first token.

        Runs on: the scheduler's thread (validated there; the rest is handed to the loop)."""
        if self._num is not None:
            raise InvalidArgument(f"room {self.room}: init() called twice")
        num_kv_indices = as_int(num_kv_indices, f"room {self.room}: num_kv_indices", 0)
        aux_index = int(as_ids([aux_index], "aux_index", self.mgr.items["aux"])[0])
        self._num = num_kv_indices
        self.mgr.call(self.mgr.side.init, self._r, num_kv_indices, aux_index)

    def send(self, kv_indices, state_indices=None) -> None:
        """Send one chunk of source pages (in request order). Validated here: ids in range,
        no duplicates, total <= num_kv_indices, state only with the last chunk — a bad call
        raises and sends nothing.

        Runs on: the scheduler's thread (validated there; the writes run on the loop)."""
        if self._num is None:
            raise InvalidArgument(f"room {self.room}: send() before init()")
        if self._done_sending:
            raise InvalidArgument(f"room {self.room}: the last chunk was already sent")
        src = as_ids(kv_indices, f"room {self.room}: kv_indices", self.mgr.items["kv"])
        total = self._sent + len(src)
        if total > self._num:
            raise IndexOutOfRange(
                f"room {self.room}: chunk ends at page {total} > num_kv_indices {self._num}"
            )
        last = total == self._num
        if not last and len(src) == 0:
            raise InvalidArgument(f"room {self.room}: empty non-final chunk")
        st = None
        if state_indices is not None:
            if not last:
                raise InvalidArgument(
                    f"room {self.room}: state_indices belong to the last chunk "
                    f"(this one ends at page {total} of {self._num})"
                )
            st = as_ids(state_indices, f"room {self.room}: state_indices", self.mgr.items["state"])
        self._sent = total
        self._done_sending = last
        if last and self._r.trace is not None:
            mark(self._r.trace, "send")
        self.mgr.call(self.mgr.side.send, self._r, src, st, last)
