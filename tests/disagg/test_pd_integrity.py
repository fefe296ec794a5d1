"""Integrity mode end to end (``KVManager(integrity=True)`` on both sides), between two spawned
processes over real UCX loopback: byte-exact rooms still succeed for every pool kind; a byte
flipped on decode after the write and before the check fails the room on BOTH sides with
IntegrityError naming the item, and every page/slot/row is released; a side with the setting
off is refused at connection time. The module runs its own pair of workers (one node per
kind, integrity on), so the session cluster of the other tests stays as it is."""

import itertools

import pytest
from pd_harness import FAST, KINDS, Worker
from testenv import DEVICE

pytestmark = pytest.mark.timeout(120)

_ids = itertools.count(1)


def room() -> int:
    return 7_000_000 + next(_ids) * 7919


class Pair:
    def __init__(self):
        from kvxfer.disagg import BootstrapServer

        dev = DEVICE
        names = list(KINDS) + ["off"]
        self.bs = {n: BootstrapServer(port=0).start_in_thread() for n in names}
        spec = {k: dict(kind=k, timeouts=FAST, device=dev, integrity=True) for k in KINDS}
        p_spec = {
            n: dict(kw, role="prefill", bootstrap=self.bs[n].address) for n, kw in spec.items()
        }
        d_spec = {
            n: dict(kw, role="decode", bootstrap=self.bs[n].address) for n, kw in spec.items()
        }
        # "off": prefill without the check, decode with it
        p_spec["off"] = dict(
            kind="mha",
            role="prefill",
            bootstrap=self.bs["off"].address,
            timeouts=FAST,
            device=dev,
            name="off",
        )
        d_spec["off"] = dict(
            kind="mha",
            role="decode",
            bootstrap=self.bs["off"].address,
            timeouts=FAST,
            device=dev,
            name="off",
            integrity=True,
        )
        self.p, self.d = Worker(p_spec), Worker(d_spec)
        self.p.ready()
        self.d.ready()

    def close(self):
        for w in (self.p, self.d):
            w.request_exit()
        for w in (self.p, self.d):
            w.close()
        for s in self.bs.values():
            s.stop_thread()


@pytest.fixture(scope="module")
def pair():
    c = Pair()
    try:
        yield c
    finally:
        c.close()


def no_leaks(c, *nodes):
    for w, n in nodes:
        assert w[n].leaks() == {"pages": 0, "slots": 0, "aux": 0, "rooms": 0}, (w, n)


@pytest.mark.parametrize("kind", KINDS)
def test_checked_rooms_succeed_byte_exact(pair, kind):
    """Chunked (decode first) and one-chunk (prefill first, queued) rooms: Success on both
    sides only after decode compared every checksum; bytes exact."""
    c = pair
    a, b = room(), room()
    c.d[kind].d_open(a, 7)
    c.p[kind].p_open(a, 7)
    assert c.p[kind].poll_until(a, ["WaitingForInput"]) == "WaitingForInput"
    for lo, hi in ((0, 2), (2, 5), (5, 7)):
        c.p[kind].p_send(a, lo, hi)
    c.p[kind].p_open(b, 3)
    c.p[kind].p_send(b, 0, 3)
    c.d[kind].d_open(b, 3)
    for r in (a, b):
        assert c.d[kind].wait(r)["state"] == "Success"
        assert c.p[kind].wait(r)["state"] == "Success"
        assert c.d[kind].verify(r) == 0
    no_leaks(c, (c.p, kind), (c.d, kind))


@pytest.mark.parametrize(
    "kind,group,index,entry,byte",
    [
        ("hybrid_per_layer", "kv", 0, 3, 5),  # a page of the FIRST chunk, one layer's V
        ("mha", "kv", 6, 0, 0),  # a page of the last chunk
        ("page_major", "kv", 4, 0, 300),  # the second layer of an all-layer page
        ("hybrid_envelope", "state", 0, 0, 7),  # the Mamba state slot
        ("mla", "aux", 0, 0, 40),  # the aux row's payload (not its stamped header)
    ],
)
def test_corrupted_destination_fails_both_sides(pair, kind, group, index, entry, byte):
    c = pair
    r = room()
    c.d[kind].d_open(r, 7)
    c.d[kind].corrupt_before_check(r, group, index, entry, byte)
    c.p[kind].p_open(r, 7)
    for lo, hi in ((0, 2), (2, 5), (5, 7)):
        c.p[kind].p_send(r, lo, hi)
    d = c.d[kind].wait(r)
    assert d["state"] == "Failed" and d["exc"] == "IntegrityError", d
    assert f"{group} item {index} " in d["msg"] and "data rejected" in d["msg"], d
    p = c.p[kind].wait(r)
    assert p["state"] == "Failed" and p["exc"] == "IntegrityError", p
    assert f"{group} item {index} " in p["msg"], p
    no_leaks(c, (c.p, kind), (c.d, kind))
    # the pair still works afterwards
    ok = room()
    c.d[kind].d_open(ok, 2)
    c.p[kind].p_open(ok, 2)
    c.p[kind].p_send(ok, 0, 2)
    assert c.d[kind].wait(ok)["state"] == "Success" and c.d[kind].verify(ok) == 0
    assert c.p[kind].wait(ok)["state"] == "Success"
    no_leaks(c, (c.p, kind), (c.d, kind))


def test_setting_mismatch_is_refused(pair):
    """Decode checks, prefill does not: refused when decode connects, naming the setting."""
    c = pair
    r = room()
    c.d["off"].d_open(r, 2)
    res = c.d["off"].wait(r)
    assert res["state"] == "Failed" and res["exc"] == "LayoutMismatch", res
    assert "integrity" in res["msg"] and "'off'" in res["msg"], res
    no_leaks(c, (c.d, "off"), (c.p, "off"))
