"""A room's Done is encoded when decode's destination is attached, not on the send's path:
with ``Done.encode`` made to fail once the room waits for input, the last chunk's write
still carries a Done that decode accepts (both sides reach Success, the bytes arrive), and
nothing encodes a Done while the send runs. Both managers in one child process, real UCX
loopback."""

import asyncio

import numpy as np
import pytest
from test_pd_api import Side

from kvxfer import BootstrapServer, KVManager, KVPoll, KVReceiver, KVSender, Timeouts
from kvxfer.procs import run_in_child

pytestmark = pytest.mark.timeout(60)

T = Timeouts(bootstrap_s=5, waiting_s=30, transfer_s=10, heartbeat_interval_s=0.2)


def test_done_encoded_at_attach_not_at_send():
    got = run_in_child(_main)
    assert got["states"] == ("Success", "Success"), got
    assert got["encodes_during_send"] == 0, got
    assert got["bytes_ok"], got


def _main():
    return asyncio.run(_run())


async def _run():
    from kvxfer.disagg import messages as m

    bs = BootstrapServer(port=0)
    await bs.start()
    P, D = Side(21), Side(22)
    p = await KVManager(P.args, "prefill", bootstrap_addr=bs.address, timeouts=T).start()
    d = await KVManager(D.args, "decode", timeouts=T).start()
    real_encode = m.Done.encode
    calls = [0]

    def refuse(self):
        calls[0] += 1
        raise AssertionError("a Done was encoded on the send's path")

    try:
        recv = KVReceiver(d, bs.address, 5)
        recv.init()
        send = KVSender(p, bs.address, 5)
        send.init(1, 0)
        recv.send_metadata([17], 5)
        while send.poll() != KVPoll.WaitingForInput:
            await asyncio.sleep(0.001)
        m.Done.encode = refuse  # type: ignore[method-assign]
        try:
            send.send([6])
            got = (await send.wait(10)).name, (await recv.wait(10)).name
        finally:
            m.Done.encode = real_encode  # type: ignore[method-assign]
        return {
            "states": got,
            "encodes_during_send": calls[0],
            "bytes_ok": bool(np.array_equal(D.page(17), P.page(6))),
        }
    finally:
        await d.close()
        await p.close()
        await bs.close()
