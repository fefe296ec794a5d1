"""The two enums that name who is who in the PD protocol.

* :class:`DisaggMode`: what a :class:`~kvxfer.disagg.KVManager` serves, prefill or decode.
  Its values are SGLang's ``DisaggregationMode`` values, so :meth:`DisaggMode.parse` accepts
  our enum, SGLang's, or the plain strings ``"prefill"`` / ``"decode"``.
* :class:`RoomRole`: what a room record is on its manager: the prefill end of a request
  (``SENDER``), the decode end (``RECEIVER``), or decode's metadata held on prefill until the
  KVSender exists (``PENDING``).

Both are ``str`` enums, so each member compares equal to its value.
"""

from __future__ import annotations

import enum
from typing import Any

from kvxfer.errors import InvalidArgument


class DisaggMode(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, mode: Any) -> "DisaggMode":
        """``mode`` as a DisaggMode: ours, SGLang's ``DisaggregationMode`` (by its value) or
        a string; InvalidArgument for anything else."""
        try:
            return cls(getattr(mode, "value", mode))
        except ValueError:
            raise InvalidArgument(f"mode {mode!r} is not 'prefill' or 'decode'") from None


class RoomRole(str, enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"
    PENDING = "pending"
