"""Heterogeneous attention TP in the SGLang backend: what one prefill rank moves to one
decode rank. Torch-free and SGLang-free (numpy only); built once per decode registration.

Rank rules: SGLang 0.5.23's (``CommonKVManager._resolve_rank_mapping`` and
``staging_buffer.compute_head_slice_params``), which are :mod:`kvxfer.disagg.tp_plan`'s:

* decode rank ``d`` of ``Td`` bootstraps with prefill ranks ``[d*k, (d+1)*k)`` when
  ``Tp = k*Td`` (``required_prefill_response_num = k`` for MHA: decode waits for every one
  of them) and with prefill rank ``d // (Td/Tp)`` when ``Td > Tp`` (that prefill rank gets
  the room's metadata from ``Td/Tp`` decode ranks, ``required_dst_info_num``);
* KV heads: ``total`` heads over ``tp`` ranks, rank ``r`` holds ``[r*n, (r+1)*n)`` with
  ``n = total/tp``, or, when ``tp > total``, the one head ``r // (tp/total)`` (replicas);
  a head a decode rank needs that several of its prefill peers hold (prefill replicas) is
  written by the first of them only (the others send no KV bytes, but still complete the
  room: decode counts every peer's completion).

Geometry: SGLang's ``MHATokenToKVPool`` registers one descriptor per layer and K|V
(``kv_data_ptrs`` = all K layers then all V layers), item = one page, token-major NHD
``[page_size, heads, head_dim]``. A head slice is therefore one byte run per token of a page
(:func:`kvxfer.disagg.tp_plan.nhd_item`): a :class:`PairPlan` holds those item-relative runs
once (a :class:`~kvxfer.engine.slices.PatternRuns`), and a chunk is one ``PatternWrite`` of
its page ids - one device-lane launch to a same-host peer, PUTs of the expanded runs
(runs continuing on both sides merged) otherwise.

Staged (cross-host, no device lane): the same runs as one side's ``(offs, lens)`` per
descriptor (:attr:`PairPlan.src_sides` / :attr:`PairPlan.dst_sides`, in the same order, so
prefill's gather and decode's scatter pair byte for byte) for a
:class:`~kvxfer.engine.types.SliceWrite`; decode derives its side itself from its own shape
and the prefill rank's TP (:func:`decode_sides`), the write names only pages.

MLA (``replicated``): the latent has no heads; every decode rank receives whole pages from
one prefill rank, SGLang marks its other peers dummies (they move nothing); item sizes must
be equal.

Mamba / hybrid state (``state``: one :class:`StatePlan` per state type): each state tensor
(one descriptor per tensor and layer, item = one slot) is split along its TP dim as
SGLang's ``MambaPool`` states it (:class:`StateShape`: rows per rank, rows before the split
dim, independently split parts); :func:`state_geoms` turns that into
:func:`kvxfer.disagg.tp_plan.state_geometries` and the pair's runs are tp_plan's
(``page_plan``), one PatternWrite per state type. Equal TP: whole slots. The state is split
over the attention-TP group (SGLang's ``linear_attn_tp_size()``, the width the Mooncake
backend slices by, is that group unless CP-TP group sharing, which needs attention CP > 1:
refused by the manager).

Invariants (tests/unit/test_sgl_tp_pairs.py, exhaustive against a brute-force byte model):
every byte of every head a decode rank holds is written exactly once per room, from a
prefill rank holding that head; runs never leave their items; equal TP gives whole items.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.disagg.tp_plan import (
    ItemGeometry,
    check_ratio,
    decode_peers,
    item_runs,
    local_units,
    nhd_item,
    page_plan,
    state_geometries,
)
from kvxfer.engine.slices import PatternRuns
from kvxfer.errors import InvalidArgument

__all__ = [
    "PairPlan",
    "Shape",
    "StatePlan",
    "StateShape",
    "decode_sides",
    "pair_plan",
    "shape",
    "state_geoms",
    "state_shapes",
    "state_tp_fields",
    "total_kv_heads",
]

#: one side's item-relative runs of a pair, per descriptor: ``(offs, lens)``
Sides = Tuple[Tuple[np.ndarray, np.ndarray], ...]


@dataclass(frozen=True)
class Shape:
    """One side's TP shape as the backend knows it: attention TP size and rank, page size,
    the KV item sizes (one per descriptor), the model's total KV heads (0: unknown) and
    whether the pool is MLA (no heads: replicated)."""

    tp_size: int
    tp_rank: int
    page_size: int
    kv_item_lens: Tuple[int, ...]
    total_kv_heads: int = 0
    mla: bool = False
    states: Tuple["StateShape", ...] = ()

    def describe(self) -> str:
        heads = "MLA" if self.mla else f"{self.total_kv_heads or '?'} kv heads"
        items = sorted(set(self.kv_item_lens))
        states = "".join(f"; state {i}: {st.describe()}" for i, st in enumerate(self.states))
        return (
            f"tp {self.tp_rank}/{self.tp_size}, {heads}, page {self.page_size}, "
            f"{len(self.kv_item_lens)} kv items of {items} B{states}"
        )


@dataclass(frozen=True)
class StateShape:
    """One state type's descriptors (one per state tensor and layer) as SGLang's ``KVArgs``
    state them (``MambaPool``'s ``get_state_*`` metadata): ``item_lens`` (one slot's
    bytes), ``dims`` (``state_dim_per_tensor``: this rank's rows of the TP-split dim; 0:
    replicated over ranks), ``outer`` (``state_slice_outer_counts``: rows before that dim;
    ``()``: 1 each) and ``groups`` (``state_conv_shard_groups``: full sizes of the parts
    of that dim split independently, e.g. GDN's conv ``q | k | v``; None: one part).
    ``dims == ()``: the rank stated no TP metadata (it pairs at equal TP only)."""

    item_lens: Tuple[int, ...]
    dims: Tuple[int, ...] = ()
    outer: Tuple[int, ...] = ()
    groups: Tuple[Optional[Tuple[int, ...]], ...] = ()

    def describe(self) -> str:
        if not self.dims:
            return f"{len(self.item_lens)} tensors, no TP dims"
        parts = sorted({g for g in self.groups if g}) if self.groups else []
        outer = sorted(set(self.outer)) if self.outer else [1]
        return (
            f"{len(self.item_lens)} tensors of {sorted(set(self.item_lens))} B, split rows "
            f"{sorted(set(self.dims))} after {outer} outer rows"
            + (f", parts {[list(p) for p in parts]}" if parts else "")
        )


@dataclass(frozen=True)
class StatePlan:
    """What one prefill rank writes of one state type into one decode rank's slot:
    ``whole`` (equal TP: the slot, an ItemWrite), else ``runs`` (the item-relative runs of
    every descriptor, a PatternWrite: one run per part per outer row per slice, never per
    element; None: this rank sends none of it, e.g. a replicated tensor another peer
    writes)."""

    whole: bool
    runs: Optional[PatternRuns] = None


@dataclass(frozen=True)
class PairPlan:
    """What prefill rank ``prefill.tp_rank`` writes into decode rank ``decode.tp_rank``.

    ``whole``: equal TP (or MLA): whole KV items, as an ItemWrite. Else ``kv_runs`` (None:
    this prefill rank holds no head the decode rank takes from it) are the per-descriptor
    item-relative runs of a PatternWrite of the ``kv`` group, ``src_sides`` / ``dst_sides``
    the same runs as each side's ``(offs, lens)`` (a staged SliceWrite; None with
    ``kv_runs``). ``sends_aux``: this prefill rank writes the metadata row (exactly one of a
    decode rank's peers does: the first)."""

    whole: bool
    kv_runs: Optional[PatternRuns]
    sends_aux: bool
    runs_per_page: int  # byte runs one page costs over all descriptors (0: no KV bytes)
    src_sides: Optional[Sides] = None
    dst_sides: Optional[Sides] = None
    #: one per state type (``()``: the pool has none)
    state: Tuple[StatePlan, ...] = ()


def _bad(prefill: Shape, decode: Shape, why: str) -> TpShapeMismatch:
    return TpShapeMismatch(f"{why}: prefill {prefill.describe()}; decode {decode.describe()}")


def pair_plan(prefill: Shape, decode: Shape) -> PairPlan:
    """The plan of one (prefill rank, decode rank) pair; TpShapeMismatch naming both shapes
    when they cannot be joined (TP sizes not dividing one another, heads that do not split,
    item sizes that are not those heads, a decode rank that is not this prefill rank's peer,
    MLA on one side only, state tensors whose split rows do not join)."""
    plan = _kv_plan(prefill, decode)
    if prefill.states or decode.states:
        plan = replace(plan, state=_state_plans(prefill, decode))
    return plan


def _kv_plan(prefill: Shape, decode: Shape) -> PairPlan:
    tp_p, tp_d = prefill.tp_size, decode.tp_size
    try:
        check_ratio(tp_p, tp_d)
    except TpShapeMismatch as exc:
        raise _bad(prefill, decode, str(exc)) from None
    if not (0 <= prefill.tp_rank < tp_p and 0 <= decode.tp_rank < tp_d):
        raise _bad(prefill, decode, "tp rank outside its tp size")
    peers = decode_peers(decode.tp_rank, tp_p, tp_d)
    if prefill.tp_rank not in peers:
        raise _bad(prefill, decode, f"decode's prefill peers are tp ranks {list(peers)}")
    if prefill.page_size != decode.page_size:
        raise _bad(prefill, decode, "page sizes differ")
    if len(prefill.kv_item_lens) != len(decode.kv_item_lens):
        raise _bad(prefill, decode, "kv descriptor counts differ")
    if prefill.mla != decode.mla:
        raise _bad(prefill, decode, "MLA on one side only")
    sends_aux = prefill.tp_rank == peers[0]
    if tp_p == tp_d or prefill.mla:
        if tuple(prefill.kv_item_lens) != tuple(decode.kv_item_lens):
            raise _bad(prefill, decode, "kv item sizes differ")
        return PairPlan(True, None, sends_aux, len(prefill.kv_item_lens))
    total = prefill.total_kv_heads
    if total <= 0:
        raise _bad(prefill, decode, "prefill's total kv head count is unknown")
    if decode.total_kv_heads not in (0, total):
        raise _bad(prefill, decode, "total kv head counts differ")
    try:
        h_p = local_units(total, tp_p, "prefill kv heads")
        h_d = local_units(total, tp_d, "decode kv heads")
    except TpShapeMismatch as exc:
        raise _bad(prefill, decode, str(exc)) from None
    ps = prefill.page_size
    runs = []
    n_runs = 0
    for i, (src_len, dst_len) in enumerate(zip(prefill.kv_item_lens, decode.kv_item_lens)):
        head_bytes, rest = divmod(int(src_len), ps * h_p)
        if rest or head_bytes <= 0 or int(dst_len) != ps * h_d * head_bytes:
            raise _bad(
                prefill,
                decode,
                f"kv descriptor {i}: {src_len} B / {dst_len} B are not pages of "
                f"{h_p} / {h_d} heads of one size",
            )
        ro, rd, rn = item_runs(
            nhd_item(ps, head_bytes, total, tp_p),
            nhd_item(ps, head_bytes, total, tp_d),
            prefill.tp_rank,
            decode.tp_rank,
            tp_p,
            tp_d,
        )
        runs.append((ro, rd, rn))
        n_runs += int(rn.size)
    if not n_runs:
        return PairPlan(False, None, sends_aux, 0)
    kv = PatternRuns.make(runs, prefill.kv_item_lens, decode.kv_item_lens)
    src = tuple((ro, rn) for ro, _, rn in runs)
    dst = tuple((rd, rn) for _, rd, rn in runs)
    return PairPlan(False, kv, sends_aux, n_runs, src, dst)


def state_geoms(st: StateShape, tp: int) -> List[ItemGeometry]:
    """The item geometry of every descriptor of ``st`` at TP size ``tp``
    (:func:`kvxfer.disagg.tp_plan.state_geometries`), from SGLang's metadata: a dim of 0 is
    a replicated tensor; the parts ``groups`` are used (each ``full / tp`` local rows) only
    where they sum to the full dim (``dim * tp``), SGLang's rule
    (``compute_mamba_state_slice_blocks``), else the dim is one part. InvalidArgument when
    the metadata does not describe the items (or parts do not split over ``tp``)."""
    n = len(st.item_lens)
    if (
        len(st.dims) != n
        or (st.outer and len(st.outer) != n)
        or (st.groups and len(st.groups) != n)
    ):
        raise InvalidArgument(
            f"{n} state descriptors but {len(st.dims)} dims, {len(st.outer)} outer counts, "
            f"{len(st.groups)} part lists"
        )
    parts: List[List[int]] = []
    for i, dim in enumerate(st.dims):
        g = st.groups[i] if st.groups else None
        if dim > 0 and g and sum(g) == dim * tp:
            if any(x % tp for x in g):
                raise InvalidArgument(
                    f"state descriptor {i}: parts {list(g)} do not split over tp {tp}"
                )
            parts.append([x // tp for x in g])
        else:
            parts.append([])
    dims: List[Any] = [d if d > 0 else None for d in st.dims]
    return state_geometries(st.item_lens, dims, parts, tp, st.outer)


def _state_plans(prefill: Shape, decode: Shape) -> Tuple[StatePlan, ...]:
    if len(prefill.states) != len(decode.states):
        raise _bad(prefill, decode, "state type counts differ")
    out = []
    tp_p, tp_d = prefill.tp_size, decode.tp_size
    for i, (sp, sd) in enumerate(zip(prefill.states, decode.states)):
        if len(sp.item_lens) != len(sd.item_lens):
            raise _bad(prefill, decode, f"state {i}: descriptor counts differ")
        if tp_p == tp_d:
            if sp.item_lens != sd.item_lens:
                raise _bad(prefill, decode, f"state {i}: item sizes differ")
            out.append(StatePlan(True))
            continue
        if not sp.dims or not sd.dims:
            who = "prefill" if not sp.dims else "decode"
            raise _bad(prefill, decode, f"state {i}: {who} states no per-tensor TP dims")
        try:
            src, dst = state_geoms(sp, tp_p), state_geoms(sd, tp_d)
            pp = page_plan(src, dst, prefill.tp_rank, decode.tp_rank, tp_p, tp_d)
        except (InvalidArgument, TpShapeMismatch) as exc:
            raise _bad(prefill, decode, f"state {i}: {exc}") from None
        runs: List[Tuple[Any, Any, Any]] = [([], [], [])] * len(src)
        for descs, ro, rd, rn, _, _ in pp.classes:
            for d in descs:
                runs[d] = (ro, rd, rn)
        if not pp.classes:
            out.append(StatePlan(False))
            continue
        pattern = PatternRuns.make(runs, sp.item_lens, sd.item_lens)
        out.append(StatePlan(False, pattern))
    return tuple(out)


def state_shapes(
    item_lens: Sequence[Sequence[int]],
    dims: Sequence[Sequence[int]] = (),
    outer: Sequence[Sequence[int]] = (),
    groups: Sequence[Sequence[Optional[Sequence[int]]]] = (),
) -> Tuple[StateShape, ...]:
    """One :class:`StateShape` per state type from SGLang's ``KVArgs`` lists
    (``state_item_lens``, ``state_dim_per_tensor``, ``state_slice_outer_counts``,
    ``state_conv_shard_groups``; the latter three may be shorter (absent), ints coerced)."""

    def at(xs: Sequence[Any], i: int) -> Sequence[Any]:
        return (xs[i] or ()) if i < len(xs) else ()

    return tuple(
        StateShape(
            tuple(int(x) for x in lens),
            tuple(int(x) for x in at(dims, i)),
            tuple(int(x) for x in at(outer, i)),
            tuple(None if g is None else tuple(int(x) for x in g) for g in at(groups, i)),
        )
        for i, lens in enumerate(item_lens)
    )


def state_tp_fields(kv_args: Any) -> Dict[str, list]:
    """SGLang's per-tensor state TP metadata of ``kv_args`` (``state_dim_per_tensor``,
    ``state_slice_outer_counts``, ``state_conv_shard_groups``, as its ``MambaPool``
    reports them) as :class:`~.messages.SglRegister`'s plain fields (``[]`` where absent)."""

    def ints(xs: Any) -> list:
        return [int(x) for x in xs or []]

    return {
        "state_dims": [ints(x) for x in getattr(kv_args, "state_dim_per_tensor", None) or []],
        "state_outer": [ints(x) for x in getattr(kv_args, "state_slice_outer_counts", None) or []],
        "state_groups": [
            [None if g is None else ints(g) for g in x or []]
            for x in getattr(kv_args, "state_conv_shard_groups", None) or []
        ],
    }


def decode_sides(decode: Shape, prefill_tp: int, prefill_rank: int) -> Optional[Sides]:
    """Decode's side of :attr:`PairPlan.dst_sides` for its pair with prefill rank
    ``prefill_rank`` of ``prefill_tp``, from decode's own shape alone (what it registers for
    a staged write; prefill derives the same runs from both shapes): prefill's pages hold
    the same heads' bytes per token as decode's, over its own head count. None when the
    pair moves whole pages (equal TP, MLA) or nothing; TpShapeMismatch as
    :func:`pair_plan`."""
    if decode.mla or prefill_tp == decode.tp_size:
        return None
    total = decode.total_kv_heads
    if total <= 0:
        raise TpShapeMismatch(f"decode's total kv head count is unknown: {decode.describe()}")
    try:
        check_ratio(prefill_tp, decode.tp_size)
        h_p = local_units(total, prefill_tp, "prefill kv heads")
        h_d = local_units(total, decode.tp_size, "decode kv heads")
    except TpShapeMismatch as exc:
        raise TpShapeMismatch(f"{exc}: decode {decode.describe()}") from None
    lens = []
    for i, n in enumerate(decode.kv_item_lens):
        per_head, rest = divmod(int(n), h_d)
        if rest:
            raise TpShapeMismatch(
                f"kv descriptor {i}: {n} B is not pages of {h_d} heads: {decode.describe()}"
            )
        lens.append(per_head * h_p)
    prefill = Shape(prefill_tp, prefill_rank, decode.page_size, tuple(lens), total, mla=False)
    return pair_plan(prefill, decode).dst_sides


def shape(
    tp_size: int,
    tp_rank: int,
    page_size: int,
    kv_item_lens: Sequence[int],
    total_kv_heads: int = 0,
    mla: bool = False,
    states: Tuple[StateShape, ...] = (),
) -> Shape:
    """A :class:`Shape` from plain values (ints coerced)."""
    return Shape(
        int(tp_size),
        int(tp_rank),
        int(page_size),
        tuple(int(x) for x in kv_item_lens),
        int(total_kv_heads or 0),
        bool(mla),
        tuple(states),
    )


def total_kv_heads(kv_args, tp_size: int, derive: bool = True) -> int:
    """The model's KV heads over all ranks from SGLang's ``KVArgs`` (0: unknown), as SGLang's
    ``resolve_total_kv_heads``: ``total_kv_head_num``, else (``derive``) ``kv_head_num *
    tp_size``."""
    total = int(getattr(kv_args, "total_kv_head_num", 0) or 0)
    if total > 0 or not derive:
        return max(total, 0)
    return max(int(getattr(kv_args, "kv_head_num", 0) or 0), 0) * int(tp_size)
