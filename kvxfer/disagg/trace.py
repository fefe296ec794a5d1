"""Per-request stage timestamps for the latency breakdown (``kvxfer bench pd --stages``).

Off by default: ``KVManager(trace=True)`` or ``$KVXFER_TRACE=1`` (read once, when the manager
is made) turns it on. Off, a room's ``trace`` is None and each stage point costs one
attribute check; no allocation, no per-page work.

On, every room made by the manager gets a plain dict ``{"room", "role", <stage>: ns}`` that
the protocol fills in as the room moves; the stamps are ``time.monotonic_ns()`` — one clock
per host, so prefill's and decode's stamps of the same room compare across processes. Stage
names (prefill stamps the last chunk only; decode its Done):

* prefill: ``send`` (``KVSender.send`` on the scheduler thread), ``loop`` (picked up on the
  loop thread), ``plan`` (page map done), ``write`` (``Peer.write`` called, after the task
  hop), then from the engine's :class:`~kvxfer.engine.types.TransferStats`: ``planned``
  (its planning done: the post starts), ``launched`` (its lane launches returned — the
  device lane's, the host lane's start — when it had any; "planned → launched" includes the
  lane pick before them), ``put`` (its UCX PUTs start being posted: after the launches, the
  lane masks and the notification's turn), ``posted`` (the native post returned),
  ``flushed`` (UCX reported the flush), ``woken`` (the loop resumed after it), ``notified``
  (the notification handed to UCX and ``Peer.write`` returned).
* decode: ``arrived`` (the Done's notification taken by the transport's native receive
  callback, :func:`kvxfer.transport.base.note_arrival`; absent when the Done was not
  delivered inline from it), ``recv`` (Done decoded on the loop, room found), ``handled``
  (room at Success), ``seen`` (the first ``poll()`` that saw Success, on the scheduler
  thread).

The records live in a deque of at most ``maxlen`` (the oldest fall out); :meth:`drain`
returns copies and empties it. A record drained while its room is live is partial.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Deque, Dict, List, Optional

#: environment switch, read once per manager
ENV = "KVXFER_TRACE"

Record = Dict[str, Any]


def enabled(trace: Optional[bool]) -> bool:
    """``trace`` if given, else ``$KVXFER_TRACE`` set to a non-empty value other than 0."""
    if trace is not None:
        return bool(trace)
    return os.environ.get(ENV, "") not in ("", "0")


def mark(rec: Record, stage: str) -> None:
    """Stamp ``stage`` now (the first stamp of a stage wins)."""
    if stage not in rec:
        rec[stage] = time.monotonic_ns()


def mark_recv(rec: Record) -> None:
    """Stamp ``recv`` now and, when a notification's delivery is running on this thread,
    ``arrived`` at its native arrival time."""
    from kvxfer.transport.base import note_arrival

    mark(rec, "recv")
    t = note_arrival()
    if t and "arrived" not in rec:
        rec["arrived"] = int(t * 1e9)


def mark_write(rec: Record, t_call: int, t_ret: int, stats: Any) -> None:
    """Stamp ``write`` at ``t_call`` and the engine's stages from ``stats`` (durations from
    the end of posting), the write having returned at ``t_ret``."""
    # measured where posting ended when the engine says (TransferStats.posted_ns); else
    # derived from the return, which a thread holding the GIL in between makes late
    posted = int(getattr(stats, "posted_ns", 0)) or t_ret - int(stats.complete_s * 1e9)
    planned = max(t_call, posted - int(stats.post_s * 1e9))
    rec.update(
        write=t_call,
        planned=planned,
        posted=posted,
        flushed=posted + int(stats.flush_s * 1e9),
        woken=posted + int(stats.wake_s * 1e9),
        notified=t_ret,
    )
    # (the end of the lane launches and the start of the PUTs, where the engine measured
    # them; else "launched" derived as the launches' time after "planned")
    launched = int(getattr(stats, "launched_ns", 0))
    launch_s = getattr(stats, "launch_s", 0.0)
    if launched or launch_s:
        rec["launched"] = launched or planned + int(launch_s * 1e9)
    put = int(getattr(stats, "put_ns", 0))
    if put:
        rec["put"] = put


class StageTrace:
    """The bounded record store of one manager. Runs on: any thread (a lock guards it)."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._q: Deque[Record] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def start(self, room: int, role: str) -> Record:
        """A new room's record (kept until drained or pushed out)."""
        rec: Record = {"room": room, "role": role}
        with self._lock:
            self._q.append(rec)
        return rec

    def __len__(self) -> int:
        return len(self._q)

    def drain(self) -> List[Record]:
        with self._lock:
            out = [dict(r) for r in self._q]
            self._q.clear()
        return out
