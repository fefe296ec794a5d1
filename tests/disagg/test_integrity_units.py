"""Integrity mode without processes: the wire fields, the fingerprint check, and the per-room
state machine of :mod:`kvxfer.disagg.integrity` driven step by step on a real (unstarted)
KVManager over real host buffers, in the orders a network may produce (e.g. decode's verdict
before prefill's own write completion)."""

import asyncio

import msgpack
import numpy as np
import pytest

from kvxfer import wire
from kvxfer.disagg import KVArgs, KVManager, KVPoll, MetadataBuffer, Timeouts
from kvxfer.disagg import messages as m
from kvxfer.disagg.decode_side import remote_error
from kvxfer.disagg.errors import IntegrityError, LayoutMismatch
from kvxfer.disagg.kv_args import check_compatible
from kvxfer.disagg.manager import Link
from kvxfer.disagg.rooms import Room
from kvxfer.errors import ProtocolError
from kvxfer.kernels.checksum import ALGORITHM, item_checksums_host

pytestmark = pytest.mark.timeout(30)


# ---------------------------------------------------------------------- wire + fingerprint
def test_done_sums_absent_when_off_and_typed_when_on():
    plain = m.Done(room=3, pages=2).encode()
    assert "sums" not in msgpack.unpackb(plain)  # nothing extra on the wire
    assert wire.decode(plain).sums is None
    blob = np.arange(3, dtype="<u4").tobytes()
    assert wire.decode(m.Done(room=3, pages=2, sums=blob).encode()).sums == blob
    for bad in (5, "abcd", [1, 2]):
        body = {"t": "pd.done", "v": wire.PROTOCOL_VERSION, "room": 3, "pages": 2, "sums": bad}
        with pytest.raises(ProtocolError, match="sums"):
            wire.decode(msgpack.packb(body))


def test_verdict_round_trip_and_remote_kind():
    v = wire.decode(m.Verdict(room=9, ok=False, reason="kv item 2", kind="IntegrityError").encode())
    assert (v.room, v.ok, v.kind) == (9, False, "IntegrityError")
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb({"t": "pd.verdict", "v": wire.PROTOCOL_VERSION, "room": 9}))
    assert isinstance(remote_error("IntegrityError", "x", "decode d"), IntegrityError)


def test_fingerprint_names_the_setting():
    on, off = {"page_size": 4, "integrity": ALGORITHM}, {"page_size": 4}
    check_compatible(on, dict(on), us="a", them="b")
    check_compatible(off, dict(off), us="a", them="b")
    for ours, theirs in ((on, off), (off, on)):
        with pytest.raises(LayoutMismatch) as ei:
            check_compatible(ours, theirs, us="decode d", them="prefill p")
        assert "integrity" in str(ei.value) and "'off'" in str(ei.value)
        assert ALGORITHM in str(ei.value)


# ---------------------------------------------------------------------- state machine
class Outbox:
    """The link's peer: keeps what the manager sends (decoded, as the peer would see it)."""

    def __init__(self) -> None:
        self.sent = []

    async def send(self, payload: bytes) -> None:
        self.sent.append(wire.decode(payload))


def _manager(mode: str):
    kv = np.random.default_rng(1).integers(0, 256, (4, 16, 40), dtype=np.uint8)
    aux = MetadataBuffer(8, 64)
    ap, al, ai = aux.buf_infos()
    args = KVArgs(
        kv_data_ptrs=[kv[i].ctypes.data for i in range(4)],
        kv_data_lens=[640] * 4,
        kv_item_lens=[40] * 4,
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
    )
    mgr = KVManager(
        args,
        mode,
        bootstrap_addr="127.0.0.1:9",
        integrity=True,
        timeouts=Timeouts(transfer_s=30.0, waiting_s=30.0),
    )
    assert mgr.fingerprint["integrity"] == ALGORITHM
    mgr.loop = asyncio.get_running_loop()
    return mgr, kv, aux, args


def _room(mgr, role: str, done: list):
    link = Link("k", Outbox(), "peer-x")
    r = Room(11, role, on_done=lambda state, exc: done.append((state, exc)))
    mgr.rooms.insert(r)
    r.link = link
    link.rooms.add(r)
    mgr.advance(r, KVPoll.Transferring)
    return r, link


def _expected(args, kv_ids, aux_row):
    kv = item_checksums_host(args.kv_data_ptrs, args.kv_item_lens, kv_ids)
    aux = item_checksums_host(args.aux_data_ptrs, args.aux_item_lens, [aux_row])
    return np.concatenate((kv, aux)).astype("<u4").tobytes()


