"""Layer-wise streaming (kvxfer.disagg.layerwise), multi-process on real UCX loopback:
per-layer, page-major, MLA and hybrid pools stream chunk by chunk and layer by layer, every
byte checked on decode; decode's per-layer readiness; aborts mid-stream on either side;
CUDA-event polling (a fake event); metadata arriving mid-stream; the fence and leak checks."""

import pytest
from pd_harness import KINDS, Node

from kvxfer.errors import RemoteError

pytestmark = pytest.mark.timeout(120)


def _clean(c, node):
    for w in (c.p, c.d):
        assert w[node].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, node
        f = w[node].fence_check()
        assert f["pages"] == f["slots"] == f["rows"] == f["guards"] == [], (node, f)


def _success(c, node, r):
    res = c.d[node].wait(r)
    assert res["state"] == "Success", res
    assert c.p[node].wait(r)["state"] == "Success"
    assert c.d[node].verify(r) == 0
    _clean(c, node)


@pytest.mark.parametrize("kind", KINDS)
def test_layerwise_chunks_byte_exact(cluster, room, kind):
    """Three chunks, layers declared in order, reversed, and grouped; the hybrid kinds'
    Mamba state goes with the last chunk's last write."""
    c = cluster
    r = room()
    c.p[kind].p_open(r, 7)
    c.d[kind].d_open(r, 7)
    assert c.p[kind].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    c.p[kind].p_send_layers(r, 0, 2)
    n = c.p[kind].p_begin(r, 2, 5)
    for layer in reversed(range(n)):
        c.p[kind].p_layer(r, layer)
    c.p[kind].p_send_layers(r, 5, 7, group=2)
    _success(c, kind, r)


@pytest.mark.parametrize("kind", ["mha", "page_major"])
def test_mixed_whole_and_layerwise_chunks(cluster, room, kind):
    c = cluster
    r = room()
    c.p[kind].p_open(r, 6)
    c.d[kind].d_open(r, 6)
    c.p[kind].p_send(r, 0, 2)
    c.p[kind].p_send_layers(r, 2, 4)
    c.p[kind].p_send(r, 4, 6)
    _success(c, kind, r)


def test_layerwise_from_the_managers_loop(cluster, room):
    """An asyncio scheduler on the manager's loop: the calls run inline there."""
    c, k = cluster, "page_major"
    r = room()
    c.p[k].p_open(r, 4)
    c.d[k].d_open(r, 4)
    c.p[k].p_send_layers_on_loop(r, 0, 2)
    c.p[k].p_send_layers_on_loop(r, 2, 4)
    _success(c, k, r)


def test_decode_sees_layers_before_success(cluster, room):
    """The last chunk's early layers are visible on decode while its last write is held."""
    c, k = cluster, "page_major"
    r = room()
    c.p[k].p_open(r, 4)
    c.d[k].d_open(r, 4)
    c.p[k].p_send_layers(r, 0, 2)  # a non-final chunk: no layer is complete with it
    n = c.p[k].p_begin(r, 2, 4)
    assert n >= 2
    assert c.d[k].d_layers_ready(r) == 0
    for layer in range(n - 1):
        c.p[k].p_layer(r, layer)
        got = c.d[k].d_wait_layer(r, layer)
        assert got["ready"] == layer + 1 and got["state"] == "Transferring", got
    c.p[k].hook_on("before_write", r, "gate")  # the completing write (state, aux, Done)
    c.p[k].p_layer(r, n - 1)
    c.p[k].wait_fired("before_write", r, entered=True)
    assert c.d[k].d_layers_ready(r) == n - 1
    assert c.d[k].poll(r) == "Transferring"
    c.p[k].open_gate()
    assert c.d[k].d_wait_layer(r, n - 1)["ready"] == n
    _success(c, k, r)


def test_layers_ready_during_a_write_go_in_the_next_one(cluster, room):
    """One layer write of a room on the wire at a time: layers declared while it is held
    (the loop blocked in its post) go together in the next write, not one write each."""
    c, k = cluster, "page_major"
    r = room()
    c.p[k].p_open(r, 4)
    c.d[k].d_open(r, 4)
    assert c.p[k].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    n = c.p[k].p_begin(r, 0, 4)
    assert n >= 4
    c.p[k].hook_on("before_layer_write", r, "gate")
    c.p[k].p_layer(r, 0)
    c.p[k].wait_fired("before_layer_write", r, entered=True)
    c.p[k].hook_on("before_layer_write", r, "call", Node.note_layers_sent, r)
    c.p[k].p_layer(r, 1)
    c.p[k].p_layer(r, 2)
    c.p[k].open_gate()
    assert c.p[k].wait_record("sent", r) == ("sent", r, (0, 1, 2), 1)  # one write: [1, 2]
    for layer in range(3, n):
        c.p[k].p_layer(r, layer)
    _success(c, k, r)


@pytest.mark.parametrize("kind", ["mha", "page_major"])
def test_layer_write_is_posted_before_layer_ready_returns(cluster, room, kind):
    """A layer write starts on the stack that found the layer ready (kvxfer.eager, as a
    chunk's write does): layer_ready called on the manager's loop returns with the layer's
    bytes already posted (PUTs, or a device-lane launch), no task hop in between; the room
    completes as usual."""
    c = cluster
    r = room()
    c.p[kind].p_open(r, 4)
    c.d[kind].d_open(r, 4)
    assert c.p[kind].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    n = c.p[kind].p_begin(r, 0, 4)
    assert n >= 2
    assert c.p[kind].p_layer_on_loop(r, 0) > 0  # the first layer goes alone, posted now
    for layer in range(1, n):
        c.p[kind].p_layer(r, layer)
    _success(c, kind, r)


