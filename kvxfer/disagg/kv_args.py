"""KVArgs: the buffers one rank registers for transfer, and the fingerprint peers compare.

Three descriptor groups, each three equal-length lists ``(ptrs, lens, item_lens)``:

* ``kv``    — item = one page (of one layer's K or V for per-layer pools; of all layers for
  page-major pools); filled from ``pool.get_contiguous_buf_infos()``;
* ``state`` — item = one state slot (Mamba conv + temporal, or SWA state); filled from
  ``mamba_pool.get_state_buf_infos()``;
* ``aux``   — item = one metadata row, **host memory**; the first entry's row starts with the
  16-byte header kvxfer stamps (room id; see :mod:`kvxfer.disagg.aux`).

``kv_segments`` is the pool's token geometry (:mod:`kvxfer.disagg.page_map`; empty when the
pool states none): with it on both sides, peers of different page sizes pair (the segments
must match instead); without it the page sizes must be equal.

Invariants checked by :meth:`KVArgs.validate`: equal list lengths per group, positive item
sizes, every ``len`` a multiple of its ``item_len``, a non-empty ``kv`` group, a non-empty
``aux`` group whose first row is at least :data:`~kvxfer.disagg.aux.HEADER_BYTES` long.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from kvxfer.argcheck import as_int
from kvxfer.disagg.aux import HEADER_BYTES
from kvxfer.disagg.errors import LayoutMismatch
from kvxfer.disagg.tp_shape import TP_KEYS, check_hetero, strip_tp, tp_shape_of
from kvxfer.errors import InvalidArgument

#: keys of a pool's ``describe()`` that legitimately differ between peers (capacity, device).
_LOCAL_KEYS = frozenset({"size", "num_pages", "device", "num_slots", "capacity", "backing"})


@dataclass
class KVArgs:
    kv_data_ptrs: List[int]
    kv_data_lens: List[int]
    kv_item_lens: List[int]
    aux_data_ptrs: List[int] = field(default_factory=list)
    aux_data_lens: List[int] = field(default_factory=list)
    aux_item_lens: List[int] = field(default_factory=list)
    state_data_ptrs: List[int] = field(default_factory=list)
    state_data_lens: List[int] = field(default_factory=list)
    state_item_lens: List[int] = field(default_factory=list)
    state_types: List[str] = field(default_factory=list)
    state_dim_per_tensor: List[int] = field(default_factory=list)
    page_size: int = 1
    dtype: str = ""
    #: token geometry per kv descriptor (``pool.kv_token_segments()``); empty: none stated
    kv_segments: List[List[int]] = field(default_factory=list)
    #: layout fingerprint: the pools' ``describe()`` dicts, e.g. ``{"kv": {...}, "state": {...}}``
    layout: Dict[str, Any] = field(default_factory=dict)
    #: TP shape (:mod:`kvxfer.disagg.tp_shape`): TP size + item geometry per kv / state
    #: descriptor; empty: none stated (only equal TP sizes pair then)
    tp_shape: Dict[str, Any] = field(default_factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    pp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("page_size", "tp_rank", "tp_size", "dp_rank", "pp_rank"):
            setattr(self, name, as_int(getattr(self, name), f"KVArgs.{name}"))
        for name in (
            "kv_data_ptrs",
            "kv_data_lens",
            "kv_item_lens",
            "aux_data_ptrs",
            "aux_data_lens",
            "aux_item_lens",
            "state_data_ptrs",
            "state_data_lens",
            "state_item_lens",
        ):
            setattr(self, name, [int(v) for v in getattr(self, name)])
        # None (a state tensor with no per-TP-rank split dimension) travels as -1
        self.state_dim_per_tensor = [-1 if v is None else int(v) for v in self.state_dim_per_tensor]
        self.state_types = [str(v) for v in self.state_types]
        self.kv_segments = [[int(b) for b in seg] for seg in self.kv_segments or ()]
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pools(
        cls,
        kv_pool,
        *,
        aux=None,
        state_pool=None,
        tp_rank: int = 0,
        tp_size: int = 1,
        dp_rank: int = 0,
        pp_rank: int = 0,
        state_type: str = "mamba",
        total_kv_heads: Optional[int] = None,
    ) -> "KVArgs":
        """Fill from a KV pool (``get_contiguous_buf_infos``/``describe``), an optional state
        pool (``get_state_buf_infos``/``get_state_dim_per_tensor``/``describe``) and an aux
        buffer (anything with ``buf_infos() -> (ptrs, lens, item_lens)``, e.g. MetadataBuffer).
        A hybrid pool exposing both KV and state descriptors may be passed as ``kv_pool`` and
        ``state_pool`` at once. ``total_kv_heads``: the model's KV heads over all TP ranks
        (needed for the TP shape only when ``tp_size`` exceeds it: replicated heads)."""
        ptrs, lens, items = kv_pool.get_contiguous_buf_infos()
        layout: Dict[str, Any] = {"kv": _plain(kv_pool.describe())}
        segments = getattr(kv_pool, "kv_token_segments", None)
        kw: Dict[str, Any] = {}
        if state_pool is not None:
            sp, sl, si = state_pool.get_state_buf_infos()
            dims = getattr(state_pool, "get_state_dim_per_tensor", None)
            kw.update(
                state_data_ptrs=sp,
                state_data_lens=sl,
                state_item_lens=si,
                state_types=[state_type] * len(sp),
                state_dim_per_tensor=list(dims()) if dims is not None else [],
            )
            if hasattr(state_pool, "describe"):
                layout["state"] = _plain(state_pool.describe())
        if aux is not None:
            ap, al, ai = aux.buf_infos()
            kw.update(aux_data_ptrs=ap, aux_data_lens=al, aux_item_lens=ai)
        return cls(
            kv_data_ptrs=ptrs,
            kv_data_lens=lens,
            kv_item_lens=items,
            page_size=int(kv_pool.page_size),
            dtype=_dtype_name(kv_pool),
            kv_segments=(segments() if segments is not None else None) or [],
            layout=layout,
            tp_shape=tp_shape_of(kv_pool, state_pool, tp_size, total_kv_heads),
            tp_rank=tp_rank,
            tp_size=tp_size,
            dp_rank=dp_rank,
            pp_rank=pp_rank,
            **kw,
        )

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        for g in ("kv", "aux", "state"):
            ptrs, lens, items = self.group(g)
            if not (len(ptrs) == len(lens) == len(items)):
                raise InvalidArgument(
                    f"KVArgs.{g}: {len(ptrs)} ptrs, {len(lens)} lens, {len(items)} item_lens"
                )
            for i, (p, n, it) in enumerate(zip(ptrs, lens, items)):
                if it <= 0 or n <= 0 or p <= 0:
                    raise InvalidArgument(f"KVArgs.{g}[{i}]: ptr={p:#x} len={n} item_len={it}")
                if n % it:
                    raise InvalidArgument(
                        f"KVArgs.{g}[{i}]: len {n} is not a multiple of item_len {it}"
                    )
        if not self.kv_data_ptrs:
            raise InvalidArgument("KVArgs: the kv group is empty")
        if not self.aux_data_ptrs:
            raise InvalidArgument("KVArgs: the aux group (metadata rows) is empty")
        if self.aux_item_lens[0] < HEADER_BYTES:
            raise InvalidArgument(
                f"KVArgs: aux row of {self.aux_item_lens[0]} bytes < header {HEADER_BYTES}"
            )
        if self.page_size <= 0:
            raise InvalidArgument(f"KVArgs: page_size {self.page_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"KVArgs: tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        if self.kv_segments:
            if len(self.kv_segments) != len(self.kv_data_ptrs) or any(
                not seg or min(seg) <= 0 or self.page_size * sum(seg) != it
                for seg, it in zip(self.kv_segments, self.kv_item_lens)
            ):
                raise InvalidArgument(
                    f"KVArgs: kv_segments {self.kv_segments} do not make the kv item_lens "
                    f"{self.kv_item_lens} at page_size {self.page_size}"
                )
        if self.state_types and len(self.state_types) != len(self.state_data_ptrs):
            raise InvalidArgument(
                f"KVArgs: {len(self.state_types)} state_types for "
                f"{len(self.state_data_ptrs)} state buffers"
            )

    def group(self, name: str) -> Tuple[List[int], List[int], List[int]]:
        return (
            getattr(self, f"{name}_data_ptrs"),
            getattr(self, f"{name}_data_lens"),
            getattr(self, f"{name}_item_lens"),
        )

    def num_items(self, name: str) -> int:
        """Item ids valid in every entry of group ``name``: ``[0, num_items)``."""
        _, lens, items = self.group(name)
        return min((n // it for n, it in zip(lens, items)), default=0)

    # ------------------------------------------------------------------ fingerprint
    def fingerprint(self) -> Dict[str, Any]:
        """Plain msgpack-able dict two peers must agree on (capacity excluded; the page size
        only when either side has no ``kv_segments``)."""
        fp = {
            "page_size": self.page_size,
            "dtype": self.dtype,
            "kv_item_lens": list(self.kv_item_lens),
            "state_item_lens": list(self.state_item_lens),
            "aux_item_lens": list(self.aux_item_lens),
            "state_types": list(self.state_types),
            "state_dim_per_tensor": list(self.state_dim_per_tensor),
            "layout": _strip_local(self.layout),
            "tp_size": self.tp_size,
        }
        if self.kv_segments:
            fp["kv_segments"] = [list(s) for s in self.kv_segments]
        if self.tp_shape:
            fp["tp"] = self.tp_shape
        # a capability, not compared (check_compatible reads only its own keys): this side
        # takes LayerDone notifications (kvxfer.disagg.layerwise)
        fp["layer_notify"] = True
        # and DoneMany notifications (kvxfer.disagg.coalesce)
        fp["done_many"] = True
        return fp


def check_compatible(
    ours: Dict[str, Any],
    theirs: Dict[str, Any],
    *,
    us: str,
    them: str,
    ignore_tp: bool = False,
    ours_is_prefill: Optional[bool] = None,
) -> None:
    """Raise :class:`LayoutMismatch` naming the first field that differs (with both values).

    When both sides state ``kv_segments`` (token geometry) those must be equal instead of the
    page size and the kv item sizes that follow from it: the page sizes may then differ.
    When the TP sizes differ (and ``ours_is_prefill`` says which side is which) the TP
    shapes must join instead of the keys that follow from the TP size
    (:func:`kvxfer.disagg.tp_shape.check_hetero`; TpShapeMismatch)."""
    order = (
        "kv_segments",
        "page_size",
        "dtype",
        "kv_item_lens",
        "state_item_lens",
        "aux_item_lens",
        "state_types",
        "state_dim_per_tensor",
        "layout",
        "tp_size",
        "integrity",
    )
    if not isinstance(theirs, dict):
        raise LayoutMismatch(f"{them} sent a fingerprint of type {type(theirs).__name__}")
    hetero = (
        not ignore_tp
        and ours_is_prefill is not None
        and ours.get("tp_size") != theirs.get("tp_size")
    )
    if hetero:
        assert ours_is_prefill is not None
        check_hetero(ours, theirs, us=us, them=them, ours_is_prefill=ours_is_prefill)
    paged = bool(ours.get("kv_segments")) and bool(theirs.get("kv_segments"))
    for key in order:
        if hetero and key in TP_KEYS:
            continue
        if ignore_tp and key == "tp_size":
            continue
        if key in ("page_size", "kv_item_lens") and paged:
            continue  # implied by kv_segments at each side's own page size
        if key == "kv_segments" and not paged:
            continue
        a, b = ours.get(key), theirs.get(key)
        if key == "layout":
            b = _strip_local(b) if isinstance(b, dict) else b
            if paged and isinstance(a, dict) and isinstance(b, dict):
                a, b = _strip_paging(a), _strip_paging(b)
            if hetero:
                a, b = strip_tp(a), strip_tp(b)
            diff = _first_diff(a, b, "layout")
            if diff is not None:
                path, va, vb = diff
                raise LayoutMismatch(f"{path}: {us} has {va!r}, {them} has {vb!r}")
        elif key == "integrity" and a != b:  # set by KVManager(integrity=...) only
            raise LayoutMismatch(
                f"integrity: {us} has {a or 'off'!r}, {them} has "
                f"{b or 'off'!r}; both sides need the same "
                f"KVManager(integrity=...)"
            )
        elif a != b:
            raise LayoutMismatch(f"{key}: {us} has {a!r}, {them} has {b!r}")


def _first_diff(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            d = _first_diff(a.get(k), b.get(k), f"{path}.{k}")
            if d is not None:
                return d
        return None
    return None if a == b else (path, a, b)


def _strip_local(d):
    if isinstance(d, dict):
        return {k: _strip_local(v) for k, v in d.items() if k not in _LOCAL_KEYS}
    return d


def _strip_paging(layout: Dict[str, Any]) -> Dict[str, Any]:
    """``layout`` without what follows from the kv page size: ``page_size`` and ``item_lens``
    (of a kv pool's description, also where a hybrid pool's description carries them as the
    state pool's; a nested ``mamba`` description is kept whole, and the state item sizes are
    compared as ``state_item_lens`` anyway)."""

    def strip(d):
        if not isinstance(d, dict):
            return d
        return {
            k: (v if k == "mamba" else strip(v))
            for k, v in d.items()
            if k not in ("page_size", "item_lens")
        }

    return {k: strip(v) for k, v in layout.items()}


def _plain(v):
    """Reduce describe() output to msgpack-able plain values (tuples -> lists, dtypes -> str)."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    return str(v)


def _dtype_name(pool) -> str:
    dt = getattr(pool, "dtype", None)
    return "" if dt is None else str(dt).replace("torch.", "")


def replace(args: KVArgs, **changes) -> KVArgs:
    """A validated copy of ``args`` with fields changed (e.g. another tp_rank)."""
    return dataclasses.replace(args, **changes)


__all__ = ["KVArgs", "check_compatible", "replace"]
