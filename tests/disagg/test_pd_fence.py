"""Fenced release, proved (issue 12, defect 6): once a side's ``on_done`` ran, no byte of the
pages, state slots and aux rows it released changes — whatever happens next.

The harness fills every item it frees with a sentinel byte and keeps a guard item at both
ends of every registered buffer (see pd_harness). Each scenario drives one room into a state,
makes something go wrong there, waits until both sides ran ``on_done``, lets the scheduler go
on (late ``send`` calls), and only then checks every freed item and every guard on both
sides: aborts from either side in every state, deadlines, decode's metadata expiring on
prefill, duplicate and late metadata, and a peer frozen (SIGSTOP) then resumed (SIGCONT).

A pair of worker processes of its own (module fixture, once per error mode): the freeze
scenarios stop a whole process.

A frozen writer cannot be fenced by closing the link: one-sided lanes (cma in error mode
"none", cuda_ipc, the device lane) write without the reader taking part, and even over tcp a
resumed writer's PUT raced the close (seen ~1 run in 6 before 2026-12-02). So decode *holds*
what it gave up on: the room fails at once (``poll()``), its items stay with decode until
the resumed writer confirms the room (Done, Abort or AbortAck) or is gone. The freeze
scenarios check both halves: held while frozen, released and clean after."""

import pytest
from pd_harness import Node, Worker
from testenv import DEVICE

pytestmark = pytest.mark.timeout(120)
K = "hybrid_per_layer"
N = 4
#: deadlines short enough to pass within a test; heartbeats long enough that an abort ack
#: that never comes (abort_ack_s) is noticed before the silence. bootstrap_s also bounds
#: decode's connect, so the fixture connects once first: with 1.5 s, a first connect (UCX
#: start-up) that timed out on a loaded machine was followed by a segfault in UCXX.
T = dict(
    bootstrap_s=4.0,
    waiting_s=1.5,
    transfer_s=1.5,
    heartbeat_interval_s=0.2,
    heartbeat_timeout_s=10.0,
    abort_ack_s=2.0,
)
NO_LEAKS = {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}
ENDED = {"Success", "Failed"}


class Pair:
    def __init__(self, mode: str = "peer"):
        from kvxfer.disagg import BootstrapServer

        self.mode = mode
        self.bs = BootstrapServer(port=0).start_in_thread()
        node = dict(kind=K, timeouts=T, bootstrap=self.bs.address, error_mode=mode, device=DEVICE)
        self.p = Worker({"f": dict(node, role="prefill")})
        self.d = Worker(
            {"f": dict(node, role="decode"), "f2": dict(node, role="decode", name="second")}
        )
        for w in (self.p, self.d):
            w.ready()
        for w, n in ((self.d, "f"), (self.d, "f2")):  # connect once, with no deadline near
            r = 4_999_999 - len(n)
            self.p["f"].p_open(r, 1)
            w[n].d_open(r, 1)
            self.p["f"].p_send(r, 0, 1)
            assert w[n].wait(r)["state"] == "Success" and w[n].verify(r) == 0
            assert self.p["f"].wait(r)["state"] == "Success"
        self.rooms = iter(range(5_000_000, 6_000_000, 7))

    def close(self):
        for w in (self.p, self.d):
            w.resume()  # never leave a frozen worker behind
            w.request_exit()
        for w in (self.p, self.d):
            w.close()
        self.bs.stop_thread()


def pair_in(mode: str):
    """A started Pair in error mode ``mode``, closed after (a fixture's body)."""
    p = Pair(mode)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module", params=["peer", "none"])
def pair(request):
    yield from pair_in(request.param)


def settled(w, node, r, timeout=30.0):
    res = w[node].wait(r, timeout)
    assert res is not None and res["state"] in ENDED, (node, r, res)
    return res


def _changed(c):
    out = {}
    for tag, w, n in (("prefill", c.p, "f"), ("decode", c.d, "f"), ("decode2", c.d, "f2")):
        f = w[n].fence_check()
        out[tag] = {(k, x) for k in ("pages", "slots", "rows", "guards") for x in f[k]}
    return out


@pytest.fixture(autouse=True)
def known(pair):
    """Changed items found before the test (a failed earlier test's) are not blamed on it."""
    pair.known = _changed(pair)


def fenced(c):
    """Everything released, and not one byte of a freed or guard item changed."""
    for w, n in ((c.p, "f"), (c.d, "f"), (c.d, "f2")):
        assert w[n].leaks() == NO_LEAKS, n
    new = {tag: items - c.known[tag] for tag, items in _changed(c).items()}
    assert not any(new.values()), new


def to_state(c, r, state):
    """Both sides open room ``r``; then drive it to ``state`` (decode's view)."""
    c.p["f"].p_open(r, N)
    if state == "Bootstrapping":  # decode not even looked up
        c.d["f"].d_open(r, N, meta=False, init=False)
        return
    c.d["f"].d_open(r, N)
    assert c.d["f"].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    if state == "Transferring":
        c.p["f"].p_send(r, 0, 1)
        assert c.d["f"].poll_until(r, ["Transferring"]) == "Transferring"


def late_sends(c, r, start=0):
    """The scheduler goes on after the failure: every remaining chunk is handed over."""
    for lo in range(start, N):
        c.p["f"].p_send(r, lo, lo + 1)


