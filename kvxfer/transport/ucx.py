"""UCX implementation of the transport contract: UCXX for context, worker, listener,
endpoints and active messages; the native ``_rma`` extension for registrations, keys,
batched PUTs and flushes.

Facts this module relies on (measured, see docs/engine.md):
- UCXX runs one UCP context/worker per process in ``UCS_THREAD_MODE_MULTI`` with a progress
  *thread* by default; that thread also progresses the target side of RMA (needed over
  tcp). It sleeps on the worker's event fd with a 1 ms epoll timeout.
- Flush completions arrive on whichever thread progresses the worker; ``_rma.CompletionQueue``
  queues them and signals an eventfd that the event loop watches (``loop.add_reader``).
  A ``spin`` flush is progressed by the queue's native poller thread until it completes:
  cuda_ipc completions never signal the worker fd, so they would otherwise wait for
  UCXX's next 1 ms tick (measured on the H200: 2 GiB PUTs at half of ucx_perftest).
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
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from kvxfer.errors import Closed, PeerClosed, ProtocolError, TransferTimeout, TransportError
from kvxfer.transport.base import AcceptCallback, Channel, Region, RmaEndpoint, Transport
from kvxfer.transport.ucx_rma import (UcxRegion, UcxRma, _ucx_error_types,  # noqa: F401
                                      cuda_alloc_range, load_ucx, parse_rma_lanes,
                                      status_error)
from kvxfer.transport.ucx_sockaddr import sockaddrs

log = logging.getLogger(__name__)

_PADDING = bytes(8)  # epoch 0, empty payload (see UcxChannel)
_CLOSE = b"\xc1"      # payload of a close frame (0xc1 is never a msgpack message)
#: bound on sending the opening padding frame of an accepted connection
OPEN_TIMEOUT_S = 10.0


# ----------------------------------------------------------------- channels


class UcxChannel(Channel):
    """Active messages over one UCXX endpoint (peer error handling on).

    UCXX keys its active-message queues by the UCP endpoint *handle*, and UCP reuses the
    handle of a closed endpoint for a new one. Two leftovers of a closed connection can
    therefore reach a new one with the same handle: a message that arrived and was never
    received (it would surface as the new connection's first message), and a receive request
    still waiting in UCXX (UCXX cannot withdraw it; it would swallow the new connection's
    first message). Hence:

    - Connection epochs: every message is framed as ``epoch (8 bytes LE) + payload``. The
      connecting side picks a random non-zero epoch; the accepting side learns it from the
      first message its handshake accepts (:meth:`adopt_epoch`). From then on a frame of
      another epoch is dropped and logged.
    - Padding: each side opens with one empty frame of epoch 0 (:meth:`open`), which a
      leftover receive request of the peer's previous endpoint swallows instead of a real
      message; receivers drop padding frames.
    - Receive requests are owned: a ``recv`` that timed out or was cancelled leaves its
      request to the next ``recv`` (nothing it receives is lost).
    - Orderly close (:meth:`close`): each side sends a close frame (its epoch + ``0xc1``)
      and waits, bounded, for the other's before it aborts the endpoint; the connecting
      side then also waits for the accepting side's abort, so that the accepting side
      never aborts under a close frame still in flight to it. The peer's close frame
      completes the receive request still posted here: a request UCXX never completes
      stays in the worker (it is keyed by the endpoint handle) and keeps the endpoint
      alive, and an accepted endpoint keeps its listener, i.e. the listening socket,
      alive. The close frame also says "nothing more comes from me": the engine quiesces
      its PUTs before it closes the channel (see kvxfer.engine.peer).
    - UCXX holds our close callback for as long as its endpoint lives; it holds only a
      weak reference to the channel (a strong one made an uncollectable cycle through
      UCXX's endpoint finalizer, leaking endpoint and listener per connection).
    - Closing drops what UCXX already queued for the endpoint and nobody will read (a peer,
      authenticated or not, may have pushed many messages before we closed): see
      :meth:`_drain`."""

    def __init__(self, ep, loop: asyncio.AbstractEventLoop, ucxx, epoch: Optional[int] = None):
        self._ep, self._loop, self._ucxx = ep, loop, ucxx
        self._callbacks: List[Callable[[Exception], None]] = []
        self._exc: Optional[Exception] = None
        self._closing = False
        self._epoch = epoch  # None: not known yet (accepting side before the handshake)
        self._connecting = epoch is not None  # we opened the connection (chose the epoch)
        self._rx_epoch = 0   # epoch of the last frame returned while ours was unknown
        self._rx: Optional[asyncio.Future] = None  # the pending receive request
        self._close_seen = False  # the peer's close frame arrived
        self._disconnected = asyncio.Event()  # UCXX reported the endpoint closed or failed
        self._frames = 0     # frames received (padding included)
        self.dropped = 0     # frames of another connection dropped
        # UCXX keeps the callback (and what it references) in the UCXEndpoint, which its
        # endpoint finalizer keeps alive: a strong reference to us would be a cycle through
        # that global registry that never dies (nor the endpoint, nor its listener).
        ep.set_close_callback(_close_callback, (weakref.ref(self),))

    @property
    def ucx_endpoint(self):
        return self._ep

    @property
    def epoch(self) -> Optional[int]:
        return self._epoch

    def adopt_epoch(self) -> None:
        """Accepting side: the epoch of the last received frame is this connection's."""
        if self._epoch is None:
            self._epoch = self._rx_epoch

    def binding(self) -> bytes:
        """``client ip:port>server ip:port`` of this connection (``ucp_ep_query``): both ends
        compute the same bytes; a relay's two connections give two different ones."""
        ep = self._ep._ep
        if ep is None:
            raise PeerClosed("endpoint closed")
        local, remote = sockaddrs(ep.handle)
        client, server = (local, remote) if self._connecting else (remote, local)
        return f"{client[0]}:{client[1]}>{server[0]}:{server[1]}".encode()

    def _on_ucx_close(self, *args):  # any thread (UCXX progress thread)
        try:
            self._loop.call_soon_threadsafe(self._on_disconnect)
        except RuntimeError:  # loop already closed: nobody left to tell
            pass

    def _on_disconnect(self) -> None:
        self._disconnected.set()
        self._fire(PeerClosed("UCX endpoint closed (peer died or disconnected)"))

    def _fire(self, exc: Exception) -> None:
        if self._exc is not None:
            return
        self._exc = exc
        for cb in self._callbacks:
            try:
                cb(exc)
            except Exception:  # a handler's bug must not break the transport
                log.exception("channel close callback failed")

    def on_closed(self, callback):
        self._callbacks.append(callback)
        if self._exc is not None:
            self._loop.call_soon(callback, self._exc)

    @property
    def closed(self) -> bool:
        return self._exc is not None or self._closing or self._ep is None or self._ep.closed

    def _check(self):
        if self._exc is not None:
            raise PeerClosed(str(self._exc))
        if self._closing:
            raise Closed("channel closed")

    async def open(self, timeout: float) -> "UcxChannel":
        """Send the opening padding frame; returns the channel."""
        try:
            await asyncio.wait_for(self._ep.am_send(_PADDING), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"opening message not sent in {timeout:.3g} s") from None
        except _ucx_error_types(self._ucxx) as exc:
            raise PeerClosed(f"send failed: {exc}") from None
        return self

    async def send(self, payload: bytes, timeout: float) -> None:
        self._check()
        frame = (self._epoch or 0).to_bytes(8, "little") + payload
        try:
            await asyncio.wait_for(self._ep.am_send(frame), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"message send not done after {timeout:.3g} s") from None
        except _ucx_error_types(self._ucxx) as exc:
            raise PeerClosed(f"send failed: {exc}") from None

    async def _recv_frame(self, timeout: Optional[float]):
        self._check()
        return await self._next_frame(timeout)

    async def _next_frame(self, timeout: Optional[float]):
        """The next frame off the endpoint (also while closing, for the close handshake)."""
        if self._rx is None:
            if self._ep.closed:
                raise PeerClosed("receive failed: endpoint closed")
            self._rx = asyncio.ensure_future(_await_request(self._ep._ep.am_recv()))
            self._rx.add_done_callback(_retrieve)
        rx = self._rx
        try:
            buf = await asyncio.wait_for(asyncio.shield(rx), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"no message within {timeout:.3g} s") from None
        except _ucx_error_types(self._ucxx) as exc:
            if self._rx is rx:
                self._rx = None
            raise PeerClosed(f"receive failed: {exc}") from None
        if self._rx is rx:
            self._rx = None
        self._frames += 1
        return memoryview(buf).cast("B")

    async def recv(self, timeout: Optional[float], max_bytes: Optional[int] = None) -> bytes:
        end = None if timeout is None else self._loop.time() + timeout
        while True:
            left = None if end is None else max(0.0, end - self._loop.time())
            frame = await self._recv_frame(left)
            if len(frame) < 8:
                raise ProtocolError(f"frame of {len(frame)} bytes has no connection epoch")
            epoch = int.from_bytes(frame[:8], "little")
            if epoch == 0 and len(frame) == 8:  # padding (see the class docstring)
                continue
            if len(frame) == 9 and frame[8:] == _CLOSE:
                if self._epoch is None or epoch == self._epoch:
                    if self._epoch is None:  # answered with this epoch (close handshake)
                        self._rx_epoch = epoch
                    self._close_seen = True
                    self._fire(PeerClosed("peer closed the connection"))
                    self._check()
                self.dropped += 1  # an earlier connection's close frame
                continue
            if self._epoch is None:
                self._rx_epoch = epoch
            elif epoch != self._epoch:
                self.dropped += 1
                (log.warning if self.dropped == 1 else log.debug)(
                    "dropped a %d-byte message of an earlier connection (epoch %#x, this one "
                    "%#x; %d dropped so far, further ones logged at debug level)",
                    len(frame) - 8, epoch, self._epoch, self.dropped)
                continue
            if max_bytes is not None and len(frame) - 8 > max_bytes:
                n = len(frame) - 8
                del frame  # UCXX's buffer goes now (no copy; not kept by the traceback)
                raise ProtocolError(f"message of {n} bytes exceeds the {max_bytes}-byte limit")
            return bytes(frame[8:])

    async def close(self, timeout: float) -> None:
        """Close handshake (bounded by ``timeout``, see the class docstring), then abort
        the endpoint and drop it (its UCXX objects die now, not at the next gc)."""
        if self._closing:
            return
        self._closing = True
        await self._close_handshake(timeout)
        try:
            self._drain()
        except Exception as exc:  # best effort: the endpoint may be gone already
            log.debug("draining a closing endpoint: %s", exc)
        ep, self._ep = self._ep, None
        try:
            ep.abort(period=int(timeout * 1e9), max_attempts=1)
        except Exception as exc:  # already gone
            log.debug("endpoint abort: %s", exc)
        self._fire(Closed("channel closed locally"))

    async def _close_handshake(self, timeout: float) -> None:
        """Send our close frame, then take frames until the peer's (dropping the rest).
        Skipped when the endpoint failed or the connection's epoch is still unknown (no
        frame of it ever arrived: nothing to tell an earlier connection's frames from)."""
        epoch = self._epoch if self._epoch is not None else self._rx_epoch
        if not epoch or self._ep.closed:
            return
        end = self._loop.time() + timeout
        try:
            await asyncio.wait_for(self._ep.am_send(epoch.to_bytes(8, "little") + _CLOSE),
                                   timeout)
            while not self._close_seen:
                frame = await self._next_frame(max(0.0, end - self._loop.time()))
                if len(frame) == 9 and frame[8:] == _CLOSE and \
                        int.from_bytes(frame[:8], "little") == epoch:
                    self._close_seen = True
            if self._connecting:  # the accepting side aborts first (class docstring)
                await asyncio.wait_for(self._disconnected.wait(),
                                       max(0.0, end - self._loop.time()))
        except (asyncio.TimeoutError, TransferTimeout, PeerClosed) as exc:
            log.debug("close handshake: %s", exc or type(exc).__name__)
        except _ucx_error_types(self._ucxx) as exc:
            log.debug("close handshake: %s", exc)


def _close_callback(ref) -> None:
    """UCXX close callback (any thread): forward to the channel, if it still exists."""
    ch = ref()
    if ch is not None:
        ch._on_ucx_close()


    def _drain(self) -> int:
        """Pop and drop every message UCXX queued for this endpoint that nobody will read
        (the queue is keyed by the endpoint handle and never freed; it would hold them until
        a later connection reusing the handle read them). Returns how many.

        Only once a frame was received (then no receive request of an earlier connection
        with this handle is still waiting: it took the first frame) and while none of ours
        is pending (then the queue is empty: UCXX hands arrivals to a waiting request).
        Stops at the first request that is not complete at once (one still arriving, or a
        fresh one waiting): it is owned like an abandoned ``recv``'s (UCXX cancels a
        request whose Python object goes away, and a cancel racing its completion
        deadlocks in UCXX), and the next connection's padding frame absorbs a waiting one."""
        if not self._frames or (self._rx is not None and not self._rx.done()):
            return 0
        self._rx = None
        ep, n = self._ep._ep, 0
        while ep is not None:
            req = ep.am_recv()
            if not req.completed:
                self._rx = asyncio.ensure_future(_await_request(req))
                self._rx.add_done_callback(_retrieve)
                break
            n += 1
        if n:
            log.debug("dropped %d unread message(s) of a closing endpoint", n)
        return n


async def _await_request(req):
    """Wait for one UCXX active-message receive request; returns its buffer."""
    await req.wait()
    return req.recv_buffer


def _retrieve(fut: asyncio.Future) -> None:
    """Receive requests are awaited by whoever reads next; one nobody reads any more (its
    connection is gone) must not log "exception was never retrieved"."""
    if not fut.cancelled():
        fut.exception()


def new_epoch() -> int:
    """A random non-zero connection epoch."""
    return int.from_bytes(os.urandom(8), "little") or 1


# ---------------------------------------------------------------- transport


class UcxTransport(Transport):
    """One per engine; all engines of a process share UCXX's context and worker."""

    def __init__(self, ucx_options: Optional[dict] = None, progress_mode: str = "thread"):
        self.ucxx, self.rma = load_ucx()
        from ucxx import core as _core

        if _core._ctx is None:
            self.ucxx.init(options=dict(ucx_options or {}), progress_mode=progress_mode)
        elif ucx_options:
            log.warning("UCX already initialised in this process; ignoring ucx_options=%r",
                        ucx_options)
        self._app = _core._get_ctx()
        self.context_handle = self._app.context.handle
        self.worker_handle = self._app.worker.handle
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._cq = None
        self._tokens = itertools.count(1)
        self._waiters: Dict[int, asyncio.Future] = {}  # token -> (status, t) future
        self._flushes: Dict[int, asyncio.Future] = {}  # token -> t future (flush_future)
        self._watch: Dict[int, Callable[[int], None]] = {}  # endpoint error tokens
        self._listener = None
        self._closed = False

    # -- event-loop side of flush completions
    def _bind_loop(self):
        if self._closed:
            raise Closed("transport closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self._cq = self.rma.CompletionQueue(worker=self.worker_handle)
            loop.add_reader(self._cq.fileno(), self._on_completions)
        elif self._loop is not loop:
            raise TransportError("a transport is bound to the event loop that started it")
        return loop

    def _on_completions(self):
        for token, status, t in self._cq.drain():
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

    async def _start_and_wait(self, start, args, timeout: float, what: str,
                              *extra) -> Tuple[int, float]:
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
        loop = self._bind_loop()
        token = next(self._tokens)
        fut = loop.create_future()
        try:
            status = self._cq.ep_flush(ep_handle, token, spin)
        except ValueError as exc:  # NULL handle
            fut.set_exception(PeerClosed(str(exc)))
            return fut
        if status is None:
            self._flushes[token] = fut
        elif status == self.rma.UCS_OK:
            fut.set_result(time.monotonic())
        else:
            fut.set_exception(status_error(self.rma, status, "ucp_ep_flush"))
        return fut

    async def flush_ep(self, ep_handle: int, timeout: float, spin: bool = False) -> float:
        """Flush one endpoint; ``spin``: the queue's native poller progresses the worker
        until it completes. Returns the monotonic time UCX reported completion."""
        try:
            return await asyncio.wait_for(self.flush_future(ep_handle, spin), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"ucp_ep_flush not complete after {timeout:.3g} s") from None

    async def flush_worker(self, timeout: float, spin: bool = False) -> float:
        self._bind_loop()
        status, t = await self._start_and_wait(self._cq.worker_flush, (self.worker_handle,),
                                               timeout, "ucp_worker_flush", spin)
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
            status, _ = await self._start_and_wait(self._cq.ep_close, (ep,), timeout,
                                                   "ucp_ep_close", False)
        except (TransferTimeout, PeerClosed) as exc:
            log.debug("bulk endpoint close: %s", exc)
            return False
        finally:
            self._watch.pop(err_token, None)
        if status != self.rma.UCS_OK:  # e.g. its flush failed: closed all the same
            log.debug("bulk endpoint close: %s", self.rma.status_string(status))
        self.rma.ep_ctx_free(ctx)
        return True

    # -- contract
    async def listen(self, host: str, port: int, on_accept: AcceptCallback):
        loop = self._bind_loop()

        async def _handler(ep):
            ch = UcxChannel(ep, loop, self.ucxx, None)
            try:
                await ch.open(OPEN_TIMEOUT_S)
            except (PeerClosed, TransferTimeout) as exc:
                log.info("incoming connection dropped before its first message: %s", exc)
                await ch.close(1.0)
                return
            await on_accept(ch)

        self._listener = self.ucxx.create_listener(_handler, port=port,
                                                   endpoint_error_handling=True)
        return host, self._listener.port

    async def connect(self, host: str, port: int, timeout: float) -> Channel:
        loop = self._bind_loop()
        # UCXX may finish a cancelled create_endpoint with an error instead: retrieve it
        task = loop.create_task(self.ucxx.create_endpoint(host, port, endpoint_error_handling=True,
                                                          connect_timeout=timeout))
        task.add_done_callback(_retrieve)
        try:
            ep = await asyncio.wait_for(task, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"connecting to {host}:{port}: no answer in {timeout:.3g} s") \
                from None
        except _ucx_error_types(self.ucxx) as exc:
            raise PeerClosed(f"connecting to {host}:{port}: {exc}") from None
        ch = UcxChannel(ep, loop, self.ucxx, new_epoch())
        try:
            return await ch.open(timeout)
        except BaseException:
            await ch.close(1.0)
            raise

    def local_address(self) -> bytes:
        return bytes(self.ucxx.get_worker_address())

    async def rma_endpoint(self, channel: Channel, peer_address: Optional[bytes],
                           timeout: float) -> RmaEndpoint:
        """``peer_address`` None: RMA over the channel's own (error-handled) endpoint.
        Otherwise a bulk endpoint to the peer's worker address, error mode NONE with an
        error handler (keeps shared-memory lanes; a dead peer is reported, not fatal)."""
        self._bind_loop()
        if peer_address is None:
            return UcxRma(self, ep=channel.ucx_endpoint)
        token = next(self._tokens)
        try:
            ep, ctx = self._cq.ep_create(self.worker_handle, peer_address, token)
        except self.rma.UcxError as exc:
            raise PeerClosed(f"bulk endpoint: {exc.args[1]}") from None
        rma = UcxRma(self, raw=(ep, ctx), err_token=token)
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
        if self._cq is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._cq.fileno())
            self._cq.close()  # late callbacks are dropped safely by the native side
            self._cq = None
