"""The 5-state poll machine every room goes through.

Invariants (enforced by :func:`can_advance`, asserted by the room table):

* states only move forward: ``Bootstrapping -> WaitingForInput -> Transferring -> Success``
  (skipping a state is allowed, going back never is);
* ``Failed`` can be entered from any non-terminal state and is sticky;
* ``Success`` and ``Failed`` are terminal; a room that reached one never changes again, and
  once cleared from its manager its id is never resurrected by a late message.
"""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    """Numeric values match SGLang's ``KVPoll`` so schedulers can compare them directly."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = frozenset((KVPoll.Failed, KVPoll.Success))


def is_terminal(state: int) -> bool:
    return state == KVPoll.Failed or state == KVPoll.Success


def can_advance(current: int, new: int) -> bool:
    """True when ``current -> new`` is a legal transition (see module invariants)."""
    if is_terminal(current):
        return False
    if new == KVPoll.Failed:
        return True
    return new > current
