"""Relay and wrong-secret attempts against real engines (three processes, real UCX loopback):
no Layout, remote key or region table ever reaches a party without the secret.

The relay is a real forwarding program (:meth:`sec_nodes.Attacker.relay_start`): decode
connects to it believing it is prefill, it connects to the real prefill and forwards every
message both ways. Before the handshake bound its proofs to the connection, both Layouts
crossed it (and with them prefill's remote keys: write access to its pool)."""

import pytest
from sec_nodes import SECRET, WRONG, Attacker, TargetNode, engine_spec

from kvxfer.procs import Worker, run_in_child

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def net():
    workers = [
        Worker(TargetNode, engine_spec("prefill"), name="prefill"),
        Worker(TargetNode, engine_spec("decode"), name="decode"),
        Worker(Attacker, name="mallory"),
    ]
    try:
        for w in workers:
            w.start()
        prefill, decode = (w.proxy(TargetNode) for w in workers[:2])
        yield {
            "prefill": prefill,
            "decode": decode,
            "mallory": workers[2].proxy(Attacker),
            "port": prefill.ports()["main"],
            "dport": decode.ports()["main"],
        }
    finally:
        for w in workers:
            w.close()


def _keys(net):
    return net["prefill"].rkeys("main") + net["decode"].rkeys("main")


def test_relay_between_decode_and_prefill_gets_no_layout(net):
    relay = net["mallory"].relay_start("127.0.0.1", net["port"])
    res = net["decode"].connect("main", "127.0.0.1", relay)
    assert res.get("error") == "AuthenticationFailed", res
    assert "relay" in res["msg"]
    log = net["mallory"].relayed(_keys(net))
    tags = [t for _, t in log["tags"]]
    assert log["ended"] == 2, log
    # a working relay: decode's Hello reached prefill and prefill's answer came back ...
    assert tags[:2] == ["kx.hello", "kx.hello_ack"], tags
    # ... but no region table, remote key or landing grant crossed it, either way
    assert "kx.layout" not in tags and "kx.proof" not in tags, tags
    assert log["with_needle"] == 0, log
    assert net["prefill"].peers("main") == []
    assert net["decode"].peers("main") == []
    # the two real engines still pair directly
    direct = net["decode"].connect("main", "127.0.0.1", net["port"])
    assert "ok" in direct, direct
    assert net["prefill"].errors() == [] and net["decode"].errors() == []


def test_wrong_secret_as_client_gets_no_layout(net):
    out = net["mallory"].wrong_secret_client("127.0.0.1", net["port"], 5)
    assert out["layouts"] == 0, out
    # each attempt ends with the target closing it (after a best-effort Reject), nothing else
    assert set(out["answers"]) <= {"kx.reject", "PeerClosed"}, out
    assert out["answers"]["PeerClosed"] == 5, out


def test_wrong_secret_as_server_gets_no_layout(net):
    port = net["mallory"].fake_engine_start(WRONG)
    res = net["decode"].connect("main", "127.0.0.1", port)
    assert res.get("error") == "AuthenticationFailed", res
    seen = net["mallory"].fake_seen()
    assert "kx.layout" not in seen and "kx.proof" not in seen, seen
    assert set(seen) <= {"kx.reject"}, seen  # at most decode's (best-effort) Reject


def test_right_secret_fake_server_is_an_authenticated_peer(net):
    """Control for the two tests above: the same fake engine with the secret passes decode's
    check (decode then sends its Proof, and would send its Layout after the fake's), so
    what stops the others is the secret."""
    port = net["mallory"].fake_engine_start(SECRET)
    before = len(net["mallory"].fake_seen())
    res = net["decode"].connect("main", "127.0.0.1", port, 3.0)
    assert res.get("error") == "TransferTimeout", res  # the fake never sends its own Layout
    seen = net["mallory"].fake_seen()[before:]
    assert seen[:1] == ["kx.proof"], seen


def test_relay_between_kv_managers_gets_no_layout():
    """The issue's scenario with real managers: decode is sent to an attacker (here the
    prefill's bootstrap entry is made to point at it, as a stale entry whose port the
    attacker took over would) that relays to the real prefill. The room fails; no Layout
    crosses; prefill never gets a link."""
    out = run_in_child(_manager_relay, timeout=120)
    assert out["state"] == "Failed" and out["exc"] == "AuthenticationFailed", out
    assert out["tags"][:2] == ["kx.hello", "kx.hello_ack"], out
    assert "kx.layout" not in out["tags"] and out["with_key"] == 0, out
    assert out["prefill_links"] == 0, out


def _manager_relay() -> dict:
    import asyncio

    import numpy as np

    from kvxfer import BootstrapServer, KVArgs, KVManager, KVPoll, KVReceiver, Timeouts, wire
    from kvxfer.engine import messages  # noqa: F401  (registers the kx. tags)
    from kvxfer.errors import KvxferError
    from kvxfer.transport.ucx import UcxTransport

    def args():
        kv, aux = np.zeros(8 * 64, dtype=np.uint8), np.zeros(8 * 16, dtype=np.uint8)
        a = KVArgs(
            kv_data_ptrs=[int(kv.ctypes.data)],
            kv_data_lens=[kv.nbytes],
            kv_item_lens=[64],
            aux_data_ptrs=[int(aux.ctypes.data)],
            aux_data_lens=[aux.nbytes],
            aux_item_lens=[16],
            page_size=1,
            dtype="uint8",
        )
        a._keep = (kv, aux)
        return a

    async def go():
        t = Timeouts(bootstrap_s=10, waiting_s=10, transfer_s=10, heartbeat_interval_s=0.2)
        bs = BootstrapServer(port=0, secret=SECRET)
        await bs.start()
        p = await KVManager(
            args(), "prefill", bootstrap_addr=bs.address, secret=SECRET, timeouts=t
        ).start()
        d = await KVManager(args(), "decode", secret=SECRET, timeouts=t).start()
        relay, relayed = UcxTransport(), []

        async def pump(src, dst):
            try:
                while True:
                    raw = await src.recv(30.0)
                    src.adopt_epoch()
                    relayed.append(raw)
                    await dst.send(raw, 10.0)
            except KvxferError:
                pass
            finally:
                await src.close(1.0)
                await dst.close(1.0)

        async def on_accept(client):
            server = await relay.connect(*p.address, 10.0)
            await asyncio.gather(pump(client, server), pump(server, client))

        _, rport = await relay.listen("127.0.0.1", 0, on_accept)
        try:
            entry = next(iter(bs._entries.values()))
            entry["port"] = rport  # decode will be sent to the relay
            recv = KVReceiver(d, bs.address, 42)
            recv.init()  # decode looks prefill up and connects
            state = await recv.wait(30)
            tags = []
            for raw in relayed:
                try:
                    tags.append(wire.decode(raw).TAG)
                except Exception:
                    tags.append(None)
            keys = p.engine._groups.region_table()[2] + d.engine._groups.region_table()[2]
            return {
                "state": KVPoll(state).name,
                "exc": type(recv.failure_exception()).__name__,
                "tags": tags,
                "msg": str(recv.failure_exception()),
                "with_key": sum(any(k in raw for k in keys) for raw in relayed),
                "prefill_links": len(p.links),
            }
        finally:
            await d.close()
            await p.close()
            await relay.close()
            await bs.close()

    return asyncio.run(go())
