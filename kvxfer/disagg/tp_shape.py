"""The TP shape a rank advertises (``KVArgs.tp_shape``, carried in its fingerprint as
``"tp"``) and the handshake check between two ranks of different TP sizes.

A rank's TP shape is :func:`kvxfer.disagg.tp_plan.tp_fingerprint` of its TP size and the item
geometry of every ``kv`` and ``state`` descriptor (carried run-length encoded, ``"runs"``:
``[[count, geometry], ...]`` per group, since consecutive layers repeat one geometry;
:func:`expand` restores the plain form), derived from its pools' own statement
(``kv_token_segments`` / ``kv_token_heads``; ``get_state_dim_per_tensor`` /
``get_state_parts_per_tensor``, or ``get_state_item_regions`` for an envelope pool). A pool
that states no TP geometry (FP4 MHA, MiniMax sparse) gives no shape: such a rank pairs only
with a rank of its own TP size.

Handshake (:func:`check_hetero`, called by :func:`kvxfer.disagg.kv_args.check_compatible`
when the TP sizes differ): both shapes must join (:func:`~kvxfer.disagg.tp_plan.
check_tp_compatible`); with different page sizes the kv items are compared token by token
instead (:func:`~kvxfer.disagg.tp_tokens.check_kv_tokens`: the same heads per token row, and
no rows of several heads against blocks of several heads). Every other fingerprint key that
does not depend on the TP size must still match. Failures raise :class:`TpShapeMismatch` naming both shapes.
Torch-free.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.disagg.tp_plan import (
    ItemGeometry,
    check_tp_compatible,
    envelope_state_geometry,
    kv_geometries,
    state_geometries,
    tp_fingerprint,
)
from kvxfer.disagg.tp_tokens import check_kv_tokens
from kvxfer.errors import InvalidArgument

#: keys of a pool's ``describe()`` that follow from the rank's share of the heads / rows
TP_LAYOUT_KEYS = frozenset(
    {"head_num", "item_lens", "conv_shapes", "temporal_shape", "entry_bytes", "conv_parts"}
)
#: fingerprint keys that follow from the TP size (compared through the TP shape instead)
TP_KEYS = frozenset(
    {
        "kv_segments",
        "kv_item_lens",
        "state_item_lens",
        "state_dim_per_tensor",
        "tp_size",
        "tp",
    }
)


def local_kv_heads(pool: Any) -> Optional[int]:
    """The KV heads the pool's rank holds (from ``kv_token_heads``), None when it states
    none (``[]`` everywhere: a replicated latent gives 0)."""
    heads = getattr(pool, "kv_token_heads", None)
    got = heads() if heads is not None else None
    if got is None:
        return None
    return max((a + n for desc in got for a, n in desc), default=0)


def tp_shape_of(
    kv_pool: Any, state_pool: Any, tp_size: int, total_kv_heads: Optional[int] = None
) -> Dict[str, Any]:
    """The TP shape of a rank holding ``kv_pool`` (and ``state_pool``) as rank of
    ``tp_size``; ``{}`` when a pool states no TP geometry. ``total_kv_heads``: the model's
    KV heads over all ranks (SGLang's ``total_kv_head_num``); default: the pool's heads times
    ``tp_size`` (right unless heads are replicated, ``tp_size > total``)."""
    h = local_kv_heads(kv_pool)
    if h is None:
        return {}
    total = int(total_kv_heads) if total_kv_heads is not None else max(1, h * tp_size)
    try:
        groups: Dict[str, Sequence[ItemGeometry]] = {"kv": kv_geometries(kv_pool, total, tp_size)}
        if state_pool is not None:
            groups["state"] = state_geometry(state_pool, tp_size)
    except (InvalidArgument, TpShapeMismatch):
        return {}
    plain = tp_fingerprint(tp_size, groups)
    runs: Dict[str, List[List[Any]]] = {}
    for g, geoms in plain["groups"].items():
        out: List[List[Any]] = []
        runs[g] = out
        for v in geoms:
            if out and out[-1][1] == v:
                out[-1][0] += 1
            else:
                out.append([1, v])
    return {"tp_size": plain["tp_size"], "runs": runs}


def expand(shape: Dict[str, Any]) -> Dict[str, Any]:
    """The plain form (:func:`~kvxfer.disagg.tp_plan.tp_fingerprint`) of a TP shape;
    TpShapeMismatch when it is malformed."""
    if not isinstance(shape, dict) or "runs" not in shape:
        return shape
    try:
        groups = {
            g: [v for n, v in runs for _ in range(int(n))] for g, runs in shape["runs"].items()
        }
        if sum(len(x) for x in groups.values()) > 1 << 16:
            raise ValueError("more than 65536 descriptors")
        return {"tp_size": shape["tp_size"], "groups": groups}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise TpShapeMismatch(f"malformed TP shape: {exc}") from None


def state_geometry(state_pool: Any, tp_size: int) -> List[ItemGeometry]:
    """Item geometry of every state descriptor of a (Mamba or hybrid) state pool."""
    _, _, items = state_pool.get_state_buf_infos()
    mamba = getattr(state_pool, "mamba_pool", state_pool)
    if getattr(mamba, "layout", None) == "envelope":
        regions = mamba.get_state_item_regions()
        return [envelope_state_geometry(int(items[0]), regions, tp_size)]
    dims = state_pool.get_state_dim_per_tensor()
    parts_fn = getattr(state_pool, "get_state_parts_per_tensor", None)
    parts = parts_fn() if parts_fn is not None else []
    return state_geometries(items, dims, parts, tp_size)


def groups_of(shape: Dict[str, Any]) -> Dict[str, List[ItemGeometry]]:
    """The item geometries of a (validated) TP shape, per group."""
    return {
        g: [ItemGeometry.from_plain(v) for v in geoms]
        for g, geoms in expand(shape)["groups"].items()
    }


def check_hetero(
    ours: Dict[str, Any], theirs: Dict[str, Any], *, us: str, them: str, ours_is_prefill: bool
) -> None:
    """The TP-specific part of the handshake between ranks of different TP sizes (see the
    module docstring); TpShapeMismatch naming both shapes."""
    tp_a, tp_b = ours.get("tp_size"), theirs.get("tp_size")
    a, b = ours.get("tp"), theirs.get("tp")
    if not a or not b:
        who = f"{us} (tp {tp_a})" if not a else f"{them} (tp {tp_b})"
        raise TpShapeMismatch(
            f"tp_size: {us} has {tp_a}, {them} has {tp_b}, and {who} states no TP geometry "
            f"(its pool cannot be split by heads): only equal TP sizes pair"
        )
    prefill, decode = (a, b) if ours_is_prefill else (b, a)
    pp, pd = (ours, theirs) if ours_is_prefill else (theirs, ours)
    ps_p, ps_d = pp.get("page_size"), pd.get("page_size")
    try:
        fp_p, fp_d = expand(prefill), expand(decode)
        if ps_p != ps_d:  # the kv items pair token by token (tp_tokens), the rest as items
            if not (isinstance(ps_p, int) and isinstance(ps_d, int) and ps_p > 0 and ps_d > 0):
                raise TpShapeMismatch(f"page sizes {ps_p!r} / {ps_d!r}")
            if set(fp_p["groups"]) != set(fp_d["groups"]):
                raise TpShapeMismatch(
                    f"prefill has groups {sorted(fp_p['groups'])}, decode {sorted(fp_d['groups'])}"
                )
            kv_p, kv_d = groups_of(prefill).get("kv", []), groups_of(decode).get("kv", [])
            check_kv_tokens(kv_p, kv_d, ps_p, ps_d, int(fp_p["tp_size"]), int(fp_d["tp_size"]))
            fp_p = {**fp_p, "groups": {g: v for g, v in fp_p["groups"].items() if g != "kv"}}
            fp_d = {**fp_d, "groups": {g: v for g, v in fp_d["groups"].items() if g != "kv"}}
        check_tp_compatible(fp_p, fp_d)
    except TpShapeMismatch as exc:
        raise TpShapeMismatch(
            f"{us} (tp {tp_a}, page {ours.get('page_size')}) and {them} (tp {tp_b}, page "
            f"{theirs.get('page_size')}): {exc}"
        ) from None


def strip_tp(layout: Any) -> Any:
    """``layout`` without the keys that follow from the TP size (:data:`TP_LAYOUT_KEYS`)."""
    if isinstance(layout, dict):
        return {k: strip_tp(v) for k, v in layout.items() if k not in TP_LAYOUT_KEYS}
    return layout


__all__ = [
    "TP_KEYS",
    "check_hetero",
    "expand",
    "groups_of",
    "local_kv_heads",
    "state_geometry",
    "strip_tp",
    "tp_shape_of",
]
