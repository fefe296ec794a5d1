"""A write that starts after its peer died never succeeds, whatever the transport's flush
does (kvxfer.testing.dead_peer_checks: two spawned processes, real UCX over loopback)."""

import pytest

from kvxfer.procs import Worker
from kvxfer.testing.dead_peer_checks import RmaSurvivor, RmaTarget

pytestmark = pytest.mark.timeout(90)

NBYTES = 4 << 20


@pytest.fixture
def pair():
    target = Worker(RmaTarget, NBYTES, name="target").start()
    survivor = Worker(RmaSurvivor, NBYTES, name="survivor").start()
    try:
        yield target, survivor
    finally:
        survivor.close()
        target.kill()


@pytest.mark.parametrize("how", ["chain", "flush"])
def test_put_to_a_dead_peer_fails(pair, how):
    """Deterministic order: one write lands; the target is SIGKILLed and reaped; the next
    write's PUTs and flush start in one loop step, before the survivor can have handled
    any report of the death. cma's flush completes OK after a PUT that failed (ESRCH), so
    without the PUTs' own statuses that write was reported done."""
    target, survivor = pair
    t, s = target.proxy(RmaTarget), survivor.proxy(RmaSurvivor)
    lanes = s.connect(t.info())
    assert any(x.startswith("cma") for x in lanes), lanes  # the lane whose flush misleads
    first = s.write(7, how)
    assert first == {"posted": 4, "result": "ok"}, first
    assert t.first(16) == bytes([7] * 16)
    target.kill()
    second = s.write(9, how)
    assert second["result"] == "PeerClosed", second
    # it fails at the flush, after posting (what failed before the fix); had UCX already
    # failed the endpoint, the PUTs would be refused instead (no "posted"): also a failure
    assert second.get("posted", 4) == 4, second
    after = s.after()  # the endpoint's handler reports the death too; later writes fail early
    assert after == {"reported": "PeerClosed", "next": "PeerClosed"}, after
