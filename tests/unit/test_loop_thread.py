"""kvxfer.loop_thread.LoopThread: bounded waits, start failures surfaced, idempotent stop."""

import asyncio
import threading
import time

import pytest

from kvxfer.errors import Closed, TransferTimeout
from kvxfer.loop_thread import LoopThread


def test_start_runs_main_on_the_named_thread_and_returns_its_result():
    lt = LoopThread("kvxfer-test-loop")

    async def main():
        return threading.current_thread().name, asyncio.get_running_loop()

    name, loop = lt.start(main(), 5.0)
    try:
        assert name == "kvxfer-test-loop" and loop is lt.loop
        assert lt.running and not lt.in_loop()
        assert lt.run(asyncio.sleep(0, result=7), 5.0) == 7
        assert lt.run(_in_loop(lt), 5.0) is True
        assert threading.current_thread().name != "kvxfer-test-loop"
    finally:
        lt.stop(5.0)
    assert not lt.running and lt.loop.is_closed()
    assert not [t for t in threading.enumerate() if t.name == "kvxfer-test-loop"]


async def _in_loop(lt):
    return lt.in_loop()


def test_start_failure_is_raised_and_leaves_no_thread():
    lt = LoopThread("kvxfer-test-fail")

    async def main():
        raise ValueError("cannot listen")

    with pytest.raises(ValueError, match="cannot listen"):
        lt.start(main(), 5.0)
    assert not lt.running and lt.loop.is_closed()
    assert not [t for t in threading.enumerate() if t.name == "kvxfer-test-fail"]
    lt.stop(1.0)  # idempotent after a failed start
    with pytest.raises(Closed):
        lt.run(asyncio.sleep(0), 1.0)


def test_start_is_bounded():
    lt = LoopThread("kvxfer-test-slow")
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        lt.start(asyncio.sleep(30), 0.2)
    assert time.monotonic() - t0 < 5.0
    lt.stop(1.0)


def test_run_is_bounded_and_cancels_the_coroutine():
    lt = LoopThread("kvxfer-test-run")
    lt.start()
    cancelled = threading.Event()

    async def slow():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout) as info:
            lt.run(slow(), 0.2, what="slow call")
        assert isinstance(info.value, TimeoutError) and "slow call" in str(info.value)
        assert time.monotonic() - t0 < 5.0
        assert cancelled.wait(5.0)
        with pytest.raises(KeyError):  # the coroutine's error, unchanged
            lt.run(_raise_key(), 5.0)
    finally:
        lt.stop(5.0)


async def _raise_key():
    raise KeyError("x")


def test_stop_is_idempotent_runs_on_stop_and_refuses_later_work():
    lt = LoopThread("kvxfer-test-stop")
    stopped = []

    async def on_stop():
        stopped.append(threading.current_thread().name)

    lt.start(on_stop=on_stop)
    lt.stop(5.0)
    lt.stop(5.0)
    assert stopped == ["kvxfer-test-stop"] and lt.loop.is_closed()
    with pytest.raises(Closed):
        lt.call_soon(print)
    coro = asyncio.sleep(0)
    with pytest.raises(Closed):
        lt.submit(coro)
    with pytest.raises(Closed):
        lt.start()


def test_stop_before_start_closes_the_loop():
    lt = LoopThread("kvxfer-test-never")
    lt.stop()
    assert lt.loop.is_closed() and not lt.running
