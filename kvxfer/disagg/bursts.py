"""A polling scheduler's bursts of sends (prefill).

A scheduler like SGLang's polls its rooms between batches and sends the rooms of a batch
back to back. What suits one request alone — its write waiting inline for its flush on the
scheduler's thread (docs/engine.md, "Inline wait") — costs a burst its coalescing: writes
that end inline are never in flight when the next send looks, so none of the burst's rooms
wait for a shared write and each pays its own (:mod:`kvxfer.disagg.coalesce`;
bench/results/guest-writes-cpu.md, stop 50). :class:`Bursts` tells the two apart by what
the scheduler did between two writes: a write for another room than the last one, with no
poll of the manager's rooms since then, belongs to a burst. A scheduler that has not
polled for :data:`POLLER_S` (``on_done`` only) has no bursts: its back-to-back sends are
not told from sequential ones.

Pure bookkeeping, no locks: a tracker is meant for one thread at a time; threads racing on
one only misjudge a call (a burst taken for a lone send or the reverse), which changes how
fast it goes, never what it does.
"""

from __future__ import annotations

import time
from typing import Optional

#: a scheduler whose latest poll is older than this (s) is not one that polls between its
#: batches (``on_done`` only)
POLLER_S = 1.0


class Bursts:
    """One tracker of consecutive calls (the writes a manager's sends start): see the
    module docstring."""

    __slots__ = ("_polled", "_room")

    def __init__(self) -> None:
        self._polled = -1.0  # the scheduler's latest poll as of the last call
        self._room: Optional[int] = None  # the last call's room

    def burst(self, room: int, polled_at: float, now: Optional[float] = None) -> bool:
        """Whether a call for ``room`` now belongs to a burst, given the scheduler's latest
        poll of the manager's rooms at ``polled_at`` (``time.monotonic()``; 0.0: never):
        the last call was for another room, no poll came since, and that poll is less than
        :data:`POLLER_S` old (``now``: the time, for tests). Records this call."""
        burst = (
            polled_at == self._polled
            and room != self._room
            and polled_at > 0.0
            and (time.monotonic() if now is None else now) - polled_at < POLLER_S
        )
        self._polled, self._room = polled_at, room
        return burst
