"""Validation of the staged path's wire data and configuration (no UCX, no processes)."""

import pytest

from kvxfer import wire
from kvxfer.config import EngineConfig
from kvxfer.engine import messages as m
from kvxfer.engine.groups import parse_remote
from kvxfer.errors import InvalidArgument, ProtocolError

ITEM = 64  # kv: two descriptors of 32-byte items


def layout(landing):
    return m.Layout(
        groups={
            "kv": {
                "ptrs": [0x1000, 0x2000],
                "lens": [256, 256],
                "item_lens": [32, 32],
                "regions": [0, 0],
            }
        },
        region_bases=[0x1000, 0x8000],
        region_lens=[0x1100, 4 * 128],
        region_keys=[b"k", b"l"],
        region_types=["host", "host"],
        landing=landing,
    )


def land(**over):
    body = {"region": 1, "base": 0x8000, "slot_bytes": 128, "slots": [1, 3]}
    body.update(over)
    return {"kv": body}


def test_landing_parsed():
    r = parse_remote(wire.decode(layout(land()).encode()))
    assert r.landing == {"kv": (1, 0x8000, 128, [1, 3])}
    assert parse_remote(layout(None)).landing == {}


@pytest.mark.parametrize(
    "bad",
    [
        {"nope": land()["kv"]},  # unknown group
        land(region=2),  # region not in the table
        land(slots=[4]),  # slot 4 ends past the region
        land(base=0x7FFF),  # starts before the region
        land(slot_bytes=96),  # not a multiple of the 64-byte item
        land(slot_bytes=32),  # smaller than one item
        land(slots=[1, 1]),  # duplicate slot
        land(slots=[]),  # nothing granted
        land(slots=[-1]),  # not unsigned
        {"kv": {"region": 1, "base": 0x8000, "slot_bytes": 128}},  # field missing
    ],
    ids=[
        "group",
        "region",
        "slot-end",
        "base",
        "multiple",
        "small",
        "dup",
        "empty",
        "negative",
        "missing",
    ],
)
def test_bad_landing_rejected(bad):
    with pytest.raises(ProtocolError):
        parse_remote(layout(bad))


def test_staged_messages_roundtrip_and_types():
    msg = m.StagedWrite(group="kv", slot=2, offset=0, nbytes=128, dst=b"\0" * 16)
    assert wire.decode(msg.encode()) == msg
    assert wire.decode(m.SlotFree(group="kv", slot=2).encode()).slot == 2
    bad = m.StagedWrite(group="kv", slot="2", offset=0, nbytes=128, dst=b"")
    with pytest.raises(ProtocolError):
        wire.decode(bad.encode())


@pytest.mark.parametrize(
    "kw",
    [
        {"stage_min_ops": -1},
        {"stage_slot_bytes": 0},
        {"stage_slots": 0},
        {"stage_peer_slots": 0},
        {"stage_slots": 2, "stage_peer_slots": 3},
        {"stage_min_ops": True},
        {"stage_host_memory": 1},
    ],
)
def test_config_rejects(kw):
    with pytest.raises(InvalidArgument, match="stage_"):
        EngineConfig(secret=b"s", **kw)


def test_config_defaults():
    c = EngineConfig(secret=b"s")
    assert c.stage_min_ops == 0 and c.stage_peer_slots <= c.stage_slots
    assert c.stage_host_memory is False
    assert EngineConfig(secret=b"s", stage_min_ops=0).stage_min_ops == 0
