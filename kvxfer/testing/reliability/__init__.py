"""Reliability scenarios (docs/RELIABILITY.md): separate programs that drive the public API
(KVManager, KVSender, KVReceiver, KVPoll, BootstrapServer, pools and allocators) from real
worker processes over real UCX, the way an independent tester would.

- :mod:`.soak` — random sizes, chunking and aborts from both sides between one pair;
- :mod:`.kill_matrix` — each side killed (SIGKILL) or frozen (SIGSTOP, later SIGCONT) while
  rooms sit in each state; the survivor's bounds, releases and reconnection;
- :mod:`.netns` — prefill and decode in two network namespaces joined by a veth pair,
  clean and impaired.

Workers are :class:`.node.RelNode` processes; every registered item is guarded by sentinels
(see :mod:`.node`). ``python -m kvxfer.testing.reliability {soak,kill,netns} --json``.
"""
