"""Placeholder objects: any attribute access works, any call raises."""


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"torchvision.{self._name}: torchvision is stubbed in the kvxfer "
            "SGLang test environment"
        )

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


def module_getattr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name)
