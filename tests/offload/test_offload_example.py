"""The retract/restore example runs end to end (it verifies every byte itself)."""

import importlib.util
import os

import pytest
from offload_helpers import DEVICE

pytestmark = pytest.mark.timeout(120)
_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "retract_restore.py")


@pytest.mark.parametrize("kind", ["hybrid", "page_major"])
def test_retract_restore_example(kind, capsys):
    spec = importlib.util.spec_from_file_location("retract_restore_example", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--kind", kind, "--device", DEVICE, "--requests", "20"]) == 0
    out = capsys.readouterr().out
    assert "verified byte for byte; host pool empty" in out
    assert " 0 restores" not in out and " 0 retractions" not in out
