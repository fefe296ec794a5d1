"""BootstrapServer: where prefill ranks register and decode ranks look them up.

Control plane only (the data path is the transfer engine): plain asyncio TCP streams, one
request and one reply per connection, each frame a 4-byte big-endian length followed by a
:mod:`kvxfer.wire` message. Entries are keyed by ``(dp_rank, tp_rank, pp_rank)``; a rank that
restarts simply registers again and replaces its old entry, so decode ranks that look it up
afterwards reach the new engine.

Run in-process (``await BootstrapServer(port=0).start()`` or ``start_in_thread()``) or as
``kvxfer bootstrap --port N``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import struct
import threading
from typing import Any, Dict, List, Optional, Tuple

from kvxfer import wire
from kvxfer.disagg import messages as m
from kvxfer.errors import InvalidArgument, PeerClosed, ProtocolError, TransferTimeout

log = logging.getLogger(__name__)

MAX_FRAME = 1 << 20
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


async def _read_frame(reader: asyncio.StreamReader) -> wire.Message:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError(f"bootstrap frame of {n} bytes > {MAX_FRAME}")
    return wire.decode(await reader.readexactly(n))


def _frame(msg: wire.Message) -> bytes:
    body = msg.encode()
    return _LEN.pack(len(body)) + body


class BootstrapServer:
    """In-memory registry of prefill ranks, served over TCP."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host, self.port = host, port
        self._entries: Dict[Tuple[int, int, int], Dict[str, Any]] = {}
        self._server: Optional[asyncio.base_events.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def entries(self) -> List[Dict[str, Any]]:
        return [dict(e) for _, e in sorted(self._entries.items())]

    async def start(self) -> Tuple[str, int]:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        self._loop = asyncio.get_running_loop()
        log.info("bootstrap server listening on %s", self.address)
        return self.host, self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def serve_forever(self) -> None:
        if self._server is None:
            await self.start()
        await self._server.serve_forever()

    # -- background-thread use (schedulers, tests) --
    def start_in_thread(self, timeout: float = 10.0) -> "BootstrapServer":
        ready = threading.Event()
        err: List[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:  # reported to the caller below
                err.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self.close())
            loop.close()

        self._thread = threading.Thread(target=run, name="kvxfer-bootstrap", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TransferTimeout(f"bootstrap server did not start within {timeout}s")
        if err:
            raise err[0]
        return self

    def stop_thread(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            self._thread = None

    # -- protocol --
    async def _serve(self, reader, writer) -> None:
        try:
            msg = await asyncio.wait_for(_read_frame(reader), 10.0)
            reply = self._handle(msg)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            writer.close()
            return
        except ProtocolError as exc:
            reply = m.BsReply(ok=False, error=f"ProtocolError: {exc}")
        try:
            writer.write(_frame(reply))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def _handle(self, msg: wire.Message) -> m.BsReply:
        if isinstance(msg, m.BsRegister):
            entry = m.check_entry(m.entry_of(msg))
            if not 0 <= msg.tp_rank < msg.tp_size:
                return m.BsReply(ok=False, error=f"tp_rank {msg.tp_rank} not in [0, {msg.tp_size})")
            key = (msg.dp_rank, msg.tp_rank, msg.pp_rank)
            old = self._entries.get(key)
            if old is not None and old["tp_size"] != msg.tp_size:
                log.warning("bootstrap: dp %d tp_size changes %d -> %d", msg.dp_rank,
                            old["tp_size"], msg.tp_size)
            self._entries[key] = entry
            log.info("bootstrap: %s registered %s:%d (dp %d tp %d/%d)", msg.name, msg.host,
                     msg.port, msg.dp_rank, msg.tp_rank, msg.tp_size)
            return m.BsReply(ok=True)
        if isinstance(msg, m.BsUnregister):
            key = (msg.dp_rank, msg.tp_rank, msg.pp_rank)
            e = self._entries.get(key)
            if e is not None and e["name"] == msg.name:
                del self._entries[key]
            return m.BsReply(ok=True)
        if isinstance(msg, m.BsLookup):
            found = [e for (dp, _, _), e in sorted(self._entries.items()) if dp == msg.dp_rank]
            return m.BsReply(ok=True, entries=found)
        return m.BsReply(ok=False, error=f"unexpected message {msg.TAG}")


async def request(addr, msg: wire.Message, timeout: float) -> m.BsReply:
    """One request/reply with the bootstrap server at ``addr`` within ``timeout`` seconds."""
    host, port = parse_addr(addr)

    async def go() -> m.BsReply:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(_frame(msg))
            await writer.drain()
            return wire.expect(await _read_frame(reader), m.BsReply)
        finally:
            writer.close()

    try:
        reply = await asyncio.wait_for(go(), timeout)
    except asyncio.TimeoutError:
        raise TransferTimeout(f"bootstrap {host}:{port}: no reply within {timeout}s") from None
    except (OSError, asyncio.IncompleteReadError) as exc:
        raise PeerClosed(f"bootstrap {host}:{port}: {exc}") from None
    if not reply.ok:
        raise ProtocolError(f"bootstrap {host}:{port} refused: {reply.error}")
    return reply


async def lookup(addr, dp_rank: int, timeout: float) -> List[Dict[str, Any]]:
    reply = await request(addr, m.BsLookup(dp_rank=dp_rank), timeout)
    return [m.check_entry(e) for e in reply.entries]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvxfer bootstrap", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8998, help="TCP port (0: any free port)")
    a = p.parse_args(argv)

    async def run() -> None:
        server = BootstrapServer(a.host, a.port)
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
