"""Mixed deployments over real UCX loopback, one engine per spawned process: another channel
wait mode or another protocol version fails both ends of the connection at once with a typed
error naming both sides (not the connect timeout), and the engine serves the next, matching
connection as before."""

import pytest
from version_nodes import VersionNode

from kvxfer.procs import Worker
from kvxfer.wire import PROTOCOL_VERSION as V

pytestmark = pytest.mark.timeout(120)


def _node(name, mode):
    w = Worker(VersionNode, name, name=name, env={"KVXFER_CHANNEL_WAIT": mode}).start()
    return w, w.proxy(VersionNode)


@pytest.fixture(scope="module")
def nodes():
    made = [_node(n, mode) for n, mode in (("n1", "native"), ("n2", "native"), ("y1", "yield"))]
    yield {name: p for (w, p), name in zip(made, ("n1", "n2", "y1"))}
    for w, p in made:
        p.close()
        w.close()


@pytest.mark.parametrize("initiator,target", [("n1", "y1"), ("y1", "n1")])
def test_channel_mode_mismatch_fails_both_engines_fast(nodes, initiator, target):
    mode = {"n1": "native", "y1": "yield"}
    out = nodes[initiator].connect(*nodes[target].address())
    assert out["error"] == "IncompatiblePeer", out
    assert f"KVXFER_CHANNEL_WAIT={mode[target]}, this end {mode[initiator]}" in out["msg"], out
    assert out["s"] < 5.0, out  # the connect timeout is 20 s
    ref = nodes[target].refusal(10.0)
    assert ref["error"] == "IncompatiblePeer" and ref["peers"] == 0, ref
    assert f"KVXFER_CHANNEL_WAIT={mode[initiator]}, this end {mode[target]}" in ref["msg"], ref
    for n in (initiator, target):
        assert nodes[n].state() == {"peers": 0, "notes": 0}, n


def test_version_mismatch_fails_both_engines_then_matching_ones_connect(nodes):
    nodes["n2"].announce(V + 1)
    try:
        out = nodes["n1"].connect(*nodes["n2"].address())
        assert out["error"] == "VersionMismatch" and out["versions"] == [V, V + 1], out
        assert f"peer speaks protocol {V + 1}" in out["msg"], out
        assert out["s"] < 5.0, out
        ref = nodes["n2"].refusal(10.0)
        assert ref["error"] == "VersionMismatch" and ref["versions"] == [V + 1, V], ref
        out = nodes["n2"].connect(*nodes["n1"].address())  # the other direction
        assert out["error"] == "VersionMismatch" and out["versions"] == [V + 1, V], out
        ref = nodes["n1"].refusal(10.0)
        assert ref["error"] == "VersionMismatch" and ref["versions"] == [V, V + 1], ref
    finally:
        nodes["n2"].announce(None)
    out = nodes["n1"].connect(*nodes["n2"].address())  # same version, same mode: unchanged
    assert out["error"] == "connected", out
    assert nodes["n1"].state()["notes"] == 0, "a closed peer's channel token stayed registered"
