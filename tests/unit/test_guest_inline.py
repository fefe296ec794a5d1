"""kvxfer.transport.ucx's defaults for the inline flush wait of a chain a scheduler's thread
starts as a loop's guest (docs/engine.md, "Inline wait"): how long (``guest_inline_us``) and
whether it yields the CPU while the worker is idle (``inline_yield``: on small hosts)."""

import os

import pytest

from kvxfer.transport import ucx

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("cpus", [1, 2, 4, 16])
def test_the_wait_is_the_same_on_every_host(monkeypatch, cpus):
    monkeypatch.delenv("KVXFER_GUEST_INLINE_US", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert ucx.guest_inline_us() == ucx.CHAIN_INLINE_US


def test_environment_sets_the_wait(monkeypatch):
    monkeypatch.setenv("KVXFER_GUEST_INLINE_US", "25")
    assert ucx.guest_inline_us() == 25.0
    monkeypatch.setenv("KVXFER_GUEST_INLINE_US", "0")
    assert ucx.guest_inline_us() == 0.0


@pytest.mark.parametrize("cpus, want", [(1, True), (2, True), (3, True), (4, False), (16, False)])
def test_yield_follows_the_usable_cpus(monkeypatch, cpus, want):
    monkeypatch.delenv("KVXFER_INLINE_YIELD", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert ucx.inline_yield() is want


def test_environment_sets_the_yield(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setenv("KVXFER_INLINE_YIELD", "0")
    assert ucx.inline_yield() is False
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("KVXFER_INLINE_YIELD", "1")
    assert ucx.inline_yield() is True


def test_without_affinity_the_cpu_count_decides(monkeypatch):
    monkeypatch.delenv("KVXFER_INLINE_YIELD", raising=False)

    def no_affinity(pid):
        raise OSError("not here")

    monkeypatch.setattr(os, "sched_getaffinity", no_affinity)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert ucx.inline_yield() is False
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert ucx.inline_yield() is True
