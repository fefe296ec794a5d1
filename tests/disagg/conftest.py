"""Session-wide PD cluster for tests/disagg: bootstrap servers (in this process, background
threads) and two spawned worker processes — one prefill, one decode — each hosting one node
per pool kind, all on real UCX loopback. Tests use distinct room ids, so they share them."""

import itertools

import pytest
from pd_harness import FAST, KINDS, TINY, Worker
from testenv import DEVICE

_room_ids = itertools.count(1000)


@pytest.fixture
def room():
    """A fresh room id per call: ``room()``."""
    return lambda: next(_room_ids) * 7919 + 17


class Cluster:
    def __init__(self):
        from kvxfer.disagg import BootstrapServer

        names = list(KINDS) + ["many", "tiny", "victim"]
        self.bs = {n: BootstrapServer(port=0).start_in_thread() for n in names}
        # KV/state pools on the test device (CUDA on the accelerator machine); aux stays host
        dev = DEVICE
        spec = {k: dict(kind=k, timeouts=FAST, device=dev) for k in KINDS}
        spec["many"] = dict(
            kind="many",
            size=4096,
            page_size=1,
            aux_rows=4096,
            timeouts=dict(
                FAST, bootstrap_s=60.0, waiting_s=60.0, transfer_s=120.0, heartbeat_timeout_s=120.0
            ),
        )
        spec["tiny"] = dict(kind="mha", timeouts=TINY, name="tiny", device=dev)
        p_spec = {
            n: dict(kw, role="prefill", bootstrap=self.bs[n].address) for n, kw in spec.items()
        }
        d_spec = {
            n: dict(kw, role="decode", bootstrap=self.bs[n].address) for n, kw in spec.items()
        }
        d_spec["mismatch"] = dict(
            kind="mismatch",
            role="decode",
            timeouts=FAST,
            bootstrap=self.bs["mha"].address,
            device=dev,
        )
        self.device = dev
        self.p = Worker(p_spec)
        self.d = Worker(d_spec)
        self.victims = []
        self.p.ready()
        self.d.ready()

    def victim(self, role: str, bootstrap: str) -> Worker:
        """A one-node worker to be killed (kind mha, fast timeouts)."""
        w = Worker(
            {
                "mha": dict(
                    kind="mha",
                    role=role,
                    bootstrap=bootstrap,
                    timeouts=FAST,
                    name="victim",
                    device=self.device,
                )
            }
        )
        self.victims.append(w)
        return w.ready()

    def close(self):
        workers = [self.p, self.d] + self.victims
        for w in workers:
            w.request_exit()
        for w in workers:
            w.close()
        for s in self.bs.values():
            s.stop_thread()


# module scope: a worker pair left idle for the rest of the run keeps a core busy (every
# manager loop with a posted UCXX receive polls), which starves the tests that run after it
@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
