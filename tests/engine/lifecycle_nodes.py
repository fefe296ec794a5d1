"""Create/connect/close cycles inside one spawned process, with the process's listening
sockets counted after every close: engine pairs (``tests/engine/robust_nodes._Pair``) and a
prefill + decode KVManager pair with a room moved between them. No gc.collect() anywhere:
what close() releases must be released when it returns.
``tests/engine/test_lifecycle.py`` drives them through a :class:`LifecycleNode` worker
(:mod:`kvxfer.procs`)."""

from __future__ import annotations

import asyncio
import os

import numpy as np


def listening_ports() -> list:
    """Ports of this process's TCP sockets in LISTEN state (inodes of /proc/self/net/tcp*
    matched against the socket links in /proc/self/fd)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (e.g. the listdir fd itself)
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    ports = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            col = row.split()
            if col[3] == "0A" and col[9] in mine:  # 0A: TCP_LISTEN
                ports.append(int(col[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def _cycle_result(ports) -> dict:
    now = listening_ports()
    return {"still_listening": [p for p in ports if p in now], "listen": len(now)}


async def engine_cycles(n: int, mode: str) -> list:
    """``n`` times: a fresh engine pair connects, data and messages flow both ways, both
    close concurrently."""
    from robust_nodes import _Pair

    from kvxfer.engine import ItemWrite

    out = []
    for i in range(n):
        pair = _Pair(error_mode=mode)
        pb, pa = await pair.start()
        ports = [e.address[1] for e in pair.engines.values()]
        await pb.write([ItemWrite("kv", list(range(8)), list(range(8, 16)))], b"w%d" % i)
        assert await asyncio.wait_for(pair.inbox.get(), 10.0) == b"w%d" % i
        await pa.send(b"back")
        await asyncio.gather(*(e.close() for e in pair.engines.values()))
        out.append(_cycle_result(ports))
    return out


def _kv_args(seed: int):
    """numpy-backed KVArgs: 2 kv descriptors of 16 pages, 8 aux rows (buffers kept alive by
    the returned tuple)."""
    from kvxfer.disagg import KVArgs, MetadataBuffer

    item, pages = 64, 16
    kv = np.random.default_rng(seed).integers(0, 255, (2, pages * item), dtype=np.uint8)
    aux = MetadataBuffer(8, 64)
    ap, al, ai = aux.buf_infos()
    args = KVArgs(
        kv_data_ptrs=[int(kv[d].ctypes.data) for d in range(2)],
        kv_data_lens=[pages * item] * 2,
        kv_item_lens=[item] * 2,
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
        page_size=1,
        dtype="uint8",
        layout={"kv": {"kind": "lifecycle"}},
    )
    return args, kv, aux


async def manager_cycles(n: int, mode: str) -> list:
    """``n`` times: prefill and decode KVManagers start, the decode connects to the prefill
    (one room moves), both close concurrently."""
    from kvxfer.disagg import BootstrapServer, KVManager, KVPoll, KVReceiver, KVSender, Timeouts

    t = Timeouts(bootstrap_s=10, waiting_s=10, transfer_s=10, heartbeat_interval_s=0.2)
    bs = BootstrapServer(port=0)
    await bs.start()
    out = []
    try:
        for i in range(n):
            (pargs, pkv, _paux), (dargs, dkv, _daux) = _kv_args(2 * i), _kv_args(2 * i + 1)
            p = await KVManager(
                pargs, "prefill", bootstrap_addr=bs.address, timeouts=t, error_mode=mode
            ).start()
            d = await KVManager(dargs, "decode", timeouts=t, error_mode=mode).start()
            ports = [p.address[1], d.address[1]]
            room = 100 + i
            recv = KVReceiver(d, bs.address, room)
            recv.init()
            send = KVSender(p, bs.address, room)
            send.init(2, 1)
            recv.send_metadata([5, 6], 2)
            send.send([1, 2])
            assert await recv.wait(10) == KVPoll.Success
            assert await send.wait(10) == KVPoll.Success
            assert np.array_equal(dkv[:, 5 * 64 : 7 * 64], pkv[:, 64 : 3 * 64])
            await asyncio.gather(p.close(), d.close())
            out.append(_cycle_result(ports))
    finally:
        await bs.close()
    return out


class LifecycleNode:
    """Hosted in a worker: the cycles run on this process's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def engines(self, n: int, mode: str) -> list:
        return self.loop.run_until_complete(engine_cycles(n, mode))

    def managers(self, n: int, mode: str) -> list:
        return self.loop.run_until_complete(manager_cycles(n, mode))

    def close(self) -> None:
        self.loop.close()


# --------------------------------------------------------------- hammer (-m long)
def _hammer_engine(name: str, mode: str):
    from kvxfer.config import EngineConfig
    from kvxfer.engine import TransferEngine

    eng = TransferEngine(
        EngineConfig(
            secret=b"hammer",
            name=name,
            error_mode=mode,
            connect_timeout_s=10.0,
            transfer_timeout_s=10.0,
            warn_slow_lanes=False,
        )
    )
    # freed when the next cycle allocates its own: a PUT landing after close() returned
    # would write into whatever the heap put there (the target process then crashes)
    buf = np.zeros(64 * 4096, np.uint8)
    eng.register("kv", [buf.ctypes.data], [buf.nbytes], [4096])
    return eng, buf


async def _hammer_target(ports, go, cycles: int, mode: str) -> None:
    """Per cycle: listen, report the port, stream messages back while the initiator writes,
    close when told (``go``: a delay, so the two closes interleave differently)."""
    loop = asyncio.get_running_loop()
    for _ in range(cycles):
        eng, buf = _hammer_engine("T", mode)
        peers = []
        eng.on_peer(peers.append)
        ports.put((await eng.start())[1])
        delay = await loop.run_in_executor(None, go.get, True, 60.0)

        async def chatter(peers=peers):
            while peers:
                try:
                    await peers[0].send(b"x" * 100, 5.0)
                except Exception:
                    return
                await asyncio.sleep(0)

        task = loop.create_task(chatter())
        await asyncio.sleep(delay)
        await eng.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _hammer_initiator(ports, go, cycles: int, mode: str) -> None:
    """Per cycle: connect, four writers stream 16-page writes, close at a staggered moment."""
    from kvxfer.engine import ItemWrite

    loop = asyncio.get_running_loop()
    for c in range(cycles):
        port = await loop.run_in_executor(None, ports.get, True, 60.0)
        eng, buf = _hammer_engine("I", mode)
        await eng.start()
        peer = await eng.connect("127.0.0.1", port)

        async def writer(peer=peer):
            while True:
                try:
                    await peer.write([ItemWrite("kv", list(range(16)), list(range(16)))], b"n", 5.0)
                except Exception:
                    return

        tasks = [loop.create_task(writer()) for _ in range(4)]
        await asyncio.sleep(0.02)
        delay = (c % 5) * 0.003
        go.put(delay)
        await asyncio.sleep(delay + (c % 3) * 0.002)
        await eng.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def hammer_side(role: str, ports, go, cycles: int, mode: str) -> None:
    """Entry point of one hammer process (spawned); exits 0 when all cycles ran."""
    import faulthandler

    faulthandler.enable()
    side = _hammer_target if role == "target" else _hammer_initiator
    asyncio.run(side(ports, go, cycles, mode))
    for q in (ports, go):  # what we put must reach the other side before _exit
        q.close()
        q.join_thread()
    os._exit(0)  # UCX teardown at interpreter exit is not what this hammers
