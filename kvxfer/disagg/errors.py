"""Protocol-level errors of the prefill/decode layer.

They extend the one hierarchy (:mod:`kvxfer.errors`); every message names the offending
value (room id, index, field) so a scheduler log line is enough to find the culprit.
"""

from __future__ import annotations

from kvxfer.errors import IncompatiblePeer, InvalidArgument, KvxferError


class DuplicateRoom(InvalidArgument):
    """A room id that is already in flight (or was just used) on this manager or peer."""


class UnknownRoom(InvalidArgument):
    """A room id this manager does not know (never created, or already cleared)."""


class LayoutMismatch(IncompatiblePeer):
    """Prefill and decode disagree on page size, dtype, descriptor geometry or layout."""


class TpShapeMismatch(LayoutMismatch):
    """Prefill and decode tensor-parallel shapes that no head / state-row mapping can join
    (e.g. a head count not divisible by a TP size, or a TP ratio that is not an integer);
    the message names both shapes (see :mod:`kvxfer.disagg.tp_plan`)."""


class RoomMismatch(KvxferError):
    """The metadata row delivered to a room carries another room's id: data rejected."""


class IntegrityError(KvxferError):
    """Integrity mode: an item's checksum on decode differs from the one prefill computed
    before the write (or could not be computed); the room's data is rejected.

    ``room``, ``group`` (``"kv"``, ``"state"`` or ``"aux"``) and ``index`` (the item's
    position in the room) name the first bad item when known (None for a rebuilt remote
    error)."""

    def __init__(self, msg: str, *, room=None, group=None, index=None) -> None:
        super().__init__(msg)
        self.room, self.group, self.index = room, group, index
