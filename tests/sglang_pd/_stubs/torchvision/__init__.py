"""Import-time stand-in for torchvision in the SGLang test environment only.

SGLang's config package imports ``torchvision.transforms`` at module level (multimodal
preprocessing). The only torchvision wheels on PyPI link libtorch_cuda and cannot load next
to a CPU torch; the kvxfer tests never run multimodal code. Every attribute is a placeholder
that raises if called. tests/sglang_pd/conftest.py puts this on sys.path only when no real
torchvision imports.
"""

__version__ = "0.0+stub"
from torchvision import transforms  # noqa: E402,F401
from torchvision._placeholder import module_getattr as __getattr__  # noqa: E402,F401
