"""LoopThread: a private asyncio event loop on a named daemon thread.

The one home of the "event loop in a thread" pattern, for owners whose callers are not async
(schedulers, tests, the CLI): :class:`kvxfer.sync.SyncEngine`,
:meth:`kvxfer.disagg.KVManager.start_background` and
:meth:`kvxfer.disagg.BootstrapServer.start_in_thread`.

Invariants:

* every wait of the calling thread is bounded: :meth:`LoopThread.start` and
  :meth:`LoopThread.run` raise :class:`~kvxfer.errors.TransferTimeout` (a ``TimeoutError``)
  past their timeout, :meth:`LoopThread.stop` joins for at most its timeout;
* an exception of the coroutine that starts the loop (``main``) or of one run on it reaches
  the caller unchanged; a failed ``main`` leaves no thread and a closed loop behind;
* the loop is closed on its own thread, after ``run_forever`` returned and the ``on_stop``
  coroutine (if any) ran; :meth:`LoopThread.stop` is idempotent and safe before ``start``;
* guest runs (:meth:`LoopThread.run_here`): the loop's thread holds the loop's *gate* (a
  lock) at all times except while it waits in its selector, so a thread that takes the gate
  knows the loop runs nothing until it gives the gate back; it then runs a function as if on
  the loop (the loop set as its running loop) and wakes the loop when done if the function
  scheduled what the loop's wait would not see in time (ready callbacks, a timer due before
  the wait ends), so that it runs there. The gate is never waited for
  by a guest (a busy loop means "hand it over as usual"), and once the loop ended its
  thread keeps it (no guest runs on a stopped loop). A guest that asked
  (:func:`settle_after`) first runs, still holding the gate, a few passes of what the loop
  would run on waking (a transport's arrived completions, the ready callbacks): work its
  caller waits for then ends on the caller's thread, with no wake-up and no hand-over back;
  a cancelled timer at the head of the loop's heap wakes nothing;
* a coroutine given to :meth:`LoopThread.submit_here` runs its first step (up to its first
  real suspension, :func:`kvxfer.eager.start`) as such a guest run, and the loop continues
  it from there; one that finishes within that step (a write whose flush ended inline)
  costs no thread hop at all. Where no guest run is possible the first step runs on the
  loop, in the order of :meth:`LoopThread.call` (the first steps of coroutines submitted so
  run in submission order, either way);
* calls handed over by :meth:`LoopThread.call` run in call order; those handed over before
  the loop took them share one wake-up (a queue drained by one callback), so a burst of
  calls while the loop is busy costs one self-pipe write, not one each
  (bench/results/coalesce.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import heapq
import selectors
import threading
import time
from asyncio import events
from typing import Any, Awaitable, Callable, Coroutine, List, Mapping, Optional, Tuple, TypeVar

from kvxfer import eager
from kvxfer.errors import Closed, TransferTimeout

T = TypeVar("T")


class _GatedSelector(selectors.BaseSelector):
    """The loop's selector, giving the gate away only while it waits for events. Runs on:
    the loop's thread."""

    def __init__(self, gate: threading.Lock) -> None:
        self._sel = selectors.DefaultSelector()
        self._gate = gate
        #: when the wait in progress ends by itself (``time.monotonic()``; inf: no timeout)
        #: and the loop's earliest timer then (the one it waits for, or None); read by
        #: guests, who hold the gate, so they are the current wait's
        self.until = 0.0
        self.first: Any = None
        #: the loop's timer heap (BaseEventLoop._scheduled), set by LoopThread
        self.timers: Optional[List[Any]] = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._sel.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._sel.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._sel.modify(fileobj, events, data)

    def select(self, timeout: Optional[float] = None) -> List[Tuple[selectors.SelectorKey, int]]:
        self.until = float("inf") if timeout is None else time.monotonic() + timeout
        self.first = self.timers[0] if self.timers else None
        self._gate.release()
        try:
            return self._sel.select(timeout)
        finally:
            self._gate.acquire()

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self._sel.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._sel.get_map()

    def close(self) -> None:
        self._sel.close()


#: per thread: set while that thread runs a guest run (any LoopThread's)
_local = threading.local()


def _settle(out: concurrent.futures.Future, fut: "asyncio.Future[Any]") -> None:
    """Copy an asyncio future's outcome into a concurrent one."""
    if fut.cancelled():
        out.cancel()
        return
    exc = fut.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(fut.result())


def _retrieve(task: "asyncio.Task[Any]") -> None:
    if not task.cancelled():
        task.exception()


def in_guest() -> bool:
    """True on a thread while it runs a function as some loop's guest
    (:meth:`LoopThread.run_here`): code that would wait inline (a transport's bounded wait
    for a flush) can tell it would block the caller's thread, not a loop's."""
    return getattr(_local, "guest", False)


