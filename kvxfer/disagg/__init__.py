"""Prefill/decode disaggregation protocol: KVArgs, KVPoll, KVManager, KVSender, KVReceiver,
BootstrapServer. Importing this package does not import UCX (the engine loads on start)."""

from kvxfer.disagg.aux import MetadataBuffer
from kvxfer.disagg.bootstrap import BootstrapServer
from kvxfer.disagg.context import Timeouts
from kvxfer.disagg.errors import (
    DuplicateRoom,
    IntegrityError,
    LayoutMismatch,
    RoomMismatch,
    UnknownRoom,
)
from kvxfer.disagg.kv_args import KVArgs
from kvxfer.disagg.manager import KVManager
from kvxfer.disagg.poll import KVPoll
from kvxfer.disagg.receiver import KVReceiver
from kvxfer.disagg.roles import DisaggMode, RoomRole
from kvxfer.disagg.sender import KVSender

__all__ = [
    "BootstrapServer",
    "DisaggMode",
    "DuplicateRoom",
    "IntegrityError",
    "KVArgs",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "LayoutMismatch",
    "MetadataBuffer",
    "RoomMismatch",
    "RoomRole",
    "Timeouts",
    "UnknownRoom",
]
