"""KV-cache and Mamba-state memory pools, allocators and post-capture backing."""
from pools.base import KVCache  # noqa: F401
from pools.cpu_copy import KvCpuCopy  # noqa: F401
from pools.layout import KvBufferDesc, PageMajorGeometry  # noqa: F401
from pools.mha import MHATokenToKVPool  # noqa: F401
from pools.mla import MLATokenToKVPool  # noqa: F401
from pools.noop import MHATokenToKOnlyPool, NoOpMHATokenToKVPool  # noqa: F401
from pools.page_major import PageMajorMHATokenToKVPool  # noqa: F401
