"""BootstrapServer: where prefill ranks register and decode ranks look them up.

Control plane only (the data path is the transfer engine): plain asyncio TCP streams, one
request and one reply per connection, each frame a 4-byte big-endian length followed by a
:mod:`kvxfer.wire` message. Entries are keyed by ``(dp_rank, tp_rank, pp_rank)``; a rank that
restarts simply registers again and replaces its old entry, so decode ranks that look it up
afterwards reach the new engine.

Security (docs/SECURITY.md)
- Every request and every reply is authenticated with the deployment's shared secret: the
  server opens each connection with a fresh nonce (:class:`~kvxfer.disagg.messages.BsChallenge`),
  the client answers with its request sealed by an HMAC over both nonces, the server's reply
  is sealed the same way (:func:`seal`). A party without the secret can neither register,
  unregister nor look anything up (it gets a refusal that says nothing about the registry),
  cannot replay a captured request (the server's nonce is fresh), and cannot forge replies.
  The server refuses to start without a secret (``secret=`` or ``$KVXFER_SECRET``).
- Bounded under hostile clients: at most ``max_connections`` at a time; a request frame of at
  most ``MAX_REQUEST_BYTES`` read within ``REQUEST_TIMEOUT_S``; every send within
  ``SEND_TIMEOUT_S`` (a client that does not read is cut off and its buffers dropped); at most
  ``max_entries`` entries, ``max_entries_per_dp`` per DP group and ``max_entry_bytes`` each, so
  a lookup's reply (one DP group) always fits ``MAX_REPLY_BYTES``.

Run in-process (``await BootstrapServer(port=0, secret=...).start()`` or
``start_in_thread()``) or as ``kvxfer bootstrap --port N`` (secret from ``$KVXFER_SECRET`` or
``--secret-file``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import os
import struct
import sys
from typing import Any, Dict, List, Optional, Tuple

import msgpack

from kvxfer import wire
from kvxfer.config import resolve_secret
from kvxfer.disagg import messages as m
from kvxfer.errors import (
    AuthenticationFailed,
    InvalidArgument,
    KvxferError,
    PeerClosed,
    ProtocolError,
    TransferTimeout,
    VersionMismatch,
)
from kvxfer.loop_thread import LoopThread

log = logging.getLogger(__name__)

NONCE_BYTES = 32
#: largest request frame the server reads (a registration with its fingerprint)
MAX_REQUEST_BYTES = 32 << 10
#: largest reply frame a client reads (one DP group's entries: 128 x 16 KiB fit)
MAX_REPLY_BYTES = 4 << 20
#: the whole request must arrive within this many seconds of the connection
REQUEST_TIMEOUT_S = 5.0
#: every send of the server (challenge, reply) must drain within this many seconds
SEND_TIMEOUT_S = 5.0
_LEN = struct.Struct(">I")


def parse_addr(addr) -> Tuple[str, int]:
    """``"host:port"`` or ``(host, port)`` -> ``(host, port)``; typed error otherwise."""
    if isinstance(addr, tuple) and len(addr) == 2:
        host, port = addr
    elif isinstance(addr, str) and ":" in addr:
        host, _, port = addr.rpartition(":")
        host = host.strip("[]")
    else:
        raise InvalidArgument(f"bootstrap address {addr!r} is not 'host:port'")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise InvalidArgument(f"bootstrap address {addr!r}: bad port") from None
    if not host or not 0 < port < 65536:
        raise InvalidArgument(f"bootstrap address {addr!r}: bad host or port")
    return str(host), port


def seal(secret: bytes, direction: bytes, nonce_s: bytes, nonce_c: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 binding ``body`` to one connection (both nonces) and one direction
    (b"request" / b"reply"); the label keeps it apart from the engine handshake's proofs."""
    data = msgpack.packb(
        [b"kvxfer-bootstrap", wire.PROTOCOL_VERSION, direction, nonce_s, nonce_c, body],
        use_bin_type=True,
    )
    return hmac.new(secret, data, hashlib.sha256).digest()


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> wire.Message:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > limit:
        raise ProtocolError(f"bootstrap frame of {n} bytes > {limit}")
    return wire.decode(await reader.readexactly(n))


def _frame(msg: wire.Message) -> bytes:
    body = msg.encode()
    return _LEN.pack(len(body)) + body


async def _send(writer: asyncio.StreamWriter, msg: wire.Message, timeout: float) -> None:
    """Write one frame; ConnectionError (and the connection cut, its buffer dropped) when
    the peer does not take it within ``timeout``."""
    writer.write(_frame(msg))
    try:
        await asyncio.wait_for(writer.drain(), timeout)
    except asyncio.TimeoutError:
        writer.transport.abort()
        raise ConnectionError(f"peer did not read for {timeout:g} s") from None


