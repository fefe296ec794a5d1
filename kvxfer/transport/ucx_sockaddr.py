"""Socket addresses of a UCP endpoint made from a socket address (``ucp_ep_query``).

Both ends of one sockaddr connection see the same pair of addresses with the roles swapped:
the connecting side's (local, remote) is the accepting side's (remote, local). The engine's
handshake binds its proofs to that pair (:meth:`kvxfer.transport.ucx_channel.UcxChannel.binding`), so
a proof made on one connection is worthless on another: a relay between two connections
cannot forward it.

``ucp_ep_query`` is called through ctypes on the libucp that UCXX loaded (the extension and
UCXX share it, see :func:`kvxfer.transport.ucx_lib.load_ucx`); ``ucp_ep_attr_t`` starts with
``uint64_t field_mask; char name[UCP_ENTITY_NAME_MAX]; struct sockaddr_storage local,
remote; ...`` (UCX >= 1.14).
"""

from __future__ import annotations

import ctypes
import functools
import ipaddress
import os
import socket
import struct
from typing import Tuple

from kvxfer.errors import TransportError

_FIELD_LOCAL_SOCKADDR = 1 << 1
_FIELD_REMOTE_SOCKADDR = 1 << 2
_NAME_MAX = 32  # UCP_ENTITY_NAME_MAX
_SOCKADDR_STORAGE = 128
_LOCAL_OFF = 8 + _NAME_MAX
_REMOTE_OFF = _LOCAL_OFF + _SOCKADDR_STORAGE
#: more than sizeof(ucp_ep_attr_t) of any UCX release: later fields are not asked for
_ATTR_BYTES = 1024


@functools.lru_cache(maxsize=1)
def _ucp_ep_query():
    """``ucp_ep_query`` of the libucp already in the process (UCXX loaded it)."""
    try:
        lib = ctypes.CDLL("libucp.so.0", mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)
    except OSError as exc:
        raise TransportError(f"libucp is not loaded: {exc}") from None
    fn = lib.ucp_ep_query
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _parse(raw: bytes) -> Tuple[str, int]:
    (family,) = struct.unpack_from("=H", raw, 0)
    (port,) = struct.unpack_from(">H", raw, 2)
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port
    if family == socket.AF_INET6:
        ip = ipaddress.IPv6Address(raw[8:24])
        return str(ip.ipv4_mapped or ip), port  # one spelling for an IPv4 peer
    raise TransportError(f"ucp_ep_query: socket address of family {family}")


def sockaddrs(ep_handle: int) -> Tuple[Tuple[str, int], Tuple[str, int]]:
    """``((local ip, port), (remote ip, port))`` of a UCP endpoint connected to a socket
    address; :class:`TransportError` when UCX cannot say (not a sockaddr endpoint)."""
    if not ep_handle:
        raise TransportError("ucp_ep_query: endpoint closed")
    buf = ctypes.create_string_buffer(_ATTR_BYTES)
    struct.pack_into("=Q", buf, 0, _FIELD_LOCAL_SOCKADDR | _FIELD_REMOTE_SOCKADDR)
    status = _ucp_ep_query()(ep_handle, buf)
    if status != 0:
        raise TransportError(f"ucp_ep_query: UCS status {status}")
    raw = buf.raw
    return (
        _parse(raw[_LOCAL_OFF : _LOCAL_OFF + _SOCKADDR_STORAGE]),
        _parse(raw[_REMOTE_OFF : _REMOTE_OFF + _SOCKADDR_STORAGE]),
    )
