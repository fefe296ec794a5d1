"""Explicit description of a model's Mamba / linear-attention state, and its CPU copies.

``MambaStateSpec`` replaces model-config objects: per-layer conv state shapes (a list of
``(dim, kernel - 1)``-like shapes), the temporal / SSM state shape (e.g. ``(heads, head_dim,
state)``), their dtypes and the model layer ids that are mamba layers. ``conv_parts``
optionally says how a conv tensor's first (TP-split) dim is made of projections split
independently over TP ranks, e.g. Mamba2's ``x | B | C`` or GDN's ``q | k | v``: this
rank's row counts of each part, back to back, summing to ``conv_shapes[i][0]`` (default:
one part). Heterogeneous TP slices each part on its own (:mod:`kvxfer.disagg.tp_plan`).

``MambaCpuCopy`` is what :meth:`MambaPool.get_cpu_copy` returns: the state of ``n`` slots on
the host in logical form (``conv[i]: [L, n, *conv_shapes[i]]``, ``temporal: [L, n,
*temporal_shape]``), plus the spec fingerprint it was taken from. A copy taken from an
envelope pool keeps the raw slot rows (``raw: [n, entry_bytes]``) and exposes the logical
tensors as views of them, so envelope → envelope restores are one row copy while any copy can
be restored into any pool of the same spec, whatever its layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from kvxfer.pools.errors import InvalidArgument
from kvxfer.pools.mamba_layout import EnvelopeGeometry

Shape = Tuple[int, ...]


def _shape(x: Sequence[int], what: str) -> Shape:
    try:
        out = tuple(int(d) for d in x)
    except TypeError as e:
        raise InvalidArgument(f"{what} must be a sequence of ints, got {x!r}") from e
    if not out or any(d < 1 for d in out):
        raise InvalidArgument(f"{what} must be a non-empty shape of positive ints, got {x!r}")
    return out


@dataclass(frozen=True)
class MambaStateSpec:
    """What one request's recurrent state looks like (per mamba layer)."""

    conv_shapes: Tuple[Shape, ...]
    temporal_shape: Shape
    conv_dtype: torch.dtype
    temporal_dtype: torch.dtype
    layer_ids: Tuple[int, ...]
    conv_parts: Tuple[Tuple[int, ...], ...] = ()

    def __post_init__(self):
        conv = tuple(_shape(s, f"conv_shapes[{i}]") for i, s in enumerate(self.conv_shapes))
        if not conv:
            raise InvalidArgument("conv_shapes must list at least one conv state shape")
        object.__setattr__(self, "conv_shapes", conv)
        object.__setattr__(self, "temporal_shape", _shape(self.temporal_shape, "temporal_shape"))
        ids = tuple(int(i) for i in self.layer_ids)
        if not ids:
            raise InvalidArgument("layer_ids must name at least one mamba layer")
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise InvalidArgument(f"layer_ids must be distinct non-negative ints, got {ids}")
        object.__setattr__(self, "layer_ids", ids)
        parts = tuple(_shape(p, f"conv_parts[{i}]") for i, p in enumerate(self.conv_parts))
        if parts and (len(parts) != len(conv) or any(sum(p) != s[0] for p, s in zip(parts, conv))):
            raise InvalidArgument(
                f"conv_parts {[list(p) for p in parts]} must list, for each of "
                f"{len(conv)} conv shapes, row counts summing to its first dim "
                f"{[s[0] for s in conv]}"
            )
        object.__setattr__(self, "conv_parts", parts)
        for name in ("conv_dtype", "temporal_dtype"):
            if not isinstance(getattr(self, name), torch.dtype):
                raise InvalidArgument(f"{name} must be a torch.dtype, got {getattr(self, name)!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    def parts_of(self, i: int) -> Tuple[int, ...]:
        """Row counts of the parts of conv tensor ``i`` (one part unless ``conv_parts``)."""
        return self.conv_parts[i] if self.conv_parts else (self.conv_shapes[i][0],)

    @property
    def slot_bytes(self) -> int:
        """Bytes of state of one slot, all layers (no padding)."""
        from kvxfer.pools.mamba_layout import prod

        conv = sum(prod(s) for s in self.conv_shapes) * self.conv_dtype.itemsize
        return self.num_layers * (conv + prod(self.temporal_shape) * self.temporal_dtype.itemsize)

    def fingerprint(self) -> Dict[str, Any]:
        """Plain (msgpack-able) values that must agree for a state copy to be restorable
        (``conv_parts`` only when given, so single-part specs keep their fingerprint)."""
        out: Dict[str, Any] = {
            "conv_shapes": [list(s) for s in self.conv_shapes],
            "temporal_shape": list(self.temporal_shape),
            "conv_dtype": str(self.conv_dtype),
            "temporal_dtype": str(self.temporal_dtype),
            "num_layers": self.num_layers,
        }
        if self.conv_parts:
            out["conv_parts"] = [list(p) for p in self.conv_parts]
        return out


@dataclass
class MambaCpuCopy:
    """Host copy of ``num_slots`` mamba slots (see module docstring)."""

    fingerprint: Dict[str, Any]
    num_slots: int
    conv: List[torch.Tensor]
    temporal: torch.Tensor
    raw: Optional[torch.Tensor] = None  # [num_slots, entry_bytes] when taken from an envelope
    entry_bytes: Optional[int] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_raw(
        cls, fingerprint: Dict[str, Any], raw: torch.Tensor, geom: EnvelopeGeometry, dtypes
    ) -> "MambaCpuCopy":
        n = int(raw.shape[0])
        flat = raw.reshape(-1)
        views = []
        for region, dt in zip(geom.regions, dtypes):
            size, stride, off = region.view_geometry(geom.entry_bytes, n)
            views.append(torch.as_strided(flat.view(dt), size, stride, off))
        return cls(fingerprint, n, views[:-1], views[-1], raw=raw, entry_bytes=geom.entry_bytes)

    def nbytes(self) -> int:
        if self.raw is not None:
            return int(self.raw.nbytes)
        return sum(int(c.nbytes) for c in self.conv) + int(self.temporal.nbytes)
