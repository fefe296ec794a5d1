"""Start a coroutine on the caller's stack: no event-loop iteration before its first line.

``loop.create_task(coro)`` runs nothing until the loop's next iteration: everything else
ready then runs first, and a loop that polls transports (UCXX's receive requests yield
with ``asyncio.sleep(0)``: with ``KVXFER_CHANNEL_WAIT=yield`` the loop never idles once a
peer is connected) makes that hop cost a full iteration, under the GIL of every other
thread (bench/results/plan-cpu.md). A
request's write hops once this way per chunk. :func:`start` instead runs the coroutine now,
up to its first real suspension (e.g. a write's flush: planning and posting happen on
the caller's stack), and only then continues it in a task: from Python 3.12 an eager task
(``asyncio.Task(..., eager_start=True)``: its first step runs as the current task, so
``asyncio.timeout`` / 3.12's ``wait_for`` work in it), before 3.12 the same written out with
``send`` / ``throw`` (there ``wait_for`` needs no current task; nothing in the write path
uses ``asyncio.timeout``).

Invariants (tests/unit/test_eager.py)
- The coroutine's first step runs before :func:`start` returns; once it suspends, it is
  resumed exactly as a task would resume it: after the future it awaits is done (or at the
  next iteration after a bare ``yield``), seeing that future's result, exception or
  cancellation.
- The returned future ends with the coroutine's result or exception; one that returned
  synchronously is already done, one that raised synchronously is a spawned task that
  raises it (its owner sees the failure as for any task). Cancelling the continuation task delivers
  ``CancelledError`` into the coroutine at its suspension point, as for a task (the future
  it awaits is cancelled; if that future was already done, the error is thrown in).
- Only the continuation is spawned (``spawn(coro)``: e.g. a manager's owned tasks, so its
  close cancels it; from 3.12 a follower of the eager task that cancels it when cancelled);
  a coroutine that returns without suspending spawns nothing.
"""

from __future__ import annotations

import asyncio
import collections.abc
import sys
from typing import Any, Callable, Coroutine

__all__ = ["start"]

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Future[Any]"]


def start(spawn: Spawn, coro: Coroutine[Any, Any, Any]) -> "asyncio.Future[Any]":
    """Run ``coro`` now until it first suspends, then continue it in ``spawn(...)``'s task;
    returns a future of its outcome. Call on the loop's thread."""
    if _NATIVE:
        return _start_native(spawn, coro)
    loop = asyncio.get_running_loop()
    try:
        yielded = coro.send(None)
    except StopIteration as exc:
        fut = loop.create_future()
        fut.set_result(exc.value)
        return fut
    except asyncio.CancelledError:
        fut = loop.create_future()
        fut.cancel()
        return fut
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the outcome, in a spawned task (its owner sees it fail)
        return spawn(_reraise(exc))
    return spawn(_Continuation(coro, yielded))


async def _reraise(exc: BaseException) -> Any:
    raise exc


_NOTHING = object()


class _Continuation(collections.abc.Coroutine):
    """The rest of a started coroutine, as a coroutine object a task can drive: the task's
    first ``send`` gets what the coroutine yielded when it suspended (the future it awaits,
    still marked as awaited, or None), so the task waits on it exactly as if it had run the
    first step itself; every later ``send`` / ``throw`` goes straight to the coroutine. A
    cancellation before the task's first step cancels that future and is thrown into the
    coroutine at its suspension point (what a task waiting on it would do)."""

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro = coro
        self._first = yielded

    def send(self, value: Any) -> Any:
        first, self._first = self._first, _NOTHING
        if first is not _NOTHING:
            return first
        return self._coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        first, self._first = self._first, _NOTHING
        if first is not _NOTHING and first is not None and not first.done():
            first._asyncio_future_blocking = False
            if isinstance(val if val is not None else typ, asyncio.CancelledError) or (
                isinstance(typ, type) and issubclass(typ, asyncio.CancelledError)
            ):
                first.cancel()
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        return self.send(None)


#: the interpreter starts tasks eagerly itself (Python 3.12+)
_NATIVE = sys.version_info >= (3, 12)


def _start_native(spawn: Spawn, coro: Coroutine[Any, Any, Any]) -> "asyncio.Future[Any]":
    task = asyncio.Task(coro, loop=asyncio.get_running_loop(), eager_start=True)  # type: ignore[call-arg]
    if not task.done() or (not task.cancelled() and task.exception() is not None):
        spawn(_follow(task))  # owned: cancelled with its owner; a failure is seen there
    return task


async def _follow(task: "asyncio.Task[Any]") -> Any:
    """The owner's handle on an eager task: its outcome; cancelling this cancels it."""
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
        raise
