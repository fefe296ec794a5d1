"""BootstrapServer against parties without the secret and against hostile clients (real
asyncio TCP on loopback, port 0; the server in this process or as `kvxfer bootstrap`)."""

import asyncio
import os
import socket
import struct
import subprocess
import sys
import time

import pytest

from kvxfer import wire
from kvxfer.disagg import bootstrap
from kvxfer.disagg import messages as m
from kvxfer.disagg.bootstrap import SEND_TIMEOUT_S, BootstrapServer, seal
from kvxfer.errors import AuthenticationFailed, PeerClosed, ProtocolError

pytestmark = pytest.mark.timeout(60)

SECRET, WRONG = b"bootstrap-test-secret", b"kvxfer"


def _reg(name, tp_rank, port, tp_size=2, dp_rank=0, fingerprint=None):
    return m.BsRegister(
        name=name,
        host="127.0.0.1",
        port=port,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dp_rank=dp_rank,
        pp_rank=0,
        fingerprint=fingerprint if fingerprint is not None else {"page_size": 4},
    )


def _frame(msg) -> bytes:
    body = msg.encode() if isinstance(msg, wire.Message) else msg
    return struct.pack(">I", len(body)) + body


async def _read(r):
    (n,) = struct.unpack(">I", await r.readexactly(4))
    return wire.decode(await r.readexactly(n))


