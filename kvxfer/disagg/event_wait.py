"""Wake the loop when a CUDA event completes, without polling it on the loop.

Layer-wise streaming (:mod:`kvxfer.disagg.layerwise`) gets a CUDA event per layer, recorded
after that layer's kernels. Polling ``ev.query()`` from the event loop either costs the loop
(and the scheduler thread's GIL) a wake-up every few tens of µs or, backed off, notices a
layer up to a millisecond late. Instead one daemon thread per process blocks in
``ev.synchronize()`` (the GIL released) on the events handed to it, in order, and schedules
each one's callback on its loop with ``call_soon_threadsafe``.

Invariants
- Callbacks run on the loop they were registered with, never on the waiter thread; a
  callback may run after the event was already seen done elsewhere (callers re-check).
- Events are waited for in the order they were handed over (a prefill's layers complete in
  order on its stream). A callback whose loop is closed is dropped.
- The waiter never bounds a wait: an event that never completes blocks it, so the caller
  keeps its own deadline (layerwise: ``transfer_s``, then TransferTimeout). The thread is a
  daemon and holds no lock while it waits.

Runs on: :func:`watch` on any thread (the loop's, in practice); the waiting on the
``kvxfer-events`` thread; callbacks on their loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable, Optional, Tuple

log = logging.getLogger(__name__)

_Item = Tuple[Any, asyncio.AbstractEventLoop, Callable[[], None]]

_lock = threading.Lock()
_queue: "queue.SimpleQueue[_Item]" = queue.SimpleQueue()
_thread: Optional[threading.Thread] = None


def watch(event: Any, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    """Run ``callback()`` on ``loop`` once ``event`` (anything with ``synchronize()``) has
    completed or its wait raised (the callback then finds out itself, e.g. from ``query()``)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="kvxfer-events", daemon=True)
            _thread.start()
    _queue.put((event, loop, callback))


def _run() -> None:
    while True:
        event, loop, callback = _queue.get()
        try:
            event.synchronize()
        except Exception as exc:  # a CUDA error: the callback's query() reports it
            log.debug("event wait raised: %s", exc)
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nobody waits for this event any more
            pass


__all__ = ["watch"]
