"""Device selection and tensors over raw backed memory, without copying.

- :func:`make_provider`: "cpu" -> host mmap backing, "cuda[:i]" -> CUDA VMM backing.
- :func:`tensor_over`: a uint8 tensor aliasing ``[address, address + nbytes)`` -- on the host a
  ctypes buffer over the mapping handed to ``torch.frombuffer``, on CUDA an object exposing
  ``__cuda_array_interface__`` handed to ``torch.as_tensor``. Either way the tensor keeps the
  backing object referenced, so a forgotten backing is released only after its last tensor.
  On CUDA the first byte must be backed (torch asks the driver which device owns the pointer).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence, Union

import torch

from kvxfer.kernels.errors import BackingError, InvalidArgument, UnsupportedOperation

from .base import Backing, BackingProvider

__all__ = ["make_provider", "cuda_index", "tensor_over"]


def cuda_index(dev: torch.device) -> int:
    """The CUDA ordinal of ``dev``; BackingError when torch cannot use CUDA here."""
    if not torch.cuda.is_available():
        raise BackingError(
            f"{dev}: torch has no usable CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    return dev.index if dev.index is not None else torch.cuda.current_device()


def make_provider(
    device: Union[str, torch.device], *, handle_types: Optional[Sequence[str]] = None
) -> BackingProvider:
    """The backing provider for ``device`` ("cpu" -> host mmap, "cuda[:i]" -> CUDA VMM)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        if handle_types is not None:
            raise InvalidArgument(f"handle_types applies to CUDA devices only, got {handle_types}")
        from .host import HostBackingProvider

        return HostBackingProvider()
    if dev.type == "cuda":
        from .cuda import HANDLE_TYPE_ORDER, CudaVmmProvider

        return CudaVmmProvider(cuda_index(dev), handle_types=handle_types or HANDLE_TYPE_ORDER)
    raise UnsupportedOperation(f"post-capture backing is not available on device {dev}")


def _host_bytes(address: int, nbytes: int, keepalive: Backing) -> torch.Tensor:
    """A uint8 tensor over ``[address, address + nbytes)`` of host memory, no copy.

    The ctypes buffer object keeps ``keepalive`` referenced, and the tensor keeps the buffer
    object, so the mapping outlives every tensor unless it is closed explicitly.
    """

    class _Mapped(ctypes.c_uint8 * nbytes):  # a subclass so the instance takes attributes
        pass

    buf = _Mapped.from_address(address)
    buf.keepalive = keepalive
    return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes)


class _CudaArray:
    """Exposes ``__cuda_array_interface__`` for a raw device range; keeps its backing alive."""

    def __init__(self, address: int, nbytes: int, keepalive: Backing) -> None:
        self.keepalive = keepalive
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(address), False),
            "strides": None,
            "version": 3,
        }


def tensor_over(
    device: torch.device, address: int, nbytes: int, keepalive: Backing
) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` aliasing ``address`` on ``device`` (no copy)."""
    if device.type == "cpu":
        return _host_bytes(address, nbytes, keepalive)
    return torch.as_tensor(_CudaArray(address, nbytes, keepalive), device=device)
