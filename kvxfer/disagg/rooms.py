"""Per-room bookkeeping: the room record, the table (O(1) by room id), tombstones.

Threading: rooms are *inserted* from any thread (so a duplicate room raises synchronously in
the constructor of KVSender/KVReceiver) under a lock; every state transition, timer and
release happens on the manager's event-loop thread. ``Room.state`` is a plain int attribute,
so ``poll()`` reads it from any thread without locking.

Deadlines are one ``loop.call_later`` handle per room, re-armed on each transition: no task
per room, nothing polls. Tombstones remember the last ``max_tombstones`` cleared or aborted
rooms so a late message never brings a cleared room back and a reused id is refused.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

from kvxfer.disagg.errors import DuplicateRoom
from kvxfer.disagg.poll import KVPoll


#: tombstones that let the room be created (and then fail at once) instead of raising:
#: the peer aborted the room, or decode's metadata for it expired, before the handle existed.
SOFT_TOMBS = frozenset({"aborted-by-peer", "pending-expired"})


class Room:
    """State of one request on one manager (sender, receiver, or prefill-side 'pending'
    record holding decode's metadata until the KVSender exists)."""

    __slots__ = (
        "room", "role", "state", "exc", "link", "timer", "on_done", "released", "waiters",
        "event", "handle",
        # prefill (sender) side
        "num_kv", "aux_index", "dst_kv", "dst_state", "dst_aux", "pages_queued",
        "pages_done", "chain", "queued", "last_queued", "acks_owed", "peer_aborted",
        # decode (receiver) side
        "bootstrap_addr", "meta_sent", "pending_meta", "dst_aux_row", "expect_pages",
        "await_ack", "inited", "superseded",
        # integrity mode (kvxfer.disagg.integrity): that module's per-room record
        "integrity",
    )

    def __init__(self, room: int, role: str, on_done: Optional[Callable] = None) -> None:
        self.room = room
        self.role = role
        self.state = KVPoll.Bootstrapping
        self.exc: Optional[BaseException] = None
        self.link = None
        self.timer = None
        self.on_done = on_done
        self.released = False
        self.waiters: List = []
        self.event: Optional[threading.Event] = None
        self.handle = None
        self.num_kv: Optional[int] = None
        self.aux_index: Optional[int] = None
        self.dst_kv = None         # decode keeps its own destination ids here too
        self.dst_state = None
        self.dst_aux: Optional[int] = None
        self.pages_queued = 0
        self.pages_done = 0
        self.chain = None          # asyncio.Future of the last issued write (writes are ordered)
        self.queued: List = []     # chunks handed to send() before decode's metadata arrived
        self.last_queued = False
        self.acks_owed = False     # decode asked to abort: ack once no write is in flight
        self.peer_aborted = False
        self.bootstrap_addr = None
        self.meta_sent = False
        self.pending_meta = None
        self.dst_aux_row: Optional[int] = None
        self.expect_pages = 0
        self.await_ack = False
        self.inited = False
        self.superseded = False    # a 'pending' record replaced by the KVSender's room
        self.integrity = None

    def __repr__(self) -> str:
        return f"Room({self.room}, {self.role}, {self.state.name})"


class RoomTable:
    def __init__(self, max_tombstones: int = 65536) -> None:
        self._rooms: Dict[int, Room] = {}
        self._tombs: "OrderedDict[int, str]" = OrderedDict()
        self._max_tombs = max_tombstones
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._rooms)

    def get(self, room: int) -> Optional[Room]:
        return self._rooms.get(room)

    def tombstone(self, room: int) -> Optional[str]:
        return self._tombs.get(room)

    def rooms(self) -> List[Room]:
        with self._lock:
            return list(self._rooms.values())

    def insert(self, r: Room, *, replace_role: Optional[str] = None):
        """Insert ``r`` (any thread). If a record of role ``replace_role`` holds the id, ``r``
        replaces it and the old record is returned (marked superseded) for the loop to merge;
        otherwise returns None. Live duplicates and hard-tombstoned ids raise DuplicateRoom."""
        with self._lock:
            old = self._rooms.get(r.room)
            if old is not None:
                if replace_role is not None and old.role == replace_role:
                    old.superseded = True
                    self._rooms[r.room] = r
                    return old
                raise DuplicateRoom(f"room {r.room} is already in flight on this manager "
                                    f"({old.role}, {old.state.name})")
            why = self._tombs.get(r.room)
            if why is not None and why not in SOFT_TOMBS:
                raise DuplicateRoom(f"room {r.room} was already used on this manager ({why})")
            self._rooms[r.room] = r
            return None

    def remove(self, r: Room, why: str) -> None:
        with self._lock:
            if self._rooms.get(r.room) is r:
                del self._rooms[r.room]
            self.bury(r.room, why)

    def bury(self, room: int, why: str) -> None:
        """Remember ``room`` (bounded, oldest forgotten first)."""
        with self._lock:
            self._tombs[room] = why
            self._tombs.move_to_end(room)
            while len(self._tombs) > self._max_tombs:
                self._tombs.popitem(last=False)

    def unbury(self, room: int) -> Optional[str]:
        with self._lock:
            return self._tombs.pop(room, None)
