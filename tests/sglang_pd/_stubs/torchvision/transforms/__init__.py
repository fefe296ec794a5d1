from torchvision._placeholder import module_getattr as __getattr__  # noqa: F401
from torchvision.transforms import functional, v2  # noqa: F401
