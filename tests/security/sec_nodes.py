"""What the security tests host in worker processes (:class:`kvxfer.procs.Worker`, called
through typed proxies).

- :class:`TargetNode`: engines of :class:`kvxfer.bench.engine_node.EngineNode` plus
  introspection: RSS, the packed remote keys of an engine's regions, and every ERROR log
  record of kvxfer (an unexpected exception anywhere in the engine shows up there).
- :class:`Attacker`: a party on the network: a relay between two engines, raw senders
  (pre-authentication floods), fuzzers before and after authentication, and an
  authenticated client that checks the target still answers.

Everything runs over real UCX on loopback; messages are real msgpack.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import random
import threading
import time

from kvxfer.bench.engine_node import EngineNode

SECRET = b"security-tests-secret"
WRONG = b"not-the-secret"
ITEM, ITEMS = 256, 32


def engine_spec(name: str, secret: bytes = SECRET, **cfg) -> dict:
    """One engine ``main`` with one host group ``kv`` (2 descriptors)."""
    config = dict(
        dict(
            secret=secret,
            name=name,
            connect_timeout_s=5.0,
            transfer_timeout_s=10.0,
            warn_slow_lanes=False,
        ),
        **cfg,
    )
    return {
        "engines": {
            "main": {
                "config": config,
                "groups": {"kv": {"item_lens": [ITEM, ITEM], "items": ITEMS}},
            }
        }
    }


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """``field`` of /proc/<pid>/status in MiB. For this process, memory that malloc holds
    freed is handed back first (``malloc_trim``): what is left is what is still allocated."""
    if pid == os.getpid() and field == "VmRSS":
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(
            f"{record.name}: {record.getMessage()}"
            + (f" ({record.exc_info[0].__name__})" if record.exc_info else "")
        )


class TargetNode(EngineNode):
    """Engines as in :class:`EngineNode`, plus :meth:`rss`, :meth:`rkeys`, :meth:`errors`."""

    def __init__(self, spec: dict) -> None:
        self._errors = _Errors()
        logging.getLogger("kvxfer").addHandler(self._errors)
        super().__init__(spec)

    def rss(self) -> dict:
        return {"rss": rss_mb(os.getpid()), "hwm": rss_mb(os.getpid(), "VmHWM")}

    def rkeys(self, key: str) -> list:
        return self.engines[key].engine._groups.region_table()[2]

    def errors(self) -> list:
        return list(self._errors.records)


# ----------------------------------------------------------------------------- attacker
def _tag(raw: bytes):
    """The wire tag of a message (None: undecodable)."""
    from kvxfer import wire
    from kvxfer.engine import messages  # noqa: F401  (registers the kx. tags)

    try:
        return wire.decode(raw).TAG
    except Exception:
        return None


class Attacker:
    """An asyncio loop on a thread with one raw UCX transport (no secret)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._relayed = []  # (direction, payload) through the relay
        self.pumps_ended = 0
        self._fake_seen = []  # tags received by the fake engine
        self._reconnects = 0  # connection attempts retried (see _connect)
        self.t = self._run(self._transport(), 60)
        self._extra = []  # one transport per listener (a transport has one)

    async def _transport(self):
        from kvxfer.transport.ucx import UcxTransport

        t = UcxTransport()
        t._bind_loop()
        return t

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _listen(self, on_accept) -> int:
        t = await self._transport()
        self._extra.append(t)
        return (await t.listen("127.0.0.1", 0, on_accept))[1]

    async def _connect(self, host: str, port: int):
        """Connect (a refused or reset attempt is retried twice: a busy target's listener
        may drop a connection before accepting it; that is not what is tested here)."""
        from kvxfer.errors import PeerClosed

        for attempt in range(3):
            try:
                return await self.t.connect(host, port, 10.0)
            except PeerClosed:
                if attempt == 2:
                    raise
                self._reconnects += 1

    async def _cancel_rest(self):
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def close(self):
        for t in [self.t] + self._extra:
            self._run(t.close(), 30)
        self._run(self._cancel_rest(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    # -- relay: decode -> (this) -> prefill, forwarding every message both ways
    def relay_start(self, host: str, port: int) -> int:
        from kvxfer.errors import KvxferError

        async def pump(src, dst, direction):
            try:
                while True:
                    raw = await src.recv(30.0)
                    src.adopt_epoch()  # the accepted leg: its connection's epoch (no-op else)
                    self._relayed.append((direction, raw))
                    await dst.send(raw, 10.0)
            except KvxferError:
                pass
            finally:
                await src.close(1.0)
                await dst.close(1.0)
                self.pumps_ended += 1

        async def on_accept(client):
            try:
                server = await self.t.connect(host, port, 10.0)
            except KvxferError:
                await client.close(1.0)
                return
            await asyncio.gather(
                pump(client, server, "to-target"), pump(server, client, "to-initiator")
            )

        return self._run(self._listen(on_accept), 30)

    def relayed(self, needles=(), pumps: int = 2, timeout: float = 20.0):
        """Once ``pumps`` forwarding directions have ended (bounded wait): ``{"tags":
        [(direction, tag)], "with_needle": n}``, the relayed messages and how many contained
        any of ``needles`` (e.g. both engines' packed remote keys)."""
        deadline = time.monotonic() + timeout
        while self.pumps_ended < pumps and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition under a deadline (the relay's own loop)
        return {
            "tags": [(d, _tag(raw)) for d, raw in self._relayed],
            "ended": self.pumps_ended,
            "with_needle": sum(any(n in raw for n in needles) for _, raw in self._relayed),
        }

    # -- wrong secret, in either role
    def wrong_secret_client(self, host: str, port: int, n: int) -> dict:
        """``n`` handshakes as the connecting side with a wrong secret: Hello, then a Proof
        made with the wrong secret; everything the target answers is counted."""
        from kvxfer.engine import handshake
        from kvxfer.engine import messages as m
        from kvxfer.errors import KvxferError

        stats = {"answers": {}, "layouts": 0}

        async def go():
            for _ in range(n):
                ch = await self.t.connect(host, port, 10.0)
                try:
                    hello = m.Hello(
                        engine_id="mallory", name="mallory", nonce=os.urandom(32), hostname="h"
                    )
                    await ch.send(hello.encode(), 5.0)
                    ack = handshake._decode(await ch.recv(5.0))
                    await ch.send(
                        m.Proof(
                            proof=handshake._proof(WRONG, b"C", ch.binding(), hello, ack)
                        ).encode(),
                        5.0,
                    )
                    try:
                        while True:
                            got = _tag(await ch.recv(5.0))
                            stats["answers"][got] = stats["answers"].get(got, 0) + 1
                            stats["layouts"] += got == m.Layout.TAG
                    except KvxferError as exc:
                        key = type(exc).__name__
                        stats["answers"][key] = stats["answers"].get(key, 0) + 1
                finally:
                    await ch.close(1.0)
            return stats

        return self._run(go(), 60 + 10 * n)

    def fake_engine_start(self, secret: bytes) -> int:
        """Listen as a fake engine that answers Hello with a HelloAck proved with ``secret``
        and records every message it receives afterwards (:meth:`fake_seen`)."""
        from kvxfer.engine import handshake
        from kvxfer.engine import messages as m
        from kvxfer.errors import KvxferError

        async def on_accept(ch):
            try:
                hello = handshake._decode(await ch.recv(10.0))
                ch.adopt_epoch()
                ack = m.HelloAck(
                    engine_id="fake",
                    name="fake",
                    nonce=os.urandom(32),
                    hostname="h",
                    stage=False,
                    proof=b"",
                )
                ack.proof = handshake._proof(secret, b"S", ch.binding(), hello, ack)
                await ch.send(ack.encode(), 5.0)
                while True:
                    self._fake_seen.append(_tag(await ch.recv(10.0)))
            except KvxferError:
                pass
            finally:
                await ch.close(1.0)

        return self._run(self._listen(on_accept), 30)

    def fake_seen(self):
        return list(self._fake_seen)

    def reconnects(self) -> int:
        return self._reconnects

    # -- raw, unauthenticated senders
    def flood(self, host: str, port: int, sizes, timeout: float = 60.0) -> dict:
        """One connection; every payload of ``sizes`` bytes sent at once (pipelined), then
        wait until the target ends the connection. Returns what came back."""
        from kvxfer.errors import KvxferError

        async def go():
            ch = await self.t.connect(host, port, 10.0)
            got = []
            try:
                payloads = [bytes(n) for n in sizes]
                sent = await asyncio.gather(
                    *(ch.send(p, timeout) for p in payloads), return_exceptions=True
                )
                del payloads
                try:
                    while True:
                        got.append(_tag(await ch.recv(timeout)))
                except KvxferError as exc:
                    ended = type(exc).__name__
                return {"sent": sum(s is None for s in sent), "got": got, "ended": ended}
            finally:
                await ch.close(1.0)

        return self._run(go(), timeout + 30)

    def fuzz_preauth(
        self, host: str, port: int, seed: int, n: int, second: bool, concurrency: int = 8
    ) -> dict:
        """``n`` malformed messages, one connection each: the first message of the
        connection, or (``second``) the message after a well-formed Hello. Counts how the
        target answered; any Layout received is counted in ``layouts``."""
        from fuzzgen import engine_payloads

        from kvxfer.engine import messages as m
        from kvxfer.errors import KvxferError

        payloads = engine_payloads(random.Random(seed), n, authenticated=False)
        stats = {"sent": 0, "answers": {}, "layouts": 0}
        hello = m.Hello(
            engine_id="fuzz", name="fuzz", nonce=os.urandom(32), hostname="fuzz"
        ).encode()

        async def one(payload):
            ch = await self._connect(host, port)
            try:
                if second:
                    await ch.send(hello, 5.0)
                    got = _tag(await ch.recv(5.0))
                    stats["answers"][got] = stats["answers"].get(got, 0) + 1
                await ch.send(payload, 5.0)
                stats["sent"] += 1
                try:
                    while True:  # until the target ends it (or stays silent: a Hello)
                        got = _tag(await ch.recv(0.5 if not second else 2.0))
                        stats["answers"][got] = stats["answers"].get(got, 0) + 1
                        stats["layouts"] += got == m.Layout.TAG
                except KvxferError as exc:
                    key = type(exc).__name__
                    stats["answers"][key] = stats["answers"].get(key, 0) + 1
            finally:
                await ch.close(1.0)

        async def go():
            sem = asyncio.Semaphore(concurrency)

            async def bounded(p):
                async with sem:
                    await one(p)

            await asyncio.gather(*(bounded(p) for p in payloads))
            return stats

        return self._run(go(), 60 + n * 0.5)

    def fuzz_layout(self, host: str, port: int, seed: int, n: int, concurrency: int = 8) -> dict:
        """After authenticating with the right secret (a hand-run connecting side), send a
        malformed Layout instead of ours; one connection per message."""
        # real remote keys (of a buffer of ours): a forged packed key is parsed by libucp
        # unchecked and can crash the receiver, which trusts authenticated peers that far
        # (docs/SECURITY.md); every other field is fuzzed
        import numpy as np
        from fuzzgen import layout_payloads

        from kvxfer.engine import handshake
        from kvxfer.engine import messages as m
        from kvxfer.errors import KvxferError

        self._keep = np.zeros(2 << 20, dtype=np.uint8)
        regions = [
            self.t.register(self._keep.ctypes.data + i * (1 << 20), 1 << 20) for i in range(2)
        ]
        payloads = layout_payloads(random.Random(seed), n, [g.packed_key() for g in regions])
        stats = {"sent": 0, "answers": {}}

        async def one(payload):
            ch = await self._connect(host, port)
            try:
                hello = m.Hello(
                    engine_id="fuzz-auth", name="fuzz", nonce=os.urandom(32), hostname="fuzz"
                )
                await ch.send(hello.encode(), 5.0)
                ack = handshake._decode(await ch.recv(5.0))
                proof = handshake._proof(SECRET, b"C", ch.binding(), hello, ack)
                await ch.send(m.Proof(proof=proof).encode(), 5.0)
                assert _tag(await ch.recv(5.0)) == m.Layout.TAG  # authenticated: its layout
                await ch.send(payload, 5.0)
                stats["sent"] += 1
                try:
                    while True:
                        got = _tag(await ch.recv(2.0))
                        stats["answers"][got] = stats["answers"].get(got, 0) + 1
                except KvxferError as exc:
                    key = type(exc).__name__
                    stats["answers"][key] = stats["answers"].get(key, 0) + 1
            finally:
                await ch.close(1.0)

        async def go():
            sem = asyncio.Semaphore(concurrency)

            async def bounded(p):
                async with sem:
                    await one(p)

            await asyncio.gather(*(bounded(p) for p in payloads))
            return stats

        try:
            return self._run(go(), 60 + n * 0.5)
        finally:
            for g in regions:
                g.release()

    def fuzz_peer(self, host: str, port: int, seed: int, n: int) -> dict:
        """Authenticated engine (right secret): after the handshake, malformed or
        meaningless engine messages straight onto the channel, one peer connection each."""
        import numpy as np
        from fuzzgen import engine_payloads

        from kvxfer.config import EngineConfig
        from kvxfer.engine import TransferEngine
        from kvxfer.errors import PeerClosed

        payloads = engine_payloads(random.Random(seed), n, authenticated=True)
        stats = {"sent": 0}

        async def go():
            eng = TransferEngine(
                EngineConfig(
                    secret=SECRET, name="fuzz-peer", connect_timeout_s=5.0, warn_slow_lanes=False
                )
            )
            buf = np.zeros(ITEM * ITEMS * 2, dtype=np.uint8)
            eng.register(
                "kv",
                [buf.ctypes.data, buf.ctypes.data + ITEM * ITEMS],
                [ITEM * ITEMS] * 2,
                [ITEM, ITEM],
            )
            await eng.start()
            try:
                for payload in payloads:
                    for attempt in range(3):  # as in _connect
                        try:
                            peer = await eng.connect(host, port)
                            break
                        except PeerClosed:
                            if attempt == 2:
                                raise
                            self._reconnects += 1
                    await peer._channel.send(payload, 5.0)
                    stats["sent"] += 1
                    # the target handles it before our goodbye (one ordered channel): it
                    # ends the peer if the message was malformed, else takes it
                    await peer.close()
            finally:
                await eng.close()
            return stats

        return self._run(go(), 120 + n * 0.5)

    def check_answers(self, host: str, port: int, secret: bytes = SECRET) -> dict:
        """An authenticated engine connects and writes items 0-3 (descriptor ``d`` filled
        with ``7 + d``) to the target's items 4-7 with a ``still-here`` notification: the
        target still serves (the caller checks the bytes and the message there)."""
        import numpy as np

        from kvxfer.config import EngineConfig
        from kvxfer.engine import ItemWrite, TransferEngine

        async def go():
            eng = TransferEngine(
                EngineConfig(
                    secret=secret, name="checker", connect_timeout_s=10.0, warn_slow_lanes=False
                )
            )
            bufs = [np.full(ITEM * ITEMS, 7 + d, dtype=np.uint8) for d in range(2)]
            eng.register(
                "kv", [b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [ITEM, ITEM]
            )
            await eng.start()
            try:
                t0 = time.monotonic()
                peer = await eng.connect(host, port)
                await peer.write([ItemWrite("kv", [0, 1, 2, 3], [4, 5, 6, 7])], b"still-here")
                return {"ok": True, "s": time.monotonic() - t0}
            finally:
                await eng.close()

        return self._run(go(), 60)
