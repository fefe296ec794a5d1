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


# ---------------------------------------------------------------------- guest runs
def _started(name: str) -> LoopThread:
    lt = LoopThread(name)
    lt.start(None, 5.0)
    return lt


def _idle(lt: LoopThread) -> None:
    """Return once the loop ran everything handed to it before (it then waits for events)."""
    lt.run(asyncio.sleep(0), 5.0)


def test_run_here_runs_on_the_caller_as_the_loop_and_wakes_it_for_what_it_scheduled():
    lt = _started("kvxfer-test-guest")
    try:
        _idle(lt)
        seen = {}
        ran = threading.Event()

        def guest(x):
            seen["thread"] = threading.get_ident()
            seen["loop"] = asyncio.get_running_loop()
            seen["in_loop"] = lt.in_loop()
            loop = asyncio.get_running_loop()
            loop.call_soon(lambda: (seen.setdefault("cb", threading.get_ident()), ran.set()))
            loop.create_task(_mark(seen))
            return x

        assert lt.run_here(guest, True) is True
        assert seen["thread"] == threading.get_ident() and seen["loop"] is lt.loop
        assert seen["in_loop"] and not lt.in_loop()
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()  # given back
        assert ran.wait(5.0)  # woken: the callback ran on the loop's thread
        _idle(lt)
        assert seen["cb"] == seen["task"] == lt.loop._thread_id != threading.get_ident()
        assert lt.run_here(lambda: False) is False  # did nothing: no wake needed
        with pytest.raises(ZeroDivisionError):
            lt.run_here(lambda: 1 / 0)
        assert lt.run_here(lambda: True) is True  # the gate came back after the raise
    finally:
        lt.stop(5.0)


def test_run_here_wakes_the_loop_only_when_its_wait_would_miss_something(monkeypatch):
    """A guest that scheduled nothing leaves the loop asleep; one that scheduled a timer the
    loop's wait (no timeout: it is idle) would not see, or a callback before raising, gets
    the loop woken (the wake-up callback counted)."""
    import kvxfer.loop_thread as lt_mod

    wakes = []
    monkeypatch.setattr(lt_mod, "_wake", lambda: wakes.append(1))
    lt = _started("kvxfer-test-wake")
    try:
        _idle(lt)
        for _ in range(50):
            assert lt.run_here(lambda: True) is True
        _idle(lt)
        assert wakes == []

        fired, ran = threading.Event(), threading.Event()

        def timer():
            asyncio.get_running_loop().call_later(0.01, fired.set)
            return True

        assert lt.run_here(timer) is True
        assert fired.wait(5.0) and len(wakes) == 1

        def callback_then_raise():
            asyncio.get_running_loop().call_soon(ran.set)
            raise ValueError("after scheduling")

        with pytest.raises(ValueError):
            lt.run_here(callback_then_raise)
        assert ran.wait(5.0)
        _idle(lt)
        assert len(wakes) == 2 and lt.guest_wakes == 2  # counted: KVManager.guest_wakes
    finally:
        lt.stop(5.0)


class _Completions:
    """A transport whose completion queue resolves one future (a flush that completed
    natively while the guest ran)."""

    def __init__(self) -> None:
        self.fut = None
        self.taken = 0

    def take_completions(self) -> bool:
        self.taken += 1
        if self.fut is not None and not self.fut.done():
            self.fut.set_result("flushed")
            return True
        return False


async def _leg(tr, seen):
    """A write's continuation: suspends on its completion under a deadline timer, then one
    more step."""
    loop = asyncio.get_running_loop()
    tr.fut = loop.create_future()
    deadline = loop.call_later(30.0, lambda: None)
    try:
        seen["result"] = await tr.fut
    finally:
        deadline.cancel()
    await asyncio.sleep(0)
    seen["thread"] = threading.get_ident()


