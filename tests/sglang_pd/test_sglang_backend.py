"""kvxfer as SGLang's transfer backend, driven the way SGLang's schedulers drive it.

Real parts only: sglang==0.5.23's own classes (server-argument parser, runtime context,
``MHATokenToKVPool`` / ``HybridLinearKVPool`` + ``MambaPool``, ``MetadataBuffers``, ``KVArgs``,
``get_kv_class(TransferBackend("kvxfer"), ...)``, its HTTP bootstrap server), kvxfer's engine
over UCX on loopback, one process per role (spawn). The decode process is DP rank 1 of 2
while prefill has one DP rank, so every transfer here crosses differing DP ranks.
"""

import random
import time
from importlib.metadata import entry_points

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

import sgl_nodes as N  # noqa: E402
from sgl_harness import DONE, ENV, FAILED, SUCCESS, TRANSFERRING, WAITING  # noqa: E402
from sgl_harness import start as _start  # noqa: E402

from kvxfer.procs import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster():
    workers = [
        Worker(N.BootstrapServers, 6, name="bootstrap", env=ENV),
        Worker(N.node, "prefill", name="prefill", env=ENV),
        Worker(N.node, "decode", ("--dp-size", "2"), 1, name="decode", env=ENV),
    ]
    try:
        _start(*workers)
        ports = workers[0].proxy(N.BootstrapServers).ports()
        pf, dc = workers[1].proxy(N.PrefillNode), workers[2].proxy(N.DecodeNode)
        info = {}
        for scen, kind, port in (("mha", "mha", ports[0]), ("mamba", "mamba", ports[1])):
            info[scen] = (
                pf.add(scen, kind, port, timeout=120),
                dc.add(scen, kind, port, timeout=120),
            )
        yield dict(pf=pf, dc=dc, ports=ports, info=info)
    finally:
        for w in reversed(workers):
            w.close()


def _pages(rng, n, exclude=()):
    return rng.sample([p for p in range(1, 60) if p not in exclude], n)


def _open(
    pf, dc, scen, port, room, d_pages, d_aux, p_aux, first, n_tokens, mamba_d=None, prefix_tokens=0
):
    """Both ends of a room up to the point where prefill may send."""
    assert pf.sender(scen, room, "127.0.0.1", port) == "KvxferKVSender"
    got = dc.receiver(scen, room, f"127.0.0.1:{port}")
    assert got == {"prefill_dp_rank": 0, "dp_size": 1}
    dc.metadata(scen, room, d_pages, d_aux, mamba_d, prefix_tokens)
    assert pf.wait(room, [WAITING, FAILED], 30) == WAITING
    return pf.start(scen, room, n_tokens, p_aux, first)


def test_manager_is_kvxfer_and_decode_dp_differs(cluster):
    p_info, d_info = cluster["info"]["mha"]
    assert p_info["cls"] == d_info["cls"] == "KvxferKVManager"
    assert d_info["system_dp_rank"] == 1 and p_info["system_dp_rank"] == 0


def test_server_args_accept_kvxfer(cluster):
    """SGLang's own parser, after the plugin was loaded the way SGLang loads it (its
    ``load_plugins()`` over the installed entry point; a bare source checkout falls back to
    calling the plugin's ``register()``)."""
    dc = cluster["dc"]
    base = ["--model-path", "dummy", "--device", "cpu", "--disaggregation-mode", "decode"]
    ok, backend, via, secret_file = dc.parse(
        base
        + [
            "--disaggregation-transfer-backend",
            "kvxfer",
            "--kvxfer-secret-file",
            "/run/kvxfer.secret",
        ]
    )
    assert (ok, backend, secret_file) == ("ok", "kvxfer", "/run/kvxfer.secret")
    installed = any(ep.name == "kvxfer" for ep in entry_points(group="sglang.srt.plugins"))
    assert via == ("entry_point" if installed else "register")
    assert dc.parse(base + ["--disaggregation-transfer-backend", "kvxferx"]) == ["exit", 2]


