"""Test-only helpers for multi-process tests over real UCX (never imported by the demo or the
benchmarks; their worker processes are :mod:`kvxfer.procs`).

- :class:`Child` / :func:`serve` (:mod:`.process`): the older queue-based command children,
  still used by the transport, security, lifecycle and SGLang tests (to be moved to
  :mod:`kvxfer.procs` proxies).
- :class:`TransportNode` (:mod:`.transport_checks`): transport-level checks for tests/transport.
- :mod:`.reliability`: soak, kill matrix and network-namespace scenarios.
"""
from kvxfer.testing.process import Child, ChildError, serve
from kvxfer.testing.transport_checks import TransportNode

__all__ = ["Child", "ChildError", "serve", "TransportNode"]