@pytest.mark.parametrize("ask", [True, False])
def test_a_guest_that_asks_settles_what_it_left_on_its_own_thread(monkeypatch, ask):
    """``settle_after(transport)`` in a guest run: once the guest's function returned, the
    transport's completions are taken and the ready callbacks run on the guest's thread, a
    few passes deep (a task's first step, its resumption on the completion, its step after
    a bare yield), and the cancelled deadline timer left at the heap's head wakes nothing.
    Without asking, the same work goes to the loop's thread, which is woken for it; on the
    loop's own thread the request is a no-op."""
    import kvxfer.loop_thread as lt_mod

    wakes: list = []
    monkeypatch.setattr(lt_mod, "_wake", lambda: wakes.append(1))
    lt = _started("kvxfer-test-settle")
    try:
        tr, seen = _Completions(), {}

        def guest():
            asyncio.get_running_loop().create_task(_leg(tr, seen))
            if ask:
                lt_mod.settle_after(tr)
            return True

        _idle(lt)
        assert lt.run_here(guest) is True
        if ask:
            assert seen == {"result": "flushed", "thread": threading.get_ident()}
            assert lt.guest_settled == 3 and tr.taken == 4 and lt.guest_wakes == 0
        else:
            _idle(lt)  # woken for the task's first step, which then waits for ever
            assert "result" not in seen and lt.guest_settled == 0 and lt.guest_wakes == 1
            assert tr.taken == 0
        lt.run(_settle_on_loop(lt_mod, tr), 5.0)
        assert lt.guest_settled == (3 if ask else 0) and tr.taken == (4 if ask else 0)
        assert len(wakes) == lt.guest_wakes
    finally:
        lt.stop(5.0)


async def _settle_on_loop(lt_mod, tr):
    lt_mod.settle_after(tr)  # not a guest: nothing recorded, nothing run


async def _mark(seen):
    seen["task"] = threading.get_ident()


def test_run_here_refuses_a_busy_stopped_or_foreign_loop():
    assert LoopThread("kvxfer-test-unstarted").run_here(lambda: True) is False
    lt = _started("kvxfer-test-busy")
    hold, holding = threading.Event(), threading.Event()
    try:
        lt.call_soon(lambda: (holding.set(), hold.wait(10.0)))
        assert holding.wait(5.0)
        calls = []
        assert lt.run_here(calls.append, 1) is False and calls == []  # busy: not waited for
        hold.set()
        _idle(lt)

        async def foreign():  # a thread that runs a loop of its own
            return lt.run_here(calls.append, 2)

        assert asyncio.run(foreign()) is False and calls == []
        assert lt.run_here(lambda: calls.append(3) or True) is True and calls == [3]
    finally:
        hold.set()
        lt.stop(5.0)
    assert lt.run_here(lambda: True) is False  # stopped


def test_submit_here_finishes_a_coroutine_that_never_suspends_on_the_caller():
    """No thread hop: the coroutine runs on the calling thread with the loop as its running
    loop, and the future is done when submit_here returns."""
    lt = _started("kvxfer-test-start-sync")
    try:
        _idle(lt)

        async def body(x):
            done = lt.loop.create_future()  # awaited already resolved (a flush ended inline)
            done.set_result(x)
            return threading.get_ident(), asyncio.get_running_loop(), await done

        fut = lt.submit_here(body(5))
        assert fut.done() and fut.result() == (threading.get_ident(), lt.loop, 5)

        async def fails():
            raise KeyError("sync")

        with pytest.raises(KeyError):
            lt.submit_here(fails()).result(5.0)  # raised in the first step: through the future
    finally:
        lt.stop(5.0)


