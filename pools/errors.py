"""Errors raised by pools (re-exported from the single hierarchy in kernels.errors)."""

from kvxfer.kernels.errors import (  # noqa: F401
    BackingError,
    DoubleFree,
    IndexOutOfRange,
    InvalidArgument,
    KvxferError,
    OutOfMemory,
    ShapeMismatch,
    UnsupportedOperation,
)
