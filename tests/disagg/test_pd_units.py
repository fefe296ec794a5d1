"""Pure parts of the PD protocol: poll machine, KVArgs + fingerprints, aux rows, messages,
index validation, the room table. No UCX, no torch."""

import itertools

import numpy as np
import pytest

from kvxfer import wire
from kvxfer.disagg import messages as m
from kvxfer.disagg.aux import AuxRows, MetadataBuffer, check_room
from kvxfer.disagg.errors import DuplicateRoom, LayoutMismatch
from kvxfer.disagg.handle import as_ids
from kvxfer.disagg.kv_args import KVArgs, check_compatible
from kvxfer.disagg.poll import KVPoll, can_advance, is_terminal
from kvxfer.disagg.rooms import Room, RoomTable
from kvxfer.errors import (
    DoubleFree,
    IncompatiblePeer,
    IndexOutOfRange,
    InvalidArgument,
    ProtocolError,
    TransferAborted,
    TransferTimeout,
)

pytestmark = pytest.mark.timeout(30)


def test_poll_values_match_sglang():
    assert [
        int(s)
        for s in (
            KVPoll.Failed,
            KVPoll.Bootstrapping,
            KVPoll.WaitingForInput,
            KVPoll.Transferring,
            KVPoll.Success,
        )
    ] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("a,b", list(itertools.product(KVPoll, KVPoll)))
def test_poll_transitions_exhaustive(a, b):
    ok = can_advance(a, b)
    if is_terminal(a):
        assert not ok  # terminal states are sticky
    elif b == KVPoll.Failed:
        assert ok  # fail from anywhere live
    else:
        assert ok == (b > a)  # only forward


def _aux():
    buf = MetadataBuffer(8, 64)
    return buf, buf.buf_infos()


def _args(**kw):
    buf, (ap, al, ai) = _aux()
    kv = np.zeros((4, 16, 32), dtype=np.uint8)
    base = dict(
        kv_data_ptrs=[kv[i].ctypes.data for i in range(4)],
        kv_data_lens=[512] * 4,
        kv_item_lens=[32] * 4,
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
        page_size=4,
        dtype="bfloat16",
        layout={"kv": {"kind": "mha", "size": 64}},
    )
    base.update(kw)
    return KVArgs(**base), (kv, buf)


def test_kv_args_items_and_fingerprint():
    a, _keep = _args()
    assert a.num_items("kv") == 16 and a.num_items("aux") == 8 and a.num_items("state") == 0
    fp = a.fingerprint()
    assert "size" not in fp["layout"]["kv"]  # capacity may differ between peers
    wire.decode(m.Hello(name="x", tp_rank=0, fingerprint=fp).encode())  # msgpack-able


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(page_size=8), "page_size"),
        (dict(dtype="float16"), "dtype"),
        (dict(kv_item_lens=[16] * 4, kv_data_lens=[512] * 4), "kv_item_lens"),
        (dict(layout={"kv": {"kind": "mha", "head_dim": 3}}), "layout.kv.head_dim"),
    ],
)
def test_fingerprint_mismatch_names_field_and_values(change, field):
    a, _k1 = _args()
    b, _k2 = _args(**change)
    with pytest.raises(LayoutMismatch) as ei:
        check_compatible(a.fingerprint(), b.fingerprint(), us="decode d", them="prefill p")
    assert field in str(ei.value) and isinstance(ei.value, IncompatiblePeer)
    check_compatible(
        a.fingerprint(),
        _args(layout={"kv": {"kind": "mha", "size": 9}})[0].fingerprint(),
        us="a",
        them="b",
    )  # capacity differences are fine


@pytest.mark.parametrize(
    "bad",
    [
        dict(kv_item_lens=[32] * 3),
        dict(kv_data_lens=[500] * 4),
        dict(aux_data_ptrs=[], aux_data_lens=[], aux_item_lens=[]),
        dict(page_size=0),
        dict(tp_rank=2, tp_size=2),
        dict(kv_item_lens=[0] * 4),
    ],
)
def test_kv_args_rejects(bad):
    with pytest.raises(InvalidArgument):
        _args(**bad)


def test_aux_header_stamp_clear_and_garbage():
    buf, (ap, al, ai) = _aux()
    rows = AuxRows(ap[0], al[0], ai[0])
    assert rows.rows == 8
    rows.stamp(3, 12345)
    assert rows.read_room(3) == 12345
    rows.clear(3)
    assert rows.read_room(3) is None
    buf.data[4, :16] = 7  # garbage never validates
    assert rows.read_room(4) is None
    rows.stamp(5, (1 << 63) - 1)
    assert rows.read_room(5) == (1 << 63) - 1
    with pytest.raises(IndexOutOfRange, match="8"):
        rows.stamp(8, 1)
    buf.set_output(5, -42, b"hi")
    assert buf.first_token(5) == -42 and buf.payload(5, 2) == b"hi"
    assert rows.read_room(5) == (1 << 63) - 1  # payload leaves the header alone


