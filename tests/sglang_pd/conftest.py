"""SGLang integration tests: they run where ``sglang`` is importable (``make test-sglang``
builds that environment, see requirements.txt); elsewhere every test here is skipped with
that reason. The torchvision stand-in (_stubs/) goes on sys.path only in an environment
that has sglang and no working torchvision; spawned children inherit sys.path."""

import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if importlib.util.find_spec("sglang") is not None:
    try:
        import torchvision  # noqa: F401
    except Exception:  # absent, or a CUDA wheel next to a CPU torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.path.insert(0, os.path.join(HERE, "_stubs"))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
