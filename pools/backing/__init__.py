"""Post-capture backing: reserve address space now, back it physically later.

- :mod:`.base` -- the contract (:class:`Backing`, :class:`BackingProvider`), torch-free;
- :mod:`.host` -- ``mmap`` reserve / ``mprotect`` commit (any Linux machine);
- :mod:`.cuda` -- CUDA VMM through cuda-bindings (imported on first use);
- :mod:`.memory` -- device selection, tensors over raw memory without copying;
- :mod:`.owner` -- :class:`BackedBuffers`, what a pool uses: one tensor per
  :class:`~kvxfer.pools.layout.KvBufferDesc`, page 0 backed at once, ``finalize(n)`` later.
"""

from .base import Backing, BackingProvider
from .memory import make_provider
from .owner import BackedBuffers

__all__ = ["Backing", "BackingProvider", "BackedBuffers", "make_provider"]