@pytest.mark.asyncio
@pytest.mark.parametrize("early", [True, False], ids=["verdict-first", "write-first"])
async def test_prefill_ends_on_the_verdict_in_either_order(early):
    mgr, kv, aux, args = _manager("prefill")
    done = []
    r, link = _room(mgr, "sender", done)
    r.aux_index = 2
    assert await mgr.integrity.source(r, np.array([1, 2]), None, last=False) is None
    sums = await mgr.integrity.source(r, np.array([5]), np.zeros(0, np.int64), last=True)
    assert sums == _expected(args, [1, 2, 5], 2)  # every chunk's pages
    ok = m.Verdict(room=11, ok=True)
    if early:
        mgr.integrity.on_verdict(link, ok)  # before our completion
        assert r.state == KVPoll.Transferring and not done
        mgr.integrity.sent(r)
    else:
        mgr.integrity.sent(r)
        assert r.state == KVPoll.Transferring and not done  # holds its pages
        mgr.integrity.on_verdict(Link("other", Outbox()), ok)  # another peer: ignored
        mgr.integrity.on_verdict(link, m.Verdict(room=12, ok=True))  # another room: ignored
        assert r.state == KVPoll.Transferring and not done
        mgr.integrity.on_verdict(link, ok)
    assert done == [(KVPoll.Success, None)] and r.released


@pytest.mark.asyncio
async def test_prefill_fails_with_decodes_error():
    mgr, *_ = _manager("prefill")
    done = []
    r, link = _room(mgr, "sender", done)
    r.aux_index = 0
    await mgr.integrity.source(r, np.array([0]), None, last=True)
    mgr.integrity.sent(r)
    mgr.integrity.on_verdict(
        link, m.Verdict(room=11, ok=False, reason="kv item 0 bad", kind="IntegrityError")
    )
    ((state, exc),) = done
    assert state == KVPoll.Failed and isinstance(exc, IntegrityError)
    assert "kv item 0 bad" in str(exc) and exc.room == 11
    await asyncio.sleep(0)
    assert link.peer.sent == []  # nothing owed to decode


async def _decode_check(mgr, r, sums):
    mgr.integrity.done_arrived(r)
    mgr.integrity.check(r, m.Done(room=r.room, pages=len(r.dst_kv), sums=sums))
    for _ in range(50):  # the check task's steps
        if r.released:
            break
        await asyncio.sleep(0)
    await asyncio.sleep(0)  # the verdict's send task


def _decode_room(mgr, done):
    r, link = _room(mgr, "receiver", done)
    r.peer_aborted = True  # Done arrived
    r.dst_kv, r.dst_state, r.dst_aux_row = np.array([3, 0, 7]), np.zeros(0, np.int64), 4
    return r, link


@pytest.mark.asyncio
async def test_decode_accepts_matching_checksums_and_says_so():
    mgr, kv, aux, args = _manager("decode")
    done = []
    r, link = _decode_room(mgr, done)
    await _decode_check(mgr, r, _expected(args, [3, 0, 7], 4))
    assert done == [(KVPoll.Success, None)]
    assert [(type(v).__name__, v.ok) for v in link.peer.sent] == [("Verdict", True)]


@pytest.mark.asyncio
@pytest.mark.parametrize("where,group,index", [((1, 1, 5), "kv", 1), ("aux", "aux", 0)])
async def test_decode_rejects_a_flipped_byte_naming_the_item(where, group, index):
    mgr, kv, aux, args = _manager("decode")
    sums = _expected(args, [3, 0, 7], 4)
    if where == "aux":
        aux.data[4, 30] ^= 1
    else:
        d, page, byte = where
        kv[d, [3, 0, 7][page], byte] ^= 0x40
    done = []
    r, link = _decode_room(mgr, done)
    await _decode_check(mgr, r, sums)
    ((state, exc),) = done
    assert state == KVPoll.Failed and isinstance(exc, IntegrityError)
    assert (exc.room, exc.group, exc.index) == (11, group, index)
    (v,) = link.peer.sent
    assert not v.ok and v.kind == "IntegrityError" and f"{group} item {index} " in v.reason


@pytest.mark.asyncio
@pytest.mark.parametrize("sums", [None, b"\0" * 12, b"\0" * 20])
async def test_decode_refuses_a_done_without_the_right_checksums(sums):
    mgr, *_ = _manager("decode")
    done = []
    r, link = _decode_room(mgr, done)
    await _decode_check(mgr, r, sums)
    ((state, exc),) = done
    assert state == KVPoll.Failed and isinstance(exc, ProtocolError)
    assert "checksums" in str(exc) and "16 bytes" in str(exc)
    (v,) = link.peer.sent
    assert not v.ok and v.kind == "ProtocolError"


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "kind,cls",
    [
        ("RoomMismatch", "RoomMismatch"),
        ("TransferTimeout", "TransferTimeout"),
        ("NoSuchError", "TransferAborted"),
        ("Exception", "TransferAborted"),
    ],
)
async def test_prefill_rebuilds_decodes_error_class(kind, cls):
    mgr, *_ = _manager("prefill")
    done = []
    r, link = _room(mgr, "sender", done)
    r.aux_index = 0
    await mgr.integrity.source(r, np.array([0]), None, last=True)
    mgr.integrity.sent(r)
    mgr.integrity.on_verdict(link, m.Verdict(room=11, ok=False, reason="why", kind=kind))
    ((state, exc),) = done
    assert state == KVPoll.Failed and type(exc).__name__ == cls and "peer-x: why" in str(exc)
