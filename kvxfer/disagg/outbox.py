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
- ``inflight`` never counts a write twice and always returns to 0.

Runs on: one event loop's thread (or its guest, kvxfer.loop_thread), never two at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, TypeVar

T = TypeVar("T")


class Outboxes(Generic[T]):
    """``after``: a key is busy from this many writes in flight (0: never busy);
    ``start(key, batch)`` starts the one write of a drained batch and returns its future."""

    def __init__(
        self,
        after: int,
        start: Callable[[Any, List[T]], "asyncio.Future[Any]"],
        max_batch: int,
    ) -> None:
        self.after = after
        self._start = start
        self._max = max_batch
        self.inflight: Dict[Hashable, int] = {}
        self.waiting: Dict[Hashable, List[T]] = {}

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
        """Queue ``item`` for ``key``'s next batch (call only while :meth:`busy`)."""
        self.waiting.setdefault(key, []).append(item)

    def withdraw(self, key: Hashable, match: Callable[[T], bool]) -> Optional[T]:
        """Remove and return the first waiting item of ``key`` that ``match`` es (None)."""
        items = self.waiting.get(key)
        if not items:
            return None
        for i, item in enumerate(items):
            if match(item):
                del items[i]
                if not items:
                    del self.waiting[key]
                return item
        return None

    def _settled(self, key: Hashable) -> None:
        """A write to ``key`` is done. Runs on: the loop thread (a done callback)."""
        left = self.inflight[key] - 1
        if left:
            self.inflight[key] = left
        else:
            del self.inflight[key]
        items = self.waiting.get(key)
        if items and left < self.after:
            batch = items[: self._max]
            del items[: self._max]
            if not items:
                del self.waiting[key]
            self.track(key, self._start(key, batch))
