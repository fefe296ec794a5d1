"""Token geometry of the kv descriptors, and the byte runs that move tokens ``[start, end)``
between two page sizes (torch-free, vectorised numpy).

Geometry. One item (page) of kv descriptor ``d`` is a sequence of *segments*; segment ``j``
holds ``page_size`` token rows of ``segments[d][j]`` bytes each, one after the other. So token
``t`` (``0 <= t < page_size``) of segment ``j`` lies at byte
``page_size * sum(segments[d][:j]) + t * segments[d][j]`` of the item, and the item is
``page_size * sum(segments[d])`` bytes. Examples: per-layer NHD (and MLA): one segment of
``H*D*esize``; per-layer HND ``[H, page_size, D]``: ``H`` segments of ``D*esize``; page-major:
per layer a K segment ``H*D*esize`` then a V segment ``H*Dv*esize``. The segments do not depend
on the page size, so two peers with the same segments can pair any two page sizes.

Runs. :func:`plan_runs` maps the tokens ``[start, end)`` of one request — held by source
pages of ``src_page_size`` and destination pages of ``dst_page_size`` — to byte ranges
``(desc, src_off, dst_off, nbytes)`` per descriptor (offsets from the descriptor's base, the
form of :class:`kvxfer.engine.RawWrite`). Invariants: every byte of tokens ``[start, end)`` is
covered exactly once and no byte of any other token is; runs that touch in both source and
destination are merged, so equal page sizes with consecutive page ids collapse to one run per
descriptor per page run (the op count of an ItemWrite). Cost: numpy over
``pieces x segments``, where a piece is the token span inside one source page and one
destination page; no Python loop per page. Ops this costs per layout:
bench/results/pages-cpu.md; the shapes supported: docs/shapes.md.

Patterns. :func:`plan_patterns` gives the same bytes as one
:class:`~kvxfer.engine.types.PatternWrite` per *piece class* (:func:`piece_classes`: the
pieces with the same source slot, destination slot and length share their page-relative runs,
:func:`piece_pattern`): a same-host device lane copies each in one launch, whatever the run
count (16 -> 64 aligned: four classes). :mod:`kvxfer.disagg.tp_tokens` groups a
heterogeneous-TP pair's pieces the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from kvxfer.disagg.runs import Runs, run_starts
from kvxfer.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch, UnsupportedOperation
from kvxfer.kernels.ids import sorted_unique

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class TokenGeometry:
    """Per kv descriptor, the token-row bytes of each segment of an item (see module doc)."""

    segments: Tuple[Tuple[int, ...], ...]

    def __post_init__(self) -> None:
        segs = tuple(tuple(int(b) for b in s) for s in self.segments)
        if not segs or any(not s or min(s) <= 0 for s in segs):
            raise InvalidArgument(f"token geometry needs positive segments per descriptor: {segs}")
        object.__setattr__(self, "segments", segs)

    @classmethod
    def of(cls, segments: Optional[Sequence[Sequence[int]]]) -> Optional["TokenGeometry"]:
        """``None`` (the pool states no geometry) or the geometry of ``segments``."""
        return None if not segments else cls(tuple(tuple(s) for s in segments))

    @property
    def token_major(self) -> bool:
        """One segment per descriptor (NHD, MLA): consecutive tokens are adjacent bytes, so
        the runs of consecutive pages merge (few, long runs)."""
        return all(len(s) == 1 for s in self.segments)

    def item_lens(self, page_size: int) -> Tuple[int, ...]:
        """Bytes of one page per descriptor at ``page_size``."""
        return tuple(page_size * sum(s) for s in self.segments)

    def as_list(self) -> list:
        """The plain (msgpack-able) form carried in fingerprints."""
        return [list(s) for s in self.segments]


def pieces(
    start: int, end: int, src_page_size: int, dst_page_size: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Token spans ``[lo, hi)`` of ``[start, end)`` that each lie in one page of either size."""
    if end <= start:
        return _EMPTY, _EMPTY
    cuts = [
        np.arange(-(-start // p) * p, end, p, dtype=np.int64)
        for p in (src_page_size, dst_page_size)
    ]
    b = sorted_unique(np.concatenate(cuts + [np.array([start, end], dtype=np.int64)]))
    return b[:-1], b[1:]


def piece_classes(
    src: np.ndarray,
    dst: np.ndarray,
    src_page_size: int,
    dst_page_size: int,
    start: int,
    end: int,
    src_first_page: int = 0,
) -> List[Tuple[Tuple[int, int, int], np.ndarray, np.ndarray]]:
    """The :func:`pieces` of ``[start, end)`` grouped by *class* ``(a, b, n)``: source slot
    ``a``, destination slot ``b``, ``n`` tokens; per class (ascending key) the source and
    destination page ids of its pieces (``src`` / ``dst`` indexed as in :func:`plan_runs`;
    the window is the caller's to check). Every piece is in exactly one class, and within a
    class the source pages are distinct and so are the destination pages (two pieces with the
    same slot in one page would be one piece). With page sizes that divide one another and an
    aligned window there is one class per slot of the smaller page in the larger, plus the
    partial pieces at the ends: the form a :class:`~kvxfer.engine.types.PatternWrite` takes
    (one per class, the same item-relative runs for each of its page pairs).

    The grouping depends on the page sizes and the window only (:func:`class_index`,
    cached): per call, each class's ids are two fancy-indexing operations."""
    index = class_index(int(src_page_size), int(dst_page_size), int(start), int(end))
    first = int(src_first_page)
    return [(c, src[si - first] if first else src[si], dst[di]) for c, si, di in index]


#: (a, b, n), source page positions (from page 0 of the window's numbering), destination ones
ClassIndex = Tuple[Tuple[Tuple[int, int, int], np.ndarray, np.ndarray], ...]


@lru_cache(maxsize=32)  # 2 int64 per piece each: a 256k-token request's is 256 KiB
def class_index(ps: int, pd: int, start: int, end: int) -> ClassIndex:
    """:func:`piece_classes`'s grouping of ``[start, end)``: per class ``(a, b, n)`` in
    ascending key order, the positions ``lo // ps`` and ``lo // pd`` of its pieces' first
    tokens ``lo`` (ascending). Cached (read-only arrays): the legs of one heterogeneous-TP
    room and requests of one length share it. Page sizes that divide one another take
    arithmetic progressions (no sort); others the general grouping."""
    if end <= start:
        return ()
    p, big = min(ps, pd), max(ps, pd)
    if big % p:
        out = _class_index_any(ps, pd, start, end)
    else:
        out = _class_index_aligned(ps, pd, start, end)
    for _, si, di in out:
        si.flags.writeable = di.flags.writeable = False
    return out


def _class_index_aligned(ps: int, pd: int, start: int, end: int) -> ClassIndex:
    """:func:`class_index` when one page size divides the other: the pieces are the smaller
    pages' spans clipped to the window, so the whole ones fall into ``big / small`` classes
    of every ``big / small``-th piece, plus a partial piece at either end."""
    p, big = min(ps, pd), max(ps, pd)
    f0 = min(-(-start // p) * p, end)  # the first whole piece's start (or end)
    f1 = max(end // p * p, f0)  # the whole pieces end here
    m = p + 1
    found: List[Tuple[int, Tuple[int, int, int], np.ndarray]] = []
    for lo, hi in ((start, f0), (f1, end)):  # partial pieces
        if lo < hi:
            found.append((lo, (lo % ps, lo % pd, hi - lo), np.array([lo], dtype=np.int64)))
    for c in range(0, big, p):  # whole pieces starting at c modulo the larger page
        lo0 = f0 + (c - f0) % big
        if lo0 < f1:
            found.append((lo0, (lo0 % ps, lo0 % pd, p), np.arange(lo0, f1, big, dtype=np.int64)))
    found.sort(key=lambda f: (f[1][0] * pd + f[1][1]) * m + f[1][2])
    return tuple((c, lo // ps, lo // pd) for _, c, lo in found)


def _class_index_any(ps: int, pd: int, start: int, end: int) -> ClassIndex:
    """:func:`class_index` for any two page sizes: the pieces grouped by key."""
    lo, hi = pieces(start, end, ps, pd)
    m = min(ps, pd) + 1  # a piece holds at most min(ps, pd) tokens
    key = ((lo % ps) * pd + lo % pd) * m + (hi - lo)  # ascending key: ascending (a, b, n)
    classes, which = np.unique(key, return_inverse=True)
    order = np.argsort(which.reshape(-1), kind="stable")  # by class, tokens ascending within
    cuts = np.searchsorted(which.reshape(-1)[order], np.arange(classes.size + 1))
    out = []
    for c, kk in enumerate(classes.tolist()):
        k = lo[order[cuts[c] : cuts[c + 1]]]
        ab, n = divmod(kk, m)
        a, b = divmod(ab, pd)
        out.append(((a, b, n), k // ps, k // pd))
    return tuple(out)


def class_token(a: int, b: int, src_page_size: int, dst_page_size: int) -> int:
    """The first token ``t >= 0`` at source slot ``a`` and destination slot ``b``
    (``t % src_page_size == a``, ``t % dst_page_size == b``): where a piece of class
    ``(a, b, n)`` can be planned on its own. ValueError when no token is (no such piece)."""
    ps, pd = src_page_size, dst_page_size
    return next(t for t in range(a, ps * pd + a, ps) if t % pd == b)


@lru_cache(maxsize=512)
def piece_pattern(
    geom: TokenGeometry, src_page_size: int, dst_page_size: int, a: int, b: int, n: int
) -> Any:
    """The :class:`~kvxfer.engine.slices.PatternRuns` of one piece of class ``(a, b, n)``
    (:func:`piece_classes`), relative to its source and destination page: :func:`plan_runs`
    of that piece alone, with both pages at id 0. Cached (the same object each time: the
    device lane keeps its run table per pattern object)."""
    ps, pd = src_page_size, dst_page_size
    t = class_token(a, b, ps, pd)
    runs = plan_runs(
        geom,
        np.zeros(1, dtype=np.int64),
        ps,
        np.zeros(t // pd + 1, dtype=np.int64),
        pd,
        t,
        t + n,
        src_first_page=t // ps,
    )
    from kvxfer.engine.slices import PatternRuns

    by_desc = [runs.desc == d for d in range(len(geom.segments))]
    return PatternRuns.make(
        [(runs.src_off[k], runs.dst_off[k], runs.nbytes[k]) for k in by_desc],
        geom.item_lens(ps),
        geom.item_lens(pd),
    )


def plan_patterns(
    geom: TokenGeometry,
    src_pages: np.ndarray,
    src_page_size: int,
    dst_pages: np.ndarray,
    dst_page_size: int,
    start: int,
    end: int,
    *,
    src_first_page: int = 0,
) -> List[Tuple[np.ndarray, np.ndarray, Any]]:
    """:func:`plan_runs` as per-page patterns: ``[(src ids, dst ids, runs)]``, one entry per
    piece class (:func:`piece_classes`), ``runs`` its :func:`piece_pattern` (cached).
    Applying every entry's runs to its page pairs moves exactly the bytes of
    :func:`plan_runs` (same arguments, same checks); within an entry the destination pages
    are distinct."""
    ps, pd = int(src_page_size), int(dst_page_size)
    src = np.asarray(src_pages, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_pages, dtype=np.int64).reshape(-1)
    _check_window(src, ps, dst, pd, start, end, src_first_page)
    return [
        (s, d, piece_pattern(geom, ps, pd, a, b, n))
        for (a, b, n), s, d in piece_classes(src, dst, ps, pd, start, end, src_first_page)
    ]


def _check_window(
    src: np.ndarray, ps: int, dst: np.ndarray, pd: int, start: int, end: int, first: int
) -> None:
    """InvalidArgument for a page size <= 0 or a negative start; IndexOutOfRange when a
    non-empty ``[start, end)`` is not inside the pages (:func:`plan_runs`)."""
    if ps <= 0 or pd <= 0 or start < 0:
        raise InvalidArgument(f"page sizes {ps}/{pd} must be > 0 and start {start} >= 0")
    if end <= start:
        return
    lo_tok, hi_tok = first * ps, (first + src.size) * ps
    if start < lo_tok or end > hi_tok:
        raise IndexOutOfRange(
            f"tokens [{start}, {end}) not inside the source pages' [{lo_tok}, {hi_tok})"
        )
    if end > dst.size * pd:
        raise IndexOutOfRange(
            f"tokens [{start}, {end}) need {-(-end // pd)} destination pages of {pd}, "
            f"got {dst.size}"
        )


def plan_runs(
    geom: TokenGeometry,
    src_pages: np.ndarray,
    src_page_size: int,
    dst_pages: np.ndarray,
    dst_page_size: int,
    start: int,
    end: int,
    *,
    src_first_page: int = 0,
    keep: Optional[np.ndarray] = None,
) -> Runs:
    """Byte runs moving tokens ``[start, end)``. ``src_pages[i]`` holds tokens
    ``[(src_first_page + i) * src_page_size, +src_page_size)``; ``dst_pages[i]`` holds tokens
    ``[i * dst_page_size, +dst_page_size)``. Raises :class:`IndexOutOfRange` when the pages do
    not cover ``[start, end)``. ``keep``: a bool mask over every descriptor's segments
    (flattened descriptor-major): only those segments' bytes move (one layer's, say:
    :mod:`kvxfer.disagg.layerwise`)."""
    ps, pd = int(src_page_size), int(dst_page_size)
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    _check_window(src, ps, dst, pd, start, end, src_first_page)
    if end <= start:
        return Runs.empty()
    lo, hi = pieces(start, end, ps, pd)
    s_page = src[lo // ps - src_first_page]
    d_page = dst[lo // pd]
    s_slot, d_slot, ntok = lo % ps, lo % pd, hi - lo
    if keep is None and geom.token_major:
        return _token_major_runs(geom, s_page * ps + s_slot, d_page * pd + d_slot, ntok)
    # segments of every descriptor, flattened descriptor-major
    seg_desc = np.concatenate(
        [np.full(len(s), d, dtype=np.int64) for d, s in enumerate(geom.segments)]
    )
    seg_tb = np.concatenate([np.asarray(s, dtype=np.int64) for s in geom.segments])
    seg_cum = np.concatenate(
        [np.cumsum((0,) + s[:-1], dtype=np.int64) for s in geom.segments]
    )  # bytes of one token row in the segments before, per descriptor
    item_tb = np.asarray([sum(s) for s in geom.segments], dtype=np.int64)[seg_desc]
    # (S, P): segment-major rows, piece columns
    tb = seg_tb[:, None]
    so = s_page[None, :] * (ps * item_tb)[:, None] + ps * seg_cum[:, None] + s_slot[None, :] * tb
    do = d_page[None, :] * (pd * item_tb)[:, None] + pd * seg_cum[:, None] + d_slot[None, :] * tb
    nb = ntok[None, :] * tb
    if keep is not None:
        rows = np.flatnonzero(np.asarray(keep, dtype=bool))
        so, do, nb, seg_desc = so[rows], do[rows], nb[rows], seg_desc[rows]
    # order: descriptor, piece, segment (a whole page's segments then touch: they merge)
    n_p = lo.size
    key = (seg_desc[:, None] * n_p + np.arange(n_p, dtype=np.int64)[None, :]).ravel()
    order = np.argsort(key, kind="stable")
    desc = np.broadcast_to(seg_desc[:, None], so.shape).ravel()[order]
    so, do, nb = so.ravel()[order], do.ravel()[order], nb.ravel()[order]
    return Runs.merged(desc, so, do, nb)


def _token_major_runs(
    geom: TokenGeometry, s_tok: np.ndarray, d_tok: np.ndarray, ntok: np.ndarray
) -> Runs:
    """:func:`plan_runs` of a token-major geometry (one segment per descriptor): descriptor
    ``d``'s runs are its token row's bytes times the pieces' token slots (``s_tok``: source
    page x page size + slot; ``d_tok`` the same on the destination), so pieces that continue
    one another do so in every descriptor alike: merged once over the pieces, then scaled per
    descriptor (the same runs, in the same order, as the general path's merge)."""
    first = run_starts(s_tok, d_tok, ntok)
    if first.size != s_tok.size:
        s_tok, d_tok, ntok = s_tok[first], d_tok[first], np.add.reduceat(ntok, first)
    tb = np.asarray([s[0] for s in geom.segments], dtype=np.int64)[:, None]
    nd, n = tb.shape[0], s_tok.size
    return Runs(
        np.repeat(np.arange(nd, dtype=np.int64), n),
        (tb * s_tok[None, :]).ravel(),
        (tb * d_tok[None, :]).ravel(),
        (tb * ntok[None, :]).ravel(),
    )


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def check_span(
    num_pages: int, page_size: int, prefix: int, tokens: Optional[int], who: str
) -> None:
    """Decode's declaration, checked where it is made: ``tokens`` (when given) needs exactly
    ``ceil(tokens / page_size)`` pages and ``0 <= prefix <= tokens`` (else ``<=`` the pages'
    slots)."""
    if tokens is not None and _ceil(tokens, page_size) != num_pages:
        raise ShapeMismatch(
            f"{who}: {tokens} tokens need {_ceil(tokens, page_size)} pages of {page_size}, "
            f"got {num_pages} kv_indices"
        )
    limit = num_pages * page_size if tokens is None else tokens
    if not 0 <= prefix <= limit:
        raise InvalidArgument(f"{who}: prefix_len {prefix} not in [0, {limit}]")


class TokenWindows(Protocol):
    """A heterogeneous-TP pair's kv runs for a token window
    (:meth:`kvxfer.disagg.tp_rooms.TpPair.tokens`); its TP sizes name the shape in errors."""

    prefill_tp: int
    decode_tp: int

    def tokens(
        self, src_pages: Any, dst_pages: Any, start: int, end: int, first_page: int, salt: int
    ) -> Runs: ...

    def token_patterns(
        self, src_pages: Any, dst_pages: Any, start: int, end: int, first_page: int, salt: int
    ) -> List[Any]: ...


@dataclass(frozen=True)
class RoomPages:
    """How one room's tokens travel (prefill's view): tokens ``[prefix, tokens)`` of source
    pages of ``src_page_size`` into destination pages of ``dst_page_size``; by whole pages
    (:attr:`by_runs` False: equal page sizes and a page-aligned prefix, an ItemWrite, or the
    pair's whole-item plan with heterogeneous TP) or by byte runs: of the token geometry
    ``geom`` (equal TP) or of the TP pair ``tp`` (its heads of the window, salted by
    ``salt``, the room id: :mod:`kvxfer.disagg.tp_tokens`)."""

    prefix: int
    tokens: int
    src_page_size: int
    dst_page_size: int
    geom: Optional[TokenGeometry]
    tp: Optional[TokenWindows] = None
    salt: int = 0

    @property
    def by_runs(self) -> bool:
        """Whether the room moves byte runs (else whole pages)."""
        return self.geom is not None or self.tp is not None

    @classmethod
    def make(
        cls,
        *,
        num_src: int,
        num_dst: int,
        src_page_size: int,
        dst_page_size: int,
        prefix: int,
        tokens: Optional[int],
        geom: Optional[TokenGeometry],
        exact: bool,
        who: str,
        tp: Optional[TokenWindows] = None,
        salt: int = 0,
    ) -> "RoomPages":
        """Validate both sides' page counts against the token count and pick the path.
        ``tokens`` None: the slots both sides hold (``min(num_src*Ps, num_dst*Pd)``; with equal
        page sizes, whole pages as before). ``exact``: the bytes must be checkable page by page
        (integrity mode), so only the whole-page path is allowed. Raises ShapeMismatch,
        InvalidArgument or UnsupportedOperation, naming both sides' shapes. ``tp``: the pair
        of a heterogeneous-TP room, whose runs replace ``geom``'s."""
        ps, pd = src_page_size, dst_page_size
        n = min(num_src * ps, num_dst * pd) if tokens is None else tokens
        if ps == pd and tokens is None and num_src != num_dst:
            raise ShapeMismatch(f"{who}: prefill sends {num_src} pages, decode allocated {num_dst}")
        for side, count, size in (("prefill", num_src, ps), ("decode", num_dst, pd)):
            if _ceil(n, size) != count:
                raise ShapeMismatch(
                    f"{who}: {n} tokens need {_ceil(n, size)} {side} pages of {size}, "
                    f"{side} has {count}"
                )
        if not 0 <= prefix <= n:
            raise InvalidArgument(f"{who}: decode prefix {prefix} not in [0, {n}] tokens")
        whole = ps == pd and prefix % ps == 0
        tps = f"prefill tp {tp.prefill_tp}, decode tp {tp.decode_tp}, " if tp is not None else ""
        if exact and not (whole and prefix == 0):
            raise UnsupportedOperation(
                f"{who}: integrity checks whole pages; {tps}prefill page size {ps}, decode {pd}, "
                f"decode prefix {prefix} need byte runs"
            )
        if whole:
            return cls(prefix, n, ps, pd, None)
        if tp is not None:
            return cls(prefix, n, ps, pd, None, tp, int(salt))
        if geom is None:
            raise UnsupportedOperation(
                f"{who}: prefill page size {ps}, decode {pd}, decode prefix {prefix}: the pool "
                f"states no token geometry, so only equal page sizes and page-aligned prefixes"
            )
        return cls(prefix, n, ps, pd, geom)

    def chunk_tokens(self, first_page: int, num_pages: int) -> Tuple[int, int]:
        """Tokens to move for source pages ``[first_page, first_page + num_pages)``."""
        lo = max(first_page * self.src_page_size, self.prefix)
        return lo, max(lo, min((first_page + num_pages) * self.src_page_size, self.tokens))

    def whole_pages(
        self, src: np.ndarray, first_page: int, dst: np.ndarray
    ) -> Tuple[np.ndarray, np.ndarray]:
        """Whole-page path: the (source, destination) ids of a chunk, prefix pages left out."""
        skip = max(0, self.prefix // self.src_page_size - first_page)
        return src[skip:], dst[first_page + skip : first_page + len(src)]

    def runs(self, src: np.ndarray, first_page: int, dst: np.ndarray) -> Runs:
        """Byte-run path: the runs of a chunk of source pages starting at ``first_page``."""
        lo, hi = self.chunk_tokens(first_page, len(src))
        if self.tp is not None:
            return self.tp.tokens(src, dst, lo, hi, first_page, self.salt)
        assert self.geom is not None
        return plan_runs(
            self.geom,
            src,
            self.src_page_size,
            dst,
            self.dst_page_size,
            lo,
            hi,
            src_first_page=first_page,
        )

    def few_runs(
        self, src: np.ndarray, first_page: int, dst: np.ndarray, limit: int
    ) -> Optional[Runs]:
        """Equal TP, token-major geometry: the chunk's :meth:`runs` when there are fewer than
        ``limit`` (consecutive pages merged), else None; None at once for other geometries
        and for a heterogeneous-TP pair, whose runs are one per piece and head block at least.
        A few long runs move faster as PUTs than as one copy launch per piece class (the
        equal vs equal-runs rows of bench/results/eq-patterns-h200.md)."""
        if self.tp is not None or self.geom is None or not self.geom.token_major:
            return None
        lo, hi = self.chunk_tokens(first_page, len(src))
        if hi <= lo:
            return Runs.empty()
        ps, pd = self.src_page_size, self.dst_page_size
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        _check_window(src, ps, dst, pd, lo, hi, first_page)
        s = src[lo // ps - first_page : _ceil(hi, ps) - first_page]  # the window's pages
        d = dst[lo // pd : _ceil(hi, pd)]
        # a run breaks at least wherever either side's next page is not the next id
        breaks = max(
            int(np.count_nonzero(s[1:] - s[:-1] != 1)), int(np.count_nonzero(d[1:] - d[:-1] != 1))
        )
        n_desc = len(self.geom.segments)
        if n_desc * (1 + breaks) >= limit:
            return None  # (scattered pages: known before any run is built)
        if not breaks:  # consecutive pages on both sides: one run per descriptor
            return _token_major_runs(
                self.geom,
                np.array([int(s[0]) * ps + lo % ps], dtype=np.int64),
                np.array([int(d[0]) * pd + lo % pd], dtype=np.int64),
                np.array([hi - lo], dtype=np.int64),
            )
        runs = self.runs(src, first_page, dst)
        return runs if len(runs) < limit else None

    def patterns(self, src: np.ndarray, first_page: int, dst: np.ndarray) -> List[Any]:
        """The byte-run path as PatternWrites of kv, one per piece class (:func:`piece_classes`):
        the same bytes as :meth:`runs`. Equal TP: :func:`plan_patterns` of ``geom``; a
        heterogeneous-TP pair: ``TpPair.token_patterns``."""
        lo, hi = self.chunk_tokens(first_page, len(src))
        if self.tp is not None:
            return self.tp.token_patterns(src, dst, lo, hi, first_page, self.salt)
        assert self.geom is not None
        from kvxfer.engine.types import PatternWrite

        pats = plan_patterns(
            self.geom,
            src,
            self.src_page_size,
            dst,
            self.dst_page_size,
            lo,
            hi,
            src_first_page=first_page,
        )
        return [PatternWrite("kv", s, d, runs) for s, d, runs in pats]

    def dst_pages_done(self, src_pages_done: int) -> int:
        """Destination pages complete once ``src_pages_done`` source pages were sent."""
        end = min(src_pages_done * self.src_page_size, self.tokens)
        return _ceil(end, self.dst_page_size)


__all__ = [
    "TokenGeometry",
    "TokenWindows",
    "Runs",
    "RoomPages",
    "plan_runs",
    "plan_patterns",
    "piece_classes",
    "piece_pattern",
    "class_token",
    "pieces",
    "check_span",
]
