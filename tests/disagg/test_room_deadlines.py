"""Room deadlines (KVManager.arm / _expired) on a real, unstarted KVManager and a real loop,
driven step by step: a deadline moved later keeps the armed timer (it fires early and re-arms
for the rest), one moved earlier replaces it, terminal rooms have none, and a deadline that
passed fails the room with TransferTimeout naming the state it was set in."""

import asyncio

import numpy as np
import pytest

from kvxfer.disagg import KVArgs, KVManager, KVPoll, MetadataBuffer, Timeouts
from kvxfer.disagg.rooms import Room
from kvxfer.errors import TransferTimeout

pytestmark = pytest.mark.timeout(30)


def _manager(mode: str) -> KVManager:
    kv = np.zeros((2, 4, 16), dtype=np.uint8)
    aux = MetadataBuffer(4, 64)
    ap, al, ai = aux.buf_infos()
    args = KVArgs(
        kv_data_ptrs=[kv[i].ctypes.data for i in range(2)],
        kv_data_lens=[64] * 2,
        kv_item_lens=[16] * 2,
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
    )
    mgr = KVManager(
        args,
        mode,
        bootstrap_addr="127.0.0.1:9",
        timeouts=Timeouts(bootstrap_s=30.0, waiting_s=300.0, transfer_s=60.0),
    )
    mgr._keep = (kv, aux)  # type: ignore[attr-defined]
    mgr.loop = asyncio.get_running_loop()
    return mgr


def _room(mgr: KVManager, done: list) -> Room:
    r = Room(7, "sender", on_done=lambda state, exc: done.append((state, exc)))
    mgr.rooms.insert(r)
    mgr.arm(r)
    return r


@pytest.mark.asyncio
async def test_later_deadline_keeps_the_timer_and_earlier_replaces_it():
    mgr = _manager("prefill")
    loop = asyncio.get_running_loop()
    r = _room(mgr, [])
    first = r.timer
    assert first is not None and r.due is not None
    assert r.due[1] == KVPoll.Bootstrapping and r.due[2] == 30.0
    assert first.when() == pytest.approx(r.due[0])
    mgr.advance(r, KVPoll.WaitingForInput)  # 300 s: later than the armed 30 s
    assert r.timer is first and not first.cancelled()
    assert r.due[1] == KVPoll.WaitingForInput and r.due[0] > first.when() + 200
    mgr.arm(r, 5.0)  # earlier: replaced
    assert first.cancelled() and r.timer is not first
    assert r.timer.when() == pytest.approx(loop.time() + 5.0, abs=0.5)
    second = r.timer
    mgr.advance(r, KVPoll.Transferring)  # 60 s: later than 5 s, kept
    assert r.timer is second and r.due[1] == KVPoll.Transferring
    mgr.advance(r, KVPoll.Success)  # terminal: no deadline
    assert second.cancelled() and r.timer is None and r.due is None


@pytest.mark.asyncio
async def test_an_early_timer_rearms_and_a_passed_deadline_fails_the_room():
    mgr = _manager("prefill")
    loop = asyncio.get_running_loop()
    done: list = []
    r = _room(mgr, done)
    mgr.advance(r, KVPoll.WaitingForInput)
    due = r.due
    r.timer.cancel()
    mgr._expired(r)  # as the 30 s timer firing: the 300 s deadline is far
    assert r.state == KVPoll.WaitingForInput and r.due == due
    assert r.timer is not None and r.timer.when() == pytest.approx(due[0])
    r.timer.cancel()
    r.due = (loop.time() - 0.01, KVPoll.WaitingForInput, 300.0)  # the deadline passed
    mgr._expired(r)
    assert r.state == KVPoll.Failed and isinstance(r.exc, TransferTimeout)
    assert "WaitingForInput for more than 300s" in str(r.exc)
    assert done and done[0][0] == KVPoll.Failed  # released: no link, nothing in flight


@pytest.mark.asyncio
async def test_expired_after_release_or_without_deadline_does_nothing():
    mgr = _manager("decode")
    done: list = []
    r = _room(mgr, done)
    r.timer.cancel()
    r.due = None
    mgr._expired(r)
    assert r.state == KVPoll.Bootstrapping and r.timer is None
    mgr.arm(r)
    r.timer.cancel()
    r.released = True
    r.due = (asyncio.get_running_loop().time() - 1, KVPoll.Bootstrapping, 30.0)
    mgr._expired(r)
    assert r.state == KVPoll.Bootstrapping and not done
