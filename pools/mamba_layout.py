"""Torch-free byte arithmetic for Mamba state pools (plain per-layer and envelope layouts).

A Mamba state *slot* of one request is, for each of ``L`` mamba layers, ``C`` conv-state
tensors (``conv_shapes[i]``, e.g. ``(dim, kernel - 1)``) and one temporal / SSM tensor
(``temporal_shape``, e.g. ``(heads, head_dim, state)``). Slot 0 is padding; a pool of
``size`` has ``size + 1`` slots.

Plain ("per_layer") layout
    One tensor per state kind, ``[L, size + 1, *shape]`` contiguous. Layer ``l`` of kind ``k``
    is one contiguous region of ``(size + 1) * item`` bytes with ``item = prod(shape) *
    itemsize``; the transfer descriptor list is kind-major then layer-major:
    ``conv0[l=0..L-1], conv1[...], ..., temporal[l=0..L-1]``.

Envelope layout
    One raw byte buffer of ``(size + 1) * entry_bytes``. Slot ``s`` occupies
    ``[s * entry_bytes, (s + 1) * entry_bytes)`` and holds, in order, region
    ``conv0`` (all ``L`` layers back to back), ``conv1``, ..., ``temporal``::

        slot bytes = [conv0 L0 | conv0 L1 | ... | conv1 L0 | ... | temporal L0 | ... | pad]

    Each region starts at a multiple of its dtype's itemsize (padding inserted if needed)
    and ``entry_bytes`` is a multiple of ``entry_align`` (default: the largest itemsize), so
    every element of every view is naturally aligned. The logical view of kind ``k`` has
    shape ``[L, size + 1, *shape]`` with element strides
    ``(layer_bytes / itemsize, entry_bytes / itemsize, *contiguous(shape))`` and storage
    offset ``region_offset / itemsize`` into the buffer reinterpreted as that dtype. The
    transfer descriptor is ONE entry: ``(base, (size + 1) * entry_bytes, entry_bytes)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from kvxfer.kernels.errors import InvalidArgument

Shape = Tuple[int, ...]


def prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


def contiguous_strides(shape: Sequence[int]) -> Shape:
    """Row-major element strides of ``shape``."""
    out: List[int] = []
    acc = 1
    for s in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(s)
    return tuple(reversed(out))


def align_up(x: int, a: int) -> int:
    if a < 1:
        raise InvalidArgument(f"alignment must be >= 1, got {a}")
    return -(-x // a) * a


@dataclass(frozen=True)
class StateRegion:
    """One state kind (a conv tensor or the temporal tensor) inside an envelope slot."""

    name: str
    shape: Shape
    itemsize: int
    offset: int  # bytes from the start of the slot
    layer_bytes: int  # bytes of one layer's state for one slot (= prod(shape) * itemsize)
    num_layers: int

    @property
    def nbytes(self) -> int:
        """Bytes of this region in one slot (all layers)."""
        return self.layer_bytes * self.num_layers

    def view_geometry(self, entry_bytes: int, num_slots: int) -> Tuple[Shape, Shape, int]:
        """``(size, stride, storage_offset)`` in elements for the ``[L, slots, *shape]`` view."""
        assert entry_bytes % self.itemsize == 0 and self.offset % self.itemsize == 0
        size = (self.num_layers, num_slots) + self.shape
        stride = (
            self.layer_bytes // self.itemsize,
            entry_bytes // self.itemsize,
        ) + contiguous_strides(self.shape)
        return size, stride, self.offset // self.itemsize

    def element_byte_offset(self, entry_bytes: int, layer: int, slot: int, flat: int) -> int:
        """Byte offset in the raw buffer of element ``flat`` (row-major) of ``[layer, slot]``."""
        return slot * entry_bytes + self.offset + layer * self.layer_bytes + flat * self.itemsize


@dataclass(frozen=True)
class EnvelopeGeometry:
    regions: Tuple[StateRegion, ...]  # conv0..convC-1, temporal
    entry_bytes: int

    def total_bytes(self, num_slots: int) -> int:
        return num_slots * self.entry_bytes

    @property
    def payload_bytes(self) -> int:
        """Bytes of real state in one slot (``entry_bytes`` minus alignment padding)."""
        return sum(r.nbytes for r in self.regions)


def envelope_geometry(
    num_layers: int,
    conv_shapes: Sequence[Sequence[int]],
    conv_itemsize: int,
    temporal_shape: Sequence[int],
    temporal_itemsize: int,
    entry_align: Optional[int] = None,
) -> EnvelopeGeometry:
    """Place the regions of one envelope slot (see module docstring)."""
    if num_layers < 1:
        raise InvalidArgument(f"num_layers must be >= 1, got {num_layers}")
    kinds = [
        (f"conv{i}", tuple(int(d) for d in s), conv_itemsize) for i, s in enumerate(conv_shapes)
    ]
    kinds.append(("temporal", tuple(int(d) for d in temporal_shape), temporal_itemsize))
    regions = []
    off = 0
    for name, shape, isz in kinds:
        off = align_up(off, isz)
        layer_bytes = prod(shape) * isz
        regions.append(StateRegion(name, shape, isz, off, layer_bytes, num_layers))
        off += layer_bytes * num_layers
    align = entry_align if entry_align is not None else max(k[2] for k in kinds)
    if align % max(k[2] for k in kinds):
        raise InvalidArgument(f"entry_align {align} must be a multiple of every itemsize")
    return EnvelopeGeometry(tuple(regions), align_up(max(off, 1), align))


def plain_state_buf_lens(
    num_layers: int,
    num_slots: int,
    conv_shapes: Sequence[Sequence[int]],
    conv_itemsize: int,
    temporal_shape: Sequence[int],
    temporal_itemsize: int,
) -> Tuple[List[int], List[int]]:
    """``(lens, item_lens)`` of the plain layout's descriptors (kind-major, then layer)."""
    lens: List[int] = []
    items: List[int] = []
    for shape, isz in [(s, conv_itemsize) for s in conv_shapes] + [
        (temporal_shape, temporal_itemsize)
    ]:
        item = prod(shape) * isz
        lens += [item * num_slots] * num_layers
        items += [item] * num_layers
    return lens, items


def plain_state_dims(
    num_layers: int, conv_shapes: Sequence[Sequence[int]], temporal_shape: Sequence[int]
) -> List[int]:
    """TP-sliceable dimension (the first dim of each state shape) per plain descriptor."""
    dims: List[int] = []
    for shape in list(conv_shapes) + [temporal_shape]:
        dims += [int(shape[0])] * num_layers
    return dims


def dedup_conv_window_width(draft_tokens: int, window: int) -> int:
    """Columns of the shared sliding-window buffer: ``D + (K-1) - 1`` instead of ``D*(K-1)``."""
    return draft_tokens + window - 1


def dedup_conv_window_strides(phys_strides: Sequence[int]) -> Shape:
    """Strides of the ``[L, slots, D, dim, win]`` view over a ``[L, slots, dim, D+win-1]``
    physical buffer: step ``t``'s window is columns ``t .. t + win - 1``."""
    sl, ss, sd, sw = (int(x) for x in phys_strides)
    return (sl, ss, sw, sd, sw)
