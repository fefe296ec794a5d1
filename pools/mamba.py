"""Mamba / linear-attention state pool.

``MambaPool(size, spec, device, layout=...)`` holds ``size + 1`` state slots (slot 0 is
padding, never handed out by :class:`MambaSlotAllocator`) of every mamba layer:

* ``conv[i]``: ``[L, size + 1, *spec.conv_shapes[i]]`` and ``temporal``:
  ``[L, size + 1, *spec.temporal_shape]`` — real tensors (``layout="per_layer"``) or strided
  views into one raw byte buffer where a slot is all layers' state back to back
  (``layout="envelope"``; byte formulas in :mod:`kvxfer.pools.mamba_layout`).
* Speculative-decoding scratch (``intermediate_ssm``, ``intermediate_conv_window``) exists
  only when ``speculative_num_draft_tokens`` is given, and is never part of the transfer
  descriptors, item views or state dims. ``conv_window_dedup=True`` stores the draft
  tokens' overlapping conv windows once (``[dim, D + K - 2]`` per slot, exposed as the
  ``[D, dim, K - 1]`` sliding-window view); that is only correct for a linear draft chain,
  so it is refused with ``speculative_eagle_topk > 1``, and the caller decides whether its
  kernels can use it (no platform probing here).

Data operations take slot ids in ``[1, size]``; anything else raises
:class:`IndexOutOfRange` before anything is written (one host sync per call; construct with
``check_bounds=False`` to skip it in ``clear_slots`` / ``copy_from`` on hot paths whose ids
come from the allocator; host copies always check). Restoring a CPU copy checks the spec
fingerprint (shapes, dtypes, layer count) and the slot count first (:class:`ShapeMismatch`).
Work is per state kind (``C + 1`` tensors, or one raw-row op for the envelope), never per
slot or element.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from kvxfer.pools.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch
from kvxfer.pools.mamba_alloc import MambaSlotAllocator  # noqa: F401  (part of this module's API)
from kvxfer.pools.mamba_layout import (
    dedup_conv_window_strides,
    dedup_conv_window_width,
    envelope_geometry,
    plain_state_dims,
)
from kvxfer.pools.mamba_spec import MambaCpuCopy, MambaStateSpec  # noqa: F401

logger = logging.getLogger(__name__)

__all__ = ["MambaPool", "MambaStateSpec", "MambaSlotAllocator", "MambaCpuCopy", "MambaLayerCache"]

LAYOUTS = ("per_layer", "envelope")


@dataclass(frozen=True)
class MambaLayerCache:
    """The state tensors of one mamba layer: ``[size + 1, *shape]`` each."""

    conv: List[torch.Tensor]
    temporal: torch.Tensor
    intermediate_ssm: Optional[torch.Tensor] = None
    intermediate_conv_window: Optional[List[torch.Tensor]] = None


class MambaPool:
    def __init__(
        self,
        size: int,
        spec: MambaStateSpec,
        device: Union[str, torch.device] = "cpu",
        *,
        layout: str = "per_layer",
        speculative_num_draft_tokens: Optional[int] = None,
        spec_state_size: Optional[int] = None,
        conv_window_dedup: bool = False,
        speculative_eagle_topk: Optional[int] = None,
        entry_align: Optional[int] = None,
        check_bounds: bool = True,
    ):
        if int(size) < 1:
            raise InvalidArgument(f"MambaPool size must be >= 1, got {size}")
        if layout not in LAYOUTS:
            raise InvalidArgument(f"unknown mamba layout {layout!r}; expected one of {LAYOUTS}")
        if not isinstance(spec, MambaStateSpec):
            raise InvalidArgument(f"spec must be a MambaStateSpec, got {type(spec).__name__}")
        self.size = int(size)
        self.spec = spec
        self.device = torch.device(device)
        self.layout = layout
        self.check_bounds = bool(check_bounds)
        self.num_layers = spec.num_layers
        self.layer_index = {lid: i for i, lid in enumerate(spec.layer_ids)}
        slots = self.size + 1
        L = self.num_layers
        self._raw: Optional[torch.Tensor] = None
        self._geom = None
        if layout == "envelope":
            self._geom = envelope_geometry(
                L,
                spec.conv_shapes,
                spec.conv_dtype.itemsize,
                spec.temporal_shape,
                spec.temporal_dtype.itemsize,
                entry_align,
            )
            nbytes = self._geom.total_bytes(slots)
            self._raw = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            dtypes = [spec.conv_dtype] * len(spec.conv_shapes) + [spec.temporal_dtype]
            views = []
            for region, dt in zip(self._geom.regions, dtypes):
                size_, stride, off = region.view_geometry(self._geom.entry_bytes, slots)
                views.append(torch.as_strided(self._raw.view(dt), size_, stride, off))
            self.conv: List[torch.Tensor] = views[:-1]
            self.temporal: torch.Tensor = views[-1]
        else:
            self.conv = [
                torch.zeros((L, slots) + s, dtype=spec.conv_dtype, device=self.device)
                for s in spec.conv_shapes
            ]
            self.temporal = torch.zeros(
                (L, slots) + spec.temporal_shape, dtype=spec.temporal_dtype, device=self.device
            )
        if conv_window_dedup and speculative_eagle_topk is not None and speculative_eagle_topk > 1:
            raise InvalidArgument(
                f"conv_window_dedup is only correct for a linear draft chain; "
                f"speculative_eagle_topk={speculative_eagle_topk} is a tree"
            )
        self._init_speculative(speculative_num_draft_tokens, spec_state_size, conv_window_dedup)
        logger.debug("allocated %r (%d bytes)", self, self.mem_usage_bytes())

    # ------------------------------------------------------------------ speculative scratch
    def _init_speculative(
        self, draft: Optional[int], spec_size: Optional[int], dedup: bool
    ) -> None:
        self.speculative_num_draft_tokens = draft
        self.intermediate_ssm: Optional[torch.Tensor] = None
        self.intermediate_conv_window: Optional[List[torch.Tensor]] = None
        self._intermediate_conv_window_phys: List[torch.Tensor] = []
        self.conv_window_dedup = False
        if draft is None:
            if dedup or spec_size is not None:
                raise InvalidArgument(
                    "spec_state_size / conv_window_dedup need speculative_num_draft_tokens"
                )
            return
        draft = int(draft)
        if draft < 1:
            raise InvalidArgument(f"speculative_num_draft_tokens must be >= 1, got {draft}")
        n = (int(spec_size) if spec_size is not None else self.size) + 1
        L, spec = self.num_layers, self.spec
        self.intermediate_ssm = torch.zeros(
            (L, n, draft) + spec.temporal_shape, dtype=spec.temporal_dtype, device=self.device
        )
        windows = []
        for i, shape in enumerate(spec.conv_shapes):
            if dedup:
                # Safe only for a linear draft chain (the caller decides): consecutive draft
                # tokens' windows overlap, so one [dim, D + win - 1] buffer backs all of them.
                if len(shape) != 2:
                    raise InvalidArgument(
                        f"conv_window_dedup needs 2-D (dim, window) conv shapes; conv {i} is {shape}"
                    )
                dim, win = shape
                phys = torch.zeros(
                    (L, n, dim, dedup_conv_window_width(draft, win)),
                    dtype=spec.conv_dtype,
                    device=self.device,
                )
                strides = dedup_conv_window_strides(phys.stride())
                view = phys.as_strided((L, n, draft, dim, win), strides)
                self._intermediate_conv_window_phys.append(phys)
                windows.append(view)
            else:
                t = torch.zeros((L, n, draft) + shape, dtype=spec.conv_dtype, device=self.device)
                self._intermediate_conv_window_phys.append(t)
                windows.append(t)
        self.intermediate_conv_window = windows
        self.conv_window_dedup = bool(dedup)

    # ------------------------------------------------------------------ accessors
    def layer_cache(self, layer_id: int) -> MambaLayerCache:
        """State of model layer ``layer_id`` (must be one of ``spec.layer_ids``)."""
        i = self.layer_idx(layer_id)
        return MambaLayerCache(
            conv=[c[i] for c in self.conv],
            temporal=self.temporal[i],
            intermediate_ssm=None if self.intermediate_ssm is None else self.intermediate_ssm[i],
            intermediate_conv_window=None
            if self.intermediate_conv_window is None
            else [w[i] for w in self.intermediate_conv_window],
        )

    def layer_idx(self, layer_id: int) -> int:
        try:
            return self.layer_index[int(layer_id)]
        except (KeyError, TypeError, ValueError):
            raise IndexOutOfRange(
                f"layer id {layer_id!r} is not a mamba layer (mamba layers: {list(self.spec.layer_ids)})"
            ) from None

    def _raw_rows(self) -> torch.Tensor:
        assert self._raw is not None and self._geom is not None
        return self._raw.view(self.size + 1, self._geom.entry_bytes)

    def _state_tensors(self) -> List[torch.Tensor]:
        """The transferable state tensors (never the speculative scratch)."""
        return [*self.conv, self.temporal]

    # ------------------------------------------------------------------ validation
    def _slots(
        self, indices: Any, what: str, *, unique: bool = False, force: bool = False
    ) -> torch.Tensor:
        if isinstance(indices, torch.Tensor):
            if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise InvalidArgument(f"{what} must be integer slot ids, got dtype {indices.dtype}")
            idx = indices.reshape(-1).to(device=self.device, dtype=torch.int64)
        else:
            if isinstance(indices, int):
                indices = [indices]
            idx = torch.as_tensor(list(indices), dtype=torch.int64, device=self.device)
        if idx.numel() and (self.check_bounds or force):
            lo, hi = (int(x) for x in torch.stack([idx.min(), idx.max()]).tolist())
            if lo < 1 or hi > self.size:
                bad = lo if lo < 1 else hi
                raise IndexOutOfRange(
                    f"{what}: mamba slot {bad} outside [1, {self.size}] (slot 0 is the padding slot)"
                )
            if unique and torch.unique(idx).numel() != idx.numel():
                raise InvalidArgument(f"{what}: a destination slot is listed more than once")
        return idx

    # ------------------------------------------------------------------ data ops
    def clear_slots(self, indices: Any) -> None:
        """Zero every layer's state in the given slots."""
        idx = self._slots(indices, "clear_slots")
        if idx.numel() == 0:
            return
        if self._raw is not None:
            self._raw_rows()[idx] = 0
            return
        for t in self._state_tensors():
            t[:, idx] = 0

    def copy_from(self, src_indices: Any, dst_indices: Any) -> None:
        """``state[dst[j]] = state[src[j]]`` for every layer (gathers before scattering)."""
        src = self._slots(src_indices, "copy_from src")
        dst = self._slots(dst_indices, "copy_from dst", unique=True)
        if src.numel() != dst.numel():
            raise ShapeMismatch(
                f"copy_from: {src.numel()} source slots but {dst.numel()} destinations"
            )
        if src.numel() == 0:
            return
        if self._raw is not None:
            rows = self._raw_rows()
            rows[dst] = rows[src]
            return
        for t in self._state_tensors():
            t[:, dst] = t[:, src]

    def get_cpu_copy(self, indices: Any) -> MambaCpuCopy:
        """Host copy of the given slots (restorable into other slots / pools of this spec)."""
        idx = self._slots(indices, "get_cpu_copy", force=True)
        fp = self.spec.fingerprint()
        if self._raw is not None:
            rows = self._raw_rows()[idx].to("cpu")
            return MambaCpuCopy.from_raw(fp, rows, self._geom, self._dtypes())
        conv = [c[:, idx].to("cpu") for c in self.conv]
        return MambaCpuCopy(fp, int(idx.numel()), conv, self.temporal[:, idx].to("cpu"))

    def check_cpu_copy(self, copy: Any, indices: Any) -> torch.Tensor:
        """Validate a restore without writing; returns the destination slots."""
        if isinstance(copy, tuple) and len(copy) == 2:  # (conv list, temporal) as the reference
            conv, temporal = copy
            n = int(temporal.shape[1]) if temporal.dim() >= 2 else -1
            copy = MambaCpuCopy(self.spec.fingerprint(), n, list(conv), temporal)
        if not isinstance(copy, MambaCpuCopy):
            raise InvalidArgument(f"expected a MambaCpuCopy, got {type(copy).__name__}")
        mine = self.spec.fingerprint()
        for key, val in mine.items():
            if copy.fingerprint.get(key) != val:
                raise ShapeMismatch(
                    f"mamba copy {key}={copy.fingerprint.get(key)!r} does not match this pool's {val!r}"
                )
        idx = self._slots(indices, "load_cpu_copy", unique=True, force=True)
        if idx.numel() != copy.num_slots:
            raise ShapeMismatch(
                f"mamba copy holds {copy.num_slots} slots but {idx.numel()} destination slots were given"
            )
        want = [(t.shape[0], copy.num_slots, *t.shape[2:]) for t in self._state_tensors()]
        got = [*copy.conv, copy.temporal]
        if len(got) != len(want):
            raise ShapeMismatch(f"mamba copy has {len(got)} state tensors, pool has {len(want)}")
        for i, (g, w, t) in enumerate(zip(got, want, self._state_tensors())):
            if tuple(g.shape) != tuple(w) or g.dtype != t.dtype:
                raise ShapeMismatch(
                    f"mamba copy tensor {i} is {tuple(g.shape)} {g.dtype}, expected {tuple(w)} {t.dtype}"
                )
        return idx

    def load_cpu_copy(self, copy: Any, indices: Any) -> None:
        """Restore a :meth:`get_cpu_copy` result into ``indices`` (any slots; validated first)."""
        idx = self.check_cpu_copy(copy, indices)
        if idx.numel() == 0:
            return
        if not isinstance(copy, MambaCpuCopy):
            conv, temporal = copy
            copy = MambaCpuCopy({}, idx.numel(), list(conv), temporal)
        mine = getattr(self._geom, "entry_bytes", None)
        same_envelope = copy.raw is not None and copy.entry_bytes == mine
        if self._raw is not None and same_envelope:
            self._raw_rows()[idx] = copy.raw.to(self.device)
            return
        for t, c in zip(self._state_tensors(), [*copy.conv, copy.temporal]):
            t[:, idx] = c.to(self.device)

    # ------------------------------------------------------------------ descriptors
    def get_state_buf_infos(self) -> Tuple[List[int], List[int], List[int]]:
        """``(ptrs, lens, item_lens)``; item = one slot.

        Per-layer layout: ``(C + 1) * L`` entries (conv0 layers, conv1 layers, ...,
        temporal layers). Envelope: ONE entry covering the raw buffer, item = one slot of
        all layers (``entry_bytes``, padding included).
        """
        if self._raw is not None:
            return [self._raw.data_ptr()], [int(self._raw.nbytes)], [self._geom.entry_bytes]
        ptrs, lens, items = [], [], []
        for t in self._state_tensors():
            for layer in range(self.num_layers):
                ptrs.append(t[layer].data_ptr())
                lens.append(int(t[layer].nbytes))
                items.append(int(t[layer][0].nbytes))
        return ptrs, lens, items

    get_contiguous_buf_infos = get_state_buf_infos  # the reference's name for the same list

    def get_state_item_views(self) -> List[torch.Tensor]:
        """uint8 ``[lens[i] // item_lens[i], item_lens[i]]`` views aliasing the descriptors."""
        if self._raw is not None:
            return [self._raw_rows()]
        out = []
        for t in self._state_tensors():
            for layer in range(self.num_layers):
                out.append(t[layer].reshape(self.size + 1, -1).view(torch.uint8))
        return out

    def get_state_dim_per_tensor(self) -> List[Optional[int]]:
        """TP-sliceable dim per descriptor entry (first dim of the state shape).

        The envelope's single entry mixes several tensors and is not sliceable as one unit:
        its value is ``None`` (heterogeneous TP needs the per-layer layout, or a planner
        that uses :meth:`get_state_item_regions`).
        """
        if self._raw is not None:
            return [None]
        return plain_state_dims(self.num_layers, self.spec.conv_shapes, self.spec.temporal_shape)

    def get_state_parts_per_tensor(self) -> List[List[int]]:
        """Per descriptor entry (as :meth:`get_state_dim_per_tensor`): this rank's row
        counts of the parts its first dim is made of, each split over TP ranks on its own
        (conv ``x | B | C``: ``spec.conv_parts``; otherwise one part). The envelope's
        single entry has no sliceable dim: ``[[]]`` (use :meth:`get_state_item_regions`)."""
        if self._raw is not None:
            return [[]]
        kinds = len(self.spec.conv_shapes) + 1
        return [list(self._parts(k)) for k in range(kinds) for _ in range(self.num_layers)]

    def get_state_item_regions(self) -> List[Dict[str, Any]]:
        """Byte regions inside one item (envelope) or per entry (per-layer), for TP planners."""
        if self._geom is not None:
            return [
                {
                    "name": r.name,
                    "offset": r.offset,
                    "layer_bytes": r.layer_bytes,
                    "num_layers": r.num_layers,
                    "sliceable_dim": r.shape[0],
                    "parts": list(self._parts(i)),
                }
                for i, r in enumerate(self._geom.regions)
            ]
        names = [f"conv{i}" for i in range(len(self.conv))] + ["temporal"]
        return [
            {
                "name": n,
                "offset": 0,
                "layer_bytes": int(t[0][0].nbytes),
                "num_layers": 1,
                "sliceable_dim": int(t.shape[2]),
                "parts": list(self._parts(i)),
            }
            for i, (n, t) in enumerate(zip(names, self._state_tensors()))
            for _ in range(self.num_layers)
        ]

    def _parts(self, kind: int) -> Tuple[int, ...]:
        """Parts of state kind ``kind`` (conv tensors first, then the temporal tensor)."""
        if kind < len(self.spec.conv_shapes):
            return self.spec.parts_of(kind)
        return (self.spec.temporal_shape[0],)

    def describe(self) -> Dict[str, Any]:
        """Plain values: the layout fingerprint two peers compare."""
        _, _, items = self.get_state_buf_infos()
        d = {
            "kind": "mamba",
            "layout": self.layout,
            "layer_ids": list(self.spec.layer_ids),
            "item_lens": items,
        }
        d.update(self.spec.fingerprint())
        if self._geom is not None:
            d["entry_bytes"] = self._geom.entry_bytes
        return d

    def mem_usage_bytes(self) -> int:
        state = (
            int(self._raw.nbytes)
            if self._raw is not None
            else sum(int(t.nbytes) for t in self._state_tensors())
        )
        scratch = sum(int(t.nbytes) for t in self._intermediate_conv_window_phys)
        if self.intermediate_ssm is not None:
            scratch += int(self.intermediate_ssm.nbytes)
        return state + scratch

    def _dtypes(self) -> List[torch.dtype]:
        return [self.spec.conv_dtype] * len(self.spec.conv_shapes) + [self.spec.temporal_dtype]

    def __repr__(self) -> str:
        return (
            f"MambaPool(size={self.size}, layers={self.num_layers}, layout={self.layout}, "
            f"conv={list(self.spec.conv_shapes)}, temporal={self.spec.temporal_shape}, "
            f"device={self.device})"
        )
