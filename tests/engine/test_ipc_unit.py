"""Detection of CUDA memory UCX can only reach by emulated PUTs (VMM, not legacy-IPC
capable): the decision logic with the driver query injected (no GPU needed), the warning,
the Layout field and the refuse_emulated_destinations handshake check."""

import logging

import pytest
from testenv import DEVICE

from kvxfer import plan, wire
from kvxfer.config import EngineConfig
from kvxfer.engine import handshake, ipc
from kvxfer.engine import messages as m
from kvxfer.engine.groups import LocalGroups, parse_remote
from kvxfer.errors import IncompatiblePeer, InvalidArgument, ProtocolError
from kvxfer.transport.base import Region, Transport

pytestmark = pytest.mark.timeout(30)

VMM = {0x7000_0000, 0x7100_0000}  # "cuMemCreate" pointers in these tests


def query(addr):
    return None if addr == 0x7F00_0000 else addr not in VMM


def groups():
    return {
        "kv": plan.make_group("kv", [0x6000_0000, 0x7000_0000], [4096, 4096], [64, 64]),
        "state": plan.make_group("state", [0x6800_0000], [1024], [128]),
        "aux": plan.make_group("aux", [0x1000], [640], [64]),
        "odd": plan.make_group("odd", [0x7F00_0000], [64], [64]),
    }


def test_report_per_group():
    kinds = {"kv": ["cuda", "cuda"], "state": ["cuda"], "aux": ["host"], "odd": ["cuda"]}
    asked = []
    rep = ipc.ipc_report(groups(), kinds, lambda a: asked.append(a) or query(a))
    assert rep == {"kv": False, "state": True, "aux": None, "odd": None}
    assert 0x1000 not in asked  # host memory never reaches the driver
    assert ipc.non_ipc(rep) == ["kv"]


def test_loud_warning_names_group_and_share_path(caplog):
    with caplog.at_level(logging.WARNING, logger="kvxfer.engine.ipc"):
        assert ipc.warn_non_ipc({"kv": False, "state": True, "aux": None}) == ["kv"]
    text = caplog.text
    assert "'kv'" in text and "pools/backing/share.py" in text and "'state'" not in text


class _Region(Region):
    def __init__(self, addr, length, mem_type):
        self.addr, self.length, self.mem_type, self.handle = addr, length, mem_type, 1

    def packed_key(self):
        return b"k"

    def release(self):
        pass


class _Registrar(Transport):
    """Registration only (no data moves): reports addresses >= 0x6000_0000 as CUDA."""

    def register(self, addr, length):
        return _Region(addr, length, "cuda" if addr >= 0x6000_0000 else "host")

    async def listen(self, *a):  # pragma: no cover - unused
        raise NotImplementedError

    async def connect(self, *a):  # pragma: no cover
        raise NotImplementedError

    def local_address(self):  # pragma: no cover
        return b""

    async def rma_endpoint(self, *a):  # pragma: no cover
        raise NotImplementedError

    async def close(self):  # pragma: no cover
        pass


def frozen(gs, q=query):
    local = LocalGroups()
    for name, g in gs.items():
        local.add(name, g.ptrs, g.lens, g.item_lens)
    local.freeze(_Registrar(), ipc_query=q)
    return local


def test_freeze_fills_the_report_and_layout_carries_it(caplog):
    with caplog.at_level(logging.WARNING, logger="kvxfer.engine.ipc"):
        local = frozen({k: v for k, v in groups().items() if k != "odd"})
    assert local.ipc == {"kv": False, "state": True, "aux": None}
    assert "'kv'" in caplog.text
    msg = wire.decode(handshake._layout(local, b"addr", {}))
    assert msg.non_ipc == ["kv"]
    host_only = frozen({"aux": groups()["aux"]}, q=lambda a: pytest.fail("driver queried"))
    assert host_only.ipc == {"aux": None}
    assert wire.decode(handshake._layout(host_only, b"", {})).non_ipc is None


@pytest.mark.parametrize(
    "same_host,refuse,ours,theirs,error",
    [
        (True, True, ["kv"], [], "this side's memory"),
        (True, True, [], ["kv"], "the peer's memory"),
        (True, True, ["only_here"], ["only_there"], None),  # groups not shared: never written
        (True, False, ["kv"], ["kv"], None),  # off: warn only
        (False, True, ["kv"], ["kv"], None),  # other host: no cuda_ipc anyway
    ],
)
def test_refuse_emulated_destinations(same_host, refuse, ours, theirs, error):
    local_g, remote_g = ["kv", "only_here"], ["kv", "only_there"]
    if error is None:
        ipc.check_destinations(local_g, remote_g, ours, theirs, same_host, refuse)
        return
    with pytest.raises(IncompatiblePeer, match=error) as ei:
        ipc.check_destinations(local_g, remote_g, ours, theirs, same_host, refuse)
    assert "'kv'" in str(ei.value) and "share.py" in str(ei.value)


def test_handshake_check_reads_the_peer_layout():
    import socket

    local = frozen({"aux": groups()["aux"]})
    lay = m.Layout(
        groups={"aux": {"ptrs": [0x1000], "lens": [640], "item_lens": [64], "regions": [0]}},
        region_bases=[0x1000],
        region_lens=[640],
        region_keys=[b"k"],
        region_types=["host"],
        non_ipc=["aux"],
    )
    remote = parse_remote(lay)
    with pytest.raises(IncompatiblePeer, match="peer's memory"):
        handshake._check_ipc(local, lay, remote, socket.gethostname(), True)
    handshake._check_ipc(local, lay, remote, "another-host", True)
    handshake._check_ipc(local, lay, remote, socket.gethostname(), False)
    bad = m.Layout(**{**lay.__dict__, "non_ipc": [3]})
    with pytest.raises(ProtocolError, match="non_ipc"):
        handshake._check_ipc(local, bad, remote, socket.gethostname(), True)


