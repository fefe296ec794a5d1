"""The demo, the PD benchmark and the transfer benchmark keep test-only code out of their
import path: importing them never loads :mod:`kvxfer.testing`."""

import subprocess
import sys

MODULES = (
    "kvxfer.demo",
    "kvxfer.pd_demo",
    "kvxfer.pd_demo.bench",
    "kvxfer.pd_demo.hf_run",
    "kvxfer.pd_demo.hf_worker",
    "kvxfer.bench",
    "kvxfer.bench.transfer",
    "kvxfer.bench.pd",
)


def test_demo_and_bench_do_not_import_testing():
    code = (
        "import importlib, sys\n"
        f"for m in {MODULES!r}:\n"
        "    importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvxfer.testing')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
