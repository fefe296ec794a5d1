"""``Peer._bounded_future``: a transport future that already resolved (a flush that ended
inline, in the starting call) is taken as is, with no deadline timer armed and cancelled —
a cancelled timer stays in the loop's heap, and after a guest run
(``LoopThread.run_here``) it made the idle loop be woken for nothing; one still pending is
bounded by a timer and the peer's waiter set, as before."""

import asyncio

import pytest

from kvxfer.engine.peer import Peer
from kvxfer.errors import TransferTimeout

pytestmark = pytest.mark.timeout(10)


class _PeerState:
    """What ``_bounded_future`` reads of its peer."""

    def __init__(self, loop):
        self._loop = loop
        self._dead = loop.create_future()
        self._waiters = set()
        self.name, self.id = "peer", "p"

    def _check_open(self):
        raise AssertionError("the peer is alive")


def test_a_resolved_future_arms_no_timer():
    async def main():
        loop = asyncio.get_running_loop()
        st = _PeerState(loop)
        timers = loop._scheduled  # BaseEventLoop's timer heap
        done = loop.create_future()
        done.set_result(7)
        assert await Peer._bounded_future(st, done, 5.0, "flush") == 7
        assert timers == [] and not st._waiters
        failed = loop.create_future()
        failed.set_exception(KeyError("flush failed"))
        with pytest.raises(KeyError):
            await Peer._bounded_future(st, failed, 5.0, "flush")
        assert timers == []

        pending = loop.create_future()
        task = asyncio.ensure_future(Peer._bounded_future(st, pending, 5.0, "flush"))
        await asyncio.sleep(0)
        assert len(timers) == 1 and pending in st._waiters  # a real wait stays bounded
        pending.set_result(8)
        assert await task == 8 and not st._waiters

        with pytest.raises(TransferTimeout):
            await Peer._bounded_future(st, loop.create_future(), 0.01, "flush")

    asyncio.run(main())
