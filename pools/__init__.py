"""KV-cache and Mamba-state memory pools, allocators and post-capture backing."""
from pools.base import KVCache  # noqa: F401
from pools.cpu_copy import KvCpuCopy  # noqa: F401
from pools.layout import KvBufferDesc, PageMajorGeometry  # noqa: F401
from pools.mha import MHATokenToKVPool  # noqa: F401
from pools.mla import MLATokenToKVPool  # noqa: F401
from pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool  # noqa: F401
from pools.page_major import PageMajorMHATokenToKVPool  # noqa: F401
from pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: F401
from pools.req_to_token import ReqToTokenPool  # noqa: F401
from pools.mamba import MambaPool, MambaSlotAllocator, MambaStateSpec  # noqa: F401
from pools.hybrid import HybridLinearKVPool, HybridReqToTokenPool  # noqa: F401
from pools.write_loc import KVWriteLoc, unwrap_write_loc  # noqa: F401
from pools.quantized import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4  # noqa: F401
from pools.dsa import DSATokenToKVPool  # noqa: F401
from pools.minimax import MiniMaxSparseKVPool  # noqa: F401
