"""The transport contract the engine is written against.

A transport provides four things, all asyncio-native with a deadline on every wait:

- :class:`Channel` — an ordered, reliable message channel to one peer (control plane:
  handshake, application messages, completion notifications). It reports the peer's death
  or departure exactly once through ``on_closed``.
- :class:`Region` — a local memory registration (host or device memory) whose packed remote
  key can be handed to an authenticated peer.
- :class:`RmaEndpoint` — the data plane to one peer: unpack the peer's keys, post a batch of
  one-sided PUTs (bounds-checked), flush (the bytes are visible at the target when the
  flush completes), and say which lanes/transports carry the data.
- :class:`Transport` — the process-side factory: listener, outgoing connections, RMA
  endpoints and registrations, released by ``close()``.

The only implementation is :mod:`kvxfer.transport.ucx` (UCXX + the ``_rma`` extension); the
tests run it for real over loopback.
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import Any, Awaitable, Callable, List, Optional, Sequence, Tuple

_arrival = threading.local()


def note_arrival() -> float:
    """The ``time.monotonic()`` at which the transport's native receive callback took the
    notification (or channel frame) whose delivery is running now on this thread; 0.0
    outside such a delivery or when the transport does not know (stage traces:
    :mod:`kvxfer.disagg.trace`). Runs on: the thread delivering (the asyncio loop's)."""
    return float(getattr(_arrival, "t", 0.0))


def set_note_arrival(t: float) -> None:
    """A transport sets :func:`note_arrival` around one delivery (0.0 after it)."""
    _arrival.t = t


class Region(abc.ABC):
    """A registered local memory range ``[addr, addr+length)``."""

    addr: int
    length: int
    mem_type: str  # "host", "cuda", ... as reported by the transport
    handle: int  # opaque registration handle passed back in put batches (0 = none)

    @abc.abstractmethod
    def packed_key(self) -> bytes:
        """The remote key to give an authenticated peer."""

    @abc.abstractmethod
    def release(self) -> None:
        """Deregister; idempotent. Callers release only after every endpoint using it."""


class Channel(abc.ABC):
    """Ordered message channel to one peer."""

    @abc.abstractmethod
    async def send(self, payload: bytes, timeout: float) -> None:
        """Send one message; raises PeerClosed / TransferTimeout."""

    @abc.abstractmethod
    async def recv(self, timeout: Optional[float], max_bytes: Optional[int] = None) -> bytes:
        """Next message; raises PeerClosed / TransferTimeout (``None``: no deadline).
        ``max_bytes``: a longer message raises ProtocolError and is dropped unread (not
        decoded; the UCX channel bounds what it queued of it): what an unauthenticated peer
        can make us hold."""

    @abc.abstractmethod
    def binding(self) -> bytes:
        """Facts about this connection that both of its ends observe identically and that
        differ on any other connection (for UCX: the client's and the server's socket
        address). The handshake's proofs cover them, so a proof cannot be relayed to
        another connection."""

    @abc.abstractmethod
    def on_closed(self, callback: Callable[[Exception], None]) -> None:
        """Call ``callback(exc)`` once when the peer goes away.
        Runs on: the asyncio loop thread (implementations hop there)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    @abc.abstractmethod
    async def close(self, timeout: float) -> None:
        """Close the channel; idempotent. Orderly where the peer is alive: tell it, and wait
        (within ``timeout``) for its own close, so that nothing of the connection stays
        behind on either side (see UcxChannel)."""

    def adopt_epoch(self) -> None:
        """Accepting side, once the handshake accepted the connection's first message:
        from now on only messages of that message's connection are delivered (messages of
        an earlier connection that reach this one are dropped). No-op where connections
        cannot mix."""
        return None

    def trusted(self, max_bytes: int) -> None:
        """Both sides, once the handshake verified the peer's proof: the peer is
        authenticated, lift the pre-authentication bounds on what it can make us hold (its
        messages may now be up to ``max_bytes``). No-op where nothing is bounded."""
        return None


class RmaEndpoint(abc.ABC):
    """Data plane to one peer."""

    @abc.abstractmethod
    def add_remote_regions(
        self, bases: Sequence[int], lengths: Sequence[int], keys: Sequence[bytes]
    ) -> None:
        """Unpack the peer's keys; regions are then addressed by index in ``put``."""

    @abc.abstractmethod
    def put(self, laddr, raddr, nbytes, lmemh, ridx) -> int:
        """Post PUTs (parallel uint64 arrays) in one native call; every op is checked
        against its remote region first. Returns the number of ops posted."""

    @abc.abstractmethod
    async def flush(self, timeout: float, spin: bool = False) -> float:
        """Complete when every PUT posted so far is visible at the target. ``spin``: progress
        the transport actively until then (lower latency, one busy core meanwhile). Returns
        the ``time.monotonic()`` at which the transport reported completion."""

    @abc.abstractmethod
    def flush_future(self, spin: bool = False) -> "asyncio.Future":
        """Like :meth:`flush`, as a future the transport completes directly (no task in
        between: one event-loop hop less per write); unbounded, the caller bounds it and may
        complete it itself (its result is then whatever the caller set)."""

    @abc.abstractmethod
    def lanes(self) -> List[str]:
        """Transports carrying RMA, e.g. ``["cma/memory"]`` or ``["tcp/lo"]``."""

    def flush_notify_future(
        self, note_token: int, payload: bytes, spin: bool = False, inline: bool = True
    ) -> "Optional[asyncio.Future]":
        """Flush, then send ``payload`` to the peer's notification listener ``note_token``
        (:meth:`Transport.note_listen`) without returning to Python in between: the
        transport chains the two natively; the payload is only sent once every PUT posted
        so far is visible at the target, and a failed flush sends nothing. The future
        resolves (``time.monotonic()`` of the chain's end) when the payload left, or fails
        with PeerClosed / TransportError; unbounded (the caller bounds it). None: this
        endpoint cannot chain (the caller flushes and sends the message itself).
        ``inline=False``: the call does not wait for the chain's end first (see the
        transport's inline wait)."""
        return None

    def note_future(self, note_token: int, payload: bytes) -> "Optional[asyncio.Future]":
        """Send ``payload`` to the peer's notification listener ``note_token`` now, with no
        flush first (so it may overtake PUTs still in flight; those that completed are
        visible before it) and no wait on the calling thread. Resolves like
        :meth:`flush_notify_future` once the payload left. None: this endpoint has no
        notifications (the caller uses its channel)."""
        return None

    def on_failed(self, callback: Callable[[Exception], None]) -> None:
        """Call ``callback(exc)`` if a data-plane endpoint of its own fails (Runs on: the
        asyncio loop thread). Endpoints that share the channel's connection never call it (the channel
        reports)."""
        return None

    @abc.abstractmethod
    async def close(self, timeout: float) -> None:
        """Quiesce (close the endpoint it owns, flush a borrowed one: every PUT posted so
        far completes or fails), then destroy the remote keys; idempotent. Afterwards no
        PUT of ours is in flight to the peer (unless quiescing timed out: logged)."""


