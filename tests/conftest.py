"""Test-wide setup.

Triton kernels run under the interpreter on CPU unless the run targets CUDA
(``KVXFER_TEST_DEVICE=cuda`` on the accelerator machine). The variable must be set before
the first ``@triton.jit`` is evaluated, hence here, before any test module imports kernels.
"""
import os

DEVICE = os.environ.get("KVXFER_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
