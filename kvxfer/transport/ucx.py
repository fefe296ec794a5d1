"""UCX implementation of the transport contract: :class:`UcxTransport`, the process-side
factory. UCXX provides context, worker, listener and endpoints; the native ``_rma``
extension registrations, keys, batched PUTs and flushes. The pieces live beside it: the
control path in :mod:`.ucx_channel`, registrations and the RMA endpoint in :mod:`.ucx_rma`,
loading and error mapping in :mod:`.ucx_lib`.

Facts this module relies on (where each callback runs: the threads table in docs/engine.md):
- UCXX runs one UCP context/worker per process in ``UCS_THREAD_MODE_MULTI`` with a progress
  *thread* by default; that thread also progresses the target side of RMA (needed over
  tcp). It sleeps on the worker's event fd between wake-ups (with a timeout).
- Only UCXX's progress thread progresses UCXX's worker (UCXX's listener callback hands
  endpoint creation to that thread and waits for it: run on any other progressing thread, it
  stalls 3 x 3 s on the worker lock that thread holds). kvxfer's own worker (``own_rma``,
  docs/engine.md "Own worker") is progressed by its completion queue's thread and a chain's
  starter. Flush and close completions arrive on those threads;
  ``_rma.CompletionQueue`` queues them and signals an eventfd that the event loop watches
  (``loop.add_reader``): every completion is handled on the loop thread, or as the loop's
  guest by the own worker's thread that received it (:meth:`UcxTransport.take_natively`:
  a manager's native takes, docs/engine.md "Native takes"). While a ``spin``
  flush is in flight the queue's native poller thread wakes UCXX's progress thread every
  :data:`POLL_SIGNAL_US` (``ucp_worker_signal``): cuda_ipc completions never signal the
  worker fd, so they would otherwise wait for UCXX's next timeout tick (event vs spin:
  bench/results/transfer-h200-flush.md).
- Endpoints with peer error handling lose shared-memory lanes for host memory; a second
  endpoint built from the peer's worker address with error mode NONE keeps them
  (``error_mode="none"``, see :meth:`UcxTransport.rma_endpoint`). UCXX builds such endpoints
  without an error handler, and then UCX aborts the process when the peer dies mid-PUT; ours
  (``_rma.CompletionQueue.ep_create``) installs one, and the death is reported instead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from kvxfer.config import usable_cpus
from kvxfer.errors import (
    Closed,
    IncompatiblePeer,
    InvalidArgument,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
    TransportError,
)
from kvxfer.kernels.cuda_driver import keeps_gil
from kvxfer.loop_thread import in_guest
from kvxfer.transport.base import (
    AcceptCallback,
    Channel,
    Region,
    RmaEndpoint,
    Transport,
    set_note_arrival,
)
from kvxfer.transport.ucx_channel import (
    OPEN_TIMEOUT_S,
    UcxChannel,
    channel_wait_mode,
    new_epoch,
    retrieve,
)
from kvxfer.transport.ucx_lib import load_ucx, status_error, ucx_error_types
from kvxfer.transport.ucx_rma import UcxRegion, UcxRma
from kvxfer.wire import PROTOCOL_VERSION

log = logging.getLogger(__name__)

#: default bound (µs) on progressing the worker inside a chain's starting call: a shared
#: memory flush completes in a few µs but signals nothing, so without it the flush waited
#: for UCXX's progress thread's next wake-up (up to its 1 ms epoll timeout); figures in
#: bench/results/latency-cpu.md
CHAIN_INLINE_US = 50.0
#: an inline wait on kvxfer's own worker by a scheduler's thread (a loop's guest) yields
#: the CPU after each progress call that did nothing where this process may use fewer CPUs
#: than this: on the 2-core box spinning there put multi-ms stalls into the p99, yielding
#: took them away and kept the p50 gain; on the 16-core H200 host yielding cost requests/s
#: (bench/results/guest-writes-cpu.md, issue15-status.md)
YIELD_BELOW_CPUS = 4


def guest_inline_us() -> float:
    """The default of :attr:`UcxTransport.guest_inline_us`: ``$KVXFER_GUEST_INLINE_US``,
    else :data:`CHAIN_INLINE_US`."""
    env = os.environ.get("KVXFER_GUEST_INLINE_US")
    return CHAIN_INLINE_US if env is None else float(env)


def inline_yield() -> bool:
    """The default of :attr:`UcxTransport.inline_yield`: ``$KVXFER_INLINE_YIELD`` (0 or
    1), else whether this process may use fewer than :data:`YIELD_BELOW_CPUS` CPUs."""
    env = os.environ.get("KVXFER_INLINE_YIELD")
    if env is not None:
        return env not in ("", "0")
    return usable_cpus() < YIELD_BELOW_CPUS


#: opt-in, read when a transport makes its completion queue: set to 1, the queue holds one
#: spinner for the transport's whole life, as during a spin flush: the own worker's thread
#: progresses it back to back (then 10 µs naps after 2 ms idle, 200 µs naps after 0.1 s)
#: instead of sleeping on the worker's event fd while nothing is in flight (without an own
#: worker, the native poller wakes UCXX's progress thread the same way), so an arriving
#: notification or flush completion needs no thread woken. For many-core hosts where waking a thread is slow: on
#: the lent H200 VM a notification then reached the receiving process 2-12 µs after the
#: sender's flush instead of 48-171 µs, single-peer 125 MiB requests 5-14% faster; on the
#: 2-core CPU box it takes the other threads' core (1-page PD 6-7x slower). Off by
#: default (bench/results/tp-pattern-h200.md, sixth session)
NOTE_SPIN_ENV = "KVXFER_NOTE_SPIN"

#: read when a transport makes its completion queue: how long (µs) after its last
#: productive progress call the own worker's thread, with nothing in flight, polls its armed
#: event fd without sleeping before it sleeps on it (``$KVXFER_SPIN_LINGER_US``; 0: at
#: once). A notification that comes within the window needs no thread woken, and no worker
#: lock is taken meanwhile; where inline waits yield (:func:`inline_yield`) it yields the
#: core between polls. A first version progressed the worker back to back instead (also
#: while requests were in flight): it removed the wake-up too but cost concurrent
#: requests/s and the p99 on an H100 host (its lock and CUDA event polls against the
#: posting loop thread, not isolated) and the p99 on the 2-CPU box; this one, on that box:
#: 1-page PD p50 0.74x, p99 0.90x, requests/s 1.12x (bench/results/spin-linger-cpu.md,
#: spin-linger-h100.md)
SPIN_LINGER_US = 1000.0
SPIN_LINGER_ENV = "KVXFER_SPIN_LINGER_US"


def spin_linger_us() -> float:
    """The own worker's thread's linger (µs): ``$KVXFER_SPIN_LINGER_US`` (a number ≥ 0),
    else :data:`SPIN_LINGER_US`; :class:`InvalidArgument` for anything else."""
    env = os.environ.get(SPIN_LINGER_ENV)
    if env is None or env.strip() == "":
        return SPIN_LINGER_US
    try:
        us = float(env)
    except ValueError:
        us = -1.0
    if not 0.0 <= us <= 1e9:
        raise InvalidArgument(f"${SPIN_LINGER_ENV}={env!r}: expected a number of µs, 0 to 1e9")
    return us


#: how often the native poller (and a chain's inline wait) wakes UCXX's progress thread while
#: a spin flush is in flight (KVXFER_POLL_SIGNAL_US)
POLL_SIGNAL_US = 5.0


def _binding(ch: UcxChannel) -> str:
    """``client>server`` addresses of a channel, for a log line ("?" once it is gone)."""
    try:
        return ch.binding().decode()
    except Exception:  # the endpoint failed or closed meanwhile
        return "?"


#: bound on :func:`_prime_progress_start` (an import and, with a GPU, a context)
PRIME_TIMEOUT_S = 60.0


def _prime_progress_start() -> None:
    """Run, once and to its end, what UCXX's progress thread does first when it starts
    (``ucxx._lib_async.continuous_ucx_progress._create_context``: import ``cuda.core``, which
    loads a dozen extension modules and readline, and make device 0's primary context current
    where there is a GPU), on a helper thread joined here, before ``ucxx.init`` starts that
    thread. Left to that thread, the work loaded libraries while this thread went on to make
    kvxfer's UCP context, registrations and worker, and UCX installs its memory hooks by
    patching the loaded libraries: a worker died with SIGSEGV in the completion queue's
    worker creation while UCXX's thread was loading readline, about once in 1000 worker
    starts on the 2-CPU box (bench/results/host-lane-cpu.md, "A crash seen on the way").
    UCXX's thread then finds the modules loaded (and the context made). Errors (no GPU, no
    cuda.core, another UCXX) are left to UCXX's thread, which meets them as before. Runs on:
    a helper thread; joined (bounded) by the caller."""
    try:
        from ucxx._lib_async.continuous_ucx_progress import _create_context
    except ImportError:
        return

    def run() -> None:
        try:
            _create_context()
        except Exception as exc:  # noqa: BLE001 - UCXX's thread meets the same
            log.debug("priming UCXX's progress-thread start: %s", exc)

    th = threading.Thread(target=run, name="kvxfer-ucxx-prime", daemon=True)
    th.start()
    th.join(PRIME_TIMEOUT_S)


class UcxTransport(Transport):
    """One per engine; all engines of a process share UCXX's context and worker."""

    def __init__(
        self,
        ucx_options: Optional[dict] = None,
        progress_mode: str = "thread",
        own_rma: bool = False,
    ):
        self.ucxx, self.rma = load_ucx()
        from ucxx import core as _core

        if _core._ctx is None:
            _prime_progress_start()
            self.ucxx.init(options=dict(ucx_options or {}), progress_mode=progress_mode)
        elif ucx_options:
            log.warning(
                "UCX already initialised in this process; ignoring ucx_options=%r", ucx_options
            )
        self._app = _core._get_ctx()
        self.worker_handle = self._app.worker.handle
        #: ``own_rma`` (the engine decides: config.own_worker; RMA then only over bulk
        #: endpoints to the peer's address): registrations and bulk endpoints use kvxfer's
        #: own UCP context (process-wide, thread-shared) and worker (one per transport,
        #: progressed only by its completion queue's thread and a chain's starter, never by
        #: UCXX: nothing of UCXX runs there). Else UCXX's context and worker.
        self.own_rma = own_rma
        if self.own_rma:
            opts = {str(k): str(v) for k, v in (ucx_options or {}).items()}
            try:
                self.context_handle = self.rma.own_context(opts)
            except self.rma.UcxError as exc:  # e.g. an unknown option
                raise TransportError(f"kvxfer's UCP context: {exc.args[1]}") from None
        else:
            self.context_handle = self._app.context.handle
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._cq: Any = None  # _rma.CompletionQueue, made on the loop that first needs it
        #: what the own worker's thread calls after queueing completions (take_natively)
        self._native_take: Optional[Callable[[], Any]] = None
        self._tokens = itertools.count(1)
        self._waiters: Dict[int, asyncio.Future] = {}  # token -> (status, t) future
        self._flushes: Dict[int, asyncio.Future] = {}  # token -> t future (flush_future)
        self._watch: Dict[int, Callable[[int], None]] = {}  # endpoint error tokens
        self._notes: Dict[int, Callable[[Optional[bytes]], None]] = {}  # token -> receiver
        #: how long a chain's starter waits for the chain (signalling UCXX's progress thread)
        #: before it leaves it to the completion queue (KVXFER_CHAIN_INLINE_US; 0: never)
        self.chain_inline_us = float(os.environ.get("KVXFER_CHAIN_INLINE_US", CHAIN_INLINE_US))
        #: the same, for a chain on kvxfer's own worker started by a loop's guest
        #: (kvxfer.loop_thread.in_guest: a scheduler's thread) (KVXFER_GUEST_INLINE_US)
        self.guest_inline_us = guest_inline_us()
        #: an inline wait on the own worker yields the CPU after each progress call that did
        #: nothing (KVXFER_INLINE_YIELD; default: on hosts of fewer than YIELD_BELOW_CPUS)
        self.inline_yield = inline_yield()
        #: how long the own worker's thread waits on its event fd without sleeping after its
        #: last activity (KVXFER_SPIN_LINGER_US, SPIN_LINGER_US; 0: it sleeps at once); read
        #: when the completion queue is made
        self.spin_linger_us = spin_linger_us() if own_rma else 0.0
        #: chains and short PUT batches on kvxfer's own worker keep the GIL (the native side
        #: honours it only for that worker's endpoints; kvxfer.transport.ucx_rma.
        #: KEEP_GIL_MAX_OPS); not with ``$KVXFER_NATIVE_GIL=release``
        self.keep_gil = own_rma and keeps_gil()
        self._listener: Any = None  # ucxx.Listener
        self._closed = False
        #: tests only: what the channels of one role announce in their opening, overriding
        #: KVXFER_CHANNEL_WAIT and the protocol version, e.g. ``{"accept": {"mode":
        #: "yield"}, "connect": {"version": 99}}`` (both ends live in one process there)
        self.test_opening: Dict[str, Dict[str, Any]] = {}
        #: accepted connections whose opening failed the version / mode check (or was
        #: malformed); each is logged at warning level with its typed error
        self.refused_openings = 0
        self.last_refusal: Optional[Exception] = None
        #: called (on the loop) with that error once such a connection is closed
        self.on_refused: Optional[Callable[[Exception], None]] = None

    # -- event-loop side of flush completions
    def _bind_loop(self):
        if self._closed:
            raise Closed("transport closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._cq = self._make_queue()
            loop.add_reader(self._cq.fileno(), self._on_completions)
        elif self._loop is not loop:
            raise TransportError("a transport is bound to the event loop that started it")
        return loop

    def _make_queue(self):
        """The completion queue: with its own worker on kvxfer's context (:attr:`own_rma`),
        where every RMA endpoint lives, else on UCXX's worker alone (the poller then only
        signals UCXX's progress thread)."""
        signal_us = float(os.environ.get("KVXFER_POLL_SIGNAL_US", POLL_SIGNAL_US))
        if self.own_rma:
            q = self.rma.CompletionQueue(
                worker=self.worker_handle, signal_us=signal_us, context=self.context_handle
            )
        else:
            q = self.rma.CompletionQueue(worker=self.worker_handle, signal_us=signal_us)
        if os.environ.get(NOTE_SPIN_ENV, "") not in ("", "0"):
            q.spin_hold(True)  # see NOTE_SPIN_ENV
        if self.own_rma and self.spin_linger_us > 0:
            q.set_linger(self.spin_linger_us, self.inline_yield)  # see SPIN_LINGER_ENV
        if self._native_take is not None and self.own_rma:
            q.set_deliver(self._native_take)
        return q

    def take_natively(self, take: Optional[Callable[[], Any]]) -> bool:
        """See :meth:`Transport.take_natively`: with kvxfer's own worker (:attr:`own_rma`),
        whose completion queue's thread receives notifications and flush completions.
        ``take`` runs on that thread holding the GIL, between its progress calls (never
        inside one), and should hold no reference to this transport (a closure over a weak
        one): the native queue keeps it until set to None or closed."""
        if not self.own_rma:
            return False
        self._native_take = take
        if self._cq is not None:
            self._cq.set_deliver(take)
        return True

    def _on_completions(self) -> None:
        """Resolve the futures of completed native requests and report endpoint errors.
        Runs on: the asyncio loop thread (``add_reader`` on the completion queue's eventfd,
        which the native callbacks signal from UCXX's progress thread or the own worker's
        thread)."""
        note, oversize = self.rma.NOTE, self.rma.NOTE_OVERSIZE
        for token, status, t, payload in self._cq.drain():
            if status == note or status == oversize:  # oversize: payload None
                receiver = self._notes.get(token)
                if receiver is not None:
                    set_note_arrival(t)  # (stage traces: kvxfer.transport.base.note_arrival)
                    try:
                        receiver(payload)
                    except Exception:  # a receiver's bug must not stop the others
                        log.exception("notification receiver failed")
                    finally:
                        set_note_arrival(0.0)
                continue
            fut = self._flushes.pop(token, None)
            if fut is not None:
                if not fut.done():
                    if status == self.rma.UCS_OK:
                        fut.set_result(t)
                    else:
                        fut.set_exception(status_error(self.rma, status, "ucp_ep_flush"))
                continue
            fut = self._waiters.pop(token, None)
            if fut is not None:
                if not fut.done():
                    fut.set_result((status, t))
                continue
            watcher = self._watch.get(token)
            if watcher is not None:
                watcher(status)

    def completions_queued(self) -> bool:
        cq = self._cq
        return cq is not None and cq.queued > 0

    def take_completions(self) -> bool:
        if self._cq is None or self._closed or not self._cq.queued:
            return False
        self._on_completions()
        return True

    async def _start_and_wait(
        self, start, args, timeout: float, what: str, *extra
    ) -> Tuple[int, float]:
        """Start a native request completing through the queue; returns its status and the
        ``time.monotonic()`` at which UCX reported it."""
        loop = self._bind_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        self._waiters[token] = fut
        try:
            status = start(*args, token, *extra)
        except ValueError as exc:  # NULL handle
            self._waiters.pop(token, None)
            raise PeerClosed(str(exc)) from None
        if status is not None:
            self._waiters.pop(token, None)
            return status, time.monotonic()
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{what} not complete after {timeout:.3g} s") from None
        finally:
            self._waiters.pop(token, None)

    def flush_future(self, ep_handle: int, spin: bool = False) -> asyncio.Future:
        """Start an endpoint flush; the returned future resolves (with no intermediate task:
        the queue's eventfd callback sets it) to the monotonic time UCX reported completion,
        or fails with PeerClosed / TransportError. The caller bounds the wait and may
        complete the future itself (timeout, peer death); a late callback is ignored."""
        return self._started(
            lambda token: self._cq.ep_flush(ep_handle, token, spin), "ucp_ep_flush"
        )

    def chain_future(
        self,
        ep_handle: int,
        spin: bool,
        ctx: int,
        note_token: int,
        payload: bytes,
        inline: bool = True,
    ) -> asyncio.Future:
        """Start a native chain (``_rma`` ``flush_notify``): flush ``ep_handle``; its
        completion callback, on the thread progressing the endpoint's worker, sends ``payload``
        as an active message to the peer's ``note_token``. The call itself
        waits for up to :attr:`chain_inline_us` first: a chain that ends meanwhile
        returns a resolved future (no completion event, no wake-up of the loop). The future resolves to the
        monotonic time the chain ended (or fails: the flush failed and nothing was sent,
        PeerClosed / TransportError; or the endpoint was closing, PeerClosed). Like
        :meth:`flush_future`, unbounded, and set directly by the eventfd callback.
        ``inline=False``: no inline wait (the caller has more to start first)."""
        # a guest (a scheduler's thread) would progress kvxfer's own worker itself; waiting
        # on UCXX's worker only signals its progress thread, as on the loop
        wait_us = self.guest_inline_us if self.own_rma and in_guest() else self.chain_inline_us
        if not inline:
            wait_us = 0.0
        return self._started(
            lambda token: self._cq.flush_notify(
                ep_handle,
                token,
                spin,
                ctx,
                note_token,
                payload,
                wait_us,
                False,
                self.keep_gil,
                self.inline_yield,
            ),
            "flush + notify" if note_token else "ucp_ep_flush",
        )

    def note_future(
        self, ep_handle: int, ctx: int, note_token: int, payload: bytes
    ) -> asyncio.Future:
        """Send ``payload`` as a native active message to the peer's ``note_token`` on the
        RMA endpoint ``ep_handle`` now (no flush, no inline wait; ``ctx``: its error-handler
        context, whose closing cancels the send, or 0); resolves like :meth:`frame_future`."""
        return self._started(
            lambda token: self._cq.flush_notify(
                ep_handle, token, False, ctx, note_token, payload, 0.0, True, self.keep_gil
            ),
            "notification send",
        )

    def frame_future(self, ep_handle: int, note_token: int, payload: bytes) -> asyncio.Future:
        """Send ``payload`` as a native active message to the peer's ``note_token`` on
        ``ep_handle`` now (no flush first; ordered after earlier active messages on the
        endpoint): a :class:`UcxChannel` frame. The future resolves like
        :meth:`chain_future`'s once the message completed locally (eager: usually at once,
        a resolved future)."""
        return self._started(
            lambda token: self._cq.flush_notify(
                ep_handle, token, False, 0, note_token, payload, 0.0, True
            ),
            "channel frame send",
        )

    def _started(self, start: Callable[[int], Optional[int]], what: str) -> asyncio.Future:
        """Run ``start(token)`` (a native flush or chain) and return its future: resolved now
        when it ended inline, failed now when it could not start, else registered under
        ``token`` for the completion queue's callback."""
        loop = self._bind_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        try:
            status = start(token)
        except ValueError as exc:  # NULL handle
            fut.set_exception(PeerClosed(str(exc)))
            return fut
        if status is None:
            self._flushes[token] = fut
        elif status == self.rma.UCS_OK:
            fut.set_result(time.monotonic())
        else:
            fut.set_exception(status_error(self.rma, status, what))
        return fut

    def note_listen(self, callback: Callable[[Optional[bytes]], None], max_bytes: int = 0) -> int:
        """A fresh random 64-bit token routed to ``callback`` (see base.Transport): tokens
        are unguessable, so a notification reaches only the peer that was given it."""
        self._bind_loop()
        while True:
            token = int.from_bytes(os.urandom(8), "little")
            if token and token not in self._notes:
                break
        self._cq.note_listen(token, max_bytes)
        self._notes[token] = callback
        return token

    def note_limit(self, token: int, max_bytes: int) -> None:
        """Change ``token``'s size limit (0: none; see :meth:`note_listen`)."""
        if token in self._notes and self._cq is not None:
            self._cq.note_limit(token, max_bytes)

    def note_unlisten(self, token: int) -> None:
        if self._notes.pop(token, None) is not None and self._cq is not None:
            self._cq.note_unlisten(token)

    async def flush_ep(self, ep_handle: int, timeout: float, spin: bool = False) -> float:
        """Flush one endpoint; ``spin``: the queue's native poller keeps UCXX's progress
        thread progressing the worker until it completes. Returns the monotonic time UCX reported completion."""
        try:
            return await asyncio.wait_for(self.flush_future(ep_handle, spin), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"ucp_ep_flush not complete after {timeout:.3g} s") from None

    async def flush_worker(self, timeout: float, spin: bool = False) -> float:
        self._bind_loop()
        status, t = await self._start_and_wait(
            self._cq.worker_flush,
            (self._cq.own_worker or self.worker_handle,),
            timeout,
            "ucp_worker_flush",
            spin,
        )
        if status != self.rma.UCS_OK:
            raise status_error(self.rma, status, "ucp_worker_flush")
        return t

    async def close_bulk(self, ep: int, ctx: int, err_token: int, timeout: float) -> bool:
        """Close an endpoint made by :meth:`rma_endpoint`: a flush-mode close (its PUTs
        complete or fail first; UCX refuses a forced close of an error-mode-NONE endpoint
        and leaves it open). The error-handler context is freed once UCX completed the
        close: from then on UCX never calls the handler. Not confirmed in time: the
        context is leaked rather than freed under a handler that may still run. Returns
        whether the close completed (then no PUT on the endpoint is in flight)."""
        if self._closed:  # the queue is gone: nothing can confirm; leak the context
            return False
        try:
            status, _ = await self._start_and_wait(
                self._cq.ep_close, (ep,), timeout, "ucp_ep_close", False, ctx
            )
        except (TransferTimeout, PeerClosed) as exc:
            log.debug("bulk endpoint close: %s", exc)
            return False
        finally:
            self._watch.pop(err_token, None)
        if status != self.rma.UCS_OK:  # e.g. its flush failed: closed all the same
            log.debug("bulk endpoint close: %s", self.rma.status_string(status))
        self.rma.ep_ctx_free(ctx)
        return True

    def _channel(self, ep, loop, epoch: Optional[int]) -> UcxChannel:
        """A channel on ``ep`` (``epoch`` None: accepted), in the wait mode of
        ``KVXFER_CHANNEL_WAIT``: native frames through this transport, or None (``yield``:
        UCXX receive requests awaited by ``wait_yield``, the loop never sleeps)."""
        over = self.test_opening.get("accept" if epoch is None else "connect", {})
        mode = over.get("mode") or channel_wait_mode()
        native = None if mode == "yield" else self
        return UcxChannel(ep, loop, self.ucxx, epoch, native, over.get("version", PROTOCOL_VERSION))

    # -- contract
    async def listen(self, host: str, port: int, on_accept: AcceptCallback):
        loop = self._bind_loop()

        async def _handler(ep) -> None:
            """Runs on: the asyncio loop thread (UCXX's listener callback, on its progress
            thread, submits it with ``run_coroutine_threadsafe``)."""
            ch = self._channel(ep, loop, None)
            try:
                await ch.open(OPEN_TIMEOUT_S)
            except (PeerClosed, TransferTimeout) as exc:
                log.info("incoming connection dropped before its first message: %s", exc)
                await ch.close(1.0)
                return
            except (IncompatiblePeer, ProtocolError) as exc:  # VersionMismatch is both
                self.refused_openings += 1
                self.last_refusal = exc
                log.warning(
                    "incoming connection %s refused: %s: %s",
                    _binding(ch),
                    type(exc).__name__,
                    exc,
                )
                await ch.close(1.0)
                if self.on_refused is not None:
                    self.on_refused(exc)
                return
            await on_accept(ch)

        self._listener = self.ucxx.create_listener(
            _handler, port=port, endpoint_error_handling=True
        )
        return host, self._listener.port

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        loop = self._bind_loop()
        # UCXX may finish a cancelled create_endpoint with an error instead: retrieve it
        task = loop.create_task(
            self.ucxx.create_endpoint(
                host, port, endpoint_error_handling=True, connect_timeout=timeout
            )
        )
        task.add_done_callback(retrieve)
        try:
            ep = await asyncio.wait_for(task, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(
                f"connecting to {host}:{port}: no answer in {timeout:.3g} s"
            ) from None
        except ucx_error_types(self.ucxx) as exc:
            raise PeerClosed(f"connecting to {host}:{port}: {exc}") from None
        ch = self._channel(ep, loop, new_epoch())
        try:
            return await ch.open(timeout)
        except (IncompatiblePeer, ProtocolError) as exc:  # name the peer (type and fields kept)
            await ch.close(1.0)
            exc.args = (f"connecting to {host}:{port}: {exc}",) + exc.args[1:]
            raise
        except BaseException:
            await ch.close(1.0)
            raise

    def local_address(self) -> bytes:
        """The own worker's address (bulk endpoints are made to it), else UCXX's worker's.
        Runs on: the asyncio loop thread (it makes the completion queue)."""
        self._bind_loop()
        if self._cq.own_worker:
            return self._cq.address()
        return bytes(self.ucxx.get_worker_address())

    async def rma_endpoint(
        self,
        channel: Channel,
        peer_address: Optional[bytes],
        timeout: float,
        peer_errors: bool = False,
    ) -> RmaEndpoint:
        """``peer_address`` None: RMA over the channel's own (error-handled) endpoint.
        Otherwise a bulk endpoint to the peer's worker address (on kvxfer's own worker with
        :attr:`own_rma`) with an error handler: error mode NONE (keeps shared-memory lanes;
        a dead peer is reported, not fatal), or PEER (``peer_errors``: UCX's peer failure
        detection; for host memory UCX then gives it no RMA lane and emulates PUTs over
        active messages, see bench/results/peer-lanes-h200.md)."""
        self._bind_loop()
        if peer_address is None:
            if self.own_rma:  # registrations are on kvxfer's context, not the channel's
                raise TransportError("own_rma: RMA needs the peer's address (a bulk endpoint)")
            if not isinstance(channel, UcxChannel):
                raise TransportError(f"not a UCX channel: {type(channel).__name__}")
            return UcxRma(self, ep=channel.ucx_endpoint)
        token = next(self._tokens)
        try:
            worker = 0 if self._cq.own_worker else self.worker_handle
            ep, ctx = self._cq.ep_create(worker, peer_address, token, peer_errors)
        except self.rma.UcxError as exc:
            raise PeerClosed(f"bulk endpoint: {exc.args[1]}") from None
        rma = UcxRma(self, raw=(ep, ctx), err_token=token, keep_gil=self.keep_gil and worker == 0)
        self._watch[token] = rma._on_error
        return rma

    def register(self, addr: int, length: int) -> Region:
        if self._closed:
            raise Closed("transport closed")
        return UcxRegion(self.rma, self.context_handle, addr, length)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for fut in list(self._waiters.values()) + list(self._flushes.values()):
            if not fut.done():
                fut.set_exception(Closed("transport closed"))
        self._waiters.clear()
        self._flushes.clear()
        self._notes.clear()
        self._native_take = None
        if self._cq is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._cq.fileno())
            self._cq.close()  # late callbacks are dropped safely by the native side
            self._cq = None
