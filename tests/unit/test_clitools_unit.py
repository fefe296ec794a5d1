"""The CLI conventions every subcommand follows: --json is a switch (JSON on stdout's last
line), --json-out PATH writes a file, defaults show in --help, progress only on a TTY."""

import io
import json
import subprocess
import sys

import pytest

from kvxfer import clitools
from kvxfer.bench import kernels, offload, transfer
from kvxfer.pd_demo import bench as pd_bench
from kvxfer.pd_demo import run as demo_run

pytestmark = pytest.mark.timeout(60)


def test_json_switch_and_json_out(tmp_path, capsys):
    ap = clitools.parser("t")
    clitools.add_json_args(ap)
    a = ap.parse_args(["--json", "--json-out", str(tmp_path / "o.json")])
    clitools.emit_json(a, {"b": 1, "a": [2]})
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"a": [2], "b": 1}
    assert json.loads((tmp_path / "o.json").read_text()) == {"a": [2], "b": 1}
    quiet = ap.parse_args([])
    clitools.emit_json(quiet, {"x": 1})
    assert capsys.readouterr().out == ""


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_only_on_a_tty():
    tty, pipe = _Tty(), io.StringIO()
    with clitools.Progress(2, "x", stream=tty) as p:
        p.step("one")
        p.step("two")
    assert "[1/2] x: one" in tty.getvalue() and "[2/2] x: two" in tty.getvalue()
    assert tty.getvalue().endswith("\r")  # the line is cleared at the end
    with clitools.Progress(2, "x", stream=pipe) as p:
        p.step("one")
    with clitools.Progress(2, "x", stream=_Tty(), enabled=False) as p:  # --json
        p.step("one")
    assert pipe.getvalue() == ""


@pytest.mark.parametrize(
    "cmd",
    [
        ["info"],
        ["demo"],
        ["bench", "transfer"],
        ["bench", "pd"],
        ["bench", "offload"],
        ["bench", "kernels"],
    ],
)
def test_every_command_has_the_json_flags_and_defaults_in_help(cmd):
    out = subprocess.run(
        [sys.executable, "-m", "kvxfer", *cmd, "--help"], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "[--json]" in text and "--json-out PATH" in text
    assert cmd == ["info"] or "(default:" in text  # info has no defaults to show


def test_json_is_a_switch_everywhere():
    for mod in (transfer, pd_bench, demo_run, offload, kernels):
        src = open(mod.__file__).read()
        assert '"--json", default' not in src and "clitools.add_json_args" in src
