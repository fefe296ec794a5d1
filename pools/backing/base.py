"""The backing contract: a reserved virtual address range whose pages are backed later.

Torch-free. Two implementations: :mod:`kvxfer.pools.backing.host` (``mmap`` reserve + ``mprotect``
commit, any Linux machine) and :mod:`kvxfer.pools.backing.cuda` (CUDA VMM through cuda-bindings).

Model
-----
A :class:`Backing` owns one reserved range ``[address, address + reserved_bytes)``. Nothing in
it is usable until :meth:`Backing.commit` backs a sub-range physically. Backing is tracked as a
sorted list of disjoint *extents* ``(offset, nbytes)``; each extent is one physical allocation
mapped at one place (on CUDA one ``cuMemCreate`` + ``cuMemMap``), so an extent is also the unit
that :meth:`Backing.decommit` gives back. Invariants:

- every extent is granularity-aligned at both ends and lies inside the reservation;
- extents never overlap, and never cross a multiple of ``max_extent_bytes`` (measured from
  the start of the range), so giving memory back wastes at most one extent per boundary;
- ``backed_bytes`` is exactly the sum of the extent sizes;
- teardown is ordered: extents are released newest first, then the range itself.

A :class:`BackingProvider` holds per-device state (driver context, handle type, granularity)
and makes backings; one provider serves every buffer of a pool.
"""

from __future__ import annotations

import abc
import logging
import weakref
from typing import Any

from kvxfer.kernels.errors import BackingError, InvalidArgument

logger = logging.getLogger(__name__)