async def _exchange(port, payload: bytes):
    """Send ``payload`` at once (as a client of the old, unauthenticated protocol would),
    then return the first answer that is not a challenge (None: connection closed)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(payload)
        await w.drain()
        while True:
            try:
                msg = await asyncio.wait_for(_read(r), 10)
            except (asyncio.IncompleteReadError, ConnectionError):
                return None
            if not isinstance(msg, m.BsChallenge):
                return msg
    finally:
        w.close()


@pytest.fixture
async def srv():
    s = BootstrapServer(port=0, secret=SECRET)
    await s.start()
    yield s
    await s.close()


# ------------------------------------------------------------------ authentication (item 7)
async def test_without_the_secret_nothing_registers_or_leaks(srv):
    await bootstrap.request(srv.address, _reg("prefill", 0, 1000), 5, SECRET)
    # mallory registers under prefill's key, unregisters it, looks it up: all refused
    for msg in (
        _reg("mallory", 0, 6666),
        m.BsUnregister(name="prefill", dp_rank=0, tp_rank=0, pp_rank=0),
        m.BsLookup(dp_rank=0),
    ):
        with pytest.raises(AuthenticationFailed):
            await bootstrap.request(srv.address, msg, 5, WRONG)
    # the same requests unsealed (the protocol every client spoke before): refused, and the
    # refusal carries nothing of the registry
    for msg in (_reg("mallory", 0, 6666), m.BsLookup(dp_rank=0)):
        reply = await _exchange(srv.port, _frame(msg))
        assert isinstance(reply, m.BsReply) and not reply.ok and reply.entries == [], reply
        assert "prefill" not in reply.error and "1000" not in reply.error
    assert [(e["name"], e["port"]) for e in srv.entries()] == [("prefill", 1000)]
    assert [e["port"] for e in await bootstrap.lookup(srv.address, 0, 5, SECRET)] == [1000]


async def test_a_captured_request_cannot_be_replayed(srv):
    r, w = await asyncio.open_connection("127.0.0.1", srv.port)
    challenge = await _read(r)
    body, nonce_c = _reg("prefill", 0, 1000).encode(), os.urandom(32)
    captured = _frame(
        m.BsSealed(
            nonce=nonce_c, body=body, mac=seal(SECRET, b"request", challenge.nonce, nonce_c, body)
        )
    )
    w.write(captured)
    await w.drain()
    assert (await _read(r)).TAG == "bs.sealed"
    w.close()
    await bootstrap.request(srv.address, _reg("prefill", 0, 1001), 5, SECRET)  # restarted
    reply = await _exchange(srv.port, captured)  # replaying the old registration
    assert not reply.ok and reply.error.startswith("AuthenticationFailed"), reply
    assert [e["port"] for e in srv.entries()] == [1001]


@pytest.mark.parametrize("forgery", ["unsealed", "bad_mac", "other_nonce"])
async def test_forged_replies_are_refused(forgery):
    """A fake bootstrap server without the secret cannot point decode anywhere."""
    evil = {
        "name": "prefill",
        "host": "10.6.6.6",
        "port": 6666,
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "pp_rank": 0,
        "fingerprint": {},
    }

    async def serve(r, w):
        w.write(_frame(m.BsChallenge(nonce=os.urandom(32))))
        req = await _read(r)
        body = m.BsReply(ok=True, entries=[evil]).encode()
        reply = {
            "unsealed": m.BsReply(ok=True, entries=[evil]),
            "bad_mac": m.BsSealed(nonce=req.nonce, body=body, mac=os.urandom(32)),
            "other_nonce": m.BsSealed(nonce=os.urandom(32), body=body, mac=os.urandom(32)),
        }[forgery]
        w.write(_frame(reply))
        await w.drain()
        w.close()

    fake = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        with pytest.raises((AuthenticationFailed, ProtocolError)):
            await bootstrap.lookup(f"127.0.0.1:{fake.sockets[0].getsockname()[1]}", 0, 5, SECRET)
    finally:
        fake.close()
        await fake.wait_closed()


# ------------------------------------------------------------------ hostile clients (item 9)
async def test_a_flood_under_one_dp_rank_cannot_break_its_lookups(srv):
    fp = {"pad": "x" * 12_000}  # ~12 KiB entries: 160 of them made a 1.9 MB reply
    results = []
    for i in range(160):
        try:
            await bootstrap.request(
                srv.address, _reg(f"p{i}", i, 1000 + i, tp_size=1024, fingerprint=fp), 5, SECRET
            )
            results.append("ok")
        except ProtocolError as exc:
            results.append(str(exc))
    assert results.count("ok") == srv.max_entries_per_dp, results[-1]
    assert all("dp_rank 0 full" in x for x in results if x != "ok")
    got = await bootstrap.lookup(srv.address, 0, 5, SECRET)  # still answered
    assert len(got) == srv.max_entries_per_dp
    await bootstrap.request(srv.address, _reg("q", 0, 7, tp_size=1, dp_rank=1), 5, SECRET)
    await bootstrap.request(
        srv.address, _reg("p0-again", 0, 999, tp_size=1024, fingerprint=fp), 5, SECRET
    )  # replace: fine
    assert [e["port"] for e in await bootstrap.lookup(srv.address, 1, 5, SECRET)] == [7]


async def test_entry_size_and_registry_size_are_bounded():
    s = BootstrapServer(port=0, secret=SECRET)
    await s.start()
    try:
        with pytest.raises(ProtocolError, match="entry of"):  # 20 KiB > the 16 KiB default
            await bootstrap.request(
                s.address, _reg("big", 0, 1, fingerprint={"pad": "x" * 20_000}), 5, SECRET
            )
        assert s.entries() == []
    finally:
        await s.close()
    s = BootstrapServer(port=0, secret=SECRET, max_entries=5, max_entries_per_dp=3)
    await s.start()
    try:
        for dp, tp in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
            await bootstrap.request(s.address, _reg("p", tp, 1, tp_size=4, dp_rank=dp), 5, SECRET)
        with pytest.raises(ProtocolError, match="registry full"):
            await bootstrap.request(s.address, _reg("p", 0, 1, dp_rank=2), 5, SECRET)
        await bootstrap.request(
            s.address, m.BsUnregister(name="p", dp_rank=1, tp_rank=1, pp_rank=0), 5, SECRET
        )
        await bootstrap.request(s.address, _reg("p", 0, 1, dp_rank=2), 5, SECRET)
        assert len(s.entries()) == 5
    finally:
        await s.close()


async def test_connections_over_the_limit_are_dropped_and_the_server_recovers():
    s = BootstrapServer(port=0, secret=SECRET, max_connections=4)
    await s.start()
    idle = []
    try:
        for _ in range(4):  # hold every slot: read the challenge, send nothing
            r, w = await asyncio.open_connection("127.0.0.1", s.port)
            assert isinstance(await _read(r), m.BsChallenge)
            idle.append(w)
        with pytest.raises(PeerClosed):
            await bootstrap.lookup(s.address, 0, 5, SECRET)
        for w in idle:
            w.close()
        deadline = time.monotonic() + 10
        while s._conns and time.monotonic() < deadline:  # the server notices the closes
            await asyncio.sleep(0.01)
        assert await bootstrap.lookup(s.address, 0, 5, SECRET) == []
    finally:
        await s.close()


def test_clients_that_never_read_pin_nothing(tmp_path):
    """The issue's scenario: the largest lookup reply one can make the server build, asked
    for by 30 clients that never read it. Before, entries were unbounded (this dp_rank's
    reply grew to ~8 MB, more than the kernel's socket buffers take) and replies had no send
    deadline: each such client held a server socket and its reply for as long as it stayed.
    Now the reply is bounded by the registry caps, and whatever a client does not take
    within ``SEND_TIMEOUT_S`` is dropped with its connection."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvxfer",
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--secret-file",
            str(secret_file),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    socks = []
    try:
        line = p.stdout.readline()
        assert "listening on" in line, line
        addr = line.split()[-1]
        port = int(addr.rpartition(":")[2])
        for i in range(228):  # 128 entries of 12 KB, then 100 of 64 KB
            fp = {"pad": "x" * (12_000 if i < 128 else 64_000)}
            try:
                asyncio.run(
                    bootstrap.request(
                        addr, _reg(f"p{i}", i, 1000 + i, tp_size=1024, fingerprint=fp), 5, SECRET
                    )
                )
            except ProtocolError:
                pass  # refused: the registry caps
        base, rss0 = _sockets(p.pid), _rss_mb(p.pid)
        for _ in range(30):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            n = struct.unpack(">I", _recv_exact(s, 4))[0]
            challenge = wire.decode(_recv_exact(s, n))
            body, nonce_c = m.BsLookup(dp_rank=0).encode(), os.urandom(32)
            s.sendall(
                _frame(
                    m.BsSealed(
                        nonce=nonce_c,
                        body=body,
                        mac=seal(SECRET, b"request", challenge.nonce, nonce_c, body),
                    )
                )
            )
            socks.append(s)  # ... and never read again
        t0 = time.monotonic()
        assert len(asyncio.run(bootstrap.lookup(addr, 0, 10, SECRET))) >= 128  # still serves
        rss1 = _rss_mb(p.pid)
        while _sockets(p.pid) > base and time.monotonic() < t0 + SEND_TIMEOUT_S + 15:
            time.sleep(0.05)  # polling the server's sockets under a deadline
        assert _sockets(p.pid) <= base, (_sockets(p.pid) - base, rss0, rss1)
    finally:
        for s in socks:
            s.close()
        p.terminate()
        p.wait(10)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS:"))


def _sockets(pid: int) -> int:
    """Sockets the process holds open."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def _recv_exact(s, n):
    buf = b""
    s.settimeout(10)
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


async def test_a_send_has_a_deadline():
    """The mechanism behind the test above, where the kernel cannot absorb the reply: a
    peer that does not read makes ``_send`` give up within its timeout and drop the
    connection with everything buffered for it."""
    accepted = asyncio.get_running_loop().create_future()

    async def on_conn(r, w):
        w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        accepted.set_result(w)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
    w.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sw = await asyncio.wait_for(accepted, 10)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="did not read"):
            await bootstrap._send(sw, m.BsReply(ok=True, error="x" * (8 << 20)), 0.5)
        assert time.monotonic() - t0 < 5
        assert sw.transport.is_closing() and sw.transport.get_write_buffer_size() == 0
    finally:
        w.close()
        server.close()
        await server.wait_closed()


async def test_server_survives_garbage_and_keeps_answering(srv):
    for payload in (
        b"\x00\x00\x00\x05\xc1junk",
        struct.pack(">I", 1 << 30),
        _frame(m.BsSealed(nonce=b"short", body=b"", mac=b"")),
        _frame(m.BsChallenge(nonce=os.urandom(32))),
    ):
        reply = await _exchange(srv.port, payload)
        assert reply is None or (isinstance(reply, m.BsReply) and not reply.ok), reply
    assert await bootstrap.lookup(srv.address, 0, 5, SECRET) == []
