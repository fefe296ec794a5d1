"""The initiator's landing-slot states (kvxfer.engine.landing): every path returns the slot
exactly once, and messages that do not fit the slot's state are ProtocolErrors."""

import asyncio

import pytest

from kvxfer.engine.landing import Landing
from kvxfer.errors import ProtocolError

pytestmark = pytest.mark.timeout(30)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def _land(n=2):
    return Landing(region=0, base=0, slot_bytes=64, slots=list(range(n)))


def test_slot_free_returns_the_slot_and_resolves_its_chunk():
    async def go():
        land = _land()
        s = land.free.get_nowait()
        land.taken(s)
        fut = land.waiters[s] = asyncio.get_running_loop().create_future()
        land.freed("kv", s)
        assert fut.result() is None and land.free.qsize() == 2 and not land.out
        with pytest.raises(ProtocolError):  # twice
            land.freed("kv", s)

    _run(go())


def test_abandoned_slot_returns_only_on_reclaimed():
    async def go():
        land = _land()
        s = land.free.get_nowait()
        land.taken(s)
        fut = land.waiters[s] = asyncio.get_running_loop().create_future()
        land.abandoning.add(s)
        land.freed("kv", s)  # scattered before the abandon reached the peer
        assert fut.done() and land.free.qsize() == 1 and s in land.out
        land.reclaimed("kv", s)
        assert land.free.qsize() == 2 and not land.out and not land.abandoning
        with pytest.raises(ProtocolError):
            land.reclaimed("kv", s)
        # dropped unscattered: nothing resolved the chunk, SlotReclaimed cancels it
        s = land.free.get_nowait()
        land.taken(s)
        fut = land.waiters[s] = asyncio.get_running_loop().create_future()
        land.abandoning.add(s)
        land.reclaimed("kv", s)
        assert fut.cancelled() and land.free.qsize() == 2 and not land.waiters

    _run(go())


def test_reclaiming_slot_refuses_slot_free_and_idle_waits():
    async def go():
        land = _land(1)
        s = land.free.get_nowait()
        land.taken(s)
        land.reclaiming.add(s)
        with pytest.raises(ProtocolError):  # no plan was sent for it
            land.freed("kv", s)
        idle = asyncio.ensure_future(land.idle())
        await asyncio.sleep(0)  # one loop turn: idle() is waiting
        assert not idle.done()
        land.give_back(s)  # the reclaim flush completed
        await idle
        assert land.free.qsize() == 1 and not land.reclaiming
        await land.idle()  # already idle: returns at once

    _run(go())
