"""Offload handles: pollable, waitable and awaitable records of one retracted request.

A handle moves through ``OFFLOADING -> OFFLOADED -> RESTORING -> RESTORED``; ``DISCARDED``
can be entered from any state before ``RESTORED`` (discard and abort free the host copy at
once). ``OFFLOADING``/``RESTORING`` become ``OFFLOADED``/``RESTORED`` when the copy's
completion object (a CUDA event; ``None`` on CPU, where copies are synchronous) has fired;
:meth:`poll` observes that without blocking.

Ordering on CUDA: the copy of an operation starts only after the work queued on the
caller's current stream at the time of the call. Before the caller overwrites the source
pages of an offload, or reads the pages of a restore, on some stream, it calls
:meth:`OffloadHandle.order_before` (a stream-side wait, no host block) or :meth:`wait`.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvxfer.kernels.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from .host_pool import HostBlock

__all__ = ["OffloadHandle", "OffloadState"]

_ids = itertools.count(1)


class OffloadState(enum.Enum):
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    RESTORING = "restoring"
    RESTORED = "restored"
    DISCARDED = "discarded"


class OffloadHandle:
    """One request's KV pages (+ state slots) held in the host pool."""

    def __init__(
        self,
        owner,
        pages: np.ndarray,
        slots: np.ndarray,
        block: "HostBlock",
        geometry: tuple,
        nbytes: int,
    ) -> None:
        self.id = next(_ids)
        self._owner = owner
        self.src_pages = pages
        self.src_slots = slots
        self.block = block
        self.geometry = geometry
        self.nbytes = nbytes
        # pieces (fused path) or bus copies (copy_ paths) of the latest operation
        self.num_chunks = 0
        self.staged = False  # whether the latest operation went through the staging buffer
        self.path = ""  # path of the latest operation: "fused", "batch", "direct" or "staged"
        self.num_launches = 0  # kernel launches of the latest operation (fused path)
        self._state = OffloadState.OFFLOADING
        self._event = None  # completion object of the latest operation (None: complete)
        self._offload_event = None  # kept so a restore can be ordered after the offload

    # -- state -----------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return int(self.src_pages.size)

    @property
    def num_slots(self) -> int:
        return int(self.src_slots.size)

    @property
    def event(self):
        """Completion event of the latest copy (CUDA), or None when nothing is pending."""
        return self._event

    def poll(self) -> OffloadState:
        """Current state, advancing it if the pending copy has finished (non-blocking)."""
        if self._event is not None and self._event.query():
            self._complete()
        return self._state

    @property
    def state(self) -> OffloadState:
        return self.poll()

    def done(self) -> bool:
        """True when no copy of this handle is in flight."""
        return self.poll() in (
            OffloadState.OFFLOADED,
            OffloadState.RESTORED,
            OffloadState.DISCARDED,
        )

    def _complete(self) -> None:
        self._event = None
        if self._state is OffloadState.OFFLOADING:
            self._state = OffloadState.OFFLOADED
        elif self._state is OffloadState.RESTORING:
            self._state = OffloadState.RESTORED

    def wait(self) -> "OffloadHandle":
        """Block the calling thread until the pending copy is done (event sync only)."""
        ev = self._event
        if ev is not None:
            ev.synchronize()
            self._complete()
        return self

    def __await__(self):
        return self._wait_async().__await__()

    async def _wait_async(self) -> "OffloadHandle":
        delay = 0.0
        while not self.done():
            await asyncio.sleep(delay)  # polling an event; the loop stays free meanwhile
            delay = min(max(delay * 2, 2e-5), 1e-3)
        return self

    def order_before(self, stream=None) -> None:
        """Make ``stream`` (default: the current stream) wait for the pending copy."""
        ev = self._event
        if ev is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._owner.device)
        stream.wait_event(ev)

    # -- lifecycle -------------------------------------------------------------------
    def discard(self) -> None:
        """Same as ``manager.discard(handle)``."""
        self._owner.discard(self)

    release = discard

    def _require(self, *states: OffloadState, what: str) -> None:
        st = self.poll()
        if st not in states:
            raise InvalidArgument(f"cannot {what} offload handle {self.id}: it is {st.value}")

    def __repr__(self) -> str:
        return (
            f"OffloadHandle(id={self.id}, state={self._state.value}, pages={self.num_pages}, "
            f"slots={self.num_slots}, bytes={self.nbytes}, chunks={self.num_chunks}, "
            f"path={self.path or '-'})"
        )
