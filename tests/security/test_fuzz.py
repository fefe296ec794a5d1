"""Fuzz the control planes: malformed, oversized and wrong-typed messages (seeded generator,
:mod:`fuzzgen`) at the bootstrap server and at an engine, before and after authentication.
Nothing may crash or log an unexpected error, a party without the secret never gets a Layout,
a sealed reply or a registry entry, and both servers still answer afterwards.

Quick variants run in CI; the long ones (``make test-long``) send >= 10,000 messages to each
of the four targets (bootstrap / engine x before / after authentication)."""

import asyncio
import logging
import os
import random
import struct

import fuzzgen
import pytest
from sec_nodes import ITEM, Attacker, TargetNode, _Errors, engine_spec

from kvxfer import wire
from kvxfer.disagg import bootstrap
from kvxfer.disagg import messages as m
from kvxfer.disagg.bootstrap import BootstrapServer, seal
from kvxfer.procs import Worker

pytestmark = pytest.mark.timeout(300)

BS_SECRET = b"fuzz-secret"
QUICK = {"bs_unauth": 400, "bs_auth": 400, "first": 120, "second": 40, "layout": 60, "peer": 20}
LONG = {
    "bs_unauth": 10_000,
    "bs_auth": 10_000,
    "first": 7_500,
    "second": 2_500,
    "layout": 5_000,
    "peer": 5_000,
}


def test_generator_matches_the_protocol():
    assert fuzzgen.V == wire.PROTOCOL_VERSION


# ------------------------------------------------------------------------------ bootstrap
async def _unsealed(port: int, frame: bytes):
    """Connect, take the challenge, send ``frame``, half-close; the answer or None."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        (n,) = struct.unpack(">I", await r.readexactly(4))
        assert isinstance(wire.decode(await r.readexactly(n)), m.BsChallenge)
        w.write(frame)
        await w.drain()
        w.write_eof()
        try:
            (n,) = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 10))
            return wire.decode(await r.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
    finally:
        w.close()


async def _sealed(port: int, body: bytes) -> m.BsReply:
    """An authenticated request with a (malformed) body; the verified reply."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        (n,) = struct.unpack(">I", await r.readexactly(4))
        challenge = wire.decode(await r.readexactly(n))
        nonce_c = os.urandom(32)
        frame = m.BsSealed(
            nonce=nonce_c,
            body=body,
            mac=seal(BS_SECRET, b"request", challenge.nonce, nonce_c, body),
        )
        raw = frame.encode()
        w.write(struct.pack(">I", len(raw)) + raw)
        await w.drain()
        (n,) = struct.unpack(">I", await asyncio.wait_for(r.readexactly(4), 10))
        answer = wire.decode(await r.readexactly(n))
        if isinstance(answer, m.BsReply):  # refused before authentication: the frame size
            assert not answer.ok and "frame" in answer.error, answer
            return answer
        assert answer.nonce == nonce_c and answer.mac == seal(
            BS_SECRET, b"reply", challenge.nonce, nonce_c, answer.body
        )
        return wire.expect(wire.decode(answer.body), m.BsReply)
    finally:
        w.close()


