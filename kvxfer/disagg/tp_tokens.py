"""Heterogeneous TP combined with different page sizes and any token window: the byte runs
one prefill rank writes into one decode rank for tokens ``[start, end)`` (torch-free, numpy).

Token form of a KV segment. :mod:`kvxfer.disagg.tp_plan` describes a KV item at its own page
size ``P`` (:class:`~kvxfer.disagg.tp_plan.Segment`); :func:`token_segs` restates each
segment without ``P`` (:class:`TokenSeg`): ``units`` heads of ``unit_bytes`` per token row,
starting at ``P * row_offset`` in the item, laid out either as *rows* (NHD, each (layer, K|V)
of a page-major page: slot ``s`` head ``u`` at ``s * units * unit_bytes + u * unit_bytes``) or
as *blocks* (HND, an MLA latent, a rank's single head: ``u * P * unit_bytes + s *
unit_bytes``). Token ``t`` lives at page ``t // P`` slot ``t % P`` on each side, so the two
sides' page sizes are independent; at ``P = 1`` rows and blocks are the same bytes
(:func:`per_token_item`), which is how the handshake compares two page sizes
(:func:`check_kv_tokens`).

Runs. :meth:`TokenPlan.runs` cuts ``[start, end)`` into *pieces* (token spans inside one
source page and one destination page, :func:`kvxfer.disagg.page_map.pieces`) and crosses them
with the head slices the rank rules give the pair (:func:`~kvxfer.disagg.tp_plan.plan_axis`):

* both sides contiguous per head over tokens (blocks, or one head): one run per piece per
  head (``∝ pieces × heads``);
* otherwise both sides contiguous per token over the slice's heads (rows): one run per token
  (``∝ tokens``, as equal-page NHD heterogeneous TP);
* rows on one side and blocks of several heads on the other are refused at the handshake.

Invariants (tests/unit/test_tp_tokens.py checks them against a per-token brute force): every
byte of every token of ``[start, end)`` in every head decode rank ``d`` owns is written
exactly once, from a prefill rank owning it (one replica), and no other byte is; runs
contiguous on both sides are merged (equal page sizes, whole pages and equal TP give what
``tp_plan.plan_pages`` gives). Byte offsets are from each descriptor's base.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from kvxfer.disagg.errors import TpShapeMismatch
from kvxfer.disagg.page_map import class_token, piece_classes, pieces
from kvxfer.disagg.runs import Runs
from kvxfer.disagg.tp_plan import ItemGeometry, Segment, _pair, item_salt_period, plan_axis
from kvxfer.errors import IndexOutOfRange, InvalidArgument

__all__ = [
    "TokenPlan",
    "TokenSeg",
    "check_kv_tokens",
    "per_token_item",
    "plan_of",
    "token_segs",
]


@dataclass(frozen=True)
class TokenSeg:
    """One KV segment without its page size (see the module docstring)."""

    row_offset: int  # bytes of one token row of the segments before (offset at P = 1)
    blocks: bool  # heads as blocks of the page (HND, latents, one head) vs inside rows
    units: int
    unit_bytes: int  # one head of one token
    total: int

    def strides(self, page_size: int) -> Tuple[int, int]:
        """``(token stride, head stride)`` in an item of ``page_size`` tokens."""
        if self.blocks:
            return self.unit_bytes, page_size * self.unit_bytes
        return self.units * self.unit_bytes, self.unit_bytes


def _token_seg(s: Segment, page_size: int) -> TokenSeg:
    p = page_size
    if s.offset % p:
        raise TpShapeMismatch(f"segment at {s.offset} B is not a token segment at page size {p}")
    if s.units == 1 and (s.reps == 1 or s.stride == s.unit_bytes):
        size = s.reps * s.unit_bytes  # one contiguous block: P rows of one unit
        if size % p == 0:
            return TokenSeg(s.offset // p, True, 1, size // p, s.total)
    elif s.reps == p and p > 1 and s.stride == s.units * s.unit_bytes:
        return TokenSeg(s.offset // p, False, s.units, s.unit_bytes, s.total)
    elif s.reps == 1 and s.unit_bytes % p == 0 and s.stride == s.units * s.unit_bytes:
        return TokenSeg(s.offset // p, True, s.units, s.unit_bytes // p, s.total)
    raise TpShapeMismatch(f"segment {s.describe()} is not a token segment at page size {p}")


@lru_cache(maxsize=1024)
def token_segs(geom: ItemGeometry, page_size: int) -> Tuple[TokenSeg, ...]:
    """The token form of every segment of a KV item of ``page_size`` tokens
    (TpShapeMismatch when a segment is not ``page_size`` token rows). Cached."""
    if page_size <= 0 or geom.item_bytes % page_size:
        raise TpShapeMismatch(f"{geom.describe()} does not hold {page_size} token rows")
    return tuple(_token_seg(s, page_size) for s in geom.segments)


def per_token_item(geom: ItemGeometry, page_size: int) -> ItemGeometry:
    """The item at page size 1 (one token row): the form two page sizes compare in."""
    segs = tuple(
        Segment(t.row_offset, 1, t.units * t.unit_bytes, t.units, t.unit_bytes, t.total)
        for t in token_segs(geom, page_size)
    )
    return ItemGeometry(geom.item_bytes // page_size, segs)


def check_kv_tokens(
    src: Sequence[ItemGeometry],
    dst: Sequence[ItemGeometry],
    src_page_size: int,
    dst_page_size: int,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    """TpShapeMismatch (naming both) unless every KV descriptor pairs token by token: the
    per-token items join (:func:`~kvxfer.disagg.tp_plan._pair`) and no segment has rows of
    several heads on one side against blocks of several heads on the other."""
    if len(src) != len(dst):
        raise TpShapeMismatch(f"prefill has {len(src)} kv descriptors, decode {len(dst)}")
    for i, (s, t) in enumerate(zip(src, dst)):
        try:
            _pair(
                per_token_item(s, src_page_size),
                per_token_item(t, dst_page_size),
                prefill_tp,
                decode_tp,
            )
            for j, (a, b) in enumerate(
                zip(token_segs(s, src_page_size), token_segs(t, dst_page_size))
            ):
                mixed = a.units > 1 and b.units > 1 and a.blocks != b.blocks
                if mixed and src_page_size > 1 and dst_page_size > 1:
                    raise TpShapeMismatch(
                        f"segment {j}: {'blocks' if a.blocks else 'rows'} of {a.units} heads "
                        f"against {'blocks' if b.blocks else 'rows'} of {b.units}"
                    )
        except TpShapeMismatch as exc:
            raise TpShapeMismatch(
                f"kv descriptor {i}: prefill tp {prefill_tp} page {src_page_size} "
                f"{s.describe()}, decode tp {decode_tp} page {dst_page_size} "
                f"{t.describe()}: {exc}"
            ) from None


@dataclass(frozen=True)
class TokenPlan:
    """The token runs of one prefill rank → decode rank pair over the KV descriptors (item
    geometries validated by :func:`check_kv_tokens` at the handshake)."""

    src: Tuple[ItemGeometry, ...]
    dst: Tuple[ItemGeometry, ...]
    src_page_size: int
    dst_page_size: int
    prefill_rank: int
    decode_rank: int
    prefill_tp: int
    decode_tp: int

    def __hash__(self) -> int:
        """The fields' hash, computed once: :func:`piece_runs` is cached by plan, and hashing
        the nested geometries costs ~3 µs a call (five classes a write)."""
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", h)
        return h

    def salt_class(self, salt: int) -> int:
        """``salt`` reduced to its class: salts of one class give the same runs (the least
        common multiple of the descriptors' per-token
        :func:`~kvxfer.disagg.tp_plan.item_salt_period`; 0 for every salt where no head has
        replicas to pick from), so :func:`piece_runs` keeps one pattern per class."""
        period = self.__dict__.get("_period")
        if period is None:
            period = 1
            for s, t in zip(self.src, self.dst):
                a = per_token_item(s, self.src_page_size)
                b = per_token_item(t, self.dst_page_size)
                period = math.lcm(period, item_salt_period(a, b, self.prefill_tp, self.decode_tp))
            object.__setattr__(self, "_period", period)
        return int(salt) % period

    def runs(
        self,
        src_pages: Any,
        dst_pages: Any,
        start: int,
        end: int,
        *,
        src_first_page: int = 0,
        salt: int = 0,
    ) -> Runs:
        """Runs moving this pair's heads of tokens ``[start, end)``: ``src_pages[i]`` holds
        tokens ``[(src_first_page + i) * Ps, +Ps)``, ``dst_pages[i]`` tokens ``[i * Pd,
        +Pd)``; IndexOutOfRange when the pages do not cover the window."""
        ps, pd = self.src_page_size, self.dst_page_size
        src, dst = self._window(src_pages, dst_pages, start, end, src_first_page)
        if end <= start:
            return Runs.empty()
        lo, hi = pieces(start, end, ps, pd)
        tok = np.arange(start, end, dtype=np.int64)
        cols: List[Tuple[np.ndarray, ...]] = []
        for d, (sg, dg) in enumerate(zip(self.src, self.dst)):
            for j, (a, b) in enumerate(zip(token_segs(sg, ps), token_segs(dg, pd))):
                cols += self._segment(
                    d, j, a, b, sg, dg, src, dst, src_first_page, lo, hi, tok, salt
                )
        if not cols:
            return Runs.empty()
        desc, pos, seg, sl, head, so, do, nb = (np.concatenate(c) for c in zip(*cols))
        # order: descriptor, piece, segment, slice, head, token (a piece's whole page, all
        # segments, then touches the next: equal shapes merge as plan_pages does)
        piece = np.searchsorted(lo, pos, side="right") - 1
        order = np.lexsort((pos, head, sl, seg, piece, desc))
        return Runs.merged(desc[order], so[order], do[order], nb[order])

    def _window(
        self, src_pages: Any, dst_pages: Any, start: int, end: int, src_first_page: int
    ) -> Tuple[np.ndarray, np.ndarray]:
        """The page arrays, once the window is checked: InvalidArgument for a negative start,
        IndexOutOfRange when a non-empty window is not inside the pages."""
        ps, pd = self.src_page_size, self.dst_page_size
        src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
        dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
        if start < 0:
            raise InvalidArgument(f"token window starts at {start}")
        lo_tok, hi_tok = src_first_page * ps, (src_first_page + src.size) * ps
        if end > start and (start < lo_tok or end > hi_tok or end > dst.size * pd):
            raise IndexOutOfRange(
                f"tokens [{start}, {end}) not inside the source pages' [{lo_tok}, {hi_tok}) "
                f"and the {dst.size} destination pages of {pd}"
            )
        return src, dst

    def patterns(
        self,
        src_pages: Any,
        dst_pages: Any,
        start: int,
        end: int,
        *,
        src_first_page: int = 0,
        salt: int = 0,
    ) -> List[Tuple[np.ndarray, np.ndarray, Any]]:
        """The runs of :meth:`runs` as per-page patterns: ``[(src ids, dst ids, runs)]``,
        one entry per piece class (:func:`kvxfer.disagg.page_map.piece_classes`: a piece's
        source slot, destination slot and length); ``runs``: a
        :class:`~kvxfer.engine.slices.PatternRuns` relative to one page on each side
        (:func:`piece_runs`, cached). Applying every
        entry's runs to its page pairs moves exactly the bytes of :meth:`runs`; within an
        entry the destination pages are distinct."""
        ps, pd = self.src_page_size, self.dst_page_size
        src, dst = self._window(src_pages, dst_pages, start, end, src_first_page)
        out = []
        for (a, b, n), s, d in piece_classes(src, dst, ps, pd, start, end, src_first_page):
            runs = piece_runs(self, a, b, n, self.salt_class(salt))
            if runs is not None:
                out.append((s, d, runs))
        return out

    def _segment(
        self,
        d: int,
        j: int,
        a: TokenSeg,
        b: TokenSeg,
        sg: ItemGeometry,
        dg: ItemGeometry,
        src: np.ndarray,
        dst: np.ndarray,
        first: int,
        lo: np.ndarray,
        hi: np.ndarray,
        tok: np.ndarray,
        salt: int,
    ) -> List[Tuple[np.ndarray, ...]]:
        ps, pd = self.src_page_size, self.dst_page_size
        ts_s, hs_s = a.strides(ps)
        ts_d, hs_d = b.strides(pd)
        ub = a.unit_bytes
        out: List[Tuple[np.ndarray, ...]] = []
        axis = plan_axis(a.total, self.prefill_tp, self.decode_tp, salt)
        for k, s in enumerate(axis.receives(self.decode_rank)):
            if s.prefill_rank != self.prefill_rank:
                continue
            c = s.count
            base_s = ps * a.row_offset + s.src[0] * hs_s
            base_d = pd * b.row_offset + s.dst[0] * hs_d
            if ts_s == ub and ts_d == ub:  # per head, a piece's tokens are contiguous
                h = np.arange(c, dtype=np.int64)[:, None]
                so = src[lo // ps - first] * sg.item_bytes + base_s + (lo % ps) * ub
                do = dst[lo // pd] * dg.item_bytes + base_d + (lo % pd) * ub
                shape = (c, lo.size)
                so, do = (so[None, :] + h * hs_s).ravel(), (do[None, :] + h * hs_d).ravel()
                nb = np.broadcast_to((hi - lo) * ub, shape).ravel()
                pos = np.broadcast_to(lo, shape).ravel()
                hh = np.broadcast_to(h, shape).ravel()
            elif (hs_s == ub or c == 1) and (hs_d == ub or c == 1):  # per token, heads together
                so = src[tok // ps - first] * sg.item_bytes + base_s + (tok % ps) * ts_s
                do = dst[tok // pd] * dg.item_bytes + base_d + (tok % pd) * ts_d
                nb = np.full(tok.size, c * ub, dtype=np.int64)
                pos, hh = tok, np.zeros(tok.size, dtype=np.int64)
            else:  # refused by check_kv_tokens at the handshake
                raise InvalidArgument(f"kv descriptor {d} segment {j}: rows against blocks")
            n = so.size
            out.append(
                (
                    np.full(n, d, dtype=np.int64),
                    pos,
                    np.full(n, j, dtype=np.int64),
                    np.full(n, k, dtype=np.int64),
                    hh,
                    so,
                    do,
                    nb,
                )
            )
        return out


@lru_cache(maxsize=256)
def piece_runs(plan: TokenPlan, a: int, b: int, n: int, salt: int) -> Any:
    """The :class:`~kvxfer.engine.slices.PatternRuns` of one piece of ``n`` tokens at source
    slot ``a`` and destination slot ``b``, relative to its two pages
    (:meth:`TokenPlan.patterns`), None when the pair moves nothing of it. Cached (the same
    object each time: the device lane keeps its run table per pattern object)."""
    ps, pd = plan.src_page_size, plan.dst_page_size
    t = class_token(a, b, ps, pd)  # (a piece of this class exists, so one does)
    runs = plan.runs(
        np.zeros(1, dtype=np.int64),
        np.zeros(t // pd + 1, dtype=np.int64),
        t,
        t + n,
        src_first_page=t // ps,
        salt=salt,
    )
    if not len(runs):
        return None
    from kvxfer.engine.slices import PatternRuns

    by_desc = [runs.desc == d for d in range(len(plan.src))]
    return PatternRuns.make(
        [(runs.src_off[k], runs.dst_off[k], runs.nbytes[k]) for k in by_desc],
        [g.item_bytes for g in plan.src],
        [g.item_bytes for g in plan.dst],
    )


def plan_of(pair: Any, group: str = "kv") -> TokenPlan:
    """The :class:`TokenPlan` of a :class:`kvxfer.disagg.tp_rooms.TpPair`'s ``group``."""
    g: Dict[str, List[ItemGeometry]] = pair.src
    return TokenPlan(
        tuple(g[group]),
        tuple(pair.dst[group]),
        int(pair.src_page_size),
        int(pair.dst_page_size),
        int(pair.prefill_rank),
        int(pair.decode_rank),
        int(pair.prefill_tp),
        int(pair.decode_tp),
    )
