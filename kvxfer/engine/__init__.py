"""The asyncio transfer engine.

    from kvxfer.engine import TransferEngine, EngineConfig, ItemWrite, TransferStats

    eng = TransferEngine(EngineConfig(secret=b"...", error_mode="peer"))
    eng.register("kv", ptrs, lens, item_lens)           # before start()
    host, port = await eng.start()
    eng.on_message(lambda peer, payload: ...)            # app messages + write notifications
    peer = await eng.connect(host2, port2)               # authenticated, layouts exchanged
    stats = await peer.write([ItemWrite("kv", src, dst)], notify=b"done")
    await eng.close()

Modules: ``engine`` (TransferEngine), ``host`` (PeerHost: what a peer gets of its engine),
``peer`` (Peer: write/send/close), ``writeplan`` (validating and planning a peer's writes),
``peer_staged`` (a peer's staged path), ``slices`` (strided slice plans), ``handshake``, ``groups`` (registrations, remote
layouts), ``messages`` (wire types), ``types``. Where each part runs: the threads table in
docs/engine.md.
"""

from kvxfer.config import EngineConfig
from kvxfer.engine.engine import TransferEngine
from kvxfer.engine.peer import Peer
from kvxfer.engine.types import ItemWrite, PatternWrite, RawWrite, SliceWrite, TransferStats

__all__ = [
    "TransferEngine",
    "EngineConfig",
    "ItemWrite",
    "RawWrite",
    "SliceWrite",
    "PatternWrite",
    "TransferStats",
    "Peer",
]