def _wake() -> None:
    """Scheduled after a guest run: its only job is to make the loop run its ready queue."""


def _must_wake(loop: asyncio.AbstractEventLoop, sel: _GatedSelector) -> bool:
    """Whether a loop waiting in ``sel`` must be woken for what a guest scheduled: ready
    callbacks (a task's next step, a future's done callbacks), or a new earliest timer due
    before the wait ends. File descriptors a guest started watching need no wake (the wait
    in progress sees them). Reads ``BaseEventLoop``'s ready queue and timer heap (CPython
    3.8-3.13); a loop without them is always woken."""
    ready = getattr(loop, "_ready", None)
    timers = sel.timers
    if ready is None or timers is None:
        return True
    if ready:
        return True
    _drop_cancelled(loop, timers)
    return bool(timers) and timers[0] is not sel.first and timers[0].when() < sel.until


def _drop_cancelled(loop: asyncio.AbstractEventLoop, timers: List[Any]) -> None:
    """Pop the cancelled timers at the head of the loop's heap, as its next iteration would
    (CPython's ``BaseEventLoop._run_once``): a bounded wait that ended before its timer (a
    write's deadline, cancelled) must not wake the loop for nothing. Runs on: a guest,
    holding the gate."""
    if not hasattr(loop, "_timer_cancelled_count"):
        return
    while timers and timers[0]._cancelled:
        handle = heapq.heappop(timers)
        handle._scheduled = False
        loop._timer_cancelled_count -= 1  # type: ignore[attr-defined]


def settle_after(transport: Any) -> None:
    """Ask the guest run in progress on this thread, if any (:meth:`LoopThread.run_here`),
    to run, once its function returned, what the loop's wake-up would run first: the
    completions that reached ``transport`` meanwhile (``take_completions``) and the ready
    callbacks they and the guest left (:meth:`LoopThread._settle_ready`). For a guest that
    left work whose end its caller waits for (a room's earlier decode legs:
    :func:`kvxfer.disagg.tp_rooms.prefill_send`). Elsewhere (on the loop's own thread) a
    no-op: the loop runs them next anyway. Runs on: any thread."""
    if getattr(_local, "guest", False):
        _local.settle = transport


