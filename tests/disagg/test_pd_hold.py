"""The held release ends without the peer's answer in two ways: the frozen prefill dies, or
decode's manager closes. Each kills or closes a worker, so each test has a pair of its own
(the shared pair of test_pd_fence.py is the freeze-and-resume half).

Both modes: in "peer" the loss of a killed prefill reaches decode as an endpoint error, in
"none" (the bulk endpoint has no error handling) through the channel's."""

import os
import signal

import pytest
from test_pd_fence import NO_LEAKS, pair_in, settled, to_state

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["peer", "none"])
def pair(request):
    yield from pair_in(request.param)


def _hold(c, state):
    r = next(c.rooms)
    to_state(c, r, state)
    c.p.freeze()
    assert c.d["f"].poll_until(r, ["Failed"], 30) == "Failed"
    assert c.d["f"].held(r)
    return r


def test_prefill_killed_while_held(pair):
    """Prefill freezes mid-room (decode holds the room), then dies: the engine reports the
    loss, decode closes its endpoints (what the dead peer sent last has landed) and only then
    releases — every item back, no byte of a freed one changed."""
    c = pair
    r = _hold(c, "Transferring")
    assert c.d["f"].held_rooms() == 1
    os.kill(c.p.pid, signal.SIGKILL)
    assert settled(c.d, "f", r)["state"] == "Failed"
    assert c.d["f"].leaks() == NO_LEAKS
    assert c.d["f"].held_rooms() == 0
    f = c.d["f"].fence_check()
    assert not any(f[k] for k in ("pages", "slots", "rows", "guards")), f


def test_decode_closes_while_held(pair):
    """Decode's manager closes while it holds a frozen prefill's room: close() releases it
    (with a warning: never confirmed) once the engine is closed; nothing leaks."""
    c = pair
    r = _hold(c, "WaitingForInput")
    c.d["f"].close()
    res = c.d["f"].wait(r, 30)
    assert res is not None and res["state"] == "Failed", res
    assert c.d["f"].leaks() == NO_LEAKS