def test_submit_here_continues_a_suspended_coroutine_on_the_loop():
    """The first step on the caller, the rest (after the awaited future resolved) on the
    loop's thread; its result and exceptions reach the returned future."""
    lt = _started("kvxfer-test-start-async")
    try:
        _idle(lt)
        seen = {}
        gate = {}

        async def body():
            seen["first"] = threading.get_ident()
            gate["fut"] = asyncio.get_running_loop().create_future()
            value = await gate["fut"]
            seen["rest"] = threading.get_ident()
            if value == "boom":
                raise ValueError(value)
            return value

        fut = lt.submit_here(body())
        assert not fut.done() and seen["first"] == threading.get_ident()
        lt.loop.call_soon_threadsafe(gate["fut"].set_result, 11)
        assert fut.result(5.0) == 11
        assert seen["rest"] == lt.loop._thread_id != threading.get_ident()

        fut = lt.submit_here(body())
        lt.loop.call_soon_threadsafe(gate["fut"].set_result, "boom")
        with pytest.raises(ValueError):
            fut.result(5.0)
    finally:
        lt.stop(5.0)


def test_submit_here_keeps_submission_order_when_the_loop_is_busy():
    """Deterministic: while the loop is busy the first coroutine's first step is handed
    over; once the loop idles, later ones may start as guests, but never before the ones
    handed over before them (their first steps run in submission order: a write takes its
    notification's turn there). Then hammered: many submissions, some handed over."""
    lt = _started("kvxfer-test-start-order")
    hold, holding = threading.Event(), threading.Event()
    order = []

    async def step(i):
        order.append((i, threading.get_ident()))
        return i

    try:
        lt.call_soon(lambda: (holding.set(), hold.wait(10.0)))
        assert holding.wait(5.0)
        first = lt.submit_here(step(0))  # busy: handed over, not waited for
        assert order == [] and not first.done()
        hold.set()
        second = lt.submit_here(step(1))  # the loop may idle by now: still after step 0
        assert first.result(5.0) == 0 and second.result(5.0) == 1
        assert [i for i, _ in order] == [0, 1]
        assert order[0][1] == lt.loop._thread_id  # ran on the loop

        order.clear()
        futs = []
        for i in range(300):
            if i % 50 == 0:  # the loop busy while the next 10 are submitted: handed over
                hold.clear(), holding.clear()
                lt.call_soon(lambda: (holding.set(), hold.wait(10.0)))
                assert holding.wait(5.0)
            if i % 50 == 10:
                hold.set()  # the rest: guests once the loop idles, or handed over behind
            futs.append(lt.submit_here(step(i)))
        hold.set()
        assert [f.result(5.0) for f in futs] == list(range(300))
        assert [i for i, _ in order] == list(range(300))
        here = sum(1 for _, t in order if t == threading.get_ident())
        assert here <= 240, here  # at least the 60 submitted while busy were handed over
    finally:
        hold.set()
        lt.stop(5.0)
    with pytest.raises(Closed):
        lt.submit_here(step(9))  # stopped


def test_guest_runs_and_the_loop_never_overlap():
    """Hammer: a thread keeps running guests that flip a shared flag while the loop runs
    callbacks that check it; no callback ever sees a guest inside."""
    lt = _started("kvxfer-test-hammer")
    inside = [False]
    overlaps, guests = [], [0]
    stop = threading.Event()

    def guest():
        inside[0] = True
        time.sleep(0)  # gives the GIL away inside the guest run
        inside[0] = False
        guests[0] += 1
        return True

    def check():
        if inside[0]:
            overlaps.append(1)

    def hammer():
        while not stop.is_set():
            lt.run_here(guest)

    th = threading.Thread(target=hammer)
    th.start()
    try:
        for _ in range(3000):
            lt.call_soon(check)
        _idle(lt)
    finally:
        stop.set()
        th.join(10.0)
        lt.stop(5.0)
    assert not overlaps and guests[0] > 0