@pytest.mark.parametrize("chunks", [[4], [1, 2, 1], [2, 2]])
def test_mha_chunked_byte_exact_first_token(cluster, chunks):
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    room = 1000 + len(chunks) * 10 + chunks[0]
    rng = random.Random(room)
    n = sum(chunks)
    p_pages, d_pages = _pages(rng, n), _pages(rng, n)
    pf.fill("mha", room, p_pages)
    started = _open(pf, dc, "mha", port, room, d_pages, 3, 5, 4242 + room, n * N.PAGE - 1)
    assert started == {"prefix": 0, "pages": n}
    at = 0
    for i, c in enumerate(chunks):
        last = i == len(chunks) - 1
        assert pf.send(room, p_pages[at : at + c], last) is True
        at += c
        if not last:
            assert pf.poll(room) in (WAITING, TRANSFERRING)
            assert dc.poll(room) != SUCCESS
    assert pf.wait(room, DONE, 30) == SUCCESS
    assert dc.wait(room, DONE, 30) == SUCCESS
    assert dc.read("mha", d_pages) == dc.expected("mha", room, n)
    assert dc.first_token("mha", 3) == [4242 + room, room]
    kv_items, aux_items, _ = cluster["info"]["mha"][0]["item_lens"]
    nbytes, latency = pf.metric(room)
    assert nbytes == n * sum(kv_items) + sum(aux_items)
    assert latency is not None and latency > 0
    pf.clear(room)
    dc.clear(room)


def test_hybrid_mamba_byte_exact(cluster):
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][1]
    room, rng = 2001, random.Random(2001)
    p_pages, d_pages = _pages(rng, 5), _pages(rng, 5)
    pf.fill("mamba", room, p_pages, 2)
    _open(pf, dc, "mamba", port, room, d_pages, 6, 1, 777, 5 * N.PAGE, mamba_d=5)
    pf.send(room, p_pages[:3], False)
    pf.send(room, p_pages[3:], True, 2)
    assert pf.wait(room, DONE, 30) == SUCCESS
    assert dc.wait(room, DONE, 30) == SUCCESS
    assert dc.read("mamba", d_pages, 5) == dc.expected("mamba", room, 5, 0, True)
    assert dc.first_token("mamba", 6) == [777, room]
    kv_items, aux_items, state_items = cluster["info"]["mamba"][0]["item_lens"]
    assert pf.metric(room)[0] == 5 * sum(kv_items) + sum(aux_items) + sum(state_items[0])
    pf.clear(room)
    dc.clear(room)


def test_decode_prefix_sends_only_the_suffix(cluster):
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    room, rng = 3001, random.Random(3001)
    p_pages = _pages(rng, 6)
    d_suffix = _pages(rng, 4)
    before = dc.read("mha", d_suffix)
    pf.fill("mha", room, p_pages)  # prefill computed all 6 pages
    started = _open(
        pf, dc, "mha", port, room, d_suffix, 2, 2, 99, 6 * N.PAGE, prefix_tokens=2 * N.PAGE
    )
    assert started == {"prefix": 2 * N.PAGE, "pages": 4}
    pf.send(room, p_pages[2:], True)
    assert dc.wait(room, DONE, 30) == SUCCESS
    got = dc.read("mha", d_suffix)
    assert got == dc.expected("mha", room, 4, 2) != before
    kv_items = cluster["info"]["mha"][0]["item_lens"][0]
    assert pf.metric(room)[0] == 4 * sum(kv_items) + sum(cluster["info"]["mha"][0]["item_lens"][1])
    pf.clear(room)
    dc.clear(room)


def test_decode_says_what_sglangs_own_release_risks(cluster):
    """SGLang frees a failed room's decode pages without prefill's drained ack — after its
    deferred-release timeout (30 s by default), or at once with deferred release off; the
    decode manager says so at start, read from SGLang's own settings."""
    risk = cluster["info"]["mha"][1]["release_risk"]
    assert risk is not None and "_TIMEOUT=30:" in risk, risk
    off = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "false"}
    got = cluster["dc"].add("risk-off", "mha", cluster["ports"][0], env=off, timeout=120)
    assert "DEFERRED_DECODE_KV_RELEASE is off" in got["release_risk"], got
    inf = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "inf"}
    got = cluster["dc"].add("risk-none", "mha", cluster["ports"][0], env=inf, timeout=120)
    assert got["release_risk"] is None, got
    assert cluster["info"]["mha"][0]["release_risk"] is None  # prefill: not its call


