"""A room's Done is encoded when decode's destination is attached, not on the send's path:
with ``Done.encode`` made to fail once the room waits for input, the last chunk's write
still carries a Done that decode accepts (both sides reach Success, the bytes arrive), and
nothing encodes a Done while the send runs. Both managers in one child process, real UCX
loopback."""

import asyncio

import numpy as np
import pytest
from test_pd_api import Side, one_page_room, pd_pair

from kvxfer import Timeouts
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

    P, D = Side(21), Side(22)
    real_encode = m.Done.encode
    calls = [0]

    def refuse(self):
        calls[0] += 1
        raise AssertionError("a Done was encoded on the send's path")

    async with pd_pair(P, D, T) as (bs, p, d):
        send, recv = await one_page_room(bs, p, d, 5, 17)
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
