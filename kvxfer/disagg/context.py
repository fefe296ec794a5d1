"""What the role-specific protocol may use of its manager.

:class:`~kvxfer.disagg.manager.KVManager` owns the engine, the links, the room table and
the deadlines. Its collaborators are handed the manager typed as a Protocol holding exactly
the state and operations they use, nothing private, so that none of them imports the
manager: :class:`PrefillContext` (:class:`~kvxfer.disagg.prefill_side.PrefillSide`),
:class:`DecodeContext` (:class:`~kvxfer.disagg.decode_side.DecodeSide`), :class:`RoomOps`
(:class:`~kvxfer.disagg.integrity.Integrity`); :class:`SideContext` is what both sides share.

Runs on: every member is used on the manager's loop thread, except :meth:`SideContext.call`
(any thread).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Coroutine, Dict, Optional, Protocol, Tuple

from kvxfer import wire
from kvxfer.disagg import messages as m
from kvxfer.disagg.aux import AuxRows
from kvxfer.disagg.kv_args import KVArgs
from kvxfer.disagg.link import Link
from kvxfer.disagg.page_map import TokenGeometry
from kvxfer.disagg.poll import KVPoll
from kvxfer.disagg.rooms import Room, RoomTable


@dataclass
class Timeouts:
    """Seconds. Each state of a room has a deadline; a Transferring room's deadline is a lease
    renewed by every chunk that completes."""

    bootstrap_s: float = 30.0  # Bootstrapping: lookup+connect (decode), decode's metadata (prefill)
    waiting_s: float = 300.0  # WaitingForInput: scheduler/prefill compute until data flows
    transfer_s: float = 60.0  # Transferring: per chunk (lease)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    #: decode waits this long for prefill to confirm that no write is in flight; then it
    #: closes the link (fencing every write of that peer) before it releases the pages
    abort_ack_s: float = 10.0
    #: decode's WaitingForInput/Transferring deadlines run this much longer than prefill's
    #: (and, once its metadata went out, also cover prefill's Bootstrapping), so the side that
    #: knows what went wrong - prefill - normally reports it first
    decode_grace_s: float = 1.0
    register_s: float = 30.0  # prefill: keep trying to register at bootstrap this long


class IntegrityOps(Protocol):
    """The integrity check (:class:`kvxfer.disagg.integrity.Integrity`) as the sides and
    the manager call it."""

    algorithm: str

    async def source(self, r: Room, src: Any, src_state: Any, last: bool) -> Optional[bytes]: ...

    def sent(self, r: Room) -> None: ...

    def on_verdict(self, link: Link, msg: m.Verdict) -> None: ...

    def done_arrived(self, r: Room) -> None: ...

    def check(self, r: Room, msg: m.Done) -> None: ...

    def terminal(self, r: Room) -> None: ...


class RoomOps(Protocol):
    """The room operations of a manager: what the integrity check needs."""

    @property
    def name(self) -> str: ...

    @property
    def args(self) -> KVArgs: ...

    @property
    def kv_geometry(self) -> Optional[TokenGeometry]:
        """``TokenGeometry.of(args.kv_segments)``, made once by the manager."""
        ...

    @property
    def rooms(self) -> RoomTable: ...

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> "asyncio.Task[Any]": ...

    def send_msg(self, link: Link, msg: wire.Message) -> None: ...

    def advance(
        self, r: Room, state: KVPoll, exc: Optional[BaseException] = None, arm: bool = True
    ) -> bool: ...

    def arm(self, r: Room, seconds: Optional[float] = None) -> None: ...

    def fail(
        self, r: Room, exc: BaseException, *, notify: bool = True, peer_gone: bool = False
    ) -> None: ...

    def release(self, r: Room) -> None: ...


class SideContext(RoomOps, Protocol):
    """What both sides use of their manager."""

    @property
    def t(self) -> Timeouts: ...

    @property
    def fingerprint(self) -> Dict[str, Any]: ...

    @property
    def secret(self) -> bytes: ...

    @property
    def links(self) -> Dict[str, Link]: ...

    @property
    def aux(self) -> AuxRows: ...

    @property
    def integrity(self) -> Optional[IntegrityOps]: ...

    @property
    def closed(self) -> bool: ...

    def call(self, fn: Callable[..., Any], *args: Any, direct: bool = False) -> None:
        """Run ``fn(*args)`` on the loop: now if on it, else soon (``direct``: possibly
        now on the calling thread, as a guest of the idle loop). Runs on: any thread."""

    @property
    def direct_pages(self) -> int:
        """``KVSender.send`` chunks of at most this many pages may run ``direct``."""


class PrefillContext(SideContext, Protocol):
    """The manager as :class:`~kvxfer.disagg.prefill_side.PrefillSide` sees it."""

    @property
    def address(self) -> Optional[Tuple[str, int]]: ...

    @property
    def bootstrap_addr(self) -> Optional[str]: ...

    @property
    def stats(self) -> Dict[str, Any]: ...

    @property
    def tp_stage_min_ops(self) -> int:
        """Hetero-TP kv writes of more PUTs than this go staged (0: never)."""

    @property
    def tp_pattern(self) -> str:
        """When split kv writes (hetero-TP slices, byte runs at any TP) are PatternWrites:
        "auto" (the peer's device lane covers kv), "always", "off"."""

    @property
    def pattern_min_runs(self) -> int:
        """Under "auto", a token-major chunk of fewer byte runs than this goes as those runs,
        not as PatternWrites (the data engine's ``device_min_ops``)."""

    def count_write(self, stats: Any, rooms: int = 0) -> None:
        """Add a completed write's TransferStats to ``stats`` (``rooms``: a coalesced
        write's rooms)."""

    @property
    def polled_at(self) -> float:
        """``time.monotonic()`` of the scheduler's latest poll of one of this manager's
        rooms (0.0: none yet; kvxfer.disagg.bursts)."""

    @property
    def coalesce_after(self) -> int:
        """A last chunk waits for a coalesced write once this many writes of ours are in
        flight to its decode peer (0: never; kvxfer.disagg.coalesce)."""

    def hook(self, point: str, room: int) -> None: ...

    def room_gone(self) -> None: ...

    def link_failed(self, link: Link, exc: BaseException, *, fence: bool = False) -> None: ...


class DecodeContext(SideContext, Protocol):
    """The manager as :class:`~kvxfer.disagg.decode_side.DecodeSide` sees it."""

    async def connect(self, host: str, port: int) -> Any:
        """Connect our engine to a peer engine; its Peer."""

    async def message_engine(self, name: str) -> Any:
        """A started engine without registered memory whose messages and peer losses reach
        this manager (decode's refusals); the caller closes it."""
