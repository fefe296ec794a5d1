"""Parent side of the reliability scenarios: worker processes (:class:`Worker`), signals, the
shared secret, the pool geometry. The parent never initialises UCX; it runs bootstrap servers
on background threads and drives workers through typed proxies (:mod:`kvxfer.procs`)."""

from __future__ import annotations

import os
import secrets
from typing import Optional

from kvxfer import procs

#: small pages (page-major, 2 layers; a 4-layer envelope Mamba state): the soak is about
#: protocol interleavings, not bandwidth
SOAK_SPEC = dict(
    kv_layout="page_major",
    mamba_layout="envelope",
    attn_layers=2,
    mamba_layers=2,
    heads=1,
    head_dim=16,
    page_size=4,
    pool_tokens=4 * 1024,
    mamba_slots=96,
    aux_rows=128,
    conv_dim=8,
    ssm_heads=1,
    ssm_head_dim=4,
    ssm_state=4,
)

#: bigger pages for the kill matrix: a 2048-page write (32 MiB) is still in flight when the
#: signal lands
MATRIX_SPEC = dict(
    kv_layout="page_major",
    mamba_layout="envelope",
    attn_layers=2,
    mamba_layers=2,
    heads=2,
    head_dim=64,
    page_size=16,
    pool_tokens=16 * (2048 + 64),
    mamba_slots=32,
    aux_rows=64,
    conv_dim=8,
    ssm_heads=1,
    ssm_head_dim=4,
    ssm_state=4,
)


def ensure_secret() -> None:
    """Workers pass ``KVXFER_SECRET`` as ``secret=``; make one up for this run when unset."""
    os.environ.setdefault("KVXFER_SECRET", secrets.token_hex(16))


class Worker:
    """One spawned :class:`~kvxfer.testing.reliability.node.RelNode` process."""

    def __init__(
        self, role: str, spec: dict, bootstrap: Optional[str], opts: dict, name: str = ""
    ) -> None:
        from kvxfer.pd_demo.worker import build_worker
        from kvxfer.testing.reliability.node import RelNode

        ensure_secret()
        self.role = role
        self.worker = procs.Worker(
            build_worker, RelNode, role, spec, bootstrap, opts, name=name or role
        ).launch()
        self.node: RelNode = self.worker.proxy(RelNode)
        self.info: Optional[dict] = None

    def ready(self, timeout: float = 180.0) -> "Worker":
        if self.info is None:
            self.worker.ready(timeout)
            self.info = self.node.info()
        return self

    @property
    def pid(self) -> int:
        return self.worker.pid

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the CLOCK_MONOTONIC time it was sent (comparable with the
        workers' ``time.monotonic()`` stamps: one clock per host)."""
        return self.worker.signal(sig)

    def alive(self) -> bool:
        return self.worker.alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask it to exit (resuming it first if it is stopped); SIGKILL when it does not."""
        self.worker.close(timeout)