async def _fuzz_bootstrap(n_unauth: int, n_auth: int, seed: int) -> dict:
    loop = asyncio.get_running_loop()
    loop_errors = []
    loop.set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx.get("message")))
    errors = _Errors()
    logging.getLogger("kvxfer").addHandler(errors)
    srv = BootstrapServer(port=0, secret=BS_SECRET)
    await srv.start()
    stats = {"unauth": 0, "auth": 0, "auth_ok": 0}
    try:
        await bootstrap.request(
            srv.address,
            m.BsRegister(
                name="prefill",
                host="127.0.0.1",
                port=1234,
                tp_rank=0,
                tp_size=1,
                dp_rank=0,
                pp_rank=0,
                fingerprint={"page_size": 16},
            ),
            5,
            BS_SECRET,
        )
        rng = random.Random(seed)
        for frame in fuzzgen.bootstrap_frames(rng, n_unauth):
            answer = await _unsealed(srv.port, frame)
            # never anything sealed, never an entry: a refusal at most
            assert answer is None or (
                isinstance(answer, m.BsReply) and not answer.ok and answer.entries == []
            ), answer
            stats["unauth"] += 1
        for body in fuzzgen.bootstrap_bodies(rng, n_auth):
            reply = await _sealed(srv.port, body)
            stats["auth"] += 1
            stats["auth_ok"] += reply.ok
        for e in srv.entries():  # whatever got in is well formed
            m.check_entry(e)
        assert sum(srv._per_dp.values()) == len(srv.entries())
        got = await bootstrap.lookup(srv.address, 0, 5, BS_SECRET)  # still answers, right
        assert got == [e for e in srv.entries() if e["dp_rank"] == 0]
    finally:
        await srv.close()
        logging.getLogger("kvxfer").removeHandler(errors)
    assert loop_errors == [] and errors.records == [], (loop_errors, errors.records)
    return stats


async def test_bootstrap_fuzz_quick():
    stats = await _fuzz_bootstrap(QUICK["bs_unauth"], QUICK["bs_auth"], seed=1)
    assert stats["unauth"] == QUICK["bs_unauth"] and stats["auth"] == QUICK["bs_auth"]


@pytest.mark.long
@pytest.mark.timeout(1800)
async def test_bootstrap_fuzz_long():
    stats = await _fuzz_bootstrap(LONG["bs_unauth"], LONG["bs_auth"], seed=2)
    print("bootstrap fuzz:", stats)  # the figure in docs/SECURITY.md
    assert stats["unauth"] >= 10_000 and stats["auth"] >= 10_000


# -------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def engine_pair():
    tw = Worker(TargetNode, engine_spec("target"), name="target")
    mw = Worker(Attacker, name="mallory")
    try:
        target = tw.start().proxy(TargetNode)
        port = target.ports()["main"]
        yield target, mw.start().proxy(Attacker), port
    finally:
        mw.close()
        tw.close()


def _fuzz_engine(target, mallory, port, counts, seed) -> dict:
    out = {}
    big = 600.0 + sum(counts.values())
    out["first"] = mallory.fuzz_preauth(
        "127.0.0.1", port, seed, counts["first"], False, timeout=big
    )
    out["second"] = mallory.fuzz_preauth(
        "127.0.0.1", port, seed + 1, counts["second"], True, timeout=big
    )
    out["layout"] = mallory.fuzz_layout("127.0.0.1", port, seed + 2, counts["layout"], timeout=big)
    out["peer"] = mallory.fuzz_peer("127.0.0.1", port, seed + 3, counts["peer"], timeout=big)
    print("engine fuzz:", out)
    # before authentication nothing of the target's layout came back
    assert out["first"]["layouts"] == 0 and out["second"]["layouts"] == 0, out
    for phase in ("first", "second", "layout", "peer"):
        assert out[phase]["sent"] == counts[phase], (phase, out[phase])
    # the target is alive, logged no unexpected error, and still serves a real peer
    assert mallory.check_answers("127.0.0.1", port)["ok"]
    got = target.messages("main", 1, 10.0)  # (with the fuzz's well-formed ones)
    assert b"still-here" in [p for _, p in got], got
    assert target.items("main", "kv", [4, 5, 6, 7]) == bytes([7]) * 4 * ITEM + bytes([8]) * 4 * ITEM
    assert target.errors() == []
    return out


def test_engine_fuzz_quick(engine_pair):
    _fuzz_engine(*engine_pair, QUICK, seed=10)


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_engine_fuzz_long(engine_pair):
    out = _fuzz_engine(*engine_pair, LONG, seed=20)
    assert out["first"]["sent"] + out["second"]["sent"] >= 10_000
    assert out["layout"]["sent"] + out["peer"]["sent"] >= 10_000
