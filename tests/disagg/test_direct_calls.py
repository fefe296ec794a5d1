"""KVManager.call(direct=True): a call runs on the calling thread as a guest of the idle
loop, only once every call handed over before it has run (call order is kept), and its
exception goes to the loop's exception handler as a handed-over call's would. Driven on a
real (unstarted) KVManager bound to a real LoopThread, with the loop held inside its
selector wait (gate given away) by a patched select."""

import asyncio
import threading

import numpy as np
import pytest

from kvxfer.disagg import KVArgs, KVManager, MetadataBuffer
from kvxfer.errors import InvalidArgument
from kvxfer.loop_thread import LoopThread

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def bound(request):
    kv = np.zeros((2, 4, 16), dtype=np.uint8)
    aux = MetadataBuffer(4, 64)
    ap, al, ai = aux.buf_infos()
    args = KVArgs(
        kv_data_ptrs=[kv[i].ctypes.data for i in range(2)],
        kv_data_lens=[64] * 2,
        kv_item_lens=[16] * 2,
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
    )
    trace = getattr(request, "param", False)
    mgr = KVManager(args, "prefill", bootstrap_addr="127.0.0.1:9", trace=trace)
    lt = LoopThread("kvxfer-test-direct")
    lt.start(None, 5.0)
    mgr.loop, mgr._thread = lt.loop, lt
    mgr._loop_tid = lt.run(_tid(), 5.0)
    yield mgr, lt
    lt.stop(5.0)
    del kv, aux


async def _tid():
    return threading.get_ident()


def _idle(lt):
    lt.run(asyncio.sleep(0), 5.0)


def test_direct_call_runs_on_the_caller_when_the_loop_is_idle(bound):
    mgr, lt = bound
    _idle(lt)
    where = []
    mgr.call(lambda: where.append((threading.get_ident(), mgr.in_loop())), direct=True)
    assert where == [(threading.get_ident(), True)] and mgr.direct_calls == 1
    mgr.call(lambda: where.append(threading.get_ident()))  # not direct: on the loop
    _idle(lt)
    assert where[1] == mgr._loop_tid and mgr.direct_calls == 1


def test_a_direct_call_never_overtakes_a_call_handed_over_before_it(bound):
    mgr, lt = bound
    inner = lt.loop._selector._sel
    real = inner.select
    entered, release = threading.Event(), threading.Event()
    armed = [True]

    def held_select(timeout=None):
        if armed[0]:
            armed[0] = False
            entered.set()
            release.wait(10.0)  # the loop waits here with the gate given away
        return real(timeout)

    inner.select = held_select
    lt.call_soon(lambda: None)  # the loop goes round once more, into held_select
    assert entered.wait(5.0)
    order = []
    mgr.call(lambda: order.append(("A", threading.get_ident())))  # handed over, not run yet
    mgr.call(lambda: order.append(("B", threading.get_ident())), direct=True)
    assert order == [] and mgr.direct_calls == 0  # the gate was free, but A comes first
    release.set()
    _idle(lt)
    assert order == [("A", mgr._loop_tid), ("B", mgr._loop_tid)]
    mgr.call(lambda: order.append(("C", threading.get_ident())), direct=True)
    assert order[-1] == ("C", threading.get_ident()) and mgr.direct_calls == 1


def test_a_direct_calls_exception_goes_to_the_loops_handler(bound):
    mgr, lt = bound
    seen = []
    lt.loop.set_exception_handler(lambda loop, ctx: seen.append(ctx["exception"]))
    _idle(lt)

    def boom():
        raise ValueError("bad step")

    mgr.call(boom, direct=True)  # does not raise here
    assert mgr.direct_calls == 1 and [str(e) for e in seen] == ["bad step"]


