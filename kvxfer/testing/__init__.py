"""Test-only helpers for multi-process tests over real UCX (never imported by the demo or the
benchmarks). Every worker process, here and in the tests, is a :class:`kvxfer.procs.Worker`
hosting a plain class whose public methods the parent calls through a typed proxy.

- :mod:`.transport_checks`: :class:`~.transport_checks.TransportNode`, transport-level checks
  for tests/transport.
- :mod:`.reliability`: soak, kill matrix and network-namespace scenarios.
"""
