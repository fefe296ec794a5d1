"""Create/connect/close cycles in one long-lived process (real UCX loopback): a closed engine
or manager leaves no listening socket behind, in both error modes, and the process's count
of listening sockets does not grow with the cycles. Long variant: two processes cycling
with writes in flight while both sides close (the SIGSEGV hunt), behind ``-m long``."""

import multiprocessing as mp

import pytest
from lifecycle_nodes import LifecycleNode, hammer_side

from kvxfer.procs import Worker

pytestmark = pytest.mark.timeout(120)
MODES = pytest.mark.parametrize("mode", ["peer", "none"])


@pytest.fixture(scope="module")
def node():
    w = Worker(LifecycleNode, name="lifecycle").start()
    yield w.proxy(LifecycleNode)
    w.close()


def _check(cycles):
    # each engine's listening socket is gone when close() returns (no gc in between) ...
    assert [c["still_listening"] for c in cycles] == [[]] * len(cycles), cycles
    # ... and nothing else piles up (UCX's own listeners come once, at the first connection)
    assert len({c["listen"] for c in cycles}) == 1, cycles


@MODES
def test_engine_cycles_leave_no_listening_socket(node, mode):
    # before: +1 LISTEN socket per cycle. A UCXX endpoint accepted by the listener keeps the
    # listener alive; ours were kept alive by a cycle through UCXX's endpoint finalizer (our
    # close callback) and by the receive request each side still had posted at close
    _check(node.engines(4, mode))


@MODES
def test_prefill_manager_cycles_leave_no_listening_socket(node, mode):
    _check(node.managers(3, mode))


@pytest.mark.long
@pytest.mark.timeout(900)
@MODES
def test_cycles_with_writes_in_flight_while_both_close(mode):
    """Hammer: 60 cycles of a fresh engine pair in two long-lived processes, four writers
    streaming while both sides close at staggered moments, the target's buffer freed when
    its next cycle allocates one; both processes must exit 0 (faulthandler on: a crash
    prints its stacks). Before the fix the target died with SIGSEGV in about half the
    runs, in both modes (PUTs still in flight when close() returned landed in memory the
    heap had reused), and error_mode=none also left bulk endpoints open under a freed
    error-handler context."""
    ctx = mp.get_context("spawn")
    ports, go = ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=hammer_side, args=(role, ports, go, 60, mode), daemon=True)
        for role in ("target", "initiator")
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(800)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, 0], codes
