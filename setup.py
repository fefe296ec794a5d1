"""Build of the native RMA extension (kvxfer.transport._rma) against the installed libucx.

The extension is a small C module over libucp; the headers and libraries come from the
``libucx`` wheel (a dependency of ucxx). Everything else is declared in pyproject.toml.
"""
import os

from setuptools import Extension, setup


def _libucx_prefix():
    try:
        import libucx
    except ImportError as exc:  # pragma: no cover - build-time guidance
        raise SystemExit(
            "building kvxfer needs the libucx wheel first (pip install ucxx-cu12), "
            "then `pip install --no-build-isolation .`"
        ) from exc
    return os.path.dirname(libucx.__file__)


def _extensions():
    src = os.path.join("kvxfer", "transport", "_rma.c")
    if not os.path.exists(src):
        return []
    prefix = _libucx_prefix()
    return [
        Extension(
            "kvxfer.transport._rma",
            sources=[src],
            include_dirs=[os.path.join(prefix, "include")],
            library_dirs=[os.path.join(prefix, "lib")],
            libraries=["ucp", "ucs"],
            # libucp is loaded by `import ucxx` (libucx.load_library) before this module;
            # the rpath is a fallback for standalone use.
            runtime_library_dirs=[os.path.join(prefix, "lib")],
            extra_compile_args=["-O2", "-Wall", "-std=c11"],
        )
    ]


setup(ext_modules=_extensions())
