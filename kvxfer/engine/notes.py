"""Chained notifications: the receiving end (:class:`NoteBox`) and the sender's rule
(:func:`chainable`).

A write's ``notify`` normally travels as an :class:`~kvxfer.engine.messages.AppMessage` on the
channel after the write's flush completed on the loop (two awaits, each a thread hop). When
the peer announced a note token in its Layout and the write is a plain batch of PUTs, the
transport chains instead (:meth:`kvxfer.transport.base.RmaEndpoint.flush_notify_future`):
one native call flushes and, from the flush's completion callback, sends the payload as an
active message; the receiver's native handler queues it for the event loop (one hop), where
the :class:`NoteBox` of that connection hands it to the peer's inbox, in arrival order with
the channel's messages as they reach the loop.

Invariants
- A chained notification is sent only after every PUT posted before it on the endpoint is
  visible at the target (UCX flush semantics); a failed flush sends nothing.
- Ordering: notifications chained on one endpoint arrive in the order they were sent. A
  chained notification and a channel message travel on different endpoints: their relative
  order is that of their arrival. Bye is the exception the engine needs: it carries the
  number of chained notifications its sender completed before it (``Bye.notes``) and the
  receiver delivers that many before it acts on the Bye (bounded by the close grace).
- A token is 64 random bits, sent only inside the authenticated handshake (Layout); a
  notification with an unknown token is dropped natively. ``close()`` unregisters the token
  (late notifications are dropped).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, List, Optional, Tuple

from kvxfer.transport.base import Transport

log = logging.getLogger(__name__)

#: largest notification payload sent chained (a larger one goes on the channel); the
#: receiver drops bigger ones (a protocol violation)
MAX_NOTE_BYTES = 64 << 10
#: notifications held for a connection whose Peer does not exist yet (handshake end)
MAX_EARLY = 4096


class NoteBox:
    """Receiving end of one connection's chained notifications. Made before the handshake
    (its :attr:`token` goes into our Layout); the :class:`~kvxfer.engine.peer.Peer` attaches
    its inbox. Everything runs on the asyncio loop thread (the transport's completion
    callback calls :meth:`_deliver`)."""

    def __init__(self, transport: Transport):
        self._t = transport
        self._sink: Optional[Callable[[bytes], None]] = None
        self._early: List[bytes] = []
        self._want: Optional[Tuple[int, asyncio.Future]] = None
        self.received = 0
        self.dropped = 0
        self.token = transport.note_listen(self._deliver)

    def _deliver(self, payload: Optional[bytes]) -> None:
        if payload is None:  # over a size limit (none is set for notifications)
            return
        if len(payload) > MAX_NOTE_BYTES or (self._sink is None and len(self._early) >= MAX_EARLY):
            self.dropped += 1
            log.warning("chained notification of %d bytes dropped", len(payload))
            return
        self.received += 1
        if self._sink is None:
            self._early.append(payload)
        else:
            self._sink(payload)
        want = self._want
        if want is not None and self.received >= want[0] and not want[1].done():
            want[1].set_result(None)

    def attach(self, sink: Callable[[bytes], None]) -> None:
        """From now on notifications go to ``sink`` (those that came earlier first)."""
        early, self._early = self._early, []
        self._sink = sink
        for payload in early:
            sink(payload)

    async def wait_for(self, count: int, timeout: float) -> bool:
        """Wait (bounded) until ``count`` notifications arrived; returns whether they did."""
        if self.received >= count or not self.token:
            return self.received >= count
        fut = asyncio.get_running_loop().create_future()
        self._want = (count, fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._want = None

    def close(self) -> None:
        """Unregister the token; idempotent."""
        token, self.token = self.token, 0
        if token:
            self._t.note_unlisten(token)


def chainable(note_token: int, notify: Optional[bytes], staged: bool, posted: bool) -> bool:
    """Whether a write sends ``notify`` chained: the peer takes chained notifications, there
    is one, small enough, the write PUT something on the RMA endpoint and staged nothing (a
    staged chunk's scatter plan goes on the channel and must precede the notification)."""
    return bool(
        note_token
        and notify is not None
        and posted
        and not staged
        and len(notify) <= MAX_NOTE_BYTES
    )
