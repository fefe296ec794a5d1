"""The launch command of docs/integrations.md, through SGLang's real entry point: the plugin
is found through the installed ``sglang.srt.plugins`` entry point and admits the backend.
Long (``make test-long``): the launcher imports far more of SGLang than the backend tests,
which check the same argument parsing inside their scheduler-like processes."""

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.long
@pytest.mark.timeout(600)
def test_launch_server_loads_the_plugin_and_admits_kvxfer():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvxfer"]
    if not eps:
        pytest.skip(
            "kvxfer is not pip-installed in this environment (its entry point comes "
            "from pyproject.toml; `make install` installs it)"
        )
    assert eps[0].value == "kvxfer.integrations.sglang.plugin:register"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            "dummy",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-transfer-backend",
            "kvxfer",
            "--help",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    choices = next(
        line for line in out.stdout.splitlines() if "--disaggregation-transfer-backend" in line
    )
    assert "kvxfer" in choices
    assert "--kvxfer-secret-file" in out.stdout
