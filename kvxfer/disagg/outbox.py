"""Per-peer outboxes for coalesced writes: how many writes are in flight to each peer, and
what waits until one of them completes. Pure bookkeeping on asyncio futures; what a write
*is* belongs to the caller (:mod:`kvxfer.disagg.coalesce`).

Invariants
- ``waiting`` items of a key exist only while a tracked write of that key is in flight
  (:meth:`Outboxes.add` is for callers that saw :meth:`Outboxes.busy`); each completion of
  one drains the key's outbox when fewer than ``after`` remain in flight, so an item waits
  at most for one write (each bounded by its caller's timeout).
- A drained batch holds at most ``max_batch`` items, in arrival order; the rest go when the
  batch's own write (tracked like any other) completes.
- ``inflight`` never counts a write twice and always returns to 0. A write counts until its
  future's done callback runs on the loop — after its writer reported the room done — so a
  burst of rooms issued before the loop catches up with completions finds them counted and
  coalesces (an earlier variant that stopped counting when the write returned never
  coalesced such a burst on the H200: bench/results/coalesce.md, "mixed workload").
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


class Outboxes(Generic[T]):
    """``after``: a key is busy from this many writes in flight (0: never busy);
    ``start(key, batch)`` starts the one write of a drained batch and returns its future."""

    def __init__(
        self,
        after: int,
        start: Callable[[Any, List[T]], "asyncio.Future[Any]"],
        max_batch: int,
        max_wait_s: float = MAX_WAIT_S,
    ) -> None:
        self.after = after
        self._start = start
        self._max = max_batch
        self._max_wait = max_wait_s
        self.inflight: Dict[Hashable, int] = {}
        self.waiting: Dict[Hashable, List[T]] = {}
        #: per key with waiting items: the timer that sends them after ``max_wait_s``
        self._timers: Dict[Hashable, asyncio.TimerHandle] = {}

    def track(self, key: Hashable, fut: "asyncio.Future[Any]") -> None:
        """Count ``fut`` (a write to ``key``) in flight until it is done."""
        if self.after <= 0:
            return
        self.inflight[key] = self.inflight.get(key, 0) + 1
        fut.add_done_callback(lambda _f: self._settled(key))

    def busy(self, key: Hashable) -> bool:
        """Whether a new item for ``key`` should wait (``after`` writes in flight)."""
        return self.after > 0 and self.inflight.get(key, 0) >= self.after

    def add(self, key: Hashable, item: T) -> None:
        """Queue ``item`` for ``key``'s next batch (call only while :meth:`busy`); it goes
        when a write of ``key`` completes, or after ``max_wait_s`` at the latest."""
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
        """Start the next batch of ``key`` (its items waited long enough, or a write of it
        completed). Runs on: the loop thread."""
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
        self.track(key, self._start(key, batch))

    def _settled(self, key: Hashable) -> None:
        """A write to ``key`` is done. Runs on: the loop thread (a done callback)."""
        left = self.inflight[key] - 1
        if left:
            self.inflight[key] = left
        else:
            del self.inflight[key]
        if self.waiting.get(key) and left < self.after:
            self._send(key)
