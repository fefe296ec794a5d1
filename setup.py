"""Build of the native RMA extension (kvxfer.transport._rma) against libucx, and the package map.

The repository keeps three top-level folders (``kvxfer/``, ``pools/``, ``kernels/``); the
distribution installs one top-level name: ``kvxfer``, ``kvxfer.pools``, ``kvxfer.kernels``.

The extension is a small C module over libucp. Its headers come from the ``libucx`` wheel
(a build requirement, so ``pip install .`` / ``pip wheel .`` work with build isolation). At run
time libucp is the one the installed ucxx loads (``import ucxx`` comes first, see
``kvxfer.transport.ucx_lib.load_ucx``); the only RUNPATH is relative to the installed module
(``$ORIGIN/../../libucx/lib``), never a path of the build machine.
"""

import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

PACKAGE_DIR = {"kvxfer": "kvxfer", "kvxfer.pools": "pools", "kvxfer.kernels": "kernels"}


def _packages():
    out = []
    for name, folder in PACKAGE_DIR.items():
        out.append(name)
        out += [f"{name}.{sub}" for sub in find_packages(folder)]
    return out


def _libucx_prefix():
    try:
        import libucx
    except ImportError as exc:  # pragma: no cover - build-time guidance
        raise SystemExit(
            "building kvxfer needs the libucx headers: `pip install .` gets them through the "
            "build requirements; without build isolation install libucx-cu12 or libucx-cu13 "
            "first"
        ) from exc
    return os.path.dirname(libucx.__file__)


class _BuildExt(build_ext):
    """Drop absolute ``-rpath`` flags the interpreter's own link flags may carry (e.g. a
    pyenv prefix), so the module's only RUNPATH is the relative one below."""

    def build_extensions(self):
        linker = getattr(self.compiler, "linker_so", None)
        if linker:
            self.compiler.linker_so = [
                a for a in linker if not (a.startswith("-Wl,-rpath,/") or a.startswith("-R/"))
            ]
        super().build_extensions()


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
            extra_compile_args=["-O2", "-Wall", "-std=c11"],
            extra_link_args=["-Wl,-rpath,$ORIGIN/../../libucx/lib"],
        )
    ]


setup(
    packages=_packages(),
    package_dir=PACKAGE_DIR,
    ext_modules=_extensions(),
    cmdclass={"build_ext": _BuildExt},
)
