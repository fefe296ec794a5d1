"""The device lane into CUDA VMM memory (kvxfer.engine.vmm_share), CUDA only.

Process A registers groups in a CUDA VMM range (the pools' post-capture backing, POSIX-FD
handles) and in ordinary ``cudaMalloc`` memory; process B writes into them over real UCX on
loopback. UCX reaches VMM memory only by emulated PUTs; B's device lane maps A's VMM
extents (fds over A's abstract socket) and copies into them, whatever the write's size.

Run on the GPU machine: ``KVXFER_TEST_DEVICE=cuda python -m pytest -q tests/gpu/test_vmm_lane.py``
(the CPU half of the share service: tests/engine/test_vmm_share_unit.py).
"""

import numpy as np
import pytest
import torch

from kvxfer.bench.engine_node import EngineNode
from kvxfer.procs import Worker

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(180),
]

SECRET = b"vmm-lane-secret"
L, ITEM, ITEMS = 3, 16384, 64  # kv: 6 MiB, two VMM extents (4 + 2 MiB)


BIG_ITEM, BIG_ITEMS = 1 << 20, 320  # 320 MiB: 80 VMM extents of 4 MiB, two fd batches


def groups(vmm: bool):
    return {
        "kv": {"item_lens": [ITEM] * (2 * L), "items": ITEMS, "contiguous": True, "vmm": vmm},
        "state": {"item_lens": [512], "items": 8},
        "big": {"item_lens": [BIG_ITEM], "items": BIG_ITEMS, "vmm": vmm},
    }


def cfg(name, **kw):
    return dict(secret=SECRET, name=name, connect_timeout_s=20.0, transfer_timeout_s=20.0, **kw)


def eng(config, g):
    return {"config": config, "groups": g, "device": "cuda:0"}


@pytest.fixture(scope="module")
def nodes():
    a = Worker(
        EngineNode,
        {
            "engines": {
                "vmm": eng(cfg("A-vmm"), groups(True)),
                "plain": eng(cfg("A-plain"), groups(False)),
            }
        },
        name="A",
    )
    b = Worker(
        EngineNode,
        {
            "engines": {
                "main": eng(cfg("B"), groups(False)),  # default device_min_ops
                "ucx": eng(cfg("B-ucx", device_copy="off"), groups(False)),
                "strict": eng(cfg("B-strict", refuse_emulated_destinations=True), groups(False)),
                "strict_ucx": eng(
                    cfg("B-strict-ucx", refuse_emulated_destinations=True, device_copy="off"),
                    groups(False),
                ),
            }
        },
        name="B",
    )
    try:
        ports = a.start().proxy(EngineNode).ports()
        b.start()
        pa, pb = a.proxy(EngineNode), b.proxy(EngineNode)
        conn = {}
        for key in ("main", "ucx", "strict"):
            res = pb.connect(key, "127.0.0.1", ports["vmm"])
            assert "ok" in res, res
            conn[key] = res["ok"]
        res = pb.connect("main", "127.0.0.1", ports["plain"])
        assert "ok" in res, res
        conn["plain"] = res["ok"]
        yield {"A": pa, "B": pb, "conn": conn, "ports": ports}
    finally:
        b.close()
        a.close()


def _write(nodes, key, peer, target, src, dst, seed):
    a, b = nodes["A"], nodes["B"]
    b.fill(key, "kv", seed)
    a.zero(target, "kv")
    res = b.write(key, nodes["conn"][peer], [("kv", src, dst)], b"vmm-%d" % seed)
    assert "ok" in res, res
    assert [p for _, p in a.messages(target, 1, 20.0)] == [b"vmm-%d" % seed]
    assert a.items(target, "kv", dst) == b.items(key, "kv", src), "bytes differ"
    rest = sorted(set(range(ITEMS)) - set(dst))
    assert not any(a.items(target, "kv", rest)), "bytes outside dst written"
    return res["ok"]


