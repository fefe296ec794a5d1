"""Link: one connected peer engine, shared by all the rooms that go through it.

A link is created on the loop thread when a peer says hello (prefill) or once we connected
and said hello (decode), and dies once: ``dead`` never goes back to False. While ``fencing``
its rooms are held (not released) until our endpoints to that peer are closed — or, while
``held`` (decode gave up on a peer that may still be alive), until the peer confirms each
room or is gone; a decode room the peer confirmed (``Room.peer_aborted``) is never held.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Set

from kvxfer.errors import KvxferError


class Link:
    """One connected peer engine (``peer``: the engine's Peer), keyed by ``key``."""

    __slots__ = (
        "key",
        "peer",
        "name",
        "rooms",
        "last_heard",
        "dead",
        "fencing",
        "held",
        "refused",
        "remote_items",
        "page_size",
        "tp",
        "layer_notify",
        "done_many",
    )

    def __init__(self, key: str, peer: Any, name: str = "") -> None:
        self.key, self.peer, self.name = key, peer, name
        #: the rooms (kvxfer.disagg.rooms.Room) bound to this peer
        self.rooms: Set[Any] = set()
        self.last_heard = time.monotonic()
        self.dead = False
        #: we are closing its endpoints; its rooms are released once that is done
        self.fencing = False
        #: decode gave up on this peer while it may be alive (kvxfer.disagg.manager._hold):
        #: its endpoints stay open so that it can confirm its rooms; ``fencing`` is set too
        self.held = False
        #: the peer's layout does not match ours (LayoutMismatch): connected only to
        #: carry each room's refusal
        self.refused: Optional[KvxferError] = None
        self.remote_items: Dict[str, int] = {}
        #: the peer's page size (from its hello's fingerprint; prefill side), 0: not known
        self.page_size = 0
        #: heterogeneous TP (kvxfer.disagg.tp_rooms.TpPair): the peer's TP rank and size and
        #: both sides' item geometries; None when both TP sizes are equal
        self.tp: Any = None
        #: the peer takes LayerDone notifications (its hello's fingerprint; prefill side)
        self.layer_notify = False
        #: the peer takes DoneMany notifications (its hello's fingerprint; prefill side)
        self.done_many = False
        groups = getattr(peer, "remote_groups", None) or {}
        for g, (lens, item_lens) in groups.items():
            self.remote_items[g] = min(
                (int(n) // int(i) for n, i in zip(lens, item_lens)), default=0
            )

    def __repr__(self) -> str:
        return f"Link({self.name or self.key}, rooms={len(self.rooms)}, dead={self.dead})"
