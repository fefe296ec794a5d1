"""The control path of the UCX transport: :class:`UcxChannel`, ordered active messages over
one UCXX endpoint (peer error handling on), with connection epochs, padding and an orderly
close (see the class docstring). :mod:`.ucx` makes the endpoints (listener, connect).

Frames after the opening travel as kvxfer's native active messages (``_rma``, routed by a
per-channel token into the transport's completion queue, whose eventfd wakes the loop): an
idle loop sleeps. ``KVXFER_CHANNEL_WAIT=yield`` keeps every frame on UCXX receive requests,
which UCXX (without its python-future notifier) awaits by ``asyncio.sleep(0)`` polling: the
loop then never sleeps while a channel is connected (the A/B switch; both ends of a
connection must use the same mode: the opening's hellos check it, and the protocol version,
on both ends; figures in bench/results/quiet-cpu.md)."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import weakref
from typing import Any, Callable, Deque, List, Optional

from kvxfer.errors import (
    Closed,
    IncompatiblePeer,
    InvalidArgument,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
    TransportError,
    VersionMismatch,
)
from kvxfer.transport import opening
from kvxfer.transport.base import Channel
from kvxfer.transport.ucx_lib import ucx_error_types
from kvxfer.transport.ucx_sockaddr import sockaddrs
from kvxfer.wire import PROTOCOL_VERSION

log = logging.getLogger(__name__)

_PADDING = bytes(8)  # epoch 0, empty payload (see UcxChannel)
_CLOSE = b"\xc1"  # payload of a close frame (0xc1 is never a msgpack message)
_TAIL = b"\xc1\xc3"  # payload of the UCXX frame that ends a native channel's close
#: bound on the opening of an accepted connection (padding sent, the peer's hello received)
OPEN_TIMEOUT_S = 10.0
#: bound on the connecting side's wait for the accepting side's hello (see UcxChannel.open)
HELLO_TIMEOUT_S = 5.0
#: bounds on the native frames queued unread on one channel (a peer that pushes more, say
#: an unauthenticated one flooding us, loses the connection)
MAX_QUEUED_FRAMES = 1 << 16
MAX_QUEUED_BYTES = 256 << 20
#: before the peer is authenticated (:meth:`UcxChannel.trusted`): the largest native frame
#: taken (a longer one is dropped where it arrives, never copied, and ends the connection)
#: and the bytes bound on frames queued (kvxfer.engine.handshake reads messages of at most
#: 64 KiB then)
MAX_EARLY_BYTES = 1 << 20


def channel_wait_mode() -> str:
    """``KVXFER_CHANNEL_WAIT``: ``native`` (default: frames as native active messages, the
    loop sleeps) or ``yield`` (every frame on UCXX receive requests polled by
    ``asyncio.sleep(0)``: the behaviour before native frames, for A/B runs)."""
    mode = os.environ.get("KVXFER_CHANNEL_WAIT", "native").strip().lower() or "native"
    if mode not in ("native", "yield"):
        raise InvalidArgument(f"KVXFER_CHANNEL_WAIT={mode!r}: expected 'native' or 'yield'")
    return mode


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
      its PUTs before it closes the channel (see kvxfer.engine.peer). Waiting for it also
      drops what UCXX already queued for the endpoint and nobody read (a peer,
      authenticated or not, may have pushed many messages before we closed).
    - UCXX holds our close callback for as long as its endpoint lives; it holds only a
      weak reference to the channel (a strong one made an uncollectable cycle through
      UCXX's endpoint finalizer, leaking endpoint and listener per connection).
    - The versioned opening (both modes; :mod:`.opening` has the bytes): after its padding,
      each side sends one hello frame over UCXX (epoch, ``0xc1 0xc4``, its protocol version,
      its channel wait mode and, native, its frame token: a random 64-bit ``note_listen``
      token of this channel). The connecting side sends its hello with its epoch at once and
      takes only a hello of that epoch back; the accepting side answers the first hello it
      receives, with that hello's epoch (so a stale hello of an earlier connection fails the
      opening instead of pairing two connections), and only then checks it, so that both
      ends see both hellos: another protocol version fails both ends with
      ``VersionMismatch``, another wait mode with ``IncompatiblePeer``, at once (see
      :meth:`open` for older peers). Nothing else is read or sent before the hellos.
    - Native frames (``native`` given, the default; see the module docstring): UCXX awaits
      a receive request by polling it on every loop iteration, so a channel with a receive
      posted keeps its loop from ever sleeping. Only the opening uses UCXX receives. From
      then on every frame, close frames included, is a native active message (forced eager:
      the receiving handler drops rendezvous data) to the peer's token on this endpoint,
      queued by the transport's completion queue and handed to this channel on the loop
      thread (woken by the queue's eventfd). No UCXX receive stays posted once the opening
      completed; the close frames are native, and then each side sends one UCXX tail frame
      and drops what UCXX queued up to the peer's (a peer may have pushed UCXX messages
      nobody read), which also completes the receive that this posts. An opening that
      failed keeps the UCXX path for its close. Frames
      queued unread are bounded (:data:`MAX_QUEUED_FRAMES`, :data:`MAX_QUEUED_BYTES`): a
      peer pushing more loses the connection. Until the handshake calls :meth:`trusted`, a
      frame over :data:`MAX_EARLY_BYTES` is dropped natively, never copied, and ends the
      connection, and at most that many bytes queue; afterwards frames up to the
      handshake's message limit are taken. A frame under the limit but over ``recv``'s
      ``max_bytes`` was copied once (never decoded). The
      token is unregistered when the channel closes; frames arriving later are dropped by
      the queue. Readers share one wake-up future, not the frames (see :meth:`_next_native`).
      Both ends must use the same mode (``KVXFER_CHANNEL_WAIT``; the hellos check it)."""

    def __init__(
        self,
        ep,
        loop: asyncio.AbstractEventLoop,
        ucxx,
        epoch: Optional[int] = None,
        native: Any = None,
        version: int = PROTOCOL_VERSION,
    ):
        """``native``: the :class:`~kvxfer.transport.ucx.UcxTransport` that carries native
        frames (``frame_future``, ``note_listen``), or None: UCXX receives only.
        ``version``: the protocol version our hello announces (tests only; see
        ``UcxTransport.test_opening``)."""
        self._ep, self._loop, self._ucxx = ep, loop, ucxx
        self.version = version
        self._callbacks: List[Callable[[Exception], None]] = []
        self._exc: Optional[Exception] = None
        self._closing = False
        self._epoch = epoch  # None: not known yet (accepting side before the handshake)
        self._connecting = epoch is not None  # we opened the connection (chose the epoch)
        self._rx_epoch = 0  # epoch of the last frame returned while ours was unknown
        self._rx: Optional[asyncio.Future] = None  # the pending receive request
        self._close_seen = False  # the peer's close frame arrived
        self._disconnected = asyncio.Event()  # UCXX reported the endpoint closed or failed
        self.dropped = 0  # frames of another connection dropped
        self.ucxx_drained = 0  # UCXX messages dropped at close (native frames; _drain_ucxx)
        self._native = native
        self._token = 0  # ours: the peer's native frames reach us by it (0: none / closed)
        self._peer_token = 0  # the peer's (its hello); non-zero: frames go native
        self._inbox: Deque[bytes] = collections.deque()  # native frames not read yet
        self._inbox_bytes = 0
        self._wake: Optional[asyncio.Future] = None  # a reader waiting for the inbox
        self._flooded = False
        self._trusted = False  # the handshake authenticated the peer (trusted())
        self._unlisten_token: Optional[Callable[[], Any]] = None
        if native is not None:
            self._token = native.note_listen(
                functools.partial(_deliver, weakref.ref(self)), MAX_EARLY_BYTES + 8
            )
            # a channel dropped unclosed still frees its token (runs once)
            self._unlisten_token = weakref.finalize(self, native.note_unlisten, self._token)
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

    def _on_ucx_close(self, *args) -> None:
        """UCXX reported the endpoint closed or failed; hop to the loop.
        Runs on: UCXX's progress thread (or whichever thread UCXX closes the endpoint on)."""
        try:
            self._loop.call_soon_threadsafe(self._on_disconnect)
        except RuntimeError:  # loop already closed: nobody left to tell
            pass

    def _on_disconnect(self) -> None:
        """Runs on: the asyncio loop thread (posted by :meth:`_on_ucx_close`)."""
        self._disconnected.set()
        self._wakeup()
        self._fire(PeerClosed("UCX endpoint closed (peer died or disconnected)"))

    def trusted(self, max_bytes: int) -> None:
        """The handshake authenticated the peer: take frames up to ``max_bytes`` (+ the
        epoch) and queue up to :data:`MAX_QUEUED_BYTES`."""
        self._trusted = True
        if self._token:
            self._native.note_limit(self._token, max_bytes + 8)

    def _on_frame(self, frame: Optional[bytes]) -> None:
        """A native frame for our token (None: one over the size limit, dropped uncopied).
        Runs on: the asyncio loop thread (the transport's completion-queue callback)."""
        if not self._token or self._flooded:
            return
        limit = MAX_QUEUED_BYTES if self._trusted else MAX_EARLY_BYTES
        if (
            frame is None
            or len(self._inbox) >= MAX_QUEUED_FRAMES
            or self._inbox_bytes + len(frame) > limit
        ):
            self._flooded = True
            n, size = len(self._inbox), self._inbox_bytes
            self._inbox.clear()
            self._inbox_bytes = 0
            why = (
                "a frame over the size limit"
                if frame is None
                else f"{n} frames ({size} bytes) unread and one of {len(frame)} bytes more"
            )
            log.warning("peer sent %s: connection dropped", why)
            self._wakeup()
            self._fire(PeerClosed(f"peer flooded the channel: {why}"))
            return
        self._inbox.append(frame)
        self._inbox_bytes += len(frame)
        self._wakeup()

    def _wakeup(self) -> None:
        w, self._wake = self._wake, None
        if w is not None and not w.done():
            w.set_result(None)

    def _unlisten(self) -> None:
        self._token = 0
        if self._unlisten_token is not None:
            self._unlisten_token()
        self._inbox.clear()
        self._inbox_bytes = 0

    def _fire(self, exc: Exception) -> None:
        if self._exc is not None:
            return
        self._exc = exc
        self._wakeup()  # a reader waiting for a native frame sees it
        for cb in self._callbacks:
            try:
                cb(exc)
            except Exception:  # a handler's bug must not break the transport
                log.exception("channel close callback failed")

    def on_closed(self, callback: Callable[[Exception], None]) -> None:
        """``callback(exc)`` once. Runs on: the asyncio loop thread."""
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
        """Send the opening padding frame, then exchange the versioned hellos (see the class
        docstring and :mod:`.opening`); returns the channel.

        Raises :class:`VersionMismatch` (the peer speaks another protocol version: the
        message names both and both modes) or :class:`IncompatiblePeer` (another channel
        wait mode, or no versioned opening at all) on both ends at once: the accepting side
        sends its hello before it checks the connecting side's, so each end sees the
        other's. Older peers are recognised by what they send (protocol 1's unversioned
        hello, or a protocol message of another version where a hello belongs), except one:
        a protocol-1 accepting side with native frames ignores our hello and sends nothing
        we could tell from a slow peer. So the connecting side waits at most
        :data:`HELLO_TIMEOUT_S` for the hello and then raises a TransferTimeout naming that
        likely cause (its close frame then ends the old peer's opening at once)."""
        end = self._loop.time() + timeout
        await self._ucxx_send(_PADDING, timeout, "opening message not sent")
        if self._connecting:
            assert self._epoch is not None
            await self._ucxx_send(self._hello(self._epoch), self._left(end), "hello not sent")
            peer = await self._await_hello(min(end, self._loop.time() + HELLO_TIMEOUT_S))
        else:
            peer = await self._await_hello(end)
            await self._ucxx_send(self._hello(peer.epoch), self._left(end), "hello not sent")
        opening.check_opening(self.version, self.mode, peer)
        if self._native is not None:
            self._peer_token = peer.token
        return self

    @property
    def mode(self) -> str:
        """The channel wait mode: ``native`` or ``yield`` (see the module docstring)."""
        return "yield" if self._native is None else "native"

    def _left(self, end: float) -> float:
        return max(0.0, end - self._loop.time())

    def _hello(self, epoch: int) -> bytes:
        return epoch.to_bytes(8, "little") + opening.encode_hello(
            self.version, self.mode, self._token if self._native is not None else 0
        )

    async def _await_hello(self, end: float) -> opening.Hello:
        """UCXX frames until the peer's hello (the connecting side: of our epoch; the
        accepting side: the first, whose epoch it takes for its close handshake). Padding
        and other connections' frames are dropped; a frame of this connection that shows an
        older peer raises at once (see :meth:`open`)."""
        want = self._epoch
        while True:
            try:
                frame = await self._next_frame(self._left(end))
            except TransferTimeout:
                raise TransferTimeout(
                    "no opening hello from the peer in time: it most likely runs an older "
                    f"kvxfer (protocol {opening.LEGACY_VERSION}, native frames: it ignores "
                    f"our protocol {self.version} hello), or its event loop is stalled. Every "
                    "process of a deployment must run one kvxfer protocol version "
                    f"({opening.COMPAT_DOC})"
                ) from None
            if len(frame) < 8:
                raise ProtocolError(f"frame of {len(frame)} bytes has no connection epoch")
            epoch = int.from_bytes(frame[:8], "little")
            size = len(frame) - 8
            head = bytes(frame[8 : 8 + opening.PEEK_BYTES])  # bounded copy, then drop it
            del frame
            if not epoch or want not in (None, epoch):
                if epoch or size:  # not padding: an earlier connection's
                    self.dropped += 1
                    log.warning("dropped a %d-byte frame of an earlier connection", size)
                continue
            if size == 1 and head == _CLOSE:
                self._close_seen = True
                raise PeerClosed("peer closed the connection while opening it")
            if want is None:  # accepting: a failed opening still closes on this epoch
                self._rx_epoch = epoch
            if head[:2] == opening.HELLO_MAGIC:
                return opening.parse_hello(epoch, head, self.version)
            if size == opening.LEGACY_HELLO_BYTES and head[:2] == opening.LEGACY_HELLO_MAGIC:
                raise opening.legacy_mismatch(self.version, self.mode)
            theirs = opening.peek_version(head) if size <= opening.PEEK_BYTES else None
            if theirs is not None and theirs != self.version:
                # a protocol message where a hello belongs: an older kvxfer in yield mode
                raise VersionMismatch(
                    opening.mismatch_text(self.version, self.mode, theirs, "yield"),
                    ours=self.version,
                    theirs=theirs,
                )
            if want is not None:  # of our fresh epoch, yet no hello: not a stale frame
                raise IncompatiblePeer(
                    f"the peer answered the opening with a {size}-byte frame that is no "
                    f"hello: it does not speak protocol {self.version}'s versioned opening "
                    "(an older kvxfer?). Every process of a deployment must run one kvxfer "
                    f"protocol version ({opening.COMPAT_DOC})"
                )
            self._rx_epoch = 0  # the accepting side: a stale frame fixes nothing
            self.dropped += 1
            log.warning("dropped a %d-byte frame of an earlier connection", size)

    async def _ucxx_send(self, frame: bytes, timeout: float, what: str) -> None:
        try:
            await asyncio.wait_for(self._ep.am_send(frame), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{what} in {timeout:.3g} s") from None
        except ucx_error_types(self._ucxx) as exc:
            raise PeerClosed(f"send failed: {exc}") from None

    async def _send_frame(self, frame: bytes, timeout: float) -> None:
        """One frame: native once the opening gave us the peer's token, else over UCXX."""
        if not self._peer_token:
            await self._ucxx_send(frame, timeout, "message send not done after")
            return
        ep = self._ep
        if ep is None or ep.closed:
            raise PeerClosed("send failed: endpoint closed")
        fut = self._native.frame_future(ep.ucp_endpoint, self._peer_token, frame)
        try:
            if fut.done():
                fut.result()  # the send ended within the call (eager: the usual case)
            else:
                await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"message send not done after {timeout:.3g} s") from None
        except PeerClosed:
            raise
        except TransportError as exc:  # the channel contract: PeerClosed / TransferTimeout
            raise PeerClosed(f"send failed: {exc}") from None

    async def send(self, payload: bytes, timeout: float) -> None:
        self._check()
        await self._send_frame((self._epoch or 0).to_bytes(8, "little") + payload, timeout)

    async def _recv_frame(self, timeout: Optional[float]):
        self._check()
        return await self._next_frame(timeout)

    async def _next_frame(self, timeout: Optional[float], handshake: bool = False):
        """The next frame off the endpoint (also while closing, for the close handshake:
        ``handshake``, see :meth:`_next_native`)."""
        if self._peer_token:
            return await self._next_native(timeout, handshake)
        return await self._next_ucxx(timeout)

    async def _next_ucxx(self, timeout: Optional[float]):
        """The next frame of UCXX's queue for the endpoint (an owned receive request)."""
        if self._rx is None:
            if self._ep.closed:
                raise PeerClosed("receive failed: endpoint closed")
            self._rx = asyncio.ensure_future(_await_request(self._ep._ep.am_recv()))
            self._rx.add_done_callback(retrieve)
        rx = self._rx
        try:
            buf = await asyncio.wait_for(asyncio.shield(rx), timeout)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"no message within {timeout:.3g} s") from None
        except ucx_error_types(self._ucxx) as exc:
            if self._rx is rx:
                self._rx = None
            raise PeerClosed(f"receive failed: {exc}") from None
        if self._rx is rx:
            self._rx = None
        return memoryview(buf).cast("B")

    async def _next_native(self, timeout: Optional[float], handshake: bool = False) -> memoryview:
        """The next native frame (wakes on arrival, peer death, a flood, the channel failing
        or closing; no polling). Readers share the wake-up but not the frames (UCXX's
        receive future was shared): the close handshake (``handshake``) returns an empty
        frame once another reader took the peer's close frame, and a reader other than
        the handshake stops once the channel failed or closed."""
        end = None if timeout is None else self._loop.time() + timeout
        while not self._inbox:
            if handshake and self._close_seen:
                return memoryview(b"")
            if self._flooded or self._disconnected.is_set() or self._ep is None:
                raise PeerClosed("receive failed: endpoint closed")
            if not handshake and self._exc is not None:
                raise PeerClosed(str(self._exc))
            if self._wake is None or self._wake.done():
                self._wake = self._loop.create_future()
            left = None if end is None else self._left(end)
            try:  # shielded: a reader that gives up does not cancel another's wake-up
                await asyncio.wait_for(asyncio.shield(self._wake), left)
            except asyncio.TimeoutError:
                raise TransferTimeout(f"no message within {timeout:.3g} s") from None
        frame = self._inbox.popleft()
        self._inbox_bytes -= len(frame)
        return memoryview(frame)

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
                    self._wakeup()  # a close handshake waiting for this frame
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
                    len(frame) - 8,
                    epoch,
                    self._epoch,
                    self.dropped,
                )
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
        try:
            await self._close_handshake(timeout)
        finally:
            self._unlisten()
        ep, self._ep = self._ep, None
        try:
            ep.abort(period=int(timeout * 1e9), max_attempts=1)
        except Exception as exc:  # already gone
            log.debug("endpoint abort: %s", exc)
        self._wakeup()  # a reader still waiting for a native frame ends (PeerClosed)
        self._fire(Closed("channel closed locally"))

    async def _drain_ucxx(self, epoch: int, end: float) -> None:
        """Native frames, after the close frames: a peer may have pushed UCXX active
        messages that nobody reads after the opening, and UCXX would keep them for the
        endpoint handle for good. Each side sends a UCXX tail frame (epoch, ``0xc1 0xc3``)
        and takes UCXX frames up to the peer's, dropping them (:attr:`ucxx_drained` counts
        them); the tail also completes the receive request that this leaves posted."""
        await self._ucxx_send(
            epoch.to_bytes(8, "little") + _TAIL, self._left(end), "tail frame not sent"
        )
        while True:
            frame = await self._next_ucxx(self._left(end))
            if (
                len(frame) == 10
                and frame[8:] == _TAIL
                and int.from_bytes(frame[:8], "little") == epoch
            ):
                return
            self.ucxx_drained += 1

    async def _close_handshake(self, timeout: float) -> None:
        """Send our close frame, then take frames until the peer's (dropping the rest).
        Skipped when the endpoint failed or the connection's epoch is still unknown (no
        frame of it ever arrived: nothing to tell an earlier connection's frames from)."""
        epoch = self._epoch if self._epoch is not None else self._rx_epoch
        if not epoch or self._ep.closed:
            return
        end = self._loop.time() + timeout
        try:
            await self._send_frame(epoch.to_bytes(8, "little") + _CLOSE, timeout)
            while not self._close_seen:
                frame = await self._next_frame(max(0.0, end - self._loop.time()), True)
                if (
                    len(frame) == 9
                    and frame[8:] == _CLOSE
                    and int.from_bytes(frame[:8], "little") == epoch
                ):
                    self._close_seen = True
            if self._peer_token:
                await self._drain_ucxx(epoch, end)
            if self._connecting:  # the accepting side aborts first (class docstring)
                await asyncio.wait_for(self._disconnected.wait(), max(0.0, end - self._loop.time()))
        except (asyncio.TimeoutError, TransferTimeout, PeerClosed, TransportError) as exc:
            log.debug("close handshake: %s", exc or type(exc).__name__)
        except ucx_error_types(self._ucxx) as exc:
            log.debug("close handshake: %s", exc)


def _deliver(ref, frame: Optional[bytes]) -> None:
    """Native frame receiver registered with the transport: forward to the channel, if it
    still exists (the transport holds only a weak reference to it).
    Runs on: the asyncio loop thread."""
    ch = ref()
    if ch is not None:
        ch._on_frame(frame)


def _close_callback(ref) -> None:
    """UCXX close callback: forward to the channel, if it still exists.
    Runs on: UCXX's progress thread (or whichever thread UCXX closes the endpoint on)."""
    ch = ref()
    if ch is not None:
        ch._on_ucx_close()


async def _await_request(req):
    """Wait for one UCXX active-message receive request; returns its buffer."""
    await req.wait()
    return req.recv_buffer


def retrieve(fut: asyncio.Future) -> None:
    """Receive requests are awaited by whoever reads next; one nobody reads any more (its
    connection is gone) must not log "exception was never retrieved"."""
    if not fut.cancelled():
        fut.exception()


def new_epoch() -> int:
    """A random non-zero connection epoch."""
    return int.from_bytes(os.urandom(8), "little") or 1