def test_abort_from_decode_acks_only_after_the_write_settled(cluster):
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    room, rng = 4001, random.Random(4001)
    p_pages, d_pages = _pages(rng, 3), _pages(rng, 3)
    pf.fill("mha", room, p_pages)
    _open(pf, dc, "mha", port, room, d_pages, 7, 7, 1, 3 * N.PAGE)
    pf.hold_writes("mha")
    try:
        pf.send(room, p_pages, True)
        for _ in range(2000):  # the write is parked in flight
            if pf.parked():
                break
        assert pf.parked() == 1
        dc.abort(room)
        assert dc.poll(room) == FAILED
        assert pf.wait(room, [FAILED], 30) == FAILED
        # prefill knows about the abort, but its write may still land: no ack yet
        assert dc.release_safe("mha", room) is False
    finally:
        pf.release_writes("mha")
    for _ in range(3000):
        if dc.release_safe("mha", room):
            break
    assert dc.release_safe("mha", room) is True
    kind, msg = dc.failure(room)
    assert kind == "KVTransferError" and "Aborted by AbortReq" in msg
    kind, msg = pf.failure(room)
    assert kind == "KVTransferError" and "Aborted by decode" in msg
    assert pf.metrics("mha")["failures"].get("TransferAborted", 0) >= 1


def test_abort_from_prefill_reaches_decode_after_the_write(cluster):
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    room, rng = 4002, random.Random(4002)
    p_pages, d_pages = _pages(rng, 2), _pages(rng, 2)
    _open(pf, dc, "mha", port, room, d_pages, 8, 8, 1, 2 * N.PAGE)
    pf.hold_writes("mha")
    try:
        pf.send(room, p_pages, True)
        for _ in range(2000):
            if pf.parked():
                break
        pf.abort(room)
        assert pf.poll(room) == FAILED
        # decode is told only once the room's write settled
        assert dc.wait(room, [FAILED], 1.0) != FAILED
    finally:
        pf.release_writes("mha")
    assert dc.wait(room, DONE, 30) == FAILED
    kind, msg = dc.failure(room)
    assert kind == "KVTransferError" and "Aborted by prefill" in msg
    assert pf.failure(room)[0] == "KVTransferError"


def test_direct_sends_and_aborts_right_behind_them(cluster):
    """A small last chunk's write is planned and posted on the scheduler's thread (the engine
    loop's guest, when idle) and its SglDone goes on the RMA endpoint's notification lane.
    An abort right behind such a send on the same thread: prefill's room is Failed; decode's
    ends terminal - Failed, or Success where the write and its SglDone completed before the
    abort ran (the receiver keeps the first terminal state it polled; then every byte is
    there). Rooms sent normally in between are byte-exact."""
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    d0, n0 = pf.direct_calls("mha"), pf.notes_sent("mha")
    for room in range(5001, 5021):
        rng = random.Random(room)
        p_pages, d_pages = _pages(rng, 1), _pages(rng, 1)
        pf.fill("mha", room, p_pages)
        _open(pf, dc, "mha", port, room, d_pages, 9, 9, 31, N.PAGE)
        if room % 2:
            assert pf.send_then_abort(room, p_pages)
            assert pf.poll(room) == FAILED
            if dc.wait(room, DONE, 30) == SUCCESS:
                assert dc.read("mha", d_pages) == dc.expected("mha", room, 1)
            else:
                assert "Aborted by prefill" in dc.failure(room)[1]
        else:
            assert pf.send(room, p_pages, True) is True
            assert pf.wait(room, DONE, 30) == SUCCESS
            assert dc.wait(room, DONE, 30) == SUCCESS
            assert dc.read("mha", d_pages) == dc.expected("mha", room, 1)
        pf.clear(room)
        dc.clear(room)
    assert pf.direct_calls("mha") > d0  # an idle loop: sends ran direct
    # each normal room was alone in flight: its SglDone went on the notification lane
    assert pf.notes_sent("mha") - n0 >= 10


