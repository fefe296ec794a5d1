"""The memory regions SGLang hands this backend (``KVArgs``), checked before anything is
registered: what kvxfer's engine assumes of them holds, or the layout is refused by name.

kvxfer's engine (like SGLang's Mooncake / NIXL backends) addresses item ``i`` of a
descriptor ``(ptr, len, item_len)`` at ``[ptr + i * item_len, ptr + (i + 1) * item_len)``:
the descriptor is a dense array of items. SGLang builds every descriptor from a tensor's
``data_ptr()``, ``nbytes`` and ``[0].nbytes`` - the *logical* size - so a strided view
breaks that assumption without anything saying so. The one such layout SGLang has is the
**envelope** (page-major) Mamba layout (``MambaPool(envelope_layout=True)``): every
layer's conv and temporal state of one slot packed into one entry, each state tensor a view
whose slot stride is the whole entry. Its descriptors start inside one entry and their
logical spans ``[ptr, ptr + len)`` cover each other's bytes; slot ``i`` of a descriptor
is not at ``ptr + i * item_len``. Moving them at face value would move other layers' and
other slots' bytes - state silently wrong even at equal TP.

Invariant checked (pure arithmetic, no torch): within one group, no two descriptors'
``[ptr, ptr + len)`` overlap. Two dense item arrays of distinct state never share a byte,
so an overlap means strided views - the envelope layout, or anything like it - and the
group is refused with :class:`~kvxfer.errors.UnsupportedOperation` naming the two
descriptors and the layout. (SGLang's unified memory pool, ``--enable-unified-memory``,
registers each envelope buffer as one dense descriptor of whole entries instead, which
passes; groups may overlap one another, as the engine allows.)

Not detectable from the arguments alone: a strided layout of a single descriptor in its
group (nothing to overlap with); the envelope layout always has at least two per mamba
layer (conv and temporal state).
"""

from __future__ import annotations

from typing import Mapping, Sequence, Tuple

from kvxfer.errors import UnsupportedOperation

Group = Tuple[Sequence[int], Sequence[int], Sequence[int]]  # (ptrs, lens, item_lens)


def check_regions(groups: Mapping[str, Group]) -> None:
    """Raise UnsupportedOperation if a group's descriptors are not dense item arrays that
    share no byte (see the module docstring); ``groups``: name -> (ptrs, lens, item_lens)
    as SGLang's KVArgs gives them."""
    for name, (ptrs, lens, item_lens) in groups.items():
        if not len(ptrs) == len(lens) == len(item_lens):
            raise UnsupportedOperation(
                f"kvxfer transfer backend: group {name!r}: {len(ptrs)} pointers, "
                f"{len(lens)} lengths, {len(item_lens)} item lengths"
            )
        spans = sorted(
            (int(p), int(p) + int(n), d) for d, (p, n) in enumerate(zip(ptrs, lens)) if int(n) > 0
        )
        # sorted by start: some pair overlaps iff one span starts before the furthest end
        # reached by the spans before it
        end, owner = None, -1
        for start, stop, d in spans:
            if end is not None and start < end:
                raise UnsupportedOperation(_overlap_reason(name, owner, d, ptrs, lens, item_lens))
            if end is None or stop > end:
                end, owner = stop, d


def _overlap_reason(name: str, a: int, b: int, ptrs, lens, item_lens) -> str:
    a, b = sorted((a, b))
    what = (
        "SGLang's envelope (page-major) Mamba state layout (MambaPool(envelope_layout=True): "
        "every layer's state of a slot in one entry, each tensor a strided view of it)"
        if name.startswith("state")
        else "strided views of one buffer"
    )
    span = ", ".join(
        f"descriptor {d}: [{int(ptrs[d]):#x}, +{int(lens[d])}) of {int(item_lens[d])}-byte items"
        for d in (a, b)
    )
    return (
        f"kvxfer transfer backend: group {name!r}: descriptors {a} and {b} overlap ({span}): "
        f"{what} is not supported - item i of a descriptor is not at ptr + i * item_len, "
        "so its bytes would be moved wrong. Run without --enable-page-major-kv-layout "
        "(docs/integrations.md)."
    )


__all__ = ["check_regions"]
