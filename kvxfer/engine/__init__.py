"""The asyncio transfer engine.

    from kvxfer.engine import TransferEngine, EngineConfig, ItemWrite, TransferStats

    eng = TransferEngine(EngineConfig(secret=b"...", error_mode="peer"))
    eng.register("kv", ptrs, lens, item_lens)           # before start()
    host, port = await eng.start()
    eng.on_message(lambda peer, payload: ...)            # app messages + write notifications
    peer = await eng.connect(host2, port2)               # authenticated, layouts exchanged
    stats = await peer.write([ItemWrite("kv", src, dst)], notify=b"done")
    await eng.close()

Modules: ``engine`` (TransferEngine), ``peer`` (Peer: write/send/close), ``handshake``,
``groups`` (registrations, remote layouts), ``messages`` (wire types), ``types``.
"""
from kvxfer.config import EngineConfig
from kvxfer.engine.engine import TransferEngine
from kvxfer.engine.peer import Peer
from kvxfer.engine.types import ItemWrite, RawWrite, TransferStats

__all__ = ["TransferEngine", "EngineConfig", "ItemWrite", "RawWrite", "TransferStats", "Peer"]
