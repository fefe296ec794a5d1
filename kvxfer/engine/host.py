"""What a :class:`kvxfer.engine.peer.Peer` gets from the engine that owns it.

The engine builds one :class:`PeerHost` and hands it to every peer it establishes; a peer
touches nothing else of the engine. Everything in it is used on the asyncio loop thread
(see the threads table in docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, Generic, Optional, TypeVar

from kvxfer.config import EngineConfig
from kvxfer.engine.groups import LocalGroups
from kvxfer.errors import InvalidArgument

P = TypeVar("P")
T = TypeVar("T")


@dataclass(frozen=True)
class PeerHost(Generic[P]):
    """The engine's side of a peer (``P``: the peer type; the engine's callbacks take one).

    - ``config``: the engine's configuration (resolved: its timeouts are set).
    - ``groups``: the engine's registered groups (frozen: the peer only reads them, and
      gives back the landing slots it was granted when it closes).
    - ``spawn(coro)``: run a background coroutine that the engine owns (``close()`` awaits it).
    - ``peer_gone(peer, exc)``: the peer died or closed; called once per peer.
    - ``dispatch(peer, payload)``: deliver one app message to the engine's handlers.
    - ``dispatch_now(peer, payload)``: the same, synchronously: returns None once every
      handler ran, or a coroutine to await for the rest (a handler returned an awaitable:
      it and the handlers after it).
    """

    config: EngineConfig
    groups: LocalGroups
    spawn: Callable[[Coroutine[Any, Any, None]], None]
    peer_gone: Callable[[P, Exception], None]
    dispatch: Callable[[P, bytes], Awaitable[None]]
    dispatch_now: Callable[[P, bytes], Optional[Coroutine[Any, Any, None]]]

    @property
    def transfer_timeout_s(self) -> float:
        return resolved(self.config.transfer_timeout_s, "transfer_timeout_s")


def resolved(value: Optional[T], name: str) -> T:
    """A config field that ``EngineConfig.__post_init__`` resolves (from the environment or
    its default); ``None`` here means the config was built around that."""
    if value is None:
        raise InvalidArgument(f"EngineConfig.{name} is not set")
    return value