AcceptCallback = Callable[[Channel], Awaitable[None]]


class Transport(abc.ABC):
    """Process-side factory for channels, RMA endpoints and registrations."""

    #: registrations are valid only for RMA over :meth:`rma_endpoint` with a peer address
    #: (the UCX transport's own context); peers are told (``Layout.bulk_only``)
    own_rma: bool = False

    @abc.abstractmethod
    async def listen(self, host: str, port: int, on_accept: AcceptCallback) -> Tuple[str, int]:
        """Start accepting; ``on_accept(channel)`` runs as a task per incoming peer.
        Runs on: the asyncio loop thread."""

    @abc.abstractmethod
    async def connect(self, host: str, port: int, timeout: float) -> Channel: ...

    @abc.abstractmethod
    def local_address(self) -> bytes:
        """Opaque address a peer passes to :meth:`rma_endpoint` (sent only after auth)."""

    @abc.abstractmethod
    async def rma_endpoint(
        self,
        channel: Channel,
        peer_address: Optional[bytes],
        timeout: float,
        peer_errors: bool = False,
    ) -> RmaEndpoint:
        """RMA over ``channel``'s own connection (``peer_address`` None) or over a separate
        connection to ``peer_address`` (implementation-defined trade-offs; ``peer_errors``:
        with the peer error handling the channel's connection has)."""

    @abc.abstractmethod
    def register(self, addr: int, length: int) -> Region: ...

    def note_listen(self, callback: Callable[[Optional[bytes]], None], max_bytes: int = 0) -> int:
        """Receive chained notifications (:meth:`RmaEndpoint.flush_notify_future`): returns
        the token a peer sends them to (0: not supported); ``callback(payload)`` runs on
        the asyncio loop thread, in arrival order, until :meth:`note_unlisten`.
        ``max_bytes`` (0: none): a longer payload is dropped where it arrives, never copied,
        and reported as ``callback(None)``."""
        return 0

    def note_unlisten(self, token: int) -> None:
        """Stop receiving notifications for ``token`` (late ones are dropped)."""
        return None

    def completions_queued(self) -> bool:
        """Whether completions or notifications arrived that the loop has not handled yet
        (a hint, read without the loop: it may change at once). Runs on: any thread."""
        return False

    def take_completions(self) -> bool:
        """Handle what :meth:`completions_queued` reported, now, as the loop would (futures
        resolved, notification callbacks run); returns whether anything was handled.
        Runs on: the loop thread or a thread running as its guest
        (:meth:`kvxfer.loop_thread.LoopThread.run_here`)."""
        return False

    def take_natively(self, take: Optional[Callable[[], Any]]) -> bool:
        """Have the transport's native receive thread call ``take()`` (no arguments)
        right after it queued completions or notifications, instead of only waking the
        loop: ``take`` handles them as the loop's guest when the loop waits for events
        (:meth:`kvxfer.loop_thread.LoopThread.take_completions`), and the loop is woken
        only for what it left. ``None`` stops it. Returns whether this transport has such a
        thread (False: nothing changes, the loop takes everything). Runs on: the loop
        thread, or any thread once the transport's completion queue exists (the switch is
        atomic under the GIL)."""
        return False

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop listening and release transport resources; idempotent."""
