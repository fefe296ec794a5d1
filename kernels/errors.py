"""The one exception hierarchy of kvxfer, rooted at the lowest layer.

It lives in ``kernels`` only because every package may import downwards; users import
these names from :mod:`kvxfer.errors`, which re-exports them and adds the transfer errors.
User-caused problems raise one of these; ``assert`` is kept for internal invariants.
"""


class KvxferError(Exception):
    """Root of every error kvxfer raises on purpose."""


class InvalidArgument(KvxferError, ValueError):
    """An argument is malformed or inconsistent (shape, dtype, layout, size)."""


class IndexOutOfRange(InvalidArgument, IndexError):
    """A slot, page, row or item id falls outside what was allocated or registered."""


class ShapeMismatch(InvalidArgument):
    """Two things that must agree (shapes, dtypes, layouts, pool geometry) do not."""


class DoubleFree(InvalidArgument):
    """An id was returned to its allocator while already free."""


class OutOfMemory(KvxferError, MemoryError):
    """A bounded pool or allocator cannot satisfy the request."""


class UnsupportedOperation(KvxferError, NotImplementedError):
    """The operation is not available for this pool, layout or device."""


class BackingError(KvxferError):
    """Reserving, committing or releasing physical backing failed."""


class CudaError(KvxferError):
    """A CUDA driver call failed, or there is no driver to make it (see
    :mod:`kvxfer.kernels.cuda_driver`). ``code`` is the CUresult, ``CudaError.NO_DRIVER`` when
    cuda-bindings or the driver library is missing."""

    NO_DRIVER = -1

    def __init__(self, what: str, code: int, detail: str = "") -> None:
        super().__init__(f"{what} failed: {detail or f'CUresult {code}'}")
        self.code = code
