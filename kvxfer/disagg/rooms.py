"""Per-room bookkeeping: the room record, the table (O(1) by room id), tombstones.

Threading: rooms are *inserted* from any thread (so a duplicate room raises synchronously in
the constructor of KVSender/KVReceiver) under a lock; every state transition, timer and
release happens on the manager's event-loop thread. ``Room.state`` is a plain int attribute,
so ``poll()`` reads it from any thread without locking.

Deadlines are at most one loop timer per room (``Room.timer``) and the room's current
deadline (``Room.due``): no task per room, nothing polls. A transition moves ``due``; the timer
is replaced only when the new deadline is earlier than the armed one, else it fires early
and re-arms itself for what is left (``KVManager.arm``): most rooms make one timer in their
life, not one per transition. Prefill arms a chunk's Transferring lease only once its write
is under way: a write that ends on the sending stack (most small requests) takes the room to
Success without a timer of that state. Tombstones remember the last ``max_tombstones`` cleared or aborted
rooms so a late message never brings a cleared room back and a reused id is refused.

Hand-over of decode's metadata (prefill): a 'pending' record holds it until the KVSender
exists. The KVSender *claims* it (:meth:`RoomTable.claim`, any thread) and the loop *retires*
it when it fails (:meth:`RoomTable.retire`); both run under the table's lock, so exactly one
of them wins. A retired record is never claimed (its failure left a *soft* tombstone, the
exception that ended it, and the KVSender then fails at once with that cause); a claimed
record is never retired (its failure becomes the KVSender's). So a destination decode was
told to release is never adopted.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from kvxfer.disagg.errors import DuplicateRoom
from kvxfer.disagg.link import Link
from kvxfer.disagg.poll import KVPoll
from kvxfer.disagg.roles import RoomRole

#: a tombstone: a reason (the id was used and cleared; reusing it raises DuplicateRoom), or
#: the exception that ended decode's side of a room before its KVSender existed (a *soft*
#: tombstone: the KVSender may still be created, and fails at once with that cause)
Tomb = Union[str, BaseException]


class Room:
    """State of one request on one manager (its :class:`RoomRole`: sender, receiver, or
    prefill-side 'pending' record holding decode's metadata until the KVSender exists)."""

    __slots__ = (
        "room",
        "role",
        "state",
        "exc",
        "link",
        "timer",
        "due",
        "on_done",
        "released",
        "waiters",
        "event",
        "handle",
        # prefill (sender) side
        "num_kv",
        "aux_index",
        "dst_kv",
        "dst_state",
        "dst_aux",
        "pages_queued",
        "pages_done",
        "dst_span",
        "done_note",
        "pages_map",
        "chain",
        "queued",
        "last_queued",
        "acks_owed",
        "peer_aborted",
        # decode (receiver) side
        "bootstrap_addr",
        "meta_sent",
        "pending_meta",
        "dst_aux_row",
        "expect_pages",
        "await_ack",
        "inited",
        # a 'pending' record claimed by the KVSender (under the table lock; never retired)
        "superseded",
        # release() was asked while the room's link was being fenced: released after it
        "held",
        # integrity mode (kvxfer.disagg.integrity): that module's per-room record
        "integrity",
        # stage timestamps (kvxfer.disagg.trace), None unless the manager traces
        "trace",
        # heterogeneous TP (kvxfer.disagg.tp_rooms): a room with several peers has one
        # *leg* per peer link (``legs``, a Legs); a leg names its room as ``parent``
        "legs",
        "parent",
    )

    def __init__(
        self,
        room: int,
        role: Union[RoomRole, str],
        on_done: Optional[Callable[[KVPoll, Optional[BaseException]], None]] = None,
    ) -> None:
        self.room = room
        self.role = RoomRole(role)
        self.state = KVPoll.Bootstrapping
        self.exc: Optional[BaseException] = None
        self.link: Optional[Link] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        #: the deadline: (loop time, state it was set in, its length in s), None when none
        self.due: Optional[Tuple[float, KVPoll, float]] = None
        self.on_done = on_done
        self.released = False
        self.waiters: List[Any] = []  # asyncio / concurrent futures woken on terminal
        self.event: Optional[threading.Event] = None
        self.handle: Any = None
        self.trace: Optional[Dict[str, Any]] = None
        self.num_kv: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.dst_kv: Any = None  # ids (ndarray); decode keeps its own destination ids here too
        self.dst_state: Any = None
        self.dst_aux: Optional[int] = None
        self.pages_queued = 0
        self.pages_done = 0
        #: decode's (prefix_len, num_tokens or None), from its TransferInfo
        self.dst_span: Tuple[int, Optional[int]] = (0, None)
        #: the last chunk's Done, encoded when decode's destination came (kvxfer.disagg.
        #: prefill_side): bytes that depend only on the room and decode's page count
        self.done_note: Optional[bytes] = None
        #: how the room's tokens travel (kvxfer.disagg.page_map.RoomPages), once both sides'
        #: page counts are known
        self.pages_map: Any = None
        #: the task of the last issued write (writes are ordered)
        self.chain: Optional[asyncio.Future] = None
        #: chunks handed to send() before decode's metadata arrived: (src, src_state, last)
        self.queued: List[Tuple[np.ndarray, Optional[np.ndarray], bool]] = []
        self.last_queued = False
        self.acks_owed = False  # decode asked to abort: ack once no write is in flight
        self.peer_aborted = False
        self.bootstrap_addr: Optional[str] = None
        self.meta_sent = False
        #: send_metadata() arrived before the link: (dst_kv, dst_state, aux row)
        self.pending_meta: Optional[Tuple[np.ndarray, np.ndarray, int]] = None
        self.dst_aux_row: Optional[int] = None
        self.expect_pages = 0
        self.await_ack = False
        self.inited = False
        self.superseded = False
        self.held = False
        self.integrity: Any = None
        self.legs: Any = None
        self.parent: Optional["Room"] = None

    def __repr__(self) -> str:
        return f"Room({self.room}, {self.role.value}, {self.state.name})"


class RoomTable:
    def __init__(self, max_tombstones: int = 65536) -> None:
        self._rooms: Dict[int, Room] = {}
        self._tombs: "OrderedDict[int, Tomb]" = OrderedDict()
        self._max_tombs = max_tombstones
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int) -> Optional[Room]:
        return self._rooms.get(room)

    def tombstone(self, room: int) -> Optional[Tomb]:
        return self._tombs.get(room)

    def rooms(self) -> List[Room]:
        with self._lock:
            return list(self._rooms.values())

    def insert(self, r: Room) -> None:
        """Insert ``r`` (any thread). A live record or any tombstone of the id raises
        DuplicateRoom."""
        with self._lock:
            old = self._rooms.get(r.room)
            if old is not None:
                raise DuplicateRoom(
                    f"room {r.room} is already in flight on this manager "
                    f"({old.role.value}, {old.state.name})"
                )
            why = self._tombs.get(r.room)
            if why is not None:
                raise DuplicateRoom(f"room {r.room} was already used on this manager ({why})")
            self._rooms[r.room] = r

    def claim(self, r: Room) -> Tuple[Optional[Room], Optional[BaseException]]:
        """Insert the KVSender's room ``r`` (any thread). Returns ``(pending, None)`` when a
        live 'pending' record held the id (``r`` replaces it; the loop adopts its metadata),
        ``(None, cause)`` when a soft tombstone did (the loop fails ``r`` with ``cause``),
        else ``(None, None)``. A live record or a reason tombstone raises DuplicateRoom."""
        with self._lock:
            old = self._rooms.get(r.room)
            if old is not None:
                if old.role is not RoomRole.PENDING:
                    raise DuplicateRoom(
                        f"room {r.room} is already in flight on this manager "
                        f"({old.role.value}, {old.state.name})"
                    )
                old.superseded = True
                self._rooms[r.room] = r
                return old, None
            why = self._tombs.get(r.room)
            if isinstance(why, str):
                raise DuplicateRoom(f"room {r.room} was already used on this manager ({why})")
            if why is not None:
                del self._tombs[r.room]
            self._rooms[r.room] = r
            return None, why

    def retire(self, p: Room, cause: BaseException) -> bool:
        """Drop the failed 'pending' record ``p`` and leave ``cause`` as its soft tombstone —
        unless a KVSender claimed it first: then False, and ``p`` stays the sender's."""
        with self._lock:
            if p.superseded:
                return False
            p.released = True
            if self._rooms.get(p.room) is p:
                del self._rooms[p.room]
            self._bury(p.room, cause)
            return True

    def remove(self, r: Room, why: str) -> None:
        """Drop ``r`` and tombstone its id with ``why``."""
        with self._lock:
            if self._rooms.get(r.room) is r:
                del self._rooms[r.room]
            self._bury(r.room, why)

    def bury_unless_live(self, room: int, cause: BaseException) -> Optional[Room]:
        """The live record of ``room`` if there is one; else tombstone ``room`` with
        ``cause`` (soft) unless it already has a tombstone, and return None."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None and room not in self._tombs:
                self._bury(room, cause)
            return r

    def _bury(self, room: int, why: Tomb) -> None:
        """Remember ``room`` (bounded, oldest forgotten first); caller holds the lock."""
        self._tombs[room] = why
        self._tombs.move_to_end(room)
        while len(self._tombs) > self._max_tombs:
            self._tombs.popitem(last=False)
