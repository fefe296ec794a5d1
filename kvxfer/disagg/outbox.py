"""Per-peer outboxes for coalesced writes: how many writes are in flight to each peer, and
what waits until one of them completes. Pure bookkeeping on asyncio futures; what a write
*is* belongs to the caller (:mod:`kvxfer.disagg.coalesce`).

A key is *busy* — a new item waits — while ``after`` of its writes are in flight (begun,
not yet returned to their writer), or while ``after`` × :data:`BACKLOG` of them have not
been settled by the loop yet (their futures' done callbacks not run). The first is a link
whose writes overlap; the second a burst: rooms issued one after another on a scheduler
thread whose writes each finish inline, faster than the loop processes their completions —
batching them is what makes such a burst cheap, while a scheduler that sends its next
request on the last one's completion (one or two writes not yet settled) never waits
(bench/results/coalesce.md, "mixed workload").

Invariants
- ``waiting`` items of a key exist only while a tracked write of that key is unsettled
  (:meth:`Outboxes.add` is for callers that saw :meth:`Outboxes.busy`); whenever a write
  returns or settles, the key's outbox drains if the key is no longer busy, so an item
  waits at most for its key's writes (each bounded by its caller's timeout) and at most
  ``max_wait_s``.
- A drained batch holds at most ``max_batch`` items, in arrival order; the rest go when the
  batch's own write (tracked like any other) returns or settles.
- ``inflight`` and ``unsettled`` never count a write twice and always return to 0: a write
  counts in both from :meth:`Outboxes.begin` (or :meth:`Outboxes.track`); it leaves
  ``inflight`` when its writer ends its :class:`Ticket` (the moment the write returned,
  before the room is reported done) or when it settles, whichever is first, and
  ``unsettled`` when its future's done callback runs (:meth:`Outboxes.watch`).
- An item waits at most ``max_wait_s`` (plus the loop's timer resolution, ~1 ms with
  epoll): then what waits goes as a batch even though no write completed (a write in
  flight may be a long one; a small request must not wait for all of it).

Runs on: one event loop's thread (or its guest, kvxfer.loop_thread), never two at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, TypeVar

T = TypeVar("T")

#: the longest an item waits for a write of its key to complete before it goes anyway
MAX_WAIT_S = 0.001
#: a key is also busy while ``after`` x this many of its writes await settling (a burst)
BACKLOG = 4


class Ticket:
    """One write to ``key``: in flight until :meth:`Outboxes.end`, unsettled until
    :meth:`Outboxes.settle` (both idempotent)."""

    __slots__ = ("key", "flying", "pending")

    def __init__(self, key: Hashable) -> None:
        self.key, self.flying, self.pending = key, True, True


class Outboxes(Generic[T]):
    """``after``: a key is busy from this many writes in flight, or ``after`` x
    :data:`BACKLOG` unsettled (0: never busy); ``start(key, batch, ticket)`` starts the one
    write of a drained batch (counted under ``ticket``, which the write may end early) and
    returns its future."""

    def __init__(
        self,
        after: int,
        start: Callable[[Any, List[T], Optional[Ticket]], "asyncio.Future[Any]"],
        max_batch: int,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        self.after = after
        self._start = start
        self._max = max_batch
        self._max_wait = max_wait_s
        self.inflight: Dict[Hashable, int] = {}
        self.unsettled: Dict[Hashable, int] = {}
        self.waiting: Dict[Hashable, List[T]] = {}
        #: per key with waiting items: the timer that sends them after ``max_wait_s``
        self._timers: Dict[Hashable, asyncio.TimerHandle] = {}

    def begin(self, key: Hashable) -> Optional[Ticket]:
        """Count a write to ``key`` in flight and unsettled (None: ``after`` is 0, nothing
        is counted)."""
        if self.after <= 0:
            return None
        self.inflight[key] = self.inflight.get(key, 0) + 1
        self.unsettled[key] = self.unsettled.get(key, 0) + 1
        return Ticket(key)

    def watch(self, ticket: Optional[Ticket], fut: "asyncio.Future[Any]") -> None:
        """Settle ``ticket`` when ``fut`` is done: now if it is (a write that ended on its
        starter's stack: a done callback would be one more loop callback, and after a guest
        run a wake-up of the idle loop, LoopThread.run_here)."""
        if ticket is None:
            return
        if fut.done():
            self.settle(ticket)
        else:
            fut.add_done_callback(lambda _f: self.settle(ticket))

    def track(self, key: Hashable, fut: "asyncio.Future[Any]") -> Optional[Ticket]:
        """Count ``fut`` (a write to ``key``) in flight until the returned ticket ends or
        ``fut`` is done, unsettled until ``fut`` is done."""
        ticket = self.begin(key)
        self.watch(ticket, fut)
        return ticket

    def busy(self, key: Hashable) -> bool:
        """Whether a new item for ``key`` should wait (``after`` writes in flight, or
        ``after`` x :data:`BACKLOG` unsettled)."""
        after = self.after
        return after > 0 and (
            self.inflight.get(key, 0) >= after or self.unsettled.get(key, 0) >= after * BACKLOG
        )

    def add(self, key: Hashable, item: T) -> None:
        """Queue ``item`` for ``key``'s next batch (call only while :meth:`busy`); it goes
        when ``key`` is no longer busy, or after ``max_wait_s`` at the latest."""
        items = self.waiting.setdefault(key, [])
        items.append(item)
        if len(items) == 1:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(self._max_wait, self._send, key)

    def withdraw(self, key: Hashable, match: Callable[[T], bool]) -> Optional[T]:
        """Remove and return the first waiting item of ``key`` that ``match`` es (None)."""
        items = self.waiting.get(key)
        if not items:
            return None
        for i, item in enumerate(items):
            if match(item):
                del items[i]
                if not items:
                    self._emptied(key)
                return item
        return None

    def _emptied(self, key: Hashable) -> None:
        del self.waiting[key]
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def _send(self, key: Hashable) -> None:
        """Start the next batch of ``key`` (its items waited long enough, or the key is no
        longer busy). Runs on: the loop thread (or its guest)."""
        items = self.waiting.get(key)
        if not items:
            return
        batch = items[: self._max]
        del items[: self._max]
        if items:  # more than one batch waits: the rest after max_wait_s again at most
            old = self._timers.get(key)
            if old is not None:
                old.cancel()
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(self._max_wait, self._send, key)
        else:
            self._emptied(key)
        ticket = self.begin(key)
        self.watch(ticket, self._start(key, batch, ticket))

    def end(self, ticket: Optional[Ticket]) -> None:
        """The write returned (its writer, before it reports the room done): it is no longer
        in flight, and what waits for its key goes if the key is no longer busy. Runs on:
        the loop thread (or its guest), on the writer's stack."""
        if ticket is not None and ticket.flying:
            self._landed(ticket)
            self._drain(ticket.key)

    def settle(self, ticket: Ticket) -> None:
        """The write's future is done (it returned, if its writer did not say so). Runs on:
        the loop thread (a done callback)."""
        if not ticket.pending:
            return
        ticket.pending = False
        if ticket.flying:
            self._landed(ticket)
        key = ticket.key
        self.unsettled[key] -= 1
        if not self.unsettled[key]:
            del self.unsettled[key]
        self._drain(key)

    def _landed(self, ticket: Ticket) -> None:
        ticket.flying = False
        self.inflight[ticket.key] -= 1
        if not self.inflight[ticket.key]:
            del self.inflight[ticket.key]

    def _drain(self, key: Hashable) -> None:
        if self.waiting.get(key) and not self.busy(key):
            self._send(key)