def test_decode_poll_takes_the_done_its_loop_did_not_handle(cluster):
    """The receiver's poll() handles prefill's SglDone itself when it already arrived
    (``KvxferKVManager.take_arrived``, as the engine loop's guest): forced by making decode's
    loop stop watching its completion queue; a poll with the take off sees nothing."""
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][0]
    for room in (5100, 5101):  # the first connects the engines (the handshake needs the loop)
        rng = random.Random(room)
        p_pages, d_pages = _pages(rng, 2), _pages(rng, 2)
        pf.fill("mha", room, p_pages)
        _open(pf, dc, "mha", port, room, d_pages, 11, 11, 77, 2 * N.PAGE)
        if room == 5101:
            break
        assert pf.send(room, p_pages, True) is True
        assert pf.wait(room, DONE, 30) == SUCCESS
        assert dc.wait(room, DONE, 30) == SUCCESS
        pf.clear(room)
        dc.clear(room)
    dc.set_poll_takes("mha", False)
    dc.deaf("mha", True)
    try:
        assert pf.send(room, p_pages, True) is True
        assert pf.wait(room, DONE, 30) == SUCCESS, pf.failure(room)
        assert dc.queued("mha", 1) >= 1  # decode's SglDone arrived; nobody handled it
        assert dc.poll(room) not in DONE
        dc.set_poll_takes("mha", True)
        assert dc.poll(room) == SUCCESS  # this very poll handled it
        assert dc.queued("mha", 0, 0) == 0
    finally:
        dc.deaf("mha", False)
        dc.set_poll_takes("mha", True)
    assert dc.read("mha", d_pages) == dc.expected("mha", room, 2)
    pf.clear(room)
    dc.clear(room)


def test_unsupported_is_refused_with_the_reason(cluster):
    pf, dc = cluster["pf"], cluster["dc"]
    kind, msg = dc.refused("mha", "swa")
    assert kind == "UnsupportedOperation" and "'swa' is not supported" in msg
    assert pf.incompatible("mamba") is None
    # another TP size is planned per pair (test_sglang_hetero_tp.py): here the kv pages of
    # a TP-1 layout cannot be a TP-2 rank's
    assert "are not pages of" in pf.incompatible("mamba", {"tp_size": 2, "tp_rank": 1})
    assert "kv_item_lens" in pf.incompatible("mha", {"kv_item_lens": [64] * 6})
    assert "state_item_lens" in pf.incompatible("mamba", {"state_item_lens": [[8] * 4]})


def test_envelope_mamba_layout_is_refused_by_name(cluster):
    """SGLang's envelope (page-major) Mamba layout registers strided views at their logical
    size: the descriptors of one slot entry overlap, slot i is not at ptr + i * item_len
    (shown here on SGLang's own pool), and moving them at face value would move the wrong
    bytes. Both roles refuse the layout at manager start, naming it; the plain layout of the
    same model passes the same check (the "mamba" scenario)."""
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][1]
    regions, strides = dc.state_regions("envelope")
    assert all(s != n for (_, _, n), s in zip(regions, strides))  # strided: not dense
    assert regions[1][0] < regions[0][1]  # layer 1's conv starts inside layer 0's span
    plain, plain_strides = dc.state_regions("mamba")
    assert [n for _, _, n in plain] == plain_strides  # dense item arrays
    for node in (pf, dc):
        kind, msg = node.try_add("envelope", "envelope", port, timeout=120)
        assert kind == "UnsupportedOperation"
        assert "envelope (page-major) Mamba state layout" in msg and "'state0'" in msg
        assert "descriptors 0 and 1 overlap" in msg


def test_wrong_secret_moves_nothing_and_fails_the_room(cluster):
    """A decode whose engine has another secret never gets a byte: prefill's handshake is
    refused, the room fails on both sides with the reason, decode's pages stay as they were."""
    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][4]
    pf.add("intruder", "mha", port, timeout=120)
    dc.add("intruder", "mha", port, "not-the-secret", timeout=120)
    room, d_pages = 6001, [4, 5]
    pf.fill("intruder", room, [7, 8])
    before = dc.read("intruder", d_pages)
    _open(pf, dc, "intruder", port, room, d_pages, 1, 1, 5, 2 * N.PAGE)
    pf.send(room, [7, 8], True)
    assert pf.wait(room, DONE, 60) == FAILED
    assert dc.wait(room, DONE, 60) == FAILED
    assert "Authentication" in dc.failure(room)[1]
    assert "Authentication" in pf.failure(room)[1]
    assert dc.read("intruder", d_pages) == before
    assert dc.first_token("intruder", 1)[1] == 0  # metadata row untouched


