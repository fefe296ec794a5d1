"""Common part of KVSender / KVReceiver: poll, wait, abort, index validation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Callable, Optional

import numpy as np

from kvxfer.disagg.poll import KVPoll, is_terminal
from kvxfer.disagg.roles import DisaggMode
from kvxfer.disagg.trace import mark
from kvxfer.errors import IndexOutOfRange, InvalidArgument, TransferAborted, TransferTimeout

#: ``on_done(state: KVPoll, exc: Exception | None)``: called once, when the room is terminal
#: AND no transfer can touch its pages any more — release them there.
#: Runs on: the manager's loop thread, or a thread running as the loop's guest: the
#: scheduler's (a ``send()`` whose write finished inline, a ``poll()`` that took what
#: arrived) or the transport's native receive thread (``KVManager.take_natively``); never
#: beside the loop: the guest holds its gate, docs/engine.md "Guest runs". Keep it short;
#: hand work to the scheduler.
OnDone = Callable[[KVPoll, Optional[BaseException]], None]


def as_ids(x, what: str, limit: int, *, unique: bool = True) -> np.ndarray:
    """Validate a 1-D sequence/array/tensor of item ids in ``[0, limit)`` -> int64 ndarray."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        raise InvalidArgument(f"{what} must be 1-D, got shape {tuple(a.shape)}")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must hold integers, got dtype {a.dtype}")
    a = a.astype(np.int64, copy=False)
    if a.size == 1:  # the usual 1-page request: scalar checks only
        v = int(a[0])
        if not 0 <= v < limit:
            raise IndexOutOfRange(f"{what}: {v} not in [0, {limit})")
        return a
    if a.min() < 0 or a.max() >= limit:
        bad = a[(a < 0) | (a >= limit)]
        raise IndexOutOfRange(f"{what}: {int(bad[0])} not in [0, {limit})")
    if unique and not (a[1:] > a[:-1]).all():  # increasing ids repeat none: no sort
        s = np.sort(a)
        dup = s[1:][s[1:] == s[:-1]]
        if dup.size:
            raise InvalidArgument(f"{what}: id {int(dup[0])} appears more than once")
    return a


class RoomHandle:
    #: the manager mode this handle belongs to (set by KVSender / KVReceiver)
    _mode: DisaggMode

    def __init__(self, mgr, room, on_done: Optional[OnDone]) -> None:
        self.mgr = mgr
        self._r = mgr.new_room(room, on_done)
        self._r.handle = self

    @property
    def room(self) -> int:
        return self._r.room

    def __repr__(self) -> str:
        return f"{type(self).__name__}(room={self.room}, {KVPoll(self._r.state).name})"

    def poll(self) -> KVPoll:
        """Current state; non-blocking. A room that is not terminal first has what already
        arrived for its manager handled (``KVManager.take_arrived``, as the loop's guest).
        Runs on: any thread (the scheduler's)."""
        r = self._r
        self.mgr.polled_at = time.monotonic()
        if not is_terminal(r.state):
            self.mgr.take_arrived()
        if r.trace is not None and r.state == KVPoll.Success:
            mark(r.trace, "seen")
        return KVPoll(r.state)

    def failure_exception(self) -> Optional[BaseException]:
        """Why the room failed (a typed KvxferError), or None."""
        return self._r.exc if self._r.state == KVPoll.Failed else None

    def abort(self) -> None:
        """Fail the room (sticky) and tell the peer; pages are released via ``on_done``.

        Runs on: any thread (the scheduler's); the failure runs on the loop."""
        r = self._r
        if is_terminal(r.state):
            return
        self.mgr.call(self._abort)

    def _abort(self) -> None:
        self.mgr.fail(
            self._r,
            TransferAborted(f"room {self._r.room} aborted by {self._mode.value} {self.mgr.name}"),
        )

    def _add_waiter(self, w) -> None:
        """Runs on: the loop thread."""
        if is_terminal(self._r.state):
            if not w.done():
                w.set_result(self._r.state)
        else:
            self._r.waiters.append(w)

    async def wait(self, timeout: Optional[float] = None) -> KVPoll:
        """Await a terminal state (Success or Failed) from any event loop."""
        r = self._r
        if is_terminal(r.state):
            return KVPoll(r.state)
        loop = asyncio.get_running_loop()
        if loop is self.mgr.loop:
            fut = loop.create_future()
            self._add_waiter(fut)
        else:
            cf: concurrent.futures.Future = concurrent.futures.Future()
            self.mgr.call(self._add_waiter, cf)
            fut = asyncio.wrap_future(cf)
        try:
            return KVPoll(await asyncio.wait_for(fut, timeout))
        except asyncio.TimeoutError:
            raise TransferTimeout(
                f"room {r.room}: still {KVPoll(r.state).name} after {timeout}s"
            ) from None

    def wait_blocking(self, timeout: Optional[float] = None) -> KVPoll:
        """Block a (non-loop) thread until the room is terminal. Runs on: the caller's
        thread, never the loop's."""
        if self.mgr.in_loop():
            raise InvalidArgument("wait_blocking() on the manager's own loop would deadlock")
        r = self._r
        if is_terminal(r.state):
            return KVPoll(r.state)
        cf: concurrent.futures.Future = concurrent.futures.Future()
        self.mgr.call(self._add_waiter, cf)
        try:
            return KVPoll(cf.result(timeout))
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(
                f"room {r.room}: still {KVPoll(r.state).name} after {timeout}s"
            ) from None
