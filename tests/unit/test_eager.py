"""kvxfer.eager.start: the first step runs on the caller's stack, the rest as a task would
run it (results, exceptions, bare yields, cancellation at the suspension point). Python 3.12+
takes the interpreter's eager tasks; the same tests passed there too (3.12.1, 3.13.0, with a
pytest stub: no pytest in those interpreters here)."""

import asyncio

import pytest

from kvxfer import eager

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


class Owner:
    """A manager's spawn: owned tasks, their failures retrieved."""

    def __init__(self):
        self.tasks = []

    def spawn(self, coro):
        t = asyncio.get_running_loop().create_task(coro)
        t.add_done_callback(lambda t: t.cancelled() or t.exception())  # as the manager's
        self.tasks.append(t)
        return t


def test_first_step_runs_before_start_returns_and_result_comes_through():
    async def main():
        steps = []
        fut = asyncio.get_running_loop().create_future()

        async def body():
            steps.append("first")
            v = await fut
            steps.append("after")
            await asyncio.sleep(0)  # a bare yield
            return v * 2

        owner = Owner()
        out = eager.start(owner.spawn, body())
        assert steps == ["first"] and len(owner.tasks) == 1 and not out.done()
        fut.set_result(21)
        assert await out == 42 and steps == ["first", "after"]

    run(main())


def test_synchronous_return_spawns_nothing():
    async def main():
        async def body():
            return "now"

        owner = Owner()
        out = eager.start(owner.spawn, body())
        assert out.done() and out.result() == "now" and owner.tasks == []

    run(main())


def test_synchronous_error_is_a_failed_owned_task():
    async def main():
        async def body():
            raise ValueError("bad")

        owner = Owner()
        out = eager.start(owner.spawn, body())
        assert len(owner.tasks) == 1
        with pytest.raises(ValueError, match="bad"):
            await out

    run(main())


def test_awaited_exception_reaches_the_coroutine():
    async def main():
        fut = asyncio.get_running_loop().create_future()

        async def body():
            try:
                await fut
            except KeyError as exc:
                return f"caught {exc}"

        out = eager.start(Owner().spawn, body())
        fut.set_exception(KeyError("k"))
        assert await out == "caught 'k'"

    run(main())


@pytest.mark.parametrize("spin", [0, 1])
def test_cancel_cancels_the_awaited_future_inside_the_coroutine(spin):
    """Cancelled before (spin 0) or after (1) the continuation's first step."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        seen = []

        async def body():
            try:
                await fut
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        owner = Owner()
        out = eager.start(owner.spawn, body())
        for _ in range(spin):
            await asyncio.sleep(0)
        out.cancel()
        with pytest.raises(asyncio.CancelledError):
            await out
        assert seen == ["cancelled"] and fut.cancelled() and out.cancelled()

    run(main())


@pytest.mark.parametrize("how", ["eager", "task"])
def test_cancel_after_the_awaited_future_completed_is_thrown_in(how):
    """Woken and cancelled before the next step: the error comes out of the await that
    suspended it, as with a plain task (both ways checked)."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        seen = []

        async def body():
            seen.append("first")
            try:
                await fut
                seen.append("not cancelled")
            except asyncio.CancelledError:
                seen.append("cancelled")
                return "handled"

        if how == "eager":
            out = eager.start(Owner().spawn, body())
        else:
            out = asyncio.get_running_loop().create_task(body())
            await asyncio.sleep(0)
        fut.set_result(None)  # the continuation is woken ...
        out.cancel()  # ... and cancelled before it runs
        assert await out == "handled"
        assert seen == ["first", "cancelled"]

    run(main())


def test_awaiting_a_task_that_gets_cancelled():
    async def main():
        gate = asyncio.Event()

        async def inner():
            await gate.wait()
            return 1

        async def body():
            return await asyncio.get_running_loop().create_task(inner())

        out = eager.start(Owner().spawn, body())
        await asyncio.sleep(0)
        out.cancel()
        with pytest.raises(asyncio.CancelledError):
            await out

    run(main())


def test_chained_like_prefill_writes():
    """Each write waits for the previous one (prefill_side's chain): order is kept and a
    write whose predecessor is done starts on the caller's stack."""

    async def main():
        order = []
        futs = [asyncio.get_running_loop().create_future() for _ in range(3)]

        async def write(i, prev):
            if prev is not None and not prev.done():
                await asyncio.wait([prev])
            order.append(f"start {i}")
            await futs[i]
            order.append(f"end {i}")

        owner = Owner()
        prev = None
        chain = []
        for i in range(3):
            prev = eager.start(owner.spawn, write(i, prev))
            chain.append(prev)
        assert order == ["start 0"]  # 1 and 2 wait for their predecessors
        for f in futs:
            f.set_result(None)
        await chain[-1]
        assert order == ["start 0", "end 0", "start 1", "end 1", "start 2", "end 2"]

    run(main())


def test_cancelling_the_owned_task_cancels_the_coroutine():
    """The owner (a manager closing) cancels what it spawned: the coroutine gets it."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        seen = []

        async def body():
            try:
                await fut
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        owner = Owner()
        out = eager.start(owner.spawn, body())
        (owned,) = owner.tasks
        await asyncio.sleep(0)
        owned.cancel()
        await asyncio.wait([owned])
        with pytest.raises(asyncio.CancelledError):
            await out
        assert seen == ["cancelled"] and out.cancelled()

    run(main())
