"""kvxfer as an SGLang PD-disaggregation transfer backend (``--disaggregation-transfer-backend
kvxfer``), loaded through SGLang's plugin entry point ``sglang.srt.plugins`` (see
:mod:`.plugin` and docs/integrations.md).

Design: the classes subclass SGLang's ``CommonKVManager`` / ``CommonKVSender`` /
``CommonKVReceiver`` / ``CommonKVBootstrapServer`` and keep SGLang's control plane (HTTP
bootstrap ``/route``, ZMQ room metadata, abort notifications and drained-abort acks, rank
mapping, heartbeats); the data path - every byte of KV, state and metadata rows - and the
completion that lets decode use them go through kvxfer's engine (authenticated peers, bounded
waits, per-room ordered writes). Importing this package imports neither SGLang nor UCX.
"""

BACKEND_NAME = "kvxfer"

__all__ = ["BACKEND_NAME"]