@pytest.mark.parametrize("state", ["Bootstrapping", "WaitingForInput", "Transferring"])
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_in_each_state(pair, side, state):
    c, r = pair, next(pair.rooms)
    to_state(c, r, state)
    (c.d if side == "decode" else c.p)["f"].abort(r)
    if state == "Bootstrapping":  # decode's scheduler goes on
        c.d["f"].batch([(Node.d_init, r), (Node.d_meta, r)])
    settled(c.d, "f", r)
    settled(c.p, "f", r)
    late_sends(c, r, 1 if state == "Transferring" else 0)
    fenced(c)


@pytest.mark.parametrize("state", ["WaitingForInput", "Transferring"])
def test_deadlines(pair, state):
    """Prefill never sends (or stops after a chunk): both deadlines pass; the scheduler then
    sends everything late."""
    c, r = pair, next(pair.rooms)
    to_state(c, r, state)
    assert settled(c.p, "f", r)["exc"] == "TransferTimeout"
    assert settled(c.d, "f", r)["state"] == "Failed"
    late_sends(c, r, 1 if state == "Transferring" else 0)
    fenced(c)


def test_pending_metadata_expires(pair):
    """Decode's metadata waits on prefill for a KVSender that comes too late."""
    c, r = pair, next(pair.rooms)
    c.d["f"].d_open(r, N)
    res = settled(c.d, "f", r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    c.p["f"].p_open(r, N)
    late_sends(c, r)
    res = settled(c.p, "f", r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    fenced(c)


def test_duplicate_and_late_metadata(pair):
    """A second decode sends metadata for a live room (refused), and again after the room
    finished (unknown): prefill writes into neither destination."""
    c, r = pair, next(pair.rooms)
    c.p["f"].p_open(r, N)
    c.d["f"].d_open(r, N)
    assert c.p["f"].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    c.d["f2"].d_open(r, N)
    res = settled(c.d, "f2", r)
    assert res["state"] == "Failed" and res["exc"] == "DuplicateRoom", res
    late_sends(c, r)
    assert settled(c.d, "f", r)["state"] == "Success" and c.d["f"].verify(r) == 0
    assert settled(c.p, "f", r)["state"] == "Success"
    late = next(pair.rooms)
    c.d["f2"].d_open(late, N)  # shares no id with the finished one
    c.d["f2"].abort(late)
    settled(c.d, "f2", late)
    fenced(c)


def test_prefill_frozen_before_a_write(pair):
    """Prefill stops (SIGSTOP) right before it posts a write. Decode's lease runs out, its
    abort is never acknowledged: the room fails but its items stay held (on_done does not
    run). Prefill resumes (SIGCONT) and posts that write — into pages decode still holds
    — then answers: decode releases, and not one released byte changed."""
    c, r = pair, next(pair.rooms)
    to_state(c, r, "Transferring")
    c.p["f"].hook_on("before_write", r, "freeze")
    c.p["f"].p_send(r, 1, N)
    assert c.p.stopped()
    try:
        assert c.d["f"].poll_until(r, ["Failed"], 30) == "Failed"
        assert c.d["f"].held(r)
    finally:
        c.p.resume()
    assert c.p["f"].wait_fired("before_write", r) == [("before_write", r), ("resumed", r)]
    assert settled(c.d, "f", r)["state"] == "Failed"
    settled(c.p, "f", r)  # Success where its write completed (one-sided: it does)
    fenced(c)


def test_decode_frozen_while_prefill_writes(pair):
    """Decode stops while prefill writes towards it. Over tcp ("peer") the write times out,
    so prefill fences the link before it releases its source pages, and decode resumes and
    fails. Over a one-sided lane ("none") the write needs no help from decode: both sides
    succeed, byte-exact."""
    c, r = pair, next(pair.rooms)
    to_state(c, r, "Transferring")
    c.d.freeze()
    try:
        c.p["f"].p_send(r, 1, N)
        p_state = settled(c.p, "f", r)["state"]
    finally:
        c.d.resume()
    d_state = settled(c.d, "f", r)["state"]
    if c.mode == "peer":
        assert p_state == "Failed"
    if p_state == "Success":
        assert d_state == "Success" and c.d["f"].verify(r) == 0
    else:
        assert d_state == "Failed"
    fenced(c)


def test_prefill_frozen_while_idle(pair):
    """Prefill stops with rooms waiting; decode gives up on the silent peer: its rooms fail
    and stay held. Prefill resumes and its scheduler sends: whatever lands, lands in held
    pages; decode releases once prefill confirmed each room; both sides clean."""
    c = pair
    rs = [next(pair.rooms) for _ in range(3)]
    for r in rs:
        c.p["f"].p_open(r, N)
        c.d["f"].d_open(r, N)
        assert c.p["f"].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    c.p.freeze()
    try:
        for r in rs:
            assert c.d["f"].poll_until(r, ["Failed"], 30) == "Failed"
            assert c.d["f"].held(r)
    finally:
        c.p.resume()
    for r in rs:
        late_sends(c, r)
        settled(c.p, "f", r)
        assert settled(c.d, "f", r)["state"] == "Failed"
    fenced(c)
