"""Backend selection for the kernel launchers.

Every launcher takes ``backend: str = "auto"``:

* ``"auto"``   -> the backend forced by :func:`force_backend` if one is active, otherwise
  Triton when the tensors live on a CUDA device and the torch reference elsewhere;
* ``"triton"`` -> the Triton kernel (on CPU tensors this needs the Triton interpreter,
  i.e. ``TRITON_INTERPRET=1`` set before :mod:`kvxfer.kernels` was first imported);
* ``"torch"``  -> the plain-torch reference.

The override set by :func:`force_backend` is process-global (not thread-local): it is
meant for tests and benchmarks, not for steering production code paths.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvxfer.kernels.errors import InvalidArgument, UnsupportedOperation

BACKENDS = ("auto", "triton", "torch")

_forced: str | None = None


def _validate(name: str) -> str:
    if name not in BACKENDS:
        raise InvalidArgument(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    return name


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Make ``backend="auto"`` resolve to ``name`` inside the ``with`` block.

    ``name`` is ``"triton"``, ``"torch"`` or ``"auto"`` (the latter restores device-based
    selection inside an outer override). Explicit ``backend=`` arguments still win.
    """
    global _forced
    _validate(name)
    previous = _forced
    _forced = None if name == "auto" else name
    try:
        yield
    finally:
        _forced = previous


def forced_backend() -> str | None:
    """The backend currently forced by :func:`force_backend`, or ``None``."""
    return _forced


def resolve(backend: str, device: torch.device) -> str:
    """Turn a ``backend`` argument into ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    _validate(backend)
    if backend == "auto":
        if _forced is not None:
            return _forced
        return "triton" if device.type == "cuda" else "torch"
    return backend


def is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was decorated while the Triton interpreter was active."""
    return type(kernel).__name__ == "InterpretedFunction"


def require_runnable(kernel: object, device: torch.device) -> None:
    """Raise unless ``kernel`` can run on tensors of ``device``."""
    if device.type == "cuda" or is_interpreted(kernel):
        return
    raise UnsupportedOperation(
        f"the Triton backend cannot run on {device.type} tensors unless the Triton "
        "interpreter is active (TRITON_INTERPRET=1 before importing kernels); "
        'use backend="torch" or move the tensors to a CUDA device'
    )


def launch_context(device: torch.device) -> contextlib.AbstractContextManager:
    """Context that makes ``device`` current for a launch (a no-op off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
