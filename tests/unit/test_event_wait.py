"""kvxfer.disagg.event_wait: callbacks run on their loop's thread once the event completed,
in hand-over order; a wait that raises still calls back; a closed loop is skipped."""

import asyncio
import threading

import pytest

from kvxfer.disagg import event_wait

pytestmark = pytest.mark.timeout(30)


class _Event:
    """A CUDA-event stand-in: ``synchronize()`` blocks until :meth:`fire`."""

    def __init__(self, raises: bool = False) -> None:
        self._done = threading.Event()
        self.raises = raises

    def fire(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        assert self._done.wait(20), "never fired"
        if self.raises:
            raise RuntimeError("cuda error")


def test_callbacks_on_the_loop_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        evs = [_Event(raises=(i == 1)) for i in range(3)]
        done = loop.create_future()

        def cb(i):
            seen.append((i, threading.current_thread() is threading.main_thread()))
            if len(seen) == 3:
                done.set_result(None)

        for i, ev in enumerate(evs):
            event_wait.watch(ev, loop, lambda i=i: cb(i))
        await asyncio.sleep(0)
        assert seen == []  # nothing completed yet
        for ev in reversed(evs):  # completion order does not matter: hand-over order does
            ev.fire()
        await asyncio.wait_for(done, 10)
        return seen

    assert asyncio.run(main()) == [(0, True), (1, True), (2, True)]


def test_closed_loop_is_skipped():
    dead = asyncio.new_event_loop()
    dead.close()
    gone = _Event()
    event_wait.watch(gone, dead, lambda: pytest.fail("ran on a closed loop"))
    gone.fire()

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        ev = _Event()
        event_wait.watch(ev, loop, lambda: fut.set_result("ok"))
        ev.fire()
        return await asyncio.wait_for(fut, 10)

    assert asyncio.run(main()) == "ok"  # the waiter thread survived the closed loop
