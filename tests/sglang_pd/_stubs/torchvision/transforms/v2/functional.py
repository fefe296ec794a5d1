from torchvision._placeholder import module_getattr as __getattr__  # noqa: F401
