"""Helpers for multi-process tests and benchmarks over real UCX.

- :class:`Child` / :func:`serve` (:mod:`.process`): spawn-context children with bounded waits,
  child tracebacks re-raised in the parent as :class:`ChildError`, command servers.
- :func:`engine_node` / :class:`EngineNode` (:mod:`.nodes`): engines over host or device
  buffers, driven by commands (used by tests/engine and ``kvxfer bench transfer``).
- :func:`transport_node` (:mod:`.transport_checks`): transport-level checks for tests/transport.
"""
from kvxfer.testing.nodes import EngineNode, engine_node
from kvxfer.testing.process import Child, ChildError, serve
from kvxfer.testing.transport_checks import transport_node

__all__ = ["Child", "ChildError", "serve", "EngineNode", "engine_node", "transport_node"]
