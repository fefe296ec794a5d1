"""The SGLang backend's control messages (kvxfer.integrations.sglang.messages): who sent a
message prefill refused (``refused_sender``) - read from the fields every protocol version
put there, None for anything it cannot attribute."""

import msgpack
import pytest

from kvxfer import wire
from kvxfer.errors import ProtocolError, VersionMismatch
from kvxfer.integrations.sglang.messages import (
    FRAME_TAG,
    Sender,
    SglRegister,
    SglRoom,
    decode_frames,
    refused_sender,
)

pytestmark = pytest.mark.timeout(30)


def _room(**kw):
    base = dict(
        room=7,
        endpoint="10.0.0.2",
        port=4000,
        dst_kv=b"",
        dst_aux=1,
        required_dst_info_num=1,
        dst_state=[],
    )
    return SglRoom(**dict(base, **kw))


def _reg():
    return SglRegister(
        endpoint="10.0.0.2",
        port=4000,
        engine_host="10.0.0.2",
        engine_port=4001,
        name="d",
        tp_size=1,
        tp_rank=0,
        page_size=4,
        dtype="bfloat16",
        kv_item_lens=[64],
        aux_item_lens=[8],
        state_types=[],
        state_item_lens=[],
    )


def _with(msg, **fields):
    body = msgpack.unpackb(msg.encode(), raw=False)
    body.update(fields)
    return [FRAME_TAG, msgpack.packb(body, use_bin_type=True)]


@pytest.mark.parametrize("version", [wire.PROTOCOL_VERSION - 1, wire.PROTOCOL_VERSION + 1, 99])
def test_other_version_room_is_attributed(version):
    frames = _with(_room(), v=version)
    with pytest.raises(VersionMismatch) as ei:
        decode_frames(frames)
    assert f"version {version}, this side {wire.PROTOCOL_VERSION}" in str(ei.value)
    s = refused_sender(frames)
    assert s == Sender("sgl.room", "10.0.0.2", 4000, 7)
    assert s.key == "10.0.0.2:4000"


def test_registration_has_no_room():
    frames = _with(_reg(), v=wire.PROTOCOL_VERSION + 1)
    assert refused_sender(frames) == Sender("sgl.register", "10.0.0.2", 4000, None)


def test_a_future_version_with_other_fields_still_attributed():
    frames = _with(_room(), v=wire.PROTOCOL_VERSION + 1, new_field=[1, 2], t="sgl.room2")
    with pytest.raises(VersionMismatch):
        decode_frames(frames)
    assert refused_sender(frames) == Sender("sgl.room2", "10.0.0.2", 4000, 7)


def test_malformed_but_attributable():
    frames = _with(_room(), dst_kv=b"123")  # not whole int64s: refused later, by arrays()
    msg = decode_frames(frames)
    with pytest.raises(ProtocolError):
        msg.arrays()
    assert refused_sender(frames).room == 7


@pytest.mark.parametrize(
    "fields",
    [
        dict(endpoint=None),
        dict(endpoint=""),
        dict(endpoint=5),
        dict(endpoint="x" * 256),
        dict(port=0),
        dict(port=65536),
        dict(port=True),
        dict(port="4000"),
        dict(port=4000.0),
        dict(room=-1),
        dict(room=True),
        dict(room="7"),
    ],
)
def test_unattributable_fields(fields):
    assert refused_sender(_with(_room(), **fields)) is None


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [FRAME_TAG],
        [b"OTHER", _room().encode()],
        [FRAME_TAG, _room().encode(), b""],
        [FRAME_TAG, b"\xc1"],  # never used in msgpack
        [FRAME_TAG, msgpack.packb([1, 2])],
    ],
)
def test_not_a_control_message(frames):
    assert refused_sender(frames) is None


def test_only_the_sender_fields_are_read():
    frames = [FRAME_TAG, msgpack.packb({1: "a", "endpoint": "h", "port": 1})]
    assert refused_sender(frames) == Sender("", "h", 1, None)


def test_oversized_is_not_read():
    big = [FRAME_TAG, b"\x00" * (wire.MAX_MESSAGE_BYTES + 1)]
    assert refused_sender(big) is None