class LoopThread:
    """One event loop, run by one daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: held by the loop's thread except while it waits for events (see the module doc);
        #: held from birth, so no guest runs before the loop does
        self._gate = threading.Lock()
        self._gate.acquire()
        self._sel = _GatedSelector(self._gate)
        self.loop: asyncio.AbstractEventLoop = asyncio.SelectorEventLoop(self._sel)
        self._sel.timers = getattr(self.loop, "_scheduled", None)
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        #: the thread of the guest run in progress (None: none)
        self._guest: Optional[int] = None
        #: calls :meth:`call` handed over, and how many of them started on the loop: a
        #: direct call runs only when they are equal (call order is kept)
        self._calls_lock = threading.Lock()
        self._calls_posted = 0
        self._calls_run = 0
        #: handed-over calls not yet taken by the loop (under ``_calls_lock``); one
        #: :meth:`_drain` is scheduled whenever it is not empty: calls handed over while the
        #: loop is busy share one wake-up (one self-pipe write) instead of one each
        self._inbox: List[Tuple[Callable[..., Any], Tuple[Any, ...]]] = []
        #: how many of :meth:`call`'s calls ran direct (counted under the gate)
        self.direct_calls = 0
        #: how many guest runs woke the loop afterwards (counted under the gate)
        self.guest_wakes = 0
        #: callbacks run by guests at their end (:func:`settle_after`)
        self.guest_settled = 0

    def __repr__(self) -> str:
        return f"LoopThread({self.name})"

    @property
    def running(self) -> bool:
        """True between a successful :meth:`start` and :meth:`stop`."""
        return self._thread is not None and not self._stopped

    def cpu_seconds(self) -> float:
        """CPU time the loop's thread has used so far (its POSIX thread CPU clock; callable
        from any thread); 0.0 before :meth:`start`. An idle loop sleeps in epoll and
        adds ~nothing (UCX channels: see kvxfer.transport.ucx_channel)."""
        th = self._thread
        if th is None or th.ident is None:
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(th.ident))
        except OSError:  # the thread ended
            return 0.0

    def start(
        self,
        main: Optional[Coroutine[Any, Any, T]] = None,
        timeout: float = 10.0,
        *,
        on_stop: Optional[Callable[[], Awaitable[Any]]] = None,
    ) -> Optional[T]:
        """Start the thread and, if given, run ``main`` on the loop before anything else;
        return its result once it finished (within ``timeout``), or raise its exception.
        ``on_stop()`` is awaited on the loop after :meth:`stop` stopped it, before it closes."""
        if self._thread is not None or self._stopped:
            if main is not None:
                main.close()
            raise Closed(f"{self!r} was already started")
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(main, on_stop, ready), name=self.name, daemon=True
        )
        self._thread.start()
        try:
            return ready.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout(f"{self.name}: did not start within {timeout:g}s") from None
        except BaseException:
            self._thread.join(timeout)  # it ends right after reporting the failure
            self._thread = None
            self._stopped = True
            raise

    def _main(
        self,
        main: Optional[Coroutine[Any, Any, Any]],
        on_stop: Optional[Callable[[], Awaitable[Any]]],
        ready: concurrent.futures.Future,
    ) -> None:
        """Runs on: this object's thread (the body of the loop thread)."""
        loop = self.loop
        asyncio.set_event_loop(loop)
        result = None
        if main is not None:
            try:
                result = loop.run_until_complete(main)
            except BaseException as exc:  # reported to the caller of start()
                ready.set_exception(exc)
                loop.close()
                return
        ready.set_result(result)
        try:
            loop.run_forever()
            if on_stop is not None:
                loop.run_until_complete(on_stop())
        finally:
            loop.close()

    def in_loop(self) -> bool:
        """True when called on the loop's own thread, or in a guest run (:meth:`run_here`)."""
        tid = threading.get_ident()
        return tid == self._guest or (self._thread is not None and tid == self._thread.ident)

    def run_here(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the calling thread as if on the loop, when the loop waits for
        events: the loop is this thread's running loop meanwhile and runs nothing itself;
        afterwards it is woken if ``fn`` scheduled callbacks or an earlier timer (even when
        ``fn`` raised). Returns ``fn``'s result as a bool (whether it did its work), or False at
        once, without calling ``fn``, when the loop is busy, stopped or not started, or the
        calling thread runs an event loop of its own. ``fn``'s exception propagates.

        Runs on: any thread but the loop's (the loop's own calls ``fn`` itself)."""
        if self._stopped or self._thread is None or events._get_running_loop() is not None:
            return False
        if not self._gate.acquire(blocking=False):
            return False
        done = wake = False
        try:
            events._set_running_loop(self.loop)
            self._guest = threading.get_ident()
            _local.guest = True
            try:
                done = bool(fn(*args))
                settle = getattr(_local, "settle", None)
                if settle is not None:
                    self.guest_settled += self._settle_ready(settle)
            finally:
                _local.settle = None
                _local.guest = False
                self._guest = None
                events._set_running_loop(None)
                wake = _must_wake(self.loop, self._sel)
                self.guest_wakes += wake
        finally:
            self._gate.release()
            if wake:  # also when fn raised: what it scheduled before still runs
                try:
                    self.loop.call_soon_threadsafe(_wake)
                except RuntimeError:  # closed meanwhile: nothing left to run it
                    pass
        return done

    def _settle_ready(self, transport: Any, passes: int = 4) -> int:
        """:func:`settle_after`'s work, at the end of a guest run (holding the gate): up to
        ``passes`` times, take ``transport``'s completions and run the loop's ready callbacks
        as they stand (what its next iteration would run first, minus timers and file
        events, which stay the loop's); returns how many ran. Reads ``BaseEventLoop``'s
        ready queue (CPython 3.8-3.13, as :func:`_must_wake`); a loop without one runs
        nothing here. Runs on: the guest's thread."""
        ready = getattr(self.loop, "_ready", None)
        if ready is None:
            return 0
        ran = 0
        for _ in range(passes):
            transport.take_completions()
            n = len(ready)
            if not n:
                break
            for _ in range(n):
                handle = ready.popleft()
                if not handle._cancelled:
                    handle._run()  # (a callback's exception goes to the loop's handler)
                    ran += 1
        return ran

    def submit_here(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """As :meth:`submit`, but ``coro``'s first step (up to its first real suspension,
        :func:`kvxfer.eager.start`) runs now on the calling thread as the loop's guest when
        :meth:`call` would run a direct call (the loop waits for events and every call
        handed over before has started); else it runs on the loop, handed over through
        :meth:`call` (so first steps run in submission order). The loop continues the
        coroutine from its suspension in a task. The returned future is already done when
        the coroutine finished within a guest first step (no thread hop either way).

        Runs on: any thread but the loop's (there, use ``create_task``)."""
        if self._stopped or self._thread is None:
            coro.close()
            raise Closed(f"{self!r} is not running")
        out: "concurrent.futures.Future[T]" = concurrent.futures.Future()
        try:
            self.call(self._first_step, coro, out, direct=True)
        except BaseException:
            coro.close()
            raise
        return out

    def _first_step(self, coro: Coroutine[Any, Any, Any], out: concurrent.futures.Future) -> None:
        """:meth:`submit_here`'s first step. Runs on: the calling thread as the loop's guest,
        or the loop's thread (the outcome's copy into ``out``: then, or on the loop's
        thread when the coroutine ends)."""
        fut = eager.start(self._own_task, coro)
        if fut.done():
            _settle(out, fut)
        else:
            fut.add_done_callback(functools.partial(_settle, out))

    def _own_task(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]":
        """A continuation's task (:func:`kvxfer.eager.start`'s ``spawn``); its outcome is
        always retrieved (the caller sees it through :meth:`submit_here`'s future)."""
        task = self.loop.create_task(coro)
        task.add_done_callback(_retrieve)
        return task

    def take_completions(self, transport: Any) -> bool:
        """``transport.take_completions()`` (:class:`kvxfer.transport.base.Transport`) now, as
        this loop's guest (:meth:`run_here`), when its completion queue holds something;
        returns whether it ran and handled anything. One native read when nothing arrived;
        False for a ``None`` transport. Runs on: any thread but the loop's (a scheduler's
        ``poll()``)."""
        if transport is None or not transport.completions_queued():
            return False
        return self.run_here(transport.take_completions)

    def call(self, fn: Callable[..., Any], *args: Any, direct: bool = False) -> bool:
        """Run ``fn(*args)`` on the loop, handed over (never blocks); with ``direct`` (a short
        step the caller would otherwise wait a loop wake-up for) instead now, on the calling
        thread as the loop's guest (:meth:`run_here`), when the loop waits for events and
        every call handed over by this method before has started. Calls made through this
        method run in the order they were made either way (per calling thread; across
        threads, in the order they got here); an exception of ``fn`` goes to the loop's
        exception handler either way. Returns True when ``fn`` ran direct.

        Runs on: any thread (on the loop's own, or in a guest run, it is handed over)."""
        if direct and self.run_here(self._guest_call, fn, args):
            return True
        if self._stopped:
            raise Closed(f"{self!r} is stopped")
        with self._calls_lock:
            self._calls_posted += 1
            self._inbox.append((fn, args))
            if len(self._inbox) == 1:  # else a drain is scheduled and will take it too
                self.loop.call_soon_threadsafe(self._drain)
        return False

    def _drain(self) -> None:
        """Run the calls handed over so far, in order (those handed over meanwhile go with
        the next drain, which they scheduled); a call's exception goes to the loop's
        exception handler, as a failed callback's would, and the rest still run.
        Runs on: the loop thread."""
        with self._calls_lock:
            calls, self._inbox = self._inbox, []
        for fn, args in calls:
            self._calls_run += 1
            try:
                fn(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self.loop.call_exception_handler(
                    {"message": f"{self.name}: exception in a call of {fn!r}", "exception": exc}
                )

    def _guest_call(self, fn: Callable[..., Any], args: Tuple[Any, ...]) -> bool:
        """:meth:`call`'s direct run, holding the gate: only once every call handed over
        before it has started (else False: it is handed over behind them). Runs on: the
        calling thread, as the loop's guest."""
        if self._calls_run != self._calls_posted:
            return False
        self.direct_calls += 1
        try:
            fn(*args)
        except Exception as exc:  # as the loop reports a failed callback
            self.loop.call_exception_handler(
                {"message": f"{self.name}: exception in a direct call of {fn!r}", "exception": exc}
            )
        return True

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop from any thread; never blocks (unordered with
        :meth:`call`'s direct runs: use :meth:`call` where that order matters)."""
        if self._stopped:
            raise Closed(f"{self!r} is stopped")
        self.loop.call_soon_threadsafe(fn, *args)

    def submit(self, coro: Coroutine[Any, Any, T]) -> "concurrent.futures.Future[T]":
        """Schedule ``coro`` on the loop from another thread; never blocks."""
        if self._stopped or self._thread is None:
            coro.close()
            raise Closed(f"{self!r} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, *, what: str = "call") -> T:
        """Run ``coro`` on the loop from another thread and return its result; past
        ``timeout`` it is cancelled and :class:`TransferTimeout` raised."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeout(
                f"{self.name}: {what} did not finish within {timeout:.3g}s"
            ) from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (then ``on_stop`` runs and the loop closes on its thread) and join
        the thread for at most ``timeout``. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        thread, self._thread = self._thread, None
        if thread is None:  # never started
            self.loop.close()
            return
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed meanwhile by its own thread
                pass
        thread.join(timeout)
