"""Notifications that another write's stack hands over as soon as their copy is done.

A write started with ``inline=False`` (a room's decode legs but the last:
:func:`kvxfer.disagg.tp_rooms.prefill_send`) launches its device copy, posts its PUTs and
suspends in its task until the copy is done; only then does it chain its flush +
notification. Its task resumes when the loop next runs, i.e. after the stack that started
it returned (for a guest's stack: a thread wake-up later), while the next leg's write runs
on that stack. Such a write leaves an :class:`EarlyNote` in its engine's
:class:`EarlyNotes`; every later write on the loop's stack drains them after posting its own
bytes: a note whose copy is done is handed to UCX there and then (its flush + notify chain),
so that peer learns of its write without waiting for the loop to resume the writer
(bench/results/tp-pattern-h200.md, eleventh session).

Invariants (tests/unit/test_early.py, tests/engine/test_lane_standin.py)
- A note is posted at most once, by whichever comes first: a drain after its ``ready``
  said the write's bytes are visible (the device copy's event completed), or its own
  write, resumed (:meth:`EarlyNote.take`; the write then posts the chain itself).
- A note is posted only while live: its write retires it when it resumes or ends in any
  way (cancelled, timed out, failed), so nothing is handed over for a write that gave up.
- A note's failure to post is its write's failure (raised by :meth:`EarlyNote.take`); a
  chain posted for a write that then ended without awaiting it has its outcome retrieved.
- Everything runs on the loop's thread (or as its guest): no locks.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, List, Optional

__all__ = ["ON", "EarlyNote", "EarlyNotes"]

#: whether writes leave early notes (``Peer.write``); ``$KVXFER_EARLY_NOTES=0``: off (A/B)
ON = os.environ.get("KVXFER_EARLY_NOTES", "1").strip() != "0"


class EarlyNote:
    """One write's flush + notify chain, waiting for its device copy (see the module)."""

    __slots__ = ("_ready", "_post", "chain", "error", "live", "_taken")

    def __init__(self, ready: Callable[[float], bool], post: Callable[[], Any]) -> None:
        """``ready(spin_s)``: whether the write's bytes are visible (polled up to
        ``spin_s``); ``post()``: hands the chain to UCX, returns its future (None: nothing
        was handed over) or raises."""
        self._ready, self._post = ready, post
        self.chain: Optional[asyncio.Future] = None
        self.error: Optional[BaseException] = None
        self.live = True
        self._taken = False

    def ready(self, spin_s: float) -> bool:
        return self._ready(spin_s)

    def fire(self) -> None:
        """Post the chain now (the caller checked :meth:`ready`); a failure is kept for the
        write (:meth:`take`)."""
        self.live = False
        try:
            self.chain = self._post()
        except Exception as exc:  # the write raises it where it would have posted
            self.error = exc

    def take(self) -> Optional[asyncio.Future]:
        """By the write, resumed: the chain a drain handed over, None if none was (the write
        posts it itself); retires the note. Raises what posting it raised."""
        self.live, self._taken = False, True
        if self.error is not None:
            raise self.error
        return self.chain

    def retire(self) -> None:
        """The write ended (in any way): never post; a chain posted but not taken has its
        outcome retrieved."""
        self.live = False
        if not self._taken and self.chain is not None:
            self._taken = True
            self.chain.add_done_callback(_retrieve)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


class EarlyNotes:
    """An engine's notes of writes waiting for their device copy, in the order added."""

    __slots__ = ("_notes", "posted")

    def __init__(self) -> None:
        self._notes: List[EarlyNote] = []
        #: notes handed over by a drain so far (diagnostics, tests)
        self.posted = 0

    def __len__(self) -> int:
        return len(self._notes)

    def add(self, ready: Callable[[float], bool], post: Callable[[], Any]) -> EarlyNote:
        note = EarlyNote(ready, post)
        self._notes.append(note)
        return note

    def drain(self, spin_s: float = 0.0) -> int:
        """Post every live note whose copy is done (each polled up to ``spin_s``), forget
        those no longer live; returns how many were posted."""
        notes = self._notes
        if not notes:
            return 0
        self._notes = []  # (a note added while draining is kept, after these)
        keep, posted = [], 0
        for note in notes:
            if not note.live:
                continue
            if note.ready(spin_s):
                note.fire()
                posted += 1
            else:
                keep.append(note)
        self._notes = keep + self._notes
        self.posted += posted
        return posted
