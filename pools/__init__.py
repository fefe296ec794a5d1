"""KV-cache and Mamba-state memory pools, allocators and post-capture backing."""

from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: F401
from kvxfer.pools.base import KVCache  # noqa: F401
from kvxfer.pools.cpu_copy import KvCpuCopy  # noqa: F401
from kvxfer.pools.dsa import DSATokenToKVPool  # noqa: F401
from kvxfer.pools.hybrid import HybridLinearKVPool, HybridReqToTokenPool  # noqa: F401
from kvxfer.pools.layout import KvBufferDesc, PageMajorGeometry  # noqa: F401
from kvxfer.pools.mamba import MambaPool, MambaSlotAllocator, MambaStateSpec  # noqa: F401
from kvxfer.pools.mha import MHATokenToKVPool  # noqa: F401
from kvxfer.pools.minimax import MiniMaxSparseKVPool  # noqa: F401
from kvxfer.pools.mla import MLATokenToKVPool  # noqa: F401
from kvxfer.pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool  # noqa: F401
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool  # noqa: F401
from kvxfer.pools.quantized import MHATokenToKVPoolFP4, MLATokenToKVPoolFP4  # noqa: F401
from kvxfer.pools.req_to_token import ReqToTokenPool  # noqa: F401
from kvxfer.pools.write_loc import KVWriteLoc, unwrap_write_loc  # noqa: F401