def test_call_keeps_order_between_handed_over_and_direct_calls():
    """``LoopThread.call``: a direct call runs on the caller as the loop's guest only when the
    loop is idle and every call handed over before it has started; otherwise it is handed
    over behind them. The loop's own calls run at once. An exception of ``fn`` goes to the
    loop's exception handler on either path; ``direct_calls`` counts the guest runs."""
    lt = _started("kvxfer-test-call")
    errors = []
    lt.loop.call_soon_threadsafe(lt.loop.set_exception_handler, lambda _l, ctx: errors.append(ctx))
    try:
        _idle(lt)
        order = []
        me = threading.get_ident()
        hold, held = threading.Event(), threading.Event()

        def block():
            held.set()
            assert hold.wait(5.0)

        assert lt.call(order.append, ("direct", threading.get_ident()), direct=True) is True
        assert order == [("direct", me)] and lt.direct_calls == 1
        assert lt.call(block) is False and held.wait(5.0)  # the loop is busy in `block`
        assert lt.call(order.append, "handed") is False
        hold.set()
        _idle(lt)
        # the loop has run `handed`: a direct call now runs here, after it
        assert lt.call(lambda: order.append(("after", threading.get_ident())), direct=True)
        assert order[1:] == ["handed", ("after", me)] and lt.direct_calls == 2
        # a handed-over call not yet started keeps a direct call behind it
        hold.clear()
        held.clear()
        lt.call(block)
        assert held.wait(5.0)
        lt.call(order.append, "queued")
        assert lt.call(order.append, "late", direct=True) is False  # busy: handed over
        hold.set()
        _idle(lt)
        assert order[-2:] == ["queued", "late"] and lt.direct_calls == 2
        # an idle loop with a handed-over call that has not started yet (the window between
        # its post and the loop waking up, made here by the counter): handed over behind it
        lt._calls_posted += 1
        assert lt.call(order.append, "behind", direct=True) is False
        lt._calls_run += 1
        _idle(lt)
        assert order[-1] == "behind" and lt.direct_calls == 2
        assert lt.call(lambda: 1 / 0, direct=True) is True
        lt.call(lambda: 1 / 0)
        _idle(lt)
        kinds = [type(c.get("exception")).__name__ for c in errors]
        assert kinds == ["ZeroDivisionError", "ZeroDivisionError"], errors
        assert "direct call" in errors[0]["message"]
    finally:
        lt.stop(5.0)
    with pytest.raises(Closed):
        lt.call(order.append, "stopped")


def test_calls_handed_over_while_busy_share_one_wake_up_in_order():
    """Calls handed over while the loop is busy are taken by one drain (one self-pipe
    write, not one each), run in call order; a failing call goes to the exception handler
    and the calls after it still run; a call handed over during a drain goes with the
    next one, after every earlier call."""
    lt = _started("kvxfer-test-drain")
    errors = []
    lt.loop.set_exception_handler(lambda loop, ctx: errors.append(ctx))
    wakes = []
    post = lt.loop.call_soon_threadsafe

    def counted(*a):
        wakes.append(a[0])
        return post(*a)

    lt.loop.call_soon_threadsafe = counted
    try:
        _idle(lt)
        order = []
        hold, held = threading.Event(), threading.Event()

        def block():
            held.set()
            hold.wait(5.0)

        lt.call(block)
        assert held.wait(5.0)  # the loop is busy in `block`
        n0 = len(wakes)
        for i in range(50):
            lt.call(order.append, i)
        lt.call(lambda: 1 / 0)

        def inside():  # runs in a drain: what it hands over goes to the next one
            order.append("inside")
            lt.call(order.append, "from inside")

        lt.call(inside)
        lt.call(order.append, "last")
        assert len(wakes) == n0 + 1  # one wake-up for all 53: the first one's drain
        hold.set()
        _idle(lt)
        assert order == list(range(50)) + ["inside", "last", "from inside"]
        assert [type(c.get("exception")).__name__ for c in errors] == ["ZeroDivisionError"]
        assert lt._calls_run == lt._calls_posted and not lt._inbox
        assert lt.call(order.append, "direct", direct=True) is True  # in order again
    finally:
        lt.stop(5.0)