@pytest.mark.parametrize("kind", ["mha", "hybrid_envelope"])
def test_prefill_abort_while_a_layer_write_is_posted(cluster, room, kind):
    """Prefill's scheduler aborts just as a layer write is posted: the write lands before
    decode is told (Abort only once the chain settled), nothing is written after either
    side released, the later layer_ready calls are ignored."""
    c = cluster
    r = room()
    c.p[kind].p_open(r, 4)
    c.d[kind].d_open(r, 4)
    assert c.p[kind].poll_until(r, ["WaitingForInput"]) == "WaitingForInput"
    c.p[kind].p_send_layers(r, 0, 2)
    n = c.p[kind].p_begin(r, 2, 4)
    c.p[kind].hook_on("before_layer_write", r, "call", Node.abort, r)
    c.p[kind].p_layer(r, 0)
    assert c.p[kind].wait_fired("before_layer_write", r)[-1] == ("done", r)
    for layer in range(1, n):
        c.p[kind].p_layer(r, layer)
    res = c.p[kind].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    res = c.d[kind].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    _clean(c, kind)


def test_decode_abort_mid_stream(cluster, room):
    c, k = cluster, "hybrid_per_layer"
    r = room()
    c.p[k].p_open(r, 4)
    c.d[k].d_open(r, 4)
    c.p[k].p_send_layers(r, 0, 2)
    n = c.p[k].p_begin(r, 2, 4)
    c.p[k].p_layer(r, 0)
    c.d[k].d_wait_layer(r, 0)
    c.d[k].abort(r)
    assert c.d[k].wait(r)["state"] == "Failed"
    res = c.p[k].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    for layer in range(1, n):  # the scheduler keeps computing: ignored
        c.p[k].p_layer(r, layer)
    _clean(c, k)


def test_layers_declared_after_the_room_failed_are_ignored(cluster, room):
    """Decode aborts once a chunk's first layer went: prefill fails the room, and each
    layer its scheduler declares afterwards is dropped on the loop, none raising there
    (the first call after the failure drops the chunk, the later ones find none)."""
    c, k = cluster, "page_major"
    c.p[k].loop_errors()  # (what earlier tests left)
    r = room()
    c.p[k].p_open(r, 4)
    c.d[k].d_open(r, 4)
    n = c.p[k].p_begin(r, 0, 4)
    assert n >= 3
    c.p[k].p_layer(r, 0)
    c.d[k].d_wait_layer(r, 0)
    c.d[k].abort(r)
    assert c.d[k].wait(r)["state"] == "Failed"
    res = c.p[k].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferAborted", res
    for layer in range(1, n):
        c.p[k].p_layer(r, layer)
    assert c.p[k].loop_errors() == []
    _clean(c, k)


def test_metadata_arrives_mid_stream(cluster, room):
    """Layers declared before decode's metadata wait; a chunk declared whole by then is
    queued whole; the rest streams once decode is there."""
    c, k = cluster, "mla"
    r = room()
    c.p[k].p_open(r, 6)
    c.p[k].p_send_layers(r, 0, 2)  # all layers before decode exists: queued whole
    n = c.p[k].p_begin(r, 2, 4)
    c.p[k].p_layer(r, 0)
    c.d[k].d_open(r, 6)
    assert c.p[k].poll_until(r, ["WaitingForInput", "Transferring"]) != "Bootstrapping"
    for layer in range(1, n):
        c.p[k].p_layer(r, layer)
    c.p[k].p_send_layers(r, 4, 6)
    _success(c, k, r)


def test_cuda_event_is_polled(cluster, room):
    c, k = cluster, "mha"
    r = room()
    c.p[k].p_open(r, 2)
    c.d[k].d_open(r, 2)
    n = c.p[k].p_begin(r, 0, 2)
    for layer in range(n):
        c.p[k].p_layer(r, layer, 3 if layer % 2 == 0 else 0)
    _success(c, k, r)


def test_cuda_event_that_never_completes_times_out(cluster, room):
    c, k = cluster, "tiny"
    r = room()
    c.p[k].p_open(r, 2)
    c.d[k].d_open(r, 2)
    n = c.p[k].p_begin(r, 0, 2)
    c.p[k].p_layer(r, 0, -1)
    for layer in range(1, n):
        c.p[k].p_layer(r, layer)
    res = c.p[k].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "TransferTimeout", res
    assert "CUDA event" in res["msg"], res
    assert c.d[k].wait(r)["state"] == "Failed"
    _clean(c, k)


def test_bad_layer_calls_raise(cluster, room):
    c, k = cluster, "mha"
    r = room()
    c.p[k].p_open(r, 4)
    with pytest.raises(RemoteError, match="before begin_chunk"):
        c.p[k].p_layer(r, 0)
    n = c.p[k].p_begin(r, 0, 2)
    for bad, err in ((n, "not in"), (-1, "not in")):
        with pytest.raises(RemoteError, match=err):
            c.p[k].p_layer(r, bad)
    c.p[k].p_layer(r, 0)
    with pytest.raises(RemoteError, match="declared twice"):
        c.p[k].p_layer(r, 0)
    with pytest.raises(RemoteError, match="undeclared layers"):
        c.p[k].p_send(r, 2, 4)
    with pytest.raises(RemoteError, match="undeclared layers"):
        c.p[k].p_begin(r, 2, 4)
    c.p[k].abort(r)
    assert c.p[k].wait(r)["state"] == "Failed"
    _clean(c, k)