def test_a_one_page_write_into_vmm_takes_the_lane(nodes):
    """2L runs — far below device_min_ops — still go over the lane: UCX would emulate them."""
    st = _write(nodes, "main", "main", "vmm", [5], [17], seed=1)
    assert st["ops"] == 2 * L
    assert st["device_bytes"] == st["bytes"] == 2 * L * ITEM, st["device_lane"]
    assert st["device_lane"].startswith("active"), st["device_lane"]


def test_a_mixed_write_sends_only_its_vmm_ops_to_the_lane(nodes):
    """A 1-page request's kv page (VMM) and state slot (cudaMalloc) in one write: the kv
    runs copy on the lane, the state slot stays a cuda_ipc PUT (below device_min_ops)."""
    a, b = nodes["A"], nodes["B"]
    b.fill("main", "kv", 6)
    b.fill("main", "state", 7)
    a.zero("vmm", "kv")
    a.zero("vmm", "state")
    parts = [("kv", [9], [40]), ("state", [2], [5])]
    res = b.write("main", nodes["conn"]["main"], parts, b"mixed")
    assert "ok" in res, res
    assert [p for _, p in a.messages("vmm", 1, 20.0)] == [b"mixed"]
    assert a.items("vmm", "kv", [40]) == b.items("main", "kv", [9])
    assert a.items("vmm", "state", [5]) == b.items("main", "state", [2])
    st = res["ok"]
    assert st["device_bytes"] == 2 * L * ITEM and st["bytes"] == 2 * L * ITEM + 512, st


def test_a_region_of_many_extents_is_mapped_whole(nodes):
    """A 320 MiB VMM registration of 80 extents (its fds stream in two batches): items at
    both ends and in the middle land exactly, on the lane."""
    a, b = nodes["A"], nodes["B"]
    src, dst = [0, 1, 2], [0, BIG_ITEMS // 2, BIG_ITEMS - 1]
    b.fill("main", "big", 8)
    a.zero("vmm", "big")
    res = b.write("main", nodes["conn"]["main"], [("big", src, dst)], b"big")
    assert "ok" in res, res
    assert [p for _, p in a.messages("vmm", 1, 20.0)] == [b"big"]
    assert a.items("vmm", "big", dst) == b.items("main", "big", src)
    assert res["ok"]["device_bytes"] == res["ok"]["bytes"] == 3 * BIG_ITEM


def test_scattered_pages_into_vmm_byte_exact(nodes):
    rng = np.random.default_rng(3)
    src = rng.choice(ITEMS, 40, replace=False).tolist()
    dst = rng.choice(ITEMS, 40, replace=False).tolist()
    st = _write(nodes, "main", "main", "vmm", src, dst, seed=2)
    assert st["device_bytes"] == st["bytes"] == 40 * 2 * L * ITEM


def test_the_same_write_into_cudamalloc_memory_keeps_its_rules(nodes):
    """Into ordinary memory a small write stays on cuda_ipc PUTs (below device_min_ops)."""
    st = _write(nodes, "main", "plain", "plain", [5], [17], seed=3)
    assert st["device_bytes"] == 0 and st["bytes"] == 2 * L * ITEM


def test_without_a_lane_ucx_still_lands_every_byte(nodes):
    """device_copy="off": UCX's emulated PUTs into VMM memory — slow, but exact."""
    st = _write(nodes, "ucx", "ucx", "vmm", [1, 2, 3], [60, 0, 31], seed=4)
    assert st["device_bytes"] == 0 and st["bytes"] == 3 * 2 * L * ITEM


def test_refusing_emulated_destinations_accepts_a_mapped_vmm_pool(nodes):
    """refuse_emulated_destinations: a peer whose lane maps the VMM pool is accepted (the
    fixture connected "strict"), one without a lane is refused, naming the group."""
    st = _write(nodes, "strict", "strict", "vmm", [7], [8], seed=5)
    assert st["device_bytes"] == st["bytes"]
    res = nodes["B"].connect("strict_ucx", "127.0.0.1", nodes["ports"]["vmm"])
    assert "IncompatiblePeer" in str(res) and "'big'" in str(res), res  # (the first, sorted)
