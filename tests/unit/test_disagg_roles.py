"""kvxfer.disagg.roles: the mode and room-role enums keep accepting the public spellings."""

import enum

import pytest

from kvxfer.disagg import DisaggMode, RoomRole
from kvxfer.disagg.rooms import Room
from kvxfer.errors import InvalidArgument


class _SglangMode(enum.Enum):  # SGLang's DisaggregationMode has these values
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


@pytest.mark.parametrize(
    "given,want",
    [
        (DisaggMode.PREFILL, DisaggMode.PREFILL),
        ("decode", DisaggMode.DECODE),
        (_SglangMode.PREFILL, DisaggMode.PREFILL),
        (_SglangMode.DECODE, DisaggMode.DECODE),
    ],
)
def test_mode_parse(given, want):
    assert DisaggMode.parse(given) is want
    assert want == want.value  # a str enum: equal to its value


@pytest.mark.parametrize("bad", ["sender", _SglangMode.NULL, None, 1])
def test_mode_parse_refuses(bad):
    with pytest.raises(InvalidArgument, match="prefill"):
        DisaggMode.parse(bad)


def test_room_role_from_string():
    r = Room(3, "pending")
    assert r.role is RoomRole.PENDING and r.role == "pending"
    with pytest.raises(ValueError):
        Room(4, "prefill")
