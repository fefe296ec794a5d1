from torchvision._placeholder import module_getattr as __getattr__  # noqa: F401
from torchvision.transforms.v2 import functional  # noqa: F401
