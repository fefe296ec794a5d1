"""Torch-free byte arithmetic for KV buffers: descriptor spans and the page-major geometry.

Two ideas live here and nowhere else:

* :class:`KvBufferDesc` -- one registered buffer seen as ``rows`` of ``row_bytes`` bytes, each
  row holding ``tokens_per_row`` tokens (``1`` for a per-token NHD buffer, ``page_size`` when a
  row is a whole page: HND, page-major). From it follow the byte spans the transfer layer
  registers and the size of one transfer item (one page).
* :class:`PageMajorGeometry` -- the page-major envelope: ONE raw byte buffer of ``num_pages``
  pages; a page holds every layer, layer-major within the page: for layer ``l`` the K rows
  ``[page_size, H, D]`` followed by the V rows ``[page_size, H, Dv]``. Byte address of element
  ``(K|V, layer l, token t, head h, elem e)``::

      page  = t // page_size,  slot = t % page_size
      base  = page * page_bytes + l * layer_bytes + (0 if K else page_size * k_token_bytes)
      addr  = base + slot * token_bytes(kind) + (h * dim(kind) + e) * itemsize

  where ``k_token_bytes = H * D * itemsize``, ``v_token_bytes = H * Dv * itemsize``,
  ``layer_bytes = page_size * (k_token_bytes + v_token_bytes)`` and
  ``page_bytes = layer_num * layer_bytes``. Each token row is contiguous; pages are strided.

Invariants (tested exhaustively in ``tests/unit/test_layout.py``): the page-major map is a
bijection onto ``[0, total_bytes)``; the per-layer 4-D views described by :meth:`view_spec`
address exactly those bytes; page ``p`` of the envelope is the byte range
``[p * page_bytes, (p + 1) * page_bytes)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvxfer.kernels.errors import InvalidArgument

__all__ = [
    "KvBufferDesc",
    "PageMajorGeometry",
    "ViewSpec",
    "ceil_div",
    "num_pages_for",
    "per_layer_descs",
]


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def _positive_int(name: str, value, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an int, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InvalidArgument(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def num_pages_for(size: int, page_size: int) -> int:
    """Pages of a page-granular buffer holding ``size`` tokens plus the padding page.

    Page-granular layouts (HND, page-major) need ``size + page_size`` to be a whole number of
    pages, i.e. ``size % page_size == 0``; anything else raises :class:`InvalidArgument`.
    """
    _positive_int("size", size, allow_zero=True)
    _positive_int("page_size", page_size)
    if size % page_size:
        raise InvalidArgument(
            f"page-granular layout needs size to be a multiple of page_size; "
            f"got size={size}, page_size={page_size}"
        )
    return size // page_size + 1


class KvBufferDesc:
    """Byte-span math for one buffer made of rows of ``row_bytes`` holding ``tokens_per_row``
    tokens each (a row is one token slot, or one whole page).

    ``shape`` is the buffer's full element shape (for :meth:`reserved_span_bytes`); all other
    spans are derived from rows, so they hold for any element type.
    """

    __slots__ = ("name", "shape", "row_bytes", "tokens_per_row")

    def __init__(self, name: str, shape: tuple, *, row_bytes: int, tokens_per_row: int):
        self.name = str(name)
        self.shape = tuple(int(s) for s in shape)
        self.row_bytes = _positive_int("row_bytes", row_bytes)
        self.tokens_per_row = _positive_int("tokens_per_row", tokens_per_row)

    def rows(self, num_tokens: int) -> int:
        """Rows needed to hold ``num_tokens`` tokens (CEIL; negative counts as zero)."""
        return ceil_div(max(int(num_tokens), 0), self.tokens_per_row)

    def reserved_span_bytes(self, itemsize: int) -> int:
        """Upper-bound byte size of the whole buffer: ``prod(shape) * itemsize``."""
        return math.prod(self.shape) * int(itemsize)

    def prefix_span_bytes(self, num_tokens: int, page_size: int) -> int:
        """Bytes that must be backed for the first ``num_tokens`` token ids to be usable."""
        return self.rows(num_tokens) * self.row_bytes

    def final_span_bytes(self, num_tokens: int, page_size: int) -> int:
        """Bytes of the advertised span for a pool of ``num_tokens`` tokens: the tokens plus
        the padding page, rounded UP to whole rows (n=17, page=16 with page rows -> 3 rows)."""
        return self.rows(max(int(num_tokens), 0) + int(page_size)) * self.row_bytes

    def item_len_bytes(self, page_size: int) -> int:
        """Bytes of one transfer item = one page of this buffer."""
        _positive_int("page_size", page_size)
        if page_size % self.tokens_per_row:
            raise InvalidArgument(
                f"{self.name}: page_size={page_size} is not a multiple of "
                f"tokens_per_row={self.tokens_per_row}"
            )
        return (page_size // self.tokens_per_row) * self.row_bytes

    def __eq__(self, other) -> bool:
        if not isinstance(other, KvBufferDesc):
            return NotImplemented
        return (self.name, self.shape, self.row_bytes, self.tokens_per_row) == (
            other.name,
            other.shape,
            other.row_bytes,
            other.tokens_per_row,
        )

    def __hash__(self) -> int:
        return hash((self.name, self.shape, self.row_bytes, self.tokens_per_row))

    def __repr__(self) -> str:
        return (
            f"KvBufferDesc({self.name!r}, shape={self.shape}, row_bytes={self.row_bytes}, "
            f"tokens_per_row={self.tokens_per_row})"
        )


def per_layer_descs(
    prefix: str, layer_num: int, shape: tuple, itemsize: int, tokens_per_row: int
) -> list[KvBufferDesc]:
    """``layer_num`` descriptors ``prefix0..prefix{L-1}`` of identical per-layer buffers whose
    leading dim is rows (``row_bytes = prod(shape[1:]) * itemsize``)."""
    row_bytes = math.prod(shape[1:]) * int(itemsize)
    return [
        KvBufferDesc(f"{prefix}{i}", shape, row_bytes=row_bytes, tokens_per_row=tokens_per_row)
        for i in range(layer_num)
    ]


@dataclass(frozen=True)
class ViewSpec:
    """An element-granular strided view into a flat buffer of one element type:
    ``torch.as_strided(flat, shape, strides, offset)``."""

    offset: int
    shape: tuple
    strides: tuple

    def element_offset(self, index: tuple) -> int:
        """Flat element index of ``index`` (one int per dim) inside the viewed buffer."""
        if len(index) != len(self.shape):
            raise InvalidArgument(f"index {index} has wrong rank for shape {self.shape}")
        for i, n in zip(index, self.shape):
            if not 0 <= i < n:
                raise InvalidArgument(f"index {index} outside shape {self.shape}")
        return self.offset + sum(i * s for i, s in zip(index, self.strides))


_KINDS = ("k", "v")


@dataclass(frozen=True)
class PageMajorGeometry:
    """Geometry of the page-major MHA envelope (see module docstring for the byte map)."""

    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    v_head_dim: int
    itemsize: int
    num_pages: int

    def __post_init__(self):
        _positive_int("layer_num", self.layer_num)
        _positive_int("page_size", self.page_size)
        _positive_int("head_num", self.head_num)
        _positive_int("head_dim", self.head_dim)
        _positive_int("v_head_dim", self.v_head_dim)
        _positive_int("itemsize", self.itemsize)
        _positive_int("num_pages", self.num_pages)

    @classmethod
    def for_pool(
        cls,
        *,
        size: int,
        page_size: int,
        layer_num: int,
        head_num: int,
        head_dim: int,
        v_head_dim: int,
        itemsize: int,
    ) -> "PageMajorGeometry":
        """Geometry of a pool of ``size`` tokens (+ the padding page); ``size`` page-aligned."""
        return cls(
            layer_num,
            page_size,
            head_num,
            head_dim,
            v_head_dim,
            itemsize,
            num_pages_for(size, page_size),
        )

    # -- sizes -----------------------------------------------------------------------------
    @property
    def k_token_bytes(self) -> int:
        return self.head_num * self.head_dim * self.itemsize

    @property
    def v_token_bytes(self) -> int:
        return self.head_num * self.v_head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K rows then V rows) inside one page."""
        return self.page_size * (self.k_token_bytes + self.v_token_bytes)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of all layers = one transfer item."""
        return self.layer_num * self.layer_bytes

    @property
    def entry_bytes(self) -> int:
        """Bytes per token over all layers (K and V)."""
        return self.layer_num * (self.k_token_bytes + self.v_token_bytes)

    @property
    def total_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def num_tokens(self) -> int:
        """Token slots addressed by the envelope, padding page included."""
        return self.num_pages * self.page_size

    # -- offsets ---------------------------------------------------------------------------
    def _check(self, kind: str, layer: int) -> None:
        if kind not in _KINDS:
            raise InvalidArgument(f"kind must be 'k' or 'v', got {kind!r}")
        if not 0 <= layer < self.layer_num:
            raise InvalidArgument(f"layer {layer} outside [0, {self.layer_num})")

    def dim(self, kind: str) -> int:
        return self.head_dim if kind == "k" else self.v_head_dim

    def token_bytes(self, kind: str) -> int:
        return self.k_token_bytes if kind == "k" else self.v_token_bytes

    def block_offset_bytes(self, kind: str, layer: int) -> int:
        """Byte offset of ``(kind, layer)``'s ``[page_size, H, dim]`` block inside a page."""
        self._check(kind, layer)
        off = layer * self.layer_bytes
        return off if kind == "k" else off + self.page_size * self.k_token_bytes

    def byte_offset(self, kind: str, layer: int, token: int, head: int = 0, elem: int = 0) -> int:
        """Byte address (relative to the buffer start) of one element."""
        self._check(kind, layer)
        if not 0 <= token < self.num_tokens:
            raise InvalidArgument(f"token {token} outside [0, {self.num_tokens})")
        if not 0 <= head < self.head_num or not 0 <= elem < self.dim(kind):
            raise InvalidArgument(
                f"head/elem ({head}, {elem}) outside ({self.head_num}, {self.dim(kind)})"
            )
        page, slot = divmod(token, self.page_size)
        return (
            page * self.page_bytes
            + self.block_offset_bytes(kind, layer)
            + slot * self.token_bytes(kind)
            + (head * self.dim(kind) + elem) * self.itemsize
        )

    def page_range(self, page: int) -> tuple[int, int]:
        """``[start, end)`` bytes of page ``page`` (all layers)."""
        if not 0 <= page < self.num_pages:
            raise InvalidArgument(f"page {page} outside [0, {self.num_pages})")
        return page * self.page_bytes, (page + 1) * self.page_bytes

    def view_spec(self, kind: str, layer: int) -> ViewSpec:
        """Element-granular 4-D view ``[num_pages, page_size, H, dim]`` of ``(kind, layer)``
        over the raw buffer reinterpreted as elements of ``itemsize`` bytes."""
        self._check(kind, layer)
        d = self.dim(kind)
        isz = self.itemsize
        # All byte quantities are multiples of itemsize by construction.
        return ViewSpec(
            offset=self.block_offset_bytes(kind, layer) // isz,
            shape=(self.num_pages, self.page_size, self.head_num, d),
            strides=(self.page_bytes // isz, self.head_num * d, d, 1),
        )

    def buffer_desc(self, name: str = "kv") -> KvBufferDesc:
        """The single registration descriptor: rows are pages of all layers."""
        return KvBufferDesc(
            name, (self.total_bytes,), row_bytes=self.page_bytes, tokens_per_row=self.page_size
        )
