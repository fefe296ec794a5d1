"""kvxfer.transport.ucx.guest_inline_us: the inline flush wait of a chain a scheduler's
thread starts as a loop's guest (docs/engine.md, "Inline wait")."""

import os

import pytest

from kvxfer.transport import ucx

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "cpus, want",
    [(1, 0.0), (2, 0.0), (3, 0.0), (4, ucx.CHAIN_INLINE_US), (16, ucx.CHAIN_INLINE_US)],
)
def test_default_follows_the_usable_cpus(monkeypatch, cpus, want):
    monkeypatch.delenv("KVXFER_GUEST_INLINE_US", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert ucx.guest_inline_us() == want


def test_environment_wins(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setenv("KVXFER_GUEST_INLINE_US", "25")
    assert ucx.guest_inline_us() == 25.0
    monkeypatch.setenv("KVXFER_GUEST_INLINE_US", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert ucx.guest_inline_us() == 0.0


def test_without_affinity_the_cpu_count_decides(monkeypatch):
    monkeypatch.delenv("KVXFER_GUEST_INLINE_US", raising=False)

    def no_affinity(pid):
        raise OSError("not here")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert ucx.guest_inline_us() == ucx.CHAIN_INLINE_US
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert ucx.guest_inline_us() == 0.0
