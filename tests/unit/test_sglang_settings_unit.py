"""Torch- and SGLang-free parts of the SGLang backend: the secret's sources, the
validation of its control messages, and what SGLang's own release settings risk."""

import logging
import math

import numpy as np
import pytest

from kvxfer import wire
from kvxfer.errors import InvalidArgument, ProtocolError
from kvxfer.integrations.sglang import messages as m
from kvxfer.integrations.sglang.settings import (
    TP_STAGE_MIN_OPS,
    host_copy,
    release_risk,
    resolve_secret,
    tp_stage_min_ops,
)

pytestmark = pytest.mark.timeout(30)


def test_host_copy_is_read_per_manager():
    from kvxfer.config import EngineConfig

    assert host_copy({}) is None
    assert host_copy({"KVXFER_HOST_COPY": " OFF "}) == "off"
    assert (
        EngineConfig(secret=b"s", host_copy=host_copy({"KVXFER_HOST_COPY": "off"})).host_copy
        == "off"
    )
    with pytest.raises(InvalidArgument):
        EngineConfig(secret=b"s", host_copy=host_copy({"KVXFER_HOST_COPY": "sometimes"}))


def test_secret_from_env_then_file(tmp_path):
    assert resolve_secret({"KVXFER_SECRET": "abc"}) == b"abc"
    f = tmp_path / "secret"
    f.write_bytes(b"  from-file\n")
    assert resolve_secret({"KVXFER_SECRET_FILE": str(f)}) == b"from-file"
    assert resolve_secret({"KVXFER_SECRET": "env", "KVXFER_SECRET_FILE": str(f)}) == b"env"


@pytest.mark.parametrize("env", [{}, {"KVXFER_SECRET": ""}])
def test_no_secret_is_refused(env):
    with pytest.raises(InvalidArgument, match="shared secret"):
        resolve_secret(env)


def test_unreadable_or_empty_secret_file_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="missing"):
        resolve_secret({"KVXFER_SECRET_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(InvalidArgument, match="empty"):
        resolve_secret({"KVXFER_SECRET_FILE": str(tmp_path / "empty")})


def test_tp_stage_threshold_from_env():
    assert tp_stage_min_ops({}) == TP_STAGE_MIN_OPS == 256
    assert tp_stage_min_ops({"KVXFER_SGL_TP_STAGE_MIN_OPS": " 0 "}) == 0
    assert tp_stage_min_ops({"KVXFER_SGL_TP_STAGE_MIN_OPS": "1"}) == 1
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(InvalidArgument, match="KVXFER_SGL_TP_STAGE_MIN_OPS"):
            tp_stage_min_ops({"KVXFER_SGL_TP_STAGE_MIN_OPS": bad})


def test_room_names_the_staging_prefill_ranks():
    import msgpack

    back = wire.decode(_room(slices=["10.0.0.1:7000"]).encode())
    assert back.slices == ["10.0.0.1:7000"]
    assert wire.decode(_room().encode()).slices == []
    body = msgpack.unpackb(_room().encode())
    body["slices"] = [1]
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(body))


def _room(**kw):
    base = dict(
        room=5,
        endpoint="127.0.0.1",
        port=9,
        dst_kv=m.ids_to_bytes([3, 1]),
        dst_aux=2,
        required_dst_info_num=1,
        dst_state=[m.ids_to_bytes([4]), None],
        decode_prefix_len=8,
    )
    base.update(kw)
    return m.SglRoom(**base)


def test_room_roundtrip():
    msg = m.decode_frames([m.FRAME_TAG, _room().encode()])
    kv, states = msg.arrays()
    assert kv.tolist() == [3, 1] and states[0].tolist() == [4] and states[1] is None
    assert msg.decode_prefix_len == 8


@pytest.mark.parametrize(
    "bad",
    [
        dict(dst_kv=b"\x01\x02\x03"),
        dict(dst_kv=np.array([-1], dtype="<i8").tobytes()),
        dict(dst_state=[7]),
        dict(required_dst_info_num=0),
        dict(dst_aux=-1),
    ],
)
def test_malformed_room_is_refused(bad):
    with pytest.raises(ProtocolError):
        m.decode_frames([m.FRAME_TAG, _room(**bad).encode()]).arrays()


def _reg(**kw):
    base = dict(
        endpoint="127.0.0.1",
        port=9,
        engine_host="127.0.0.1",
        engine_port=10,
        name="sglang-decode@127.0.0.1:9",
        tp_size=1,
        tp_rank=0,
        page_size=4,
        dtype="bfloat16",
        kv_item_lens=[128],
        aux_item_lens=[64],
        state_types=[],
        state_item_lens=[],
    )
    base.update(kw)
    return m.SglRegister(**base)


@pytest.mark.parametrize(
    "bad",
    [
        dict(tp_rank=1),
        dict(port=0),
        dict(page_size=0),
        dict(state_types=["mamba"]),
        dict(state_types=["mamba"], state_item_lens=[["x"]]),
    ],
)
def test_malformed_register_is_refused(bad):
    with pytest.raises(ProtocolError):
        m.decode_frames([m.FRAME_TAG, _reg(**bad).encode()])


def test_foreign_frames_are_refused():
    assert isinstance(m.decode_frames([m.FRAME_TAG, _reg().encode()]), m.SglRegister)
    with pytest.raises(ProtocolError):
        m.decode_frames([b"OTHER", _reg().encode()])
    with pytest.raises(ProtocolError):
        m.decode_frames([m.FRAME_TAG, b"\xc1"])
    with pytest.raises(ProtocolError):
        m.decode_frames([m.FRAME_TAG, wire.Message().encode()])


@pytest.mark.parametrize("make", [_room, _reg], ids=["room", "register"])
def test_control_message_of_another_protocol_version_names_both(make):
    """A decode of another kvxfer protocol version (e.g. one without SglRoom.slices): the
    prefill refuses its control messages with VersionMismatch naming both numbers, not with
    a generic decode error about an unknown field."""
    import msgpack

    from kvxfer import wire
    from kvxfer.errors import VersionMismatch

    body = msgpack.unpackb(make().encode(), raw=False)
    body["v"] = wire.PROTOCOL_VERSION - 1
    body.pop("slices", None)
    with pytest.raises(VersionMismatch) as ei:
        m.decode_frames([m.FRAME_TAG, msgpack.packb(body, use_bin_type=True)])
    assert (ei.value.ours, ei.value.theirs) == (wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION - 1)
    assert f"version {wire.PROTOCOL_VERSION - 1}, this side {wire.PROTOCOL_VERSION}" in str(
        ei.value
    )


@pytest.mark.parametrize("timeout", [0.0, 30.0, math.inf, math.nan])
def test_deferred_release_off_warns_whatever_the_timeout(timeout):
    level, msg = release_risk(False, timeout)
    assert level == logging.WARNING
    assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off" in msg


@pytest.mark.parametrize("timeout", [-1.0, 0.0, 30.0, 1e9])
def test_a_finite_release_timeout_is_said_once_at_info(timeout):
    level, msg = release_risk(True, timeout)
    assert level == logging.INFO
    assert f"_TIMEOUT={timeout:g}" in msg and "inf" in msg


def test_deferred_release_without_timeout_risks_nothing():
    assert release_risk(True, math.inf) is None
    assert release_risk(True, float("inf")) is None
    assert release_risk(True, math.nan) is None  # a NaN deadline is never reached either
