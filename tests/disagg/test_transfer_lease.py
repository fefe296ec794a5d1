"""Prefill's Transferring lease is armed once a write is under way, and only then: a last
chunk whose write ends on the sender's stack takes the room to Success without a deadline
timer of its own (nothing made, nothing cancelled), while one whose write suspends — forced
here by a write that yields once before it starts — has its room under the Transferring
lease (``transfer_s``) until it ends. Whether an unforced 1-page write ends on the stack
depends on the host (its flush may outlast the inline wait on a loaded one), so for that
room the test asserts that any lease was armed while its write was under way (the old code
armed it before the write existed). Both managers in one child process, real UCX loopback."""

import asyncio

import numpy as np
import pytest
from test_pd_api import Side, one_page_room, pd_pair

from kvxfer import KVPoll, Timeouts
from kvxfer.procs import run_in_child

pytestmark = pytest.mark.timeout(60)

T = Timeouts(bootstrap_s=5, waiting_s=30, transfer_s=7, heartbeat_interval_s=0.2)


def test_transferring_lease_only_for_a_write_under_way():
    got = run_in_child(_lease_main)
    inline, suspended = got["inline"], got["suspended"]
    # an unforced write: Success, and a Transferring deadline only if the write was under
    # way when it was set (none at all when the write ended on the stack, the usual case)
    assert inline["state"] == "Success", inline
    assert all(under_way for _, _, under_way in inline["arms"]), inline
    # a write that suspended: its room was under the 7 s lease while it ran
    assert suspended["state"] == "Success", suspended
    assert suspended["arms"] == [("Transferring", 7.0, True)], suspended
    assert suspended["during"] == ("Transferring", 7.0), suspended
    assert got["bytes_ok"]


def _lease_main():
    return asyncio.run(_lease())


async def _lease():
    from kvxfer.engine.peer import Peer

    P, D = Side(11), Side(12)
    async with pd_pair(P, D, T) as (bs, p, d):
        arms: list = []
        real_arm = p.arm

        def arm(r, seconds=None):
            real_arm(r, seconds)
            if r.due is not None and r.state == KVPoll.Transferring:
                under_way = r.chain is not None and not r.chain.done()
                arms.append((r.room, r.due[1].name, r.due[2], under_way))

        p.arm = arm  # type: ignore[method-assign]
        out: dict = {}
        real_write = Peer.write
        during: list = []
        room_now = [0]

        async def yielding_write(self, *args, **kw):
            await asyncio.sleep(0)  # the write suspends before it starts
            r = p.rooms.get(room_now[0])
            during.append((r.due[1].name, r.due[2]) if r is not None and r.due else None)
            return await real_write(self, *args, **kw)

        for name, room, page, dst in (("inline", 1, 3, 20), ("suspended", 2, 4, 21)):
            send, recv = await one_page_room(bs, p, d, room, dst)
            room_now[0] = room
            if name == "suspended":
                Peer.write = yielding_write  # type: ignore[method-assign]
            try:
                send.send([page])
                assert await recv.wait(10) == KVPoll.Success
                state = await send.wait(10)
            finally:
                Peer.write = real_write  # type: ignore[method-assign]
            out[name] = {
                "state": state.name,
                "arms": [(s, sec, u) for rm, s, sec, u in arms if rm == room],
            }
            if name == "suspended":
                out[name]["during"] = during[0]
        out["bytes_ok"] = bool(
            np.array_equal(D.page(20), P.page(3)) and np.array_equal(D.page(21), P.page(4))
        )
        return out
