"""Stage tracing (kvxfer.disagg.trace): the bounded record store, and between two spawned
processes over UCX loopback a traced request yielding every stage in order on both sides
(decode's Done stamped at its native arrival before its decoding) while an untraced manager
next to it records nothing."""

import pytest
from pd_harness import FAST, Worker
from testenv import DEVICE

from kvxfer.disagg.trace import ENV, StageTrace, enabled, mark
from kvxfer.pd_demo.bench import SIDE_STAGES, STAGES

pytestmark = pytest.mark.timeout(120)


def test_store_is_bounded_and_drains():
    t = StageTrace(maxlen=4)
    recs = [t.start(room, "prefill") for room in range(10)]
    assert len(t) == 4
    mark(recs[-1], "send")
    first = recs[-1]["send"]
    mark(recs[-1], "send")  # the first stamp of a stage wins
    out = t.drain()
    assert [r["room"] for r in out] == [6, 7, 8, 9]
    assert out[-1]["send"] == first
    assert len(t) == 0 and t.drain() == []


def test_switch(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert not enabled(None)
    assert enabled(True)
    monkeypatch.setenv(ENV, "1")
    assert enabled(None) and not enabled(False)
    monkeypatch.setenv(ENV, "0")
    assert not enabled(None)


@pytest.fixture(scope="module")
def pair():
    from kvxfer.disagg import BootstrapServer

    bs = {n: BootstrapServer(port=0).start_in_thread() for n in ("on", "off")}
    spec = {
        n: dict(kind="mha", timeouts=FAST, device=DEVICE, name=n, trace=n == "on")
        for n in ("on", "off")
    }
    p = Worker({n: dict(kw, role="prefill", bootstrap=bs[n].address) for n, kw in spec.items()})
    d = Worker({n: dict(kw, role="decode", bootstrap=bs[n].address) for n, kw in spec.items()})
    try:
        p.ready()
        d.ready()
        yield p, d
    finally:
        for w in (p, d):
            w.request_exit()
        for w in (p, d):
            w.close()
        for s in bs.values():
            s.stop_thread()


def _one(p, d, node, room):
    d[node].d_open(room, 1)
    p[node].p_open(room, 1)
    assert p[node].poll_until(room, ["WaitingForInput"]) == "WaitingForInput"
    p[node].p_send(room, 0, 1)
    assert d[node].wait(room)["state"] == "Success"
    assert d[node].poll(room) == "Success"  # the scheduler sees it: the 'seen' stamp
    assert p[node].wait(room)["state"] == "Success"


def test_traced_request_has_every_stage_in_order(pair):
    p, d = pair
    for n in ("on", "off"):
        p[n].drain_trace(), d[n].drain_trace()
    rooms = [7001, 7002, 7003]
    for room in rooms:
        _one(p, d, "on", room)
        _one(p, d, "off", room + 100)
    pre = {r["room"]: r for r in p["on"].drain_trace()}
    dec = {r["room"]: {f"d:{k}": v for k, v in r.items()} for r in d["on"].drain_trace()}
    assert sorted(pre) == rooms and sorted(dec) == rooms
    for room in rooms:
        rec = dict(pre[room], **dec[room])
        assert "d:arrived" in rec, rec  # the Done came inline from its native receipt
        stamps = [rec[STAGES[0][1]]] + [rec[b] for _, _, b in STAGES]
        assert stamps == sorted(stamps), rec  # one clock on both sides: in order
        for _, a, b in SIDE_STAGES:
            assert rec[a] <= rec[b], rec
        # the engine's own stamps: its PUTs start after planning (and after any lane
        # launch) and end at "posted"
        assert rec["planned"] <= rec.get("launched", rec["planned"]) <= rec["put"], rec
        assert rec["put"] <= rec["posted"], rec
    # tracing off: nothing recorded, on either side
    assert p["off"].drain_trace() == [] and d["off"].drain_trace() == []
