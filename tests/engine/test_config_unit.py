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


@pytest.mark.parametrize(
    "text,cpus",
    [
        ("max 100000", None),
        ("200000 100000", 2.0),
        ("150000 100000", 1.5),
        ("50000 100000", 0.5),
        ("", None),
        ("max", None),
        ("x 100000", None),
        ("-1 100000", None),
        ("100 0", None),
    ],
)
def test_parse_cpu_max(text, cpus):
    from kvxfer.config import parse_cpu_max

    assert parse_cpu_max(text) == cpus


@pytest.mark.parametrize(
    "quota,period,cpus",
    [
        ("-1", "100000", None),
        ("400000", "100000", 4.0),
        ("25000", "100000", 0.25),
        ("0", "100000", None),
        ("x", "100000", None),
        ("100000", "0", None),
    ],
)
def test_parse_cfs(quota, period, cpus):
    from kvxfer.config import parse_cfs

    assert parse_cfs(quota, period) == cpus


def _cgroup_tree(tmp_path, self_lines, files):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "self_cgroup"
    proc.write_text("\n".join(self_lines) + "\n")
    root = tmp_path / "cg"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(root), str(proc)


def test_cgroup_cpu_limit_v2_own_path_and_top(tmp_path):
    from kvxfer.config import cgroup_cpu_limit

    # the process's own cgroup limited to 3 CPUs, the top unlimited: 3
    root, proc = _cgroup_tree(
        tmp_path, ["0::/pods/a"], {"pods/a/cpu.max": "300000 100000", "cpu.max": "max 100000"}
    )
    assert cgroup_cpu_limit(root, proc) == 3.0
    # a container's namespace: its cgroup appears as the top
    root, proc = _cgroup_tree(tmp_path / "ns", ["0::/"], {"cpu.max": "250000 100000"})
    assert cgroup_cpu_limit(root, proc) == 2.5
    # none anywhere, or no such files, or no /proc/self/cgroup
    root, proc = _cgroup_tree(tmp_path / "free", ["0::/x"], {"x/cpu.max": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(str(tmp_path / "nothing"), proc) is None
    assert cgroup_cpu_limit(root, str(tmp_path / "no_such_file")) is None


def test_cgroup_cpu_limit_v1(tmp_path):
    from kvxfer.config import cgroup_cpu_limit

    root, proc = _cgroup_tree(
        tmp_path,
        ["4:memory:/m", "2:cpu,cpuacct:/docker/c1", "1:name=systemd:/"],
        {
            "cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "600000",
            "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 6.0
    # the box's own layout: "cpu" mounted alone, quota -1 (no limit)
    root, proc = _cgroup_tree(
        tmp_path / "box",
        ["1:cpu:/", "0::/"],
        {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
    )
    assert cgroup_cpu_limit(root, proc) is None


def test_usable_cpus_capped_by_the_cgroup_limit(monkeypatch):
    import kvxfer.config as c

    monkeypatch.setattr(c.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(c, "cgroup_cpu_limit", lambda: None)
    assert c.usable_cpus() == 16
    monkeypatch.setattr(c, "cgroup_cpu_limit", lambda: 2.5)
    assert c.usable_cpus() == 3
    monkeypatch.setattr(c, "cgroup_cpu_limit", lambda: 0.25)
    assert c.usable_cpus() == 1
    monkeypatch.setattr(c, "cgroup_cpu_limit", lambda: 64.0)
    assert c.usable_cpus() == 16