def test_decode_of_another_version_fails_fast_naming_both(cluster):
    """A decode rank whose control messages claim another kvxfer protocol version: prefill
    cannot read its registration nor its room metadata (VersionMismatch), and answers the
    room instead of dropping it - the room fails on both sides within seconds (not at
    SGLang's bootstrap/waiting timeouts) with the reason naming both versions; nothing
    moves, nothing is left in any table after clear."""
    from kvxfer.wire import PROTOCOL_VERSION

    pf, dc, port = cluster["pf"], cluster["dc"], cluster["ports"][5]
    theirs = PROTOCOL_VERSION + 1
    pf.add("oldver", "mha", port, timeout=120)
    dc.add("oldver", "mha", port, timeout=120)
    assert dc.claim_version("oldver", theirs)
    room, d_pages = 6101, [6, 7]
    pf.fill("oldver", room, [9, 10])
    before = dc.read("oldver", d_pages)
    assert pf.sender("oldver", room, "127.0.0.1", port) == "KvxferKVSender"
    dc.receiver("oldver", room, f"127.0.0.1:{port}")
    t0 = time.monotonic()
    dc.metadata("oldver", room, d_pages, 2)
    assert dc.wait(room, DONE, 5) == FAILED
    assert pf.wait(room, DONE, 5) == FAILED
    assert time.monotonic() - t0 < 5
    want = f"protocol version {theirs}, this side {PROTOCOL_VERSION}"
    for node in (dc, pf):
        kind, msg = node.failure(room)  # (as a scheduler reads it: pops the record)
        assert kind == "KVTransferError"
        assert "VersionMismatch" in msg and want in msg and "sgl.room" in msg
    assert pf.metrics("oldver")["failures"].get("VersionMismatch") == 1
    assert dc.read("oldver", d_pages) == before
    assert pf.peers("oldver", 0) == 0  # never registered: never connected
    for node in (pf, dc):
        assert node.room_entries("oldver", room) == []


def test_killed_prefill_fails_decode_room(cluster):
    dc, port = cluster["dc"], cluster["ports"][2]
    vw = Worker(N.node, "prefill", name="prefill-victim", env=ENV)
    try:
        _start(vw)
        victim = vw.proxy(N.PrefillNode)
        victim.add("victim", "mha", port, timeout=120)
        dc.add("victim", "mha", port, timeout=120)
        room = 5001
        victim.sender("victim", room, "127.0.0.1", port)
        dc.receiver("victim", room, f"127.0.0.1:{port}")
        dc.metadata("victim", room, [1, 2], 9)
        assert victim.wait(room, [WAITING, FAILED], 30) == WAITING
        assert dc.peers("victim") == 1  # prefill's engine reached ours
        vw.kill()
        assert dc.wait(room, DONE, 60) == FAILED
        kind, msg = dc.failure(room)
        assert kind == "KVTransferError" and "gone" in msg
        assert dc.metrics("victim")["failures"].get("PeerClosed") == 1
    finally:
        vw.kill()


def test_killed_decode_fails_prefill_room(cluster):
    pf, port = cluster["pf"], cluster["ports"][3]
    vw = Worker(N.node, "decode", name="decode-victim", env=ENV)
    try:
        _start(vw)
        victim = vw.proxy(N.DecodeNode)
        pf.add("victim", "mha", port, timeout=120)
        victim.add("victim", "mha", port, timeout=120)
        room = 5002
        pf.sender("victim", room, "127.0.0.1", port)
        victim.receiver("victim", room, f"127.0.0.1:{port}")
        victim.metadata("victim", room, [3, 4], 9)
        assert pf.wait(room, [WAITING, FAILED], 30) == WAITING
        pf.start("victim", room, 2 * N.PAGE, 9, 5)
        assert pf.peers("victim") == 1
        vw.kill()
        assert pf.wait(room, DONE, 60) == FAILED
        kind, msg = pf.failure(room)
        assert kind == "KVTransferError"
        assert pf.send(room, [1, 2], True) is True  # a late send is a no-op
        assert pf.poll(room) == FAILED
    finally:
        vw.kill()
