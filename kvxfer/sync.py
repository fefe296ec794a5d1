"""SyncEngine: the asyncio engine driven from a background event-loop thread, for
schedulers that are not async.

Every method is thread-safe and bounded: blocking calls wait at most their timeout (plus a
small margin); ``write_async`` returns a :class:`Pending` whose ``poll()`` never blocks.
Methods run on the caller's thread and hand the work to the loop thread (a
:class:`kvxfer.loop_thread.LoopThread`, via ``run_coroutine_threadsafe``), except writes:
a write starts on the caller's thread as the loop's guest when the loop waits for events
(:meth:`LoopThread.submit_here`: planned, posted and, when its flush ends inline, finished
there, with no thread hop), else it is handed over in order (writes start in call order
either way: their notifications leave in that order). Handlers registered here run on
the loop thread (the threads table in docs/engine.md). Alternatively
``poll_messages()`` drains the messages received so far (non-blocking).
"""

from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable, List, Optional, Sequence, Tuple

from kvxfer.config import EngineConfig
from kvxfer.engine import ItemWrite, Peer, RawWrite, TransferEngine, TransferStats
from kvxfer.errors import Closed, TransferTimeout
from kvxfer.loop_thread import LoopThread

__all__ = ["SyncEngine", "SyncPeer", "Pending", "ItemWrite", "RawWrite", "TransferStats"]

_MARGIN_S = 5.0


class Pending:
    """A write in flight. ``poll()`` → True once finished; ``result()`` returns the
    :class:`TransferStats` or raises the write's error."""

    def __init__(self, fut: concurrent.futures.Future, timeout: float):
        self._fut, self._timeout = fut, timeout

    def poll(self) -> bool:
        return self._fut.done()

    def result(self, timeout: Optional[float] = None) -> TransferStats:
        try:
            return self._fut.result(self._timeout + _MARGIN_S if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            raise TransferTimeout("write did not finish in time") from None


class SyncPeer:
    def __init__(self, owner: "SyncEngine", peer: Peer):
        self._owner, self._peer = owner, peer
        self.id, self.name = peer.id, peer.name

    @property
    def remote_groups(self):
        return self._peer.remote_groups

    @property
    def lanes(self) -> List[str]:
        return list(self._peer.lanes)

    @property
    def closed(self) -> bool:
        return self._peer.closed

    def write_async(
        self, writes: Sequence, notify: Optional[bytes] = None, timeout: Optional[float] = None
    ) -> Pending:
        t = self._owner.engine.config.transfer_timeout_s if timeout is None else timeout
        return Pending(self._owner._start(self._peer.write(list(writes), notify, t)), t)

    def write(
        self, writes: Sequence, notify: Optional[bytes] = None, timeout: Optional[float] = None
    ) -> TransferStats:
        return self.write_async(writes, notify, timeout).result()

    def send(self, payload: bytes, timeout: Optional[float] = None) -> None:
        t = self._owner.engine.config.transfer_timeout_s if timeout is None else timeout
        self._owner._run(self._peer.send(payload, t), t)

    def close(self) -> None:
        self._owner._run(self._peer.close(), self._owner.engine.config.close_timeout_s * 4)


class SyncEngine:
    """Owns a thread running an event loop with one :class:`TransferEngine`."""

    def __init__(self, config: EngineConfig):
        self.engine = TransferEngine(config)
        self._lt = LoopThread(f"kvxfer-{config.name or 'engine'}")
        self._lt.start()
        self._messages: collections.deque = collections.deque()
        self._closed = False
        self._wrap: dict = {}
        # loop thread appends, caller's thread pops (poll_messages): deque ops are atomic
        self.engine.on_message(lambda peer, payload: self._messages.append((peer.id, payload)))

    # -- plumbing
    def _start(self, coro) -> concurrent.futures.Future:
        """Start ``coro`` here as the loop's guest, else on the loop, in call order
        (LoopThread.submit_here)."""
        if self._closed:
            coro.close()
            raise Closed("SyncEngine closed")
        return self._lt.submit_here(coro)

    def _run(self, coro, timeout: float):
        if self._closed:
            coro.close()
            raise Closed("SyncEngine closed")
        return self._lt.run(coro, timeout + _MARGIN_S, what="engine call")

    def _sync_peer(self, peer: Peer) -> SyncPeer:
        sp = self._wrap.get(id(peer))
        if sp is None or sp._peer is not peer:
            sp = self._wrap[id(peer)] = SyncPeer(self, peer)
        return sp

    # -- API
    def register(self, name: str, ptrs, lens, item_lens, *, item_lens_may_differ=False) -> None:
        self.engine.register(name, ptrs, lens, item_lens, item_lens_may_differ=item_lens_may_differ)

    def start(self) -> Tuple[str, int]:
        return self._run(self.engine.start(), self.engine.config.connect_timeout_s)

    @property
    def address(self):
        return self.engine.address

    def connect(self, host: str, port: int, timeout: Optional[float] = None) -> SyncPeer:
        t = self.engine.config.connect_timeout_s if timeout is None else timeout
        return self._sync_peer(self._run(self.engine.connect(host, port, t), t))

    def peers(self) -> dict:
        return {pid: self._sync_peer(p) for pid, p in self.engine.peers.items()}

    def on_message(self, handler: Callable) -> None:
        """``handler(peer_id, payload)`` for every message (keep it short).
        Runs on: the engine's loop thread (this SyncEngine's private thread)."""
        self.engine.on_message(lambda peer, payload: handler(peer.id, payload))

    def on_peer_closed(self, handler: Callable) -> None:
        """``handler(peer_id, exc)`` once per peer.
        Runs on: the engine's loop thread (this SyncEngine's private thread)."""
        self.engine.on_peer_closed(lambda peer, exc: handler(peer.id, exc))

    def poll_messages(self) -> List[Tuple[str, bytes]]:
        """Messages received since the last call, as ``(peer_id, payload)``; never blocks."""
        out = []
        while self._messages:
            out.append(self._messages.popleft())
        return out

    def close(self) -> None:
        """Close the engine and stop the loop thread; idempotent."""
        if self._closed:
            return
        try:
            self._run(self.engine.close(), self.engine.config.close_timeout_s * 4)
        finally:
            self._closed = True
            self._lt.stop(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