Extent = tuple[int, int]  # (offset from the range start, nbytes)


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``value`` (``multiple`` > 0)."""
    return -(-int(value) // multiple) * multiple


def round_down(value: int, multiple: int) -> int:
    """Largest multiple of ``multiple`` that is <= ``value`` (``multiple`` > 0)."""
    return int(value) // multiple * multiple


def subtract_ranges(lo: int, hi: int, holes: list[Extent]) -> list[tuple[int, int]]:
    """``[lo, hi)`` minus the union of ``holes`` given as ``(offset, nbytes)``; ``(lo, hi)`` pairs."""
    out = []
    cur = lo
    for off, n in sorted(holes):
        end = off + n
        if end <= cur or off >= hi:
            continue
        if off > cur:
            out.append((cur, off))
        cur = max(cur, end)
        if cur >= hi:
            break
    if cur < hi:
        out.append((cur, hi))
    return out


class _RangeState:
    """The releasable part of a backing, kept apart from it so a ``weakref.finalize``
    can tear it down without keeping the backing alive. Subclasses hold the handles."""

    def __init__(self) -> None:
        self.extents: list[Extent] = []  # sorted by offset
        self.order: list[Extent] = []  # creation order, for newest-first teardown
        self.released = False

    def unmap(self, offset: int, nbytes: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def free_range(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def sync(self) -> None:
        """Wait until no queued device work can touch the range (no-op on the host)."""

    def release(self) -> None:
        """Ordered teardown: sync, extents newest first, then the range. Idempotent."""
        if self.released:
            return
        self.released = True
        try:
            self.sync()
        except Exception:  # noqa: BLE001 - teardown must go on
            logger.exception("backing teardown: synchronisation failed")
        for off, n in reversed(self.order):
            try:
                self.unmap(off, n)
            except Exception:  # noqa: BLE001
                logger.exception("backing teardown: releasing extent (%d, %d) failed", off, n)
        self.extents.clear()
        self.order.clear()
        try:
            self.free_range()
        except Exception:  # noqa: BLE001
            logger.exception("backing teardown: freeing the reserved range failed")


class Backing(abc.ABC):
    """One reserved address range, backed extent by extent. Not thread-safe.

    Subclasses create their :class:`_RangeState` (holding the reservation) in ``__init__``,
    then call :meth:`_setup`, and implement :meth:`_map_extent`.
    """

    #: short name of the implementation ("host", "cuda_vmm")
    kind: str = "?"
    #: True when freshly committed memory is known to read as zeros
    fresh_memory_is_zero: bool = False

    def _setup(
        self,
        state: _RangeState,
        address: int,
        reserved_bytes: int,
        granularity: int,
        max_extent_bytes: int,
    ) -> None:
        self._state = state
        self.address = int(address)
        self.reserved_bytes = int(reserved_bytes)
        self.granularity = int(granularity)
        self.max_extent_bytes = int(max_extent_bytes)
        assert self.reserved_bytes % self.granularity == 0
        assert self.max_extent_bytes % self.granularity == 0 and self.max_extent_bytes > 0
        self._finalizer = weakref.finalize(self, state.release)

    # -- to implement -----------------------------------------------------------------
    @abc.abstractmethod
    def _map_extent(self, offset: int, nbytes: int) -> None:
        """Back ``[offset, offset + nbytes)`` (aligned, inside one grid cell) or raise
        :class:`BackingError` having left nothing behind for this extent."""

    # -- queries --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._state.released

    @property
    def extents(self) -> list[Extent]:
        """Backed extents, sorted by offset (a copy)."""
        return list(self._state.extents)

    @property
    def backed_bytes(self) -> int:
        return sum(n for _, n in self._state.extents)

    def is_backed(self, offset: int, nbytes: int) -> bool:
        """True when every byte of ``[offset, offset + nbytes)`` is backed."""
        if nbytes <= 0:
            return True
        return not subtract_ranges(offset, offset + nbytes, self._state.extents)

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "address": self.address,
            "reserved_bytes": self.reserved_bytes,
            "backed_bytes": self.backed_bytes,
            "granularity": self.granularity,
            "max_extent_bytes": self.max_extent_bytes,
            "extents": len(self._state.extents),
        }

    # -- commit / decommit ----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._state.released:
            raise BackingError(f"{self.kind} backing at {self.address:#x} is closed")

    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.reserved_bytes:
            raise InvalidArgument(
                f"range [{offset}, {offset + nbytes}) is outside the reservation "
                f"[0, {self.reserved_bytes})"
            )

    def commit(self, offset: int, nbytes: int) -> list[Extent]:
        """Back every byte of ``[offset, offset + nbytes)`` (rounded out to the granularity).

        Already-backed parts are left alone. Returns the extents created by this call. On
        failure the extents created by this call are released again and
        :class:`BackingError` is raised: the backing is as it was before the call.
        """
        self._check_open()
        self._check_range(offset, nbytes)
        if nbytes == 0:
            return []
        g, cell = self.granularity, self.max_extent_bytes
        lo, hi = round_down(offset, g), min(round_up(offset + nbytes, g), self.reserved_bytes)
        created: list[Extent] = []
        try:
            for gap_lo, gap_hi in subtract_ranges(lo, hi, self._state.extents):
                cur = gap_lo
                while cur < gap_hi:
                    end = min(gap_hi, round_down(cur, cell) + cell)
                    self._map_extent(cur, end - cur)
                    created.append((cur, end - cur))
                    self._add(cur, end - cur)
                    cur = end
        except BaseException:
            self.release_extents(created)
            raise
        return created

    def decommit(self, offset: int, nbytes: int) -> int:
        """Give back every extent lying wholly inside ``[offset, offset + nbytes)``.

        Extents straddling the ends stay backed (``backed_bytes`` tells the truth). Returns
        the number of bytes given back. The caller guarantees no queued work touches them;
        :meth:`sync` first when unsure.
        """
        self._check_open()
        self._check_range(offset, nbytes)
        hi = offset + nbytes
        victims = [(o, n) for o, n in self._state.extents if o >= offset and o + n <= hi]
        self.release_extents(victims)
        return sum(n for _, n in victims)

    def release_extents(self, extents: list[Extent]) -> None:
        """Release the given extents (as returned by :meth:`commit`), newest first."""
        st = self._state
        for ext in sorted(extents, key=st.order.index, reverse=True):
            st.unmap(*ext)
            st.extents.remove(ext)
            st.order.remove(ext)

    def _add(self, offset: int, nbytes: int) -> None:
        st = self._state
        st.order.append((offset, nbytes))
        st.extents.append((offset, nbytes))
        st.extents.sort()

    def sync(self) -> None:
        """Block until queued device work that may touch this range has finished."""
        if not self._state.released:
            self._state.sync()

    def close(self) -> None:
        """Ordered teardown (sync, extents newest first, range). Idempotent."""
        self._finalizer()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"backed={self.backed_bytes}"
        return (
            f"<{type(self).__name__} {self.address:#x} reserved={self.reserved_bytes} "
            f"{state} extents={len(self._state.extents)}>"
        )


class BackingProvider(abc.ABC):
    """Per-device factory of backings; holds what every range on the device shares."""

    #: torch device type of the memory ("cpu", "cuda")
    device_type: str = "?"
    granularity: int
    #: default extent cap (bytes, a multiple of the granularity)
    default_max_extent_bytes: int

    @abc.abstractmethod
    def reserve(self, nbytes: int, *, max_extent_bytes: int | None = None) -> Backing:
        """Reserve ``nbytes`` (rounded up to the granularity) of address space, unbacked."""

    def info(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "granularity": self.granularity}

    def close(self) -> None:  # noqa: B027 - a provider without per-device state has nothing to do
        """Release per-device state (after every backing it made is closed). Idempotent."""

    def _extent_cap(self, max_extent_bytes: int | None) -> int:
        if max_extent_bytes is None:
            return self.default_max_extent_bytes
        if int(max_extent_bytes) <= 0:
            raise InvalidArgument(f"max_extent_bytes must be positive, got {max_extent_bytes}")
        return round_up(int(max_extent_bytes), self.granularity)

    def _reserve_size(self, nbytes: int) -> int:
        if int(nbytes) <= 0:
            raise InvalidArgument(f"reservation size must be positive, got {nbytes}")
        return round_up(int(nbytes), self.granularity)
