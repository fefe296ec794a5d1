"""BootstrapServer over real asyncio TCP (in-process, port 0) and as `kvxfer bootstrap`."""

import asyncio
import os
import struct
import subprocess
import sys

import pytest

from kvxfer.disagg import bootstrap
from kvxfer.disagg import messages as m
from kvxfer.disagg.bootstrap import BootstrapServer, parse_addr
from kvxfer.errors import (
    AuthenticationFailed,
    InvalidArgument,
    PeerClosed,
    ProtocolError,
    VersionMismatch,
)

pytestmark = pytest.mark.timeout(30)


def _reg(name, tp_rank, port, tp_size=2, dp_rank=0):
    return m.BsRegister(
        name=name,
        host="127.0.0.1",
        port=port,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        pp_rank=0,
        fingerprint={"page_size": 4},
    )


async def test_register_lookup_replace_unregister():
    srv = BootstrapServer(port=0)
    await srv.start()
    try:
        addr = srv.address
        assert await bootstrap.lookup(addr, 0, 5) == []
        await bootstrap.request(addr, _reg("p0", 0, 1000), 5)
        await bootstrap.request(addr, _reg("p1", 1, 1001), 5)
        await bootstrap.request(addr, _reg("q0", 0, 2000, dp_rank=1), 5)
        got = await bootstrap.lookup(addr, 0, 5)
        assert [(e["name"], e["port"]) for e in got] == [("p0", 1000), ("p1", 1001)]
        await bootstrap.request(addr, _reg("p0-restarted", 0, 1002), 5)  # restart replaces
        got = await bootstrap.lookup(addr, 0, 5)
        assert [(e["name"], e["port"]) for e in got] == [("p0-restarted", 1002), ("p1", 1001)]
        await bootstrap.request(
            addr, m.BsUnregister(name="p0", dp_rank=0, tp_rank=0, pp_rank=0), 5
        )  # stale name: no effect
        assert len(await bootstrap.lookup(addr, 0, 5)) == 2
        await bootstrap.request(addr, m.BsUnregister(name="p1", dp_rank=0, tp_rank=1, pp_rank=0), 5)
        assert [e["name"] for e in await bootstrap.lookup(addr, 0, 5)] == ["p0-restarted"]
        with pytest.raises(ProtocolError, match="tp_rank 3"):
            await bootstrap.request(addr, _reg("bad", 3, 1), 5)
    finally:
        await srv.close()


async def _raw(port, payload: bytes):
    """Open a connection, read the challenge, send ``payload``; returns the server's answer
    (a wire message) or None when it closed the connection."""
    from kvxfer import wire

    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        (n,) = struct.unpack(">I", await r.readexactly(4))
        assert isinstance(wire.decode(await r.readexactly(n)), m.BsChallenge)
        w.write(payload)
        await w.drain()
        try:
            (n,) = struct.unpack(">I", await r.readexactly(4))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        return wire.decode(await r.readexactly(n))
    finally:
        w.close()


async def test_garbage_is_refused_and_server_survives():
    srv = BootstrapServer(port=0)
    await srv.start()
    try:
        reply = await _raw(srv.port, struct.pack(">I", 5) + b"\xc1junk")
        assert not reply.ok and "ProtocolError" in reply.error
        reply = await _raw(srv.port, struct.pack(">I", 1 << 30))  # oversized: refused unread
        assert not reply.ok and "exceeds" not in reply.error and str(1 << 30) in reply.error
        assert await bootstrap.lookup(srv.address, 0, 5) == []
    finally:
        await srv.close()
    with pytest.raises(PeerClosed):
        await bootstrap.lookup(srv.address, 0, 2)


def test_parse_addr():
    assert parse_addr("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_addr(("h", 1)) == ("h", 1)
    assert parse_addr("[::1]:9") == ("::1", 9)
    for bad in ("nohost", "h:0", "h:x", ":5", 5):
        with pytest.raises(InvalidArgument):
            parse_addr(bad)


def test_in_thread_server():
    srv = BootstrapServer(port=0).start_in_thread()
    try:
        asyncio.run(bootstrap.request(srv.address, _reg("p", 0, 7, tp_size=1), 5))
        assert [e["name"] for e in srv.entries()] == ["p"]
    finally:
        srv.stop_thread()


def test_cli_bootstrap():
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen(
        [sys.executable, "-m", "kvxfer", "bootstrap", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = p.stdout.readline()
        assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
        addr = line.split()[-1]
        asyncio.run(bootstrap.request(addr, _reg("p", 0, 7, tp_size=1), 5))
        assert [e["port"] for e in asyncio.run(bootstrap.lookup(addr, 0, 5))] == [7]
    finally:
        p.terminate()
        p.wait(10)


async def test_request_of_another_protocol_version_is_refused_naming_both():
    import msgpack

    from kvxfer import wire

    srv = BootstrapServer(port=0)
    await srv.start()
    try:
        body = msgpack.packb(
            {"t": "bs.sealed", "v": 99, "nonce": b"n" * 32, "body": b"", "mac": b""},
            use_bin_type=True,
        )
        reply = await _raw(srv.port, struct.pack(">I", len(body)) + body)
        assert not reply.ok and reply.error.startswith("VersionMismatch: "), reply
        assert f"protocol version 99, this side {wire.PROTOCOL_VERSION}" in reply.error
        assert bootstrap._refusal(reply.error) is VersionMismatch
        assert bootstrap._refusal("AuthenticationFailed: x") is AuthenticationFailed
        assert bootstrap._refusal("entry of 9 bytes > 8") is ProtocolError
    finally:
        await srv.close()


async def test_server_of_another_protocol_version_fails_the_client_at_once():
    """A bootstrap server of protocol 1 (its challenge says so): the client's request fails
    with VersionMismatch naming both numbers, not a timeout."""
    import msgpack

    from kvxfer import wire

    async def old_server(r, w):
        body = msgpack.packb({"t": "bs.challenge", "v": 1, "nonce": b"n" * 32})
        w.write(struct.pack(">I", len(body)) + body)
        await w.drain()
        await r.read()  # until the client hangs up
        w.close()

    server = await asyncio.start_server(old_server, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(VersionMismatch) as ei:
            await bootstrap.lookup(("127.0.0.1", port), 0, 5, secret=b"s" * 32)
        assert (ei.value.ours, ei.value.theirs) == (wire.PROTOCOL_VERSION, 1)
        assert f"protocol version 1, this side {wire.PROTOCOL_VERSION}" in str(ei.value)
    finally:
        server.close()
        await server.wait_closed()