class BootstrapServer:
    """In-memory registry of prefill ranks, served over TCP to holders of the secret."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: Optional[bytes] = None,
        max_entries: int = 1024,
        max_entries_per_dp: int = 128,
        max_entry_bytes: int = 16 << 10,
        max_connections: int = 256,
    ) -> None:
        self.host, self.port = host, port
        self._secret = resolve_secret(secret, "BootstrapServer")
        self.max_entries, self.max_entries_per_dp = max_entries, max_entries_per_dp
        self.max_entry_bytes, self.max_connections = max_entry_bytes, max_connections
        if max_entries_per_dp * max_entry_bytes > MAX_REPLY_BYTES // 2:
            raise InvalidArgument(
                f"max_entries_per_dp x max_entry_bytes must stay under "
                f"{MAX_REPLY_BYTES // 2} (one lookup reply)"
            )
        self._entries: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self._per_dp: Dict[int, int] = {}
        self._conns: set = set()
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[LoopThread] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def entries(self) -> List[Dict[str, Any]]:
        return [dict(e) for _, e in sorted(self._entries.items())]

    async def start(self) -> Tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("bootstrap server listening on %s", self.address)
        return self.host, self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._conns):
                t.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        assert self._server is not None
        await self._server.serve_forever()

    # -- background-thread use (schedulers, tests) --
    def start_in_thread(self, timeout: float = 10.0) -> "BootstrapServer":
        """Serve on a private loop thread ("kvxfer-bootstrap"); returns once listening
        (TransferTimeout past ``timeout``; a failure to listen is raised here)."""
        self._thread = LoopThread("kvxfer-bootstrap")
        self._thread.start(self.start(), timeout, on_stop=self.close)
        return self

    def stop_thread(self, timeout: float = 10.0) -> None:
        """Stop serving (the server closes on its loop) and join the thread; idempotent."""
        if self._thread is not None:
            self._thread.stop(timeout)
            self._thread = None

    # -- protocol --
    async def _serve(self, reader, writer) -> None:
        if len(self._conns) >= self.max_connections:
            writer.transport.abort()  # over the limit: no buffers, no reply
            return
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            nonce_s = os.urandom(NONCE_BYTES)
            await _send(writer, m.BsChallenge(nonce=nonce_s), SEND_TIMEOUT_S)
            try:
                msg = await asyncio.wait_for(
                    _read_frame(reader, MAX_REQUEST_BYTES), REQUEST_TIMEOUT_S
                )
                reply = self._answer(msg, nonce_s)
            except ProtocolError as exc:  # VersionMismatch included (named as such)
                if isinstance(exc, VersionMismatch):
                    log.warning("bootstrap: request refused: %s", exc)
                reply = m.BsReply(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            except AuthenticationFailed as exc:
                reply = m.BsReply(ok=False, error=f"AuthenticationFailed: {exc}")
            await _send(writer, reply, SEND_TIMEOUT_S)
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), SEND_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            writer.transport.abort()  # also after close(): drops what is still buffered
        finally:  # however else it ended (server closing included): nothing stays buffered
            if not writer.transport.is_closing():
                writer.transport.abort()
            self._conns.discard(task)

    def _answer(self, msg: wire.Message, nonce_s: bytes) -> wire.Message:
        """Open a sealed request, act on it, seal the reply. Raises AuthenticationFailed /
        ProtocolError (answered unsealed) before the request proved the secret."""
        sealed = wire.expect(msg, m.BsSealed)
        if len(sealed.nonce) != NONCE_BYTES or not hmac.compare_digest(
            seal(self._secret, b"request", nonce_s, sealed.nonce, sealed.body), sealed.mac
        ):
            raise AuthenticationFailed("request not sealed with this server's secret")
        try:
            reply = self._handle(wire.decode(sealed.body))
        except ProtocolError as exc:
            reply = m.BsReply(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        body = reply.encode()
        return m.BsSealed(
            nonce=sealed.nonce,
            body=body,
            mac=seal(self._secret, b"reply", nonce_s, sealed.nonce, body),
        )

    def _handle(self, msg: wire.Message) -> m.BsReply:
        if isinstance(msg, m.BsRegister):
            entry = m.check_entry(m.entry_of(msg))
            size = len(msgpack.packb(entry, use_bin_type=True))
            if size > self.max_entry_bytes:
                return m.BsReply(ok=False, error=f"entry of {size} bytes > {self.max_entry_bytes}")
            key = (msg.dp_rank, msg.tp_rank, msg.pp_rank)
            old = self._entries.get(key)
            if old is None:
                if len(self._entries) >= self.max_entries:
                    return m.BsReply(ok=False, error=f"registry full ({self.max_entries} entries)")
                if self._per_dp.get(msg.dp_rank, 0) >= self.max_entries_per_dp:
                    return m.BsReply(
                        ok=False,
                        error=f"dp_rank {msg.dp_rank} full ({self.max_entries_per_dp} entries)",
                    )
                self._per_dp[msg.dp_rank] = self._per_dp.get(msg.dp_rank, 0) + 1
            elif old["tp_size"] != msg.tp_size:
                log.warning(
                    "bootstrap: dp %d tp_size changes %d -> %d",
                    msg.dp_rank,
                    old["tp_size"],
                    msg.tp_size,
                )
            self._entries[key] = entry
            log.info(
                "bootstrap: %s registered %s:%d (dp %d tp %d/%d)",
                msg.name,
                msg.host,
                msg.port,
                msg.dp_rank,
                msg.tp_rank,
                msg.tp_size,
            )
            return m.BsReply(ok=True)
        if isinstance(msg, m.BsUnregister):
            key = (msg.dp_rank, msg.tp_rank, msg.pp_rank)
            e = self._entries.get(key)
            if e is not None and e["name"] == msg.name:
                del self._entries[key]
                self._per_dp[msg.dp_rank] -= 1
                if not self._per_dp[msg.dp_rank]:
                    del self._per_dp[msg.dp_rank]
            return m.BsReply(ok=True)
        if isinstance(msg, m.BsLookup):
            found = [e for (dp, _, _), e in sorted(self._entries.items()) if dp == msg.dp_rank]
            return m.BsReply(ok=True, entries=found)
        return m.BsReply(ok=False, error=f"unexpected message {msg.TAG}")


async def request(
    addr, msg: wire.Message, timeout: float, secret: Optional[bytes] = None
) -> m.BsReply:
    """One authenticated request/reply with the bootstrap server at ``addr`` within
    ``timeout`` seconds (``secret``: the deployment's, else ``$KVXFER_SECRET``). Raises
    AuthenticationFailed when either side fails the other's check, VersionMismatch (both
    numbers in its message) when the server speaks another protocol version or refused our
    request for that, ProtocolError when the server refused the request otherwise,
    PeerClosed / TransferTimeout for the connection."""
    host, port = parse_addr(addr)
    secret = resolve_secret(secret, "bootstrap client")

    async def go() -> m.BsReply:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            challenge = await _read_frame(reader, MAX_REQUEST_BYTES)
            challenge = wire.expect(challenge, m.BsChallenge)
            if len(challenge.nonce) != NONCE_BYTES:
                raise ProtocolError("bootstrap challenge: bad nonce length")
            nonce_c, body = os.urandom(NONCE_BYTES), msg.encode()
            writer.write(
                _frame(
                    m.BsSealed(
                        nonce=nonce_c,
                        body=body,
                        mac=seal(secret, b"request", challenge.nonce, nonce_c, body),
                    )
                )
            )
            await writer.drain()
            answer = await _read_frame(reader, MAX_REPLY_BYTES)
            if isinstance(answer, m.BsReply):  # unsealed: a refusal before authentication
                raise _refusal(answer.error)(f"bootstrap {host}:{port} refused: {answer.error}")
            answer = wire.expect(answer, m.BsSealed)
            if answer.nonce != nonce_c or not hmac.compare_digest(
                seal(secret, b"reply", challenge.nonce, nonce_c, answer.body), answer.mac
            ):
                raise AuthenticationFailed(
                    f"bootstrap {host}:{port}: reply not sealed with "
                    "our secret (a different secret, or not the server)"
                )
            return wire.expect(wire.decode(answer.body), m.BsReply)
        finally:
            writer.close()

    try:
        reply = await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        raise TransferTimeout(f"bootstrap {host}:{port}: no reply within {timeout}s") from None
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise PeerClosed(f"bootstrap {host}:{port}: {exc}") from None
    if not reply.ok:
        raise _refusal(reply.error)(f"bootstrap {host}:{port} refused: {reply.error}")
    return reply


def _refusal(error: str) -> type:
    """The error type of a server's refusal (its text starts with the type's name)."""
    for cls in (AuthenticationFailed, VersionMismatch):
        if error.startswith(cls.__name__ + ":"):
            return cls
    return ProtocolError


async def lookup(
    addr, dp_rank: int, timeout: float, secret: Optional[bytes] = None
) -> List[Dict[str, Any]]:
    """Every prefill entry of DP group ``dp_rank`` (see :func:`request`)."""
    reply = await request(addr, m.BsLookup(dp_rank=dp_rank), timeout, secret)
    return [m.check_entry(e) for e in reply.entries]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="kvxfer bootstrap",
        description=__doc__.split("\n")[0],
        epilog="The shared secret comes from --secret-file or $KVXFER_SECRET (never from the "
        "command line, where other users can read it); without one the server does "
        "not start. Every prefill and decode rank uses the same secret.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8998, help="TCP port (0: any free port)")
    p.add_argument(
        "--secret-file", help="file holding the shared secret (trailing newline stripped)"
    )
    a = p.parse_args(argv)
    try:
        secret = None
        if a.secret_file:
            with open(a.secret_file, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        server = BootstrapServer(a.host, a.port, secret=secret)
    except (KvxferError, OSError) as exc:
        print(f"kvxfer bootstrap: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        await server.start()
        print(f"kvxfer bootstrap listening on {server.address}", flush=True)
        try:
            await server.serve_forever()
        finally:
            await server.close()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0
