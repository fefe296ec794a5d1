"""kvxfer.memtune (KVXFER_MALLOC=keep): freed blocks of a few MiB are reused without being
faulted in again, once asked for and only then. Each case runs in a fresh interpreter: the
setting is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kvxfer.config import malloc_policy
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(60)

#: prints the minor page faults of 10 rounds of allocating and touching 24 blocks of 1 MiB,
#: then freeing them (as a large write's planning does)
PROBE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from kvxfer import memtune
    if sys.argv[1] == "keep":
        print(memtune.keep_heap(), memtune.keep_heap(), memtune.status())
    else:
        print(memtune.status())
    def round():
        blocks = [np.ones(1 << 20, dtype=np.uint8) for _ in range(24)]
        del blocks
    round()  # (the first round faults in either case)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        round()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _probe(mode: str):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    first, faults = out.stdout.strip().splitlines()
    return first, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_heap_reuses_freed_blocks_without_faulting_them_in_again():
    status, kept = _probe("keep")
    assert status == "kept kept kept"  # once, idempotent
    default_status, default = _probe("default")
    assert default_status == "None"  # nothing changes unless asked
    pages = 10 * 24 * (1 << 20) // 4096
    assert default > pages // 2  # each round faulted its blocks in again
    assert kept < pages // 20  # reused


def test_policy_values(monkeypatch):
    monkeypatch.delenv("KVXFER_MALLOC", raising=False)
    assert malloc_policy() == "default"
    monkeypatch.setenv("KVXFER_MALLOC", " KEEP ")
    assert malloc_policy() == "keep"
    monkeypatch.setenv("KVXFER_MALLOC", "always")
    with pytest.raises(InvalidArgument, match="KVXFER_MALLOC"):
        malloc_policy()


def test_an_engine_refuses_a_bad_value_before_it_starts(monkeypatch):
    import asyncio

    from kvxfer.config import EngineConfig
    from kvxfer.engine.engine import TransferEngine

    monkeypatch.setenv("KVXFER_MALLOC", "always")
    eng = TransferEngine(EngineConfig(secret=b"memtune"))
    with pytest.raises(InvalidArgument, match="KVXFER_MALLOC"):
        asyncio.run(eng.start())
    assert eng.transport is None and eng._state == "new"


def test_info_says_what_an_engine_would_do(monkeypatch):
    from kvxfer.info import _malloc

    monkeypatch.delenv("KVXFER_MALLOC", raising=False)
    assert _malloc().startswith("default")
    monkeypatch.setenv("KVXFER_MALLOC", "keep")
    assert _malloc().startswith("keep")
    monkeypatch.setenv("KVXFER_MALLOC", "bad")
    assert _malloc().startswith("invalid")
