"""Integer arguments: Python ints and numpy integers alike (a scheduler's page counts and
slot ids are often ``np.int64``), never bools; always returned as plain ``int`` so nothing
numpy-typed reaches msgpack or a comparison with a wire value."""

from __future__ import annotations

import operator
from typing import Optional

from kvxfer.errors import InvalidArgument


def as_int(value, what: str, low: Optional[int] = None) -> int:
    """``value`` as an ``int`` (anything with ``__index__`` but a bool), ``>= low`` if given;
    InvalidArgument otherwise."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        raise InvalidArgument(f"{what} must be an int, got bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if low is not None and v < low:
        raise InvalidArgument(f"{what}={v} must be >= {low}")
    return v


__all__ = ["as_int"]
