"""Test-wide setup.

Every KVManager and BootstrapServer of the run shares one secret, made here per run
(``KVXFER_SECRET``, inherited by spawned children); tests that pass ``secret=`` themselves
are unaffected.

Triton kernels run under the interpreter on CPU unless the run targets CUDA
(``KVXFER_TEST_DEVICE=cuda`` on the accelerator machine; read once, in :mod:`testenv`). The variable must be set before
the first ``@triton.jit`` is evaluated, hence here, before any test module imports kernels.
"""

import os
import secrets

import pytest
from testenv import DEVICE

os.environ.setdefault("KVXFER_SECRET", secrets.token_hex(32))

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """The torch device the run targets (:data:`testenv.DEVICE`)."""
    return DEVICE