@pytest.mark.parametrize(
    "name,env,default",
    [
        ("direct_pages", "KVXFER_DIRECT_PAGES", 65536),
        ("coalesce_after", "KVXFER_COALESCE_AFTER", 2),
    ],
)
def test_manager_int_settings(monkeypatch, name, env, default):
    """KVManager's int settings: the argument, else the environment, else the default;
    anything but an int >= 0 refused naming it."""
    aux = MetadataBuffer(4, 64)
    ap, al, ai = aux.buf_infos()
    kv = np.zeros(64, np.uint8)
    args = KVArgs(
        kv_data_ptrs=[kv.ctypes.data],
        kv_data_lens=[64],
        kv_item_lens=[16],
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
    )

    def make(**kw):
        return getattr(KVManager(args, "decode", **kw), name)

    monkeypatch.delenv(env, raising=False)
    assert make() == default and make(**{name: 0}) == 0
    monkeypatch.setenv(env, "3")
    assert make() == 3 and make(**{name: 5}) == 5
    monkeypatch.setenv(env, "x")
    with pytest.raises(InvalidArgument, match=env):
        make()
    monkeypatch.delenv(env)
    with pytest.raises(InvalidArgument):
        make(**{name: -1})


def test_direct_limit_by_peers(monkeypatch):
    """config.direct_limit: a send runs as the loop's guest up to direct_pages, to one decode
    peer or to several (a room's TP legs: no lower bound by default); $KVXFER_LEG_DIRECT_PAGES
    sets a lower one for several only; 0 stays 0; a bad value is a typed error."""
    from kvxfer.config import LEG_DIRECT_PAGES, LEG_DIRECT_PAGES_ENV, direct_limit

    monkeypatch.delenv(LEG_DIRECT_PAGES_ENV, raising=False)
    assert LEG_DIRECT_PAGES is None
    assert direct_limit(65536, 1) == 65536 and direct_limit(65536, 0) == 65536
    assert direct_limit(65536, 2) == 65536 == direct_limit(65536, 4)
    assert direct_limit(8, 2) == 8 and direct_limit(0, 1) == 0 and direct_limit(0, 3) == 0
    monkeypatch.setenv(LEG_DIRECT_PAGES_ENV, "16")
    assert direct_limit(65536, 2) == 16 and direct_limit(65536, 1) == 65536
    assert direct_limit(8, 2) == 8 and direct_limit(0, 2) == 0
    monkeypatch.setenv(LEG_DIRECT_PAGES_ENV, "many")
    with pytest.raises(InvalidArgument, match=LEG_DIRECT_PAGES_ENV):
        direct_limit(65536, 2)


@pytest.mark.parametrize("bound", [True], indirect=True)
def test_a_room_adopted_at_once_already_has_its_trace_record(bound, monkeypatch):
    """``KVManager(trace=True)``: the sender's room is adopted as the loop's guest right as
    it is made (here: the loop idle), and the adoption makes a heterogeneous-TP room's legs,
    each with a record of its own only if the room has one by then: the record exists
    before the room is handed to the side."""
    mgr, lt = bound
    _idle(lt)
    seen = []
    monkeypatch.setattr(
        type(mgr.side), "_adopt", lambda side, r, pending, cause: seen.append(r.trace)
    )
    mgr.new_room(42, None)
    assert mgr.direct_calls == 1  # adopted on this stack, as the guest
    assert seen and seen[0] is not None and seen[0]["room"] == 42
    assert [r["room"] for r in mgr.drain_trace()] == [42]


def test_a_poll_marks_the_managers_latest_poll(bound):
    """``RoomHandle.poll`` stamps ``KVManager.polled_at`` (what tells a polling scheduler's
    bursts apart, kvxfer.disagg.bursts), whatever the room's state."""
    import time

    from kvxfer.disagg import KVSender

    mgr, lt = bound
    assert mgr.polled_at == 0.0
    s = KVSender(mgr, None, 41)
    t0 = time.monotonic()
    s.poll()
    first = mgr.polled_at
    assert first >= t0
    s.poll()
    assert mgr.polled_at >= first
