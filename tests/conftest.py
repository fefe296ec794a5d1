"""Test-wide setup.

Every KVManager and BootstrapServer of the run shares one secret, made here per run
(``KVXFER_SECRET``, inherited by spawned children); tests that pass ``secret=`` themselves
are unaffected.

Triton kernels run under the interpreter on CPU unless the run targets CUDA
(``KVXFER_TEST_DEVICE=cuda`` on the accelerator machine; read once, in :mod:`testenv`). The variable must be set before
the first ``@triton.jit`` is evaluated, hence here, before any test module imports kernels.

A test that runs close to its timeout gets every live worker process's Python stacks written
to its stderr first (:func:`kvxfer.procs.live_workers`, :meth:`~kvxfer.procs.Worker.stacks`):
pytest-timeout shows only this process's threads, and a hang is usually in a child.
"""

import os
import secrets
import sys
import threading

import pytest
from testenv import DEVICE

os.environ.setdefault("KVXFER_SECRET", secrets.token_hex(32))

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    """The torch device the run targets (:data:`testenv.DEVICE`)."""
    return DEVICE


def _dump_workers(name: str) -> None:
    """Runs on: the watchdog's timer thread."""
    from kvxfer import procs

    for w in procs.live_workers():
        text = w.stacks()
        sys.stderr.write(f"\n[{name} near its timeout] {w.name} (pid {w.proc.pid}):\n{text}")
    sys.stderr.flush()


@pytest.fixture(autouse=True)
def _workers_dumped_before_timeout(request):
    marker = request.node.get_closest_marker("timeout")  # pytest-timeout's precedence
    if marker and marker.args:
        limit = float(marker.args[0])
    else:
        limit = float(request.config.getoption("timeout", None) or 0) or float(
            request.config.getini("timeout") or 0
        )
    if limit <= 0:
        yield
        return
    timer = threading.Timer(max(0.9 * limit, limit - 10.0), _dump_workers, (request.node.name,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
