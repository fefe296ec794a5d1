"""Test-wide setup.

Every KVManager and BootstrapServer of the run shares one secret, made here per run
(``KVXFER_SECRET``, inherited by spawned children); tests that pass ``secret=`` themselves
are unaffected.

Triton kernels run under the interpreter on CPU unless the run targets CUDA
(``KVXFER_TEST_DEVICE=cuda`` on the accelerator machine). The variable must be set before
the first ``@triton.jit`` is evaluated, hence here, before any test module imports kernels.
"""
import os
import secrets

os.environ.setdefault("KVXFER_SECRET", secrets.token_hex(32))

DEVICE = os.environ.get("KVXFER_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
