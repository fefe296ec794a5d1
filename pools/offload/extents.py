"""Torch-free extent allocator for the host pool's page and slot ranges.

Free space is a sorted list of disjoint, non-adjacent ``(start, length)`` extents over
``[0, size)``. ``alloc(n)`` prefers ONE extent (best fit: the smallest free extent that
holds ``n``) so that a request's host copy stays contiguous and its device runs copy as one
chunk each; when no single extent fits it takes the largest extents first (fewest
pieces). ``free`` coalesces neighbours and rejects any id that is already free.

Invariants (checked by the tests after every operation): extents are sorted, disjoint and
never adjacent; ``free_count + used_count == size``; an allocation is all-or-nothing.
"""

from __future__ import annotations

import bisect

from kvxfer.kernels.errors import DoubleFree, InvalidArgument, OutOfMemory

__all__ = ["ExtentAllocator"]

Extent = tuple[int, int]


class ExtentAllocator:
    """Bounded allocator of id ranges ``[0, size)``; returns lists of ``(start, length)``."""

    def __init__(self, size: int, what: str = "pages") -> None:
        if int(size) != size or size < 0:
            raise InvalidArgument(f"extent allocator size must be an integer >= 0, got {size!r}")
        self.size = int(size)
        self.what = what
        self._starts: list[int] = [0] if size else []
        self._lens: list[int] = [self.size] if size else []
        self._free = self.size

    # -- queries ---------------------------------------------------------------------
    @property
    def free_count(self) -> int:
        return self._free

    @property
    def used_count(self) -> int:
        return self.size - self._free

    def free_extents(self) -> list[Extent]:
        return list(zip(self._starts, self._lens))

    # -- alloc / free ----------------------------------------------------------------
    def alloc(self, n: int) -> list[Extent]:
        """Take ``n`` ids; raise :class:`OutOfMemory` (taking nothing) when fewer are free."""
        if int(n) != n or n < 0:
            raise InvalidArgument(f"cannot allocate {n!r} {self.what}")
        n = int(n)
        if n == 0:
            return []
        if n > self._free:
            raise OutOfMemory(
                f"host pool has {self._free} free {self.what} of {self.size}, {n} requested"
            )
        best = -1
        for i, length in enumerate(self._lens):
            if length >= n and (best < 0 or length < self._lens[best]):
                best = i
                if length == n:
                    break
        if best >= 0:
            return [self._take(best, n)]
        out: list[Extent] = []
        need = n
        while need:
            i = max(range(len(self._lens)), key=self._lens.__getitem__)
            got = self._take(i, min(need, self._lens[i]))
            out.append(got)
            need -= got[1]
        out.sort()
        return out

    def _take(self, i: int, n: int) -> Extent:
        start = self._starts[i]
        if self._lens[i] == n:
            del self._starts[i]
            del self._lens[i]
        else:
            self._starts[i] += n
            self._lens[i] -= n
        self._free -= n
        return (start, n)

    def free(self, extents: list[Extent]) -> None:
        """Return extents; raise :class:`DoubleFree` (freeing nothing) if any id is free."""
        ext = sorted((int(s), int(n)) for s, n in extents if n)
        for (s, n), nxt in zip(ext, ext[1:] + [None]):
            if s < 0 or n < 0 or s + n > self.size:
                raise InvalidArgument(f"extent ({s}, {n}) is outside [0, {self.size})")
            if nxt is not None and s + n > nxt[0]:
                raise DoubleFree(f"{self.what} extent ({s}, {n}) overlaps ({nxt[0]}, {nxt[1]})")
            i = bisect.bisect_right(self._starts, s) - 1
            if i >= 0 and self._starts[i] + self._lens[i] > s:
                raise DoubleFree(f"{self.what} {s} is already free")
            if i + 1 < len(self._starts) and self._starts[i + 1] < s + n:
                raise DoubleFree(f"{self.what} {self._starts[i + 1]} is already free")
        for s, n in ext:
            self._insert(s, n)

    def _insert(self, s: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, s)
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == s
        merge_next = i < len(self._starts) and self._starts[i] == s + n
        if merge_prev and merge_next:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i]
            del self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += n
        elif merge_next:
            self._starts[i] = s
            self._lens[i] += n
        else:
            self._starts.insert(i, s)
            self._lens.insert(i, n)
        self._free += n

    def check_invariants(self) -> None:
        """Internal consistency (used by tests)."""
        total = 0
        prev_end = -1
        for s, n in zip(self._starts, self._lens):
            assert n > 0 and s > prev_end, (s, n, prev_end)
            prev_end = s + n
            total += n
        assert prev_end <= self.size
        assert total == self._free

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator({self.what}: {self.used_count}/{self.size} used, "
            f"{len(self._lens)} free extents)"
        )
