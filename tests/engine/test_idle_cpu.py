"""An idle connected engine pair, and an idle connected KVManager pair, use ~no CPU: their
loops sleep in epoll between events (kvxfer issue 15: UCXX's ``wait_yield`` polled every
channel's pending receive with ``asyncio.sleep(0)``, a busy core per loop). Each side runs
in a spawned process; CPU is the loop threads' own clocks and the process's over a 1 s
window (generous bounds for a loaded 2-core CI box; a spinning loop uses ~1 core)."""

import pytest

from kvxfer.procs import Worker
from kvxfer.testing.idle_checks import IdleNode

pytestmark = pytest.mark.timeout(120)

WINDOW_S = 1.0
LOOP_MAX = 0.10  # cores, per loop thread
PROCESS_MAX = 0.30  # cores, the whole process (UCXX's progress thread included)


@pytest.mark.parametrize("mode", ["peer", "none"])
def test_idle_engine_pair_sleeps(mode):
    w = Worker(IdleNode, mode, name=f"idle-{mode}").start()
    try:
        node = w.proxy(IdleNode, timeout=60.0)
        assert node.ping(), "no answer over the channel"
        cpu = node.idle_cpu(WINDOW_S)
        assert cpu["loop_a"] < LOOP_MAX and cpu["loop_b"] < LOOP_MAX, cpu
        assert cpu["process"] < PROCESS_MAX, cpu
        assert node.ping(), "the channel no longer answers after the idle window"
    finally:
        w.close()


def test_idle_manager_pair_sleeps():
    from kvxfer.pd_demo.run import start_pair
    from kvxfer.pd_demo.spec import ModelSpec
    from kvxfer.pd_demo.worker import PDWorker

    spec = ModelSpec(pool_tokens=1024, mamba_slots=8, aux_rows=16)
    pair = start_pair(spec, {"deadline_s": 60.0, "error_mode": "none"}, PDWorker)
    try:
        warm = [(1, 16)]  # one room: decode connects to prefill (bootstrap, handshake)
        rp, rd = pair.both((pair.prefill.prefill, warm, 256), (pair.decode.decode, warm))
        assert rp["rooms"][1]["state"] == rd["rooms"][1]["state"] == "Success", (rp, rd)
        cp, cd = pair.both((pair.prefill.loop_cpu, WINDOW_S), (pair.decode.loop_cpu, WINDOW_S))
        for cpu in (cp, cd):
            assert cpu["loop"] < LOOP_MAX and cpu["process"] < PROCESS_MAX, (cp, cd)
    finally:
        pair.close()
