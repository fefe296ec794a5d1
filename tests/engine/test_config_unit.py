"""EngineConfig validation and the flush-progress choice (torch- and UCX-free)."""

import itertools

import pytest

from kvxfer.config import FLUSH_PROGRESS, OWN_WORKER, EngineConfig, own_worker, spin_flushes
from kvxfer.errors import InvalidArgument

pytestmark = pytest.mark.timeout(30)


def test_flush_progress_default_and_validation():
    assert EngineConfig(secret=b"s").flush_progress in FLUSH_PROGRESS
    assert EngineConfig(secret=b"s", flush_progress="spin").flush_progress == "spin"
    with pytest.raises(InvalidArgument, match="flush_progress"):
        EngineConfig(secret=b"s", flush_progress="busy")
    with pytest.raises(InvalidArgument, match="progress_mode"):
        EngineConfig(secret=b"s", progress_mode="polling")


@pytest.mark.parametrize(
    "local,remote,auto",
    [
        ({"host"}, ["host", "host"], False),
        ({"host", "cuda"}, ["host"], True),
        ({"host"}, ["cuda"], True),
        (set(), [], False),
    ],
)
def test_spin_flushes(local, remote, auto):
    assert spin_flushes("auto", local, remote) is auto
    assert spin_flushes("spin", local, remote) is True
    assert spin_flushes("event", local, remote) is False


def test_slice_staging_validation():
    c = EngineConfig(secret=b"s")
    assert c.stage_slice_min_ops == 0 and c.stage_groups is None
    c = EngineConfig(secret=b"s", stage_slice_min_ops=256, stage_groups=["kv"])
    assert c.stage_slice_min_ops == 256 and c.stage_groups == ("kv",)
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(InvalidArgument, match="stage_slice_min_ops"):
            EngineConfig(secret=b"s", stage_slice_min_ops=bad)
    for bad in ("kv", [1], ("kv", None)):
        with pytest.raises(InvalidArgument, match="stage_groups"):
            EngineConfig(secret=b"s", stage_groups=bad)


def test_device_small_ops_and_notify_order():
    c = EngineConfig(secret=b"s")
    assert c.device_small_ops == 0 and c.notify_order is True
    assert EngineConfig(secret=b"s", notify_order=False).notify_order is False
    with pytest.raises(InvalidArgument, match="notify_order"):
        EngineConfig(secret=b"s", notify_order=0)
    with pytest.raises(InvalidArgument, match="device_small_ops"):
        EngineConfig(secret=b"s", device_small_ops=-1)


@pytest.mark.parametrize(
    "setting,mode,device", list(itertools.product(OWN_WORKER, ("peer", "none"), (False, True)))
)
def test_own_worker(setting, mode, device):
    want = setting == "auto" and (mode == "none" or device)
    assert own_worker(setting, mode, device) is want


def test_own_worker_config(monkeypatch):
    from kvxfer import config

    assert EngineConfig(secret=b"s").own_worker in OWN_WORKER
    assert EngineConfig(secret=b"s", own_worker="off").own_worker == "off"
    with pytest.raises(InvalidArgument, match="own_worker"):
        EngineConfig(secret=b"s", own_worker="yes")
    for raw, want in (("1", "auto"), ("0", "off"), ("Auto", "auto"), ("off", "off")):
        monkeypatch.setenv("KVXFER_OWN_WORKER", raw)
        config.env_defaults.cache_clear()
        try:
            assert EngineConfig(secret=b"s").own_worker == want
        finally:
            config.env_defaults.cache_clear()


def test_device_min_bytes(monkeypatch):
    from kvxfer import config

    assert EngineConfig(secret=b"s").device_min_bytes == config.DEVICE_MIN_BYTES
    assert EngineConfig(secret=b"s", device_min_bytes=1 << 20).device_min_bytes == 1 << 20
    with pytest.raises(InvalidArgument, match="device_min_bytes"):
        EngineConfig(secret=b"s", device_min_bytes=-1)
    monkeypatch.setenv("KVXFER_DEVICE_MIN_BYTES", "4194304")
    config.env_defaults.cache_clear()
    try:
        assert EngineConfig(secret=b"s").device_min_bytes == 4 << 20
    finally:
        monkeypatch.undo()
        config.env_defaults.cache_clear()
