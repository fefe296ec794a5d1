"""The public API in both styles — asyncio (``await start()/wait()``) and a plain-thread
scheduler over background-loop managers (non-blocking ``poll()``, ``wait_blocking``, waits
from a foreign event loop) — with both managers in this process on real UCX loopback."""

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from pd_harness import Node

from kvxfer import (
    BootstrapServer,
    KVArgs,
    KVManager,
    KVPoll,
    KVReceiver,
    KVSender,
    MetadataBuffer,
    Timeouts,
)
from kvxfer.errors import Closed, IndexOutOfRange, InvalidArgument, TransferTimeout  # noqa: F401
from kvxfer.procs import run_in_child

pytestmark = pytest.mark.timeout(60)
ITEM, PAGES, NBUF = 64, 32, 3


class Side:
    """numpy-backed buffers: 3 kv descriptors of 32 pages, 4 state slots, 8 aux rows."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        self.kv = rng.integers(0, 255, (NBUF, PAGES * ITEM), dtype=np.uint8)
        self.state = rng.integers(0, 255, (4 * 48,), dtype=np.uint8)
        self.aux = MetadataBuffer(8, 64)
        ap, al, ai = self.aux.buf_infos()
        self.args = KVArgs(
            kv_data_ptrs=[int(self.kv[i].ctypes.data) for i in range(NBUF)],
            kv_data_lens=[PAGES * ITEM] * NBUF,
            kv_item_lens=[ITEM] * NBUF,
            state_data_ptrs=[int(self.state.ctypes.data)],
            state_data_lens=[192],
            state_item_lens=[48],
            state_types=["mamba"],
            aux_data_ptrs=ap,
            aux_data_lens=al,
            aux_item_lens=ai,
            page_size=2,
            dtype="uint8",
            layout={"kv": {"kind": "test"}},
        )

    def page(self, p):
        return self.kv[:, p * ITEM : (p + 1) * ITEM]


@contextlib.asynccontextmanager
async def pd_pair(P, D, timeouts):
    """A bootstrap server and started prefill (side ``P``) and decode (side ``D``) managers
    on this loop, closed on exit: ``(bs, p, d)``."""
    bs = BootstrapServer(port=0)
    await bs.start()
    p = await KVManager(P.args, "prefill", bootstrap_addr=bs.address, timeouts=timeouts).start()
    d = await KVManager(D.args, "decode", timeouts=timeouts).start()
    try:
        yield bs, p, d
    finally:
        await d.close()
        await p.close()
        await bs.close()


async def one_page_room(bs, p, d, room, dst_page, within=10.0):
    """A 1-page room's KVReceiver and KVSender (``init(1, 0)``, decode's page
    ``dst_page``), returned once the sender waits for input: ``(send, recv)``."""
    recv = KVReceiver(d, bs.address, room)
    recv.init()
    send = KVSender(p, bs.address, room)
    send.init(1, 0)
    recv.send_metadata([dst_page], room)
    end = time.monotonic() + within
    while send.poll() != KVPoll.WaitingForInput:
        assert time.monotonic() < end, f"room {room}: sender never waited for input"
        await asyncio.sleep(0.001)
    return send, recv


T = Timeouts(bootstrap_s=5, waiting_s=5, transfer_s=5, heartbeat_interval_s=0.2)


def test_async_flow_chunks_state_and_aux():
    run_in_child(_async_flow_main)


def _async_flow_main():
    asyncio.run(_async_flow())


async def _async_flow():
    bs = BootstrapServer(port=0)
    await bs.start()
    P, D = Side(1), Side(2)
    p = await KVManager(P.args, "prefill", bootstrap_addr=bs.address, timeouts=T).start()
    d = await KVManager(D.args, "decode", timeouts=T).start()
    released = []
    try:
        recv = KVReceiver(d, bs.address, 5, on_done=lambda s, e: released.append(("d", s)))
        assert recv.poll() == KVPoll.Bootstrapping
        recv.init()
        send = KVSender(p, bs.address, 5, on_done=lambda s, e: released.append(("p", s)))
        send.init(4, 2)
        P.aux.set_output(2, 31337)
        recv.send_metadata([20, 21, 9, 3], 6, [1])
        send.send([4, 5])
        send.send(np.array([6, 7]), state_indices=[3])
        assert await recv.wait(10) == KVPoll.Success
        assert await send.wait(10) == KVPoll.Success
        assert recv.failure_exception() is None
        for s, dpage in zip([4, 5, 6, 7], [20, 21, 9, 3]):
            assert np.array_equal(D.page(dpage), P.page(s))
        assert np.array_equal(D.state[48:96], P.state[144:192])
        assert D.aux.first_token(6) == 31337
        assert sorted(released) == [("d", KVPoll.Success), ("p", KVPoll.Success)]
        # a wait that runs out raises TransferTimeout; the room stays alive
        late = KVReceiver(d, bs.address, 6)
        with pytest.raises(TransferTimeout, match="room 6"):
            await late.wait(0.05)
        late.abort()
        assert await late.wait(5) == KVPoll.Failed
        assert type(late.failure_exception()).__name__ == "TransferAborted"
        bad = KVReceiver(d, bs.address, 7)
        bad.init()
        with pytest.raises(IndexOutOfRange, match="kv_indices: 32 not in"):
            bad.send_metadata([32], 0)
        bad.abort()
    finally:
        await d.close()
        await p.close()
        await bs.close()


def test_sync_scheduler_threads_and_foreign_loop(cluster, room):
    """Worker processes drive background-loop managers from their main thread (poll()); here
    also wait_blocking, await from a foreign event loop, and the in-loop deadlock guard."""
    c = cluster
    rooms = [room() for _ in range(4)]
    c.d["mha"].batch([(Node.d_open, r, 2) for r in rooms])
    c.p["mha"].batch([(Node.p_open, r, 2) for r in rooms] + [(Node.p_send, r, 0, 2) for r in rooms])
    got = c.d["mha"].api_waits(rooms)
    assert got["blocking"] == ["Success"] * 4 and got["foreign_loop"] == ["Success"] * 2
    assert "deadlock" in got["in_loop_blocking"]
    assert sum(c.d["mha"].batch([(Node.verify, r) for r in rooms])) == 0
    assert c.p["mha"].wait_all(rooms) == {"Success": 4}


def test_manager_argument_errors():
    S = Side(5)
    with pytest.raises(InvalidArgument, match="mode"):
        KVManager(S.args, "middle")
    with pytest.raises(InvalidArgument, match="bootstrap_addr"):
        KVManager(S.args, "prefill")
    d = KVManager(S.args, "decode")
    with pytest.raises(InvalidArgument, match="prefill manager"):
        KVSender(d, "127.0.0.1:1", 1)
    with pytest.raises(Closed, match="not started"):
        KVReceiver(d, "127.0.0.1:1", 1)
    with pytest.raises(InvalidArgument, match="host:port"):
        KVReceiver(d, "nowhere", 1)


def test_import_kvxfer_is_cheap():
    code = (
        "import sys, kvxfer; from kvxfer import KVArgs, KVPoll, KVManager, KVSender, "
        "KVReceiver, BootstrapServer; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ucxx', 'torch', 'rmm')]; "
        "assert not bad, bad"
    )
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


def test_send_metadata_after_release_writes_nothing():
    """A room that already failed and ran ``on_done`` (its aux row may be another request's
    by now) must not have its aux row touched by a late ``send_metadata()`` — found by the
    reliability soak: the header clear ran on the caller's thread before any state check."""
    run_in_child(_late_metadata_main)


def _late_metadata_main():
    asyncio.run(_late_metadata())


async def _late_metadata():
    bs = BootstrapServer(port=0)
    await bs.start()
    D = Side(3)
    quick = Timeouts(bootstrap_s=0.3, waiting_s=5, transfer_s=5, heartbeat_interval_s=0.2)
    d = await KVManager(D.args, "decode", timeouts=quick).start()  # no prefill registers
    done = asyncio.Event()
    try:
        recv = KVReceiver(d, bs.address, 11, on_done=lambda s, e: done.set())
        recv.init()
        await asyncio.wait_for(done.wait(), 10)
        assert recv.poll() == KVPoll.Failed
        D.aux.data[2, :] = 0xAB  # row 2 now belongs to someone else
        recv.send_metadata([0, 1], 2)  # on the loop thread: handled now
        assert (D.aux.data[2] == 0xAB).all(), "late send_metadata wrote into a released row"
    finally:
        await d.close()
        await bs.close()
