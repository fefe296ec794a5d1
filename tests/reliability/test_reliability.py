"""Reliability scenarios of docs/RELIABILITY.md, driven through kvxfer.testing.reliability
(real worker processes, real UCX, real pools). The quick variants run in CI; the full ones
are marked ``long`` (``make test-long``). Each assertion names the counts it saw."""

import json

import pytest

from kvxfer.testing.reliability.kill_matrix import run_matrix
from kvxfer.testing.reliability.netns import run_netns
from kvxfer.testing.reliability.selfcheck import run_self_check
from kvxfer.testing.reliability.soak import run_soak


def _show(summary: dict) -> str:
    return json.dumps(summary, sort_keys=True, indent=1, default=str)[:6000]


def _bad_cells(m: dict) -> list:
    out = []
    for g in m["groups"]:
        out += [
            f"{g['victim']} {g['signal']} {st}: {c}"
            for st, c in g["cells"].items()
            if not c.get("ok")
        ]
        if not g["ok"]:
            out.append(
                {
                    k: g.get(k)
                    for k in (
                        "served_after",
                        "survivor_final",
                        "partner_final",
                        "victim_after_resume",
                        "victim_after_close",
                    )
                }
            )
    return out


@pytest.mark.timeout(180)
def test_checks_fire():
    """Each instrument reports the fault injected behind the transfer layer's back."""
    s = run_self_check()
    zero = {"kv": 0, "state": 0, "aux": 0}
    assert s["clean"]["late_writes"] == zero and s["clean"]["guard_hits"] == zero, s
    assert s["corrupt"]["state"] == "Success" and s["corrupt"]["bad_items"] == 1, s
    assert s["corrupt"]["corrupt_rooms"] == 1, s
    assert s["late_writes"] == {"kv": 1, "state": 1, "aux": 1}, s
    assert s["guard_hits"] == {"kv": 1, "state": 1, "aux": 1}, s
    assert s["open_room"]["unreleased"] == 1 and s["open_room"]["leaks"]["pages"] == 3, s


@pytest.mark.timeout(240)
def test_soak_quick():
    s = run_soak(requests=300, seed=11)
    assert s["ok"], _show(s)
    assert s["succeeded"] + s["aborted"] == 300 and s["pages_verified"] > 0


@pytest.mark.timeout(120)
def test_soak_makes_up_its_secret(monkeypatch):
    """``python -m kvxfer.testing.reliability soak`` from a shell without ``KVXFER_SECRET``:
    the run makes one up before its bootstrap server needs it (it raised InvalidArgument)."""
    monkeypatch.delenv("KVXFER_SECRET")
    s = run_soak(requests=20, seed=3)
    assert s["ok"], _show(s)
    assert s["succeeded"] + s["aborted"] == 20


@pytest.mark.timeout(300)
def test_kill_matrix_quick():
    """A prefill SIGKILLed with a room in each state; restarted under the same key."""
    m = run_matrix(victims=["prefill"], signals=["KILL"])
    assert m["ok"], _bad_cells(m)


@pytest.mark.timeout(240)
def test_netns_quick():
    s = run_netns(requests=50)
    if s.get("skipped"):
        pytest.skip(s["skipped"])
    assert s["ok"], _show(s)


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_soak_long():
    s = run_soak(requests=10000, seed=0)
    assert s["ok"], _show(s)


@pytest.mark.long
@pytest.mark.timeout(1200)
def test_kill_matrix_long():
    m = run_matrix()
    assert m["ok"], _bad_cells(m)


@pytest.mark.long
@pytest.mark.timeout(900)
@pytest.mark.parametrize("impair", [False, True], ids=["clean", "impaired"])
def test_netns_long(impair):
    s = run_netns(requests=500, impair=impair)
    if s.get("skipped"):
        pytest.skip(s["skipped"])
    assert s["ok"], _show(s)
