"""Create/connect/close cycles in one long-lived process (real UCX loopback): a closed engine
or manager leaves no listening socket behind, in both error modes, and the process's count
of listening sockets does not grow with the cycles."""
import pytest

from kvxfer.testing import Child
from lifecycle_nodes import lifecycle_node

pytestmark = pytest.mark.timeout(120)
MODES = pytest.mark.parametrize("mode", ["peer", "none"])


@pytest.fixture(scope="module")
def node():
    child = Child(lifecycle_node, name="lifecycle")
    child.start()
    yield child
    child.stop()


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
    _check(node.call("engines", 4, mode))


@MODES
def test_prefill_manager_cycles_leave_no_listening_socket(node, mode):
    _check(node.call("managers", 3, mode))