def test_config_flag_is_validated():
    assert EngineConfig(secret=b"s").refuse_emulated_destinations is False
    assert EngineConfig(secret=b"s", refuse_emulated_destinations=True)
    with pytest.raises(InvalidArgument, match="refuse_emulated_destinations"):
        EngineConfig(secret=b"s", refuse_emulated_destinations=1)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs the CUDA driver (KVXFER_TEST_DEVICE=cuda)")
def test_driver_query_on_cuda():
    """cudaMalloc memory is legacy-IPC capable; VMM (cuMemCreate) memory is not; host
    memory is not device memory (None)."""
    import numpy as np
    import torch

    from kvxfer.kernels.cuda_driver import ipc_capable as cuda_ipc_capable
    from kvxfer.pools.backing.cuda import CudaVmmProvider

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    assert cuda_ipc_capable(t.data_ptr()) is True
    assert cuda_ipc_capable(np.zeros(64, np.uint8).ctypes.data) is None
    prov = CudaVmmProvider(torch.cuda.current_device())
    try:
        b = prov.reserve(prov.granularity)
        b.commit(0, prov.granularity)
        assert cuda_ipc_capable(b.address) is False
        b.close()
    finally:
        prov.close()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs the CUDA driver (KVXFER_TEST_DEVICE=cuda)")
def test_ipc_export_from_a_thread_without_context():
    """A thread the CUDA runtime never touched (an event loop's) has no current context;
    ipc_export still answers a handle there (the engine exports from its loop thread), and the
    thread is left as it was (no context current afterwards)."""
    import threading

    import torch

    from kvxfer.kernels import cuda_driver

    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    out = {}

    def work():
        cu = cuda_driver.bindings()
        out["blob"] = cuda_driver.ipc_export(t.data_ptr() + 4096)
        err, ctx = cu.cuCtxGetCurrent()
        out["after"] = int(ctx) if err == 0 else -1

    th = threading.Thread(target=work)
    th.start()
    th.join(30)
    blob = out["blob"]
    assert blob is not None and len(blob) == cuda_driver.IPC_BLOB_BYTES
    base = cuda_driver.alloc_range(t.data_ptr())[0]
    assert cuda_driver.unpack_blob(blob)[1] == t.data_ptr() + 4096 - base
    assert out["after"] == 0


def test_vmm_memory_is_offered_to_same_host_lanes(monkeypatch, caplog):
    """A group with a region in CUDA VMM memory exportable as POSIX fds (the driver's answers
    injected): with the device lane on, freeze offers it (kvxfer.engine.vmm_share) instead of
    warning; the Layout still lists it as non-IPC and carries its VMM blob; a peer whose lane
    maps it accepts it under refuse_emulated_destinations, a peer without a lane refuses it,
    and the owner's own refusal no longer counts it."""
    import socket

    from kvxfer.engine import vmm_share
    from kvxfer.kernels import cuda_driver

    monkeypatch.setattr(
        cuda_driver, "vmm_extents", lambda a, n: ([(a, n)], 4096) if a in VMM else None
    )
    monkeypatch.setattr(
        cuda_driver,
        "ipc_export",
        lambda a: b"\1" * cuda_driver.IPC_BLOB_BYTES if query(a) else None,
    )

    def owner(offer: bool):
        local = LocalGroups()
        local.export_ipc = offer
        for name, g in groups().items():
            if name != "odd":
                local.add(name, g.ptrs, g.lens, g.item_lens)
        local.freeze(_Registrar(), ipc_query=query)
        return local

    with caplog.at_level(logging.WARNING, logger="kvxfer.engine.ipc"):
        local = owner(True)
    offered_quietly = "'kv'" not in caplog.text
    peer_with_lane, peer_without = owner(True), owner(False)  # (the latter warns)
    try:
        assert local.vmm_groups == {"kv"} and offered_quietly
        lay = wire.decode(handshake._layout(local, b"addr", {}))
        assert lay.non_ipc == ["kv"]  # (UCX alone would still emulate PUTs into it)
        kinds = ["vmm" if vmm_share.is_blob(b) else "ipc" if b else "" for b in lay.region_ipc]
        assert sorted(kinds) == ["", "ipc", "ipc", "vmm"]  # aux (host), kv's two, state
        remote = parse_remote(lay)
        assert remote.vmm_covers("kv")
        here = socket.gethostname()
        handshake._check_ipc(peer_with_lane, lay, remote, here, True)
        with pytest.raises(IncompatiblePeer, match="'kv'"):
            handshake._check_ipc(peer_without, lay, remote, here, True)
        plain = m.Layout(**{**lay.__dict__, "non_ipc": None, "region_ipc": None})
        handshake._check_ipc(local, plain, parse_remote(plain), here, True)  # ours: offered
        with pytest.raises(IncompatiblePeer, match="this side's memory"):
            handshake._check_ipc(peer_without, plain, parse_remote(plain), here, True)
    finally:
        for g in (local, peer_with_lane, peer_without):
            g.release()
