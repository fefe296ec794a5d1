"""The temporary pools demo (`kvxfer demo`) runs its checks and prints the descriptor table."""

import pytest

from kvxfer import demo

pytestmark = pytest.mark.timeout(60)


def test_pools_summary_runs_every_check():
    text = demo.pools_summary(size=32, page_size=8, layers=2)
    assert "all checks passed" in text
    page_major = next(line for line in text.splitlines() if line.startswith("MHA page-major"))
    per_layer = next(line for line in text.splitlines() if line.startswith("MHA per-layer "))
    assert page_major.split()[3] == "1" and per_layer.split()[3] == "4"  # entries column
    assert text.count("host copy") == 5


def test_main_prints_and_returns_zero(capsys):
    assert demo.main(["--pools", "--dtype", "float16"]) == 0
    assert "MLA latent" in capsys.readouterr().out