def test_metadata_buffer_rows():
    buf = MetadataBuffer(3, 32)
    got = [buf.alloc() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and buf.alloc() is None
    buf.free(1)
    with pytest.raises(DoubleFree, match="1"):
        buf.free(1)
    assert buf.available() == 1


@pytest.mark.parametrize("room", [-1, 1 << 63, "7", 1.5, True])
def test_room_ids_checked(room):
    with pytest.raises(InvalidArgument):
        check_room(room)


def test_as_ids():
    np.testing.assert_array_equal(as_ids([3, 1, 2], "kv", 4), [3, 1, 2])
    assert as_ids([], "kv", 4).dtype == np.int64
    with pytest.raises(IndexOutOfRange, match="kv: 4 not in"):
        as_ids(np.array([0, 4]), "kv", 4)
    with pytest.raises(IndexOutOfRange, match="-1"):
        as_ids([-1], "kv", 4)
    with pytest.raises(InvalidArgument, match="id 2 appears more than once"):
        as_ids([2, 1, 2], "kv", 4)
    with pytest.raises(InvalidArgument, match="integers"):
        as_ids([0.5], "kv", 4)
    with pytest.raises(InvalidArgument, match="1-D"):
        as_ids([[1]], "kv", 4)


def test_as_ids_against_an_oracle():
    """Every id list of length <= 4 over [-1, 5) with limit 4, unique required or not:
    accepted (as the same int64 ids) exactly when all lie in range (and, when required, none
    repeats); the error names the first out-of-range id, else the smallest repeated one."""
    import itertools

    for n in range(5):
        for ids in itertools.product(range(-1, 5), repeat=n):
            out = [x for x in ids if not 0 <= x < 4]
            rep = sorted(x for x in set(ids) if ids.count(x) > 1)
            for unique in (True, False):
                if out:
                    with pytest.raises(IndexOutOfRange, match=rf"^kv: {out[0]} not in \[0, 4\)$"):
                        as_ids(list(ids), "kv", 4, unique=unique)
                elif rep and unique:
                    with pytest.raises(InvalidArgument, match=rf"id {rep[0]} appears"):
                        as_ids(np.array(ids), "kv", 4, unique=unique)
                else:
                    got = as_ids(np.array(ids, dtype=np.int32), "kv", 4, unique=unique)
                    assert got.dtype == np.int64 and got.tolist() == list(ids)


def test_messages_roundtrip_and_validation():
    ids = np.array([5, 0, 9], dtype=np.int64)
    msg = m.TransferInfo(room=7, dst_kv=m.ids_to_bytes(ids), dst_state=b"", dst_aux=2)
    back = wire.decode(msg.encode())
    assert back == msg
    np.testing.assert_array_equal(m.ids_from_bytes(back.dst_kv, "x"), ids)
    with pytest.raises(ProtocolError, match="int64"):
        m.ids_from_bytes(b"1234567", "dst_kv")
    bad = m.TransferInfo(room="7", dst_kv=b"", dst_state=b"", dst_aux=0).encode()
    with pytest.raises(ProtocolError, match="room"):
        wire.decode(bad)
    with pytest.raises(ProtocolError, match="port"):
        m.check_entry(
            {
                "name": "p",
                "host": "h",
                "port": 0,
                "tp_rank": 0,
                "tp_size": 1,
                "dp_rank": 0,
                "pp_rank": 0,
                "fingerprint": {},
            }
        )
    with pytest.raises(ProtocolError, match="tp_rank"):
        m.check_entry(
            {
                "name": "p",
                "host": "h",
                "port": 1,
                "tp_rank": "0",
                "tp_size": 1,
                "dp_rank": 0,
                "pp_rank": 0,
                "fingerprint": {},
            }
        )


def test_room_table_duplicates_and_tombstones():
    t = RoomTable(max_tombstones=2)
    a = Room(1, "receiver")
    t.insert(a)
    with pytest.raises(DuplicateRoom, match="room 1"):
        t.insert(Room(1, "receiver"))
    p = Room(2, "pending")
    t.insert(p)
    s = Room(2, "sender")
    assert t.claim(s) == (p, None) and p.superseded  # decode's info merges
    assert t.get(2) is s
    assert not t.retire(p, TransferAborted("late")) and t.get(2) is s  # claimed: not retired
    t.remove(a, "done")
    assert t.get(1) is None
    with pytest.raises(DuplicateRoom, match="already used"):
        t.insert(Room(1, "receiver"))  # never resurrected
    assert t.bury_unless_live(2, TransferAborted("x")) is s  # live: not buried
    cause = TransferAborted("decode aborted")
    assert t.bury_unless_live(3, cause) is None
    assert t.bury_unless_live(3, TransferAborted("again")) is None and t.tombstone(3) is cause
    with pytest.raises(DuplicateRoom):
        t.insert(Room(3, "pending"))  # any tomb refuses insert
    assert t.claim(Room(3, "sender")) == (None, cause)  # soft: created, then fails
    t.remove(Room(4, "receiver"), "done")
    t.remove(Room(5, "receiver"), "done")  # bound: 1 forgotten
    assert t.tombstone(1) is None and t.tombstone(5) == "done"
    t.insert(Room(1, "receiver"))


def test_pending_record_retired_before_claim_is_never_adopted():
    """The hand-over race of issue 12 defect 1, in the table: whichever of retire (loop,
    the pending record failed) and claim (scheduler thread, KVSender) takes the lock first
    wins; a retired record is never returned to a claimant."""
    for first in ("retire", "claim"):
        t = RoomTable()
        p = Room(7, "pending")
        t.insert(p)
        s = Room(7, "sender")
        cause = TransferTimeout("pending-expired")
        if first == "retire":
            assert t.retire(p, cause) and p.released
            assert t.claim(s) == (None, cause)
        else:
            assert t.claim(s) == (p, None)
            assert not t.retire(p, cause) and not p.released
        assert t.get(7) is s
        with pytest.raises(DuplicateRoom):
            t.claim(Room(7, "sender"))
