"""Heterogeneous attention TP at 4:1, 1:4 and 2:4 through the kvxfer SGLang backend: the
harness of test_sglang_hetero_tp.py (real SGLang 0.5.23 classes and rank mapping, one
process per TP rank, every byte of every decode rank checked) with four prefill and four
decode processes.

Long (``-m long``): nine processes importing SGLang cost far more than the transfers (the
rooms themselves take about a second); run with
``.venv-sglang/bin/python -m pytest -q -m long tests/sglang_pd/test_sglang_hetero_tp4.py``.

Scenarios: ``p4d1`` / ``p1d4`` / ``p2d4``: 4 KV heads; ``p4d1r``: 2 KV heads over prefill
TP 4 (prefill replicas: ranks 1 and 3 move no KV byte); ``p2d4r``: 2 KV heads over decode
TP 4 (decode replicas: each prefill rank writes its head into two decode ranks);
``g4d1`` / ``g1d4`` / ``g2d4``: a hybrid model with a Mamba2 conv state of three parts
split on their own (GDN), ``k4d1`` / ``k1d4``: KimiLinear state (split dim after the outer
rows) - every byte of every state tensor on every decode rank.
"""

import pytest

pytest.importorskip(
    "sglang",
    reason="sglang is not installed here: `make test-sglang` runs these tests in .venv-sglang",
)

import sgl_harness as H  # noqa: E402
from sgl_harness import DONE, FAILED, SUCCESS  # noqa: E402

pytestmark = [pytest.mark.long, pytest.mark.timeout(1500)]

SCENARIOS = {  # name: (pool, total kv heads, prefill tp, decode tp)
    "p4d1": ("mha", 4, 4, 1),
    "p1d4": ("mha", 4, 1, 4),
    "p2d4": ("mha", 4, 2, 4),
    "p4d1r": ("mha", 2, 4, 1),
    "p2d4r": ("mha", 2, 2, 4),
    "g4d1": ("gdn", 4, 4, 1),
    "g1d4": ("gdn", 4, 1, 4),
    "g2d4": ("gdn", 4, 2, 4),
    "k4d1": ("kimi", 4, 4, 1),
    "k1d4": ("kimi", 4, 1, 4),
}


@pytest.fixture(scope="module")
def cluster():
    # nine processes importing SGLang at once: on a 2-core machine their start takes minutes
    with H.hetero_cluster(SCENARIOS, 4, 4, start_timeout=900) as c:
        yield c


@pytest.mark.parametrize("scen", list(SCENARIOS))
def test_byte_exact_at_every_ratio(cluster, scen):
    H.byte_exact(cluster, scen, 7400 + list(SCENARIOS).index(scen))


def test_decode_abort_at_4_to_1_waits_for_the_write_in_flight(cluster):
    """4:1: decode aborts while one prefill rank's write is held in flight; its pages are
    release-safe only after all four prefill ranks acked, the held one only after its write
    settled."""
    scen, room = "p4d1", 7450
    pfs, dc = cluster["pf"], cluster["dc"][0]
    p_pages, _ = H.open_room(cluster, scen, room, 2)
    pfs[3].hold_writes(scen)
    for pf in pfs:
        assert pf.send(room, p_pages, True) is True
    for pf in pfs[:3]:
        assert pf.wait(room, DONE, 30) == SUCCESS
    for _ in range(3000):
        if pfs[3].parked():
            break
    assert pfs[3].parked() == 1
    dc.abort(room)
    assert dc.poll(room) == FAILED
    assert pfs[3].wait(room, [FAILED], 30) == FAILED
    for _ in range(200):  # three acks arrive; the fourth cannot while the write is held
        assert dc.release_safe(scen, room, 4) is False
    pfs[3].release_writes(scen)
    for _ in range(3000):
        if dc.release_safe(scen, room, 4):
            break
    assert dc.release_safe(scen, room, 4) is True
    for node in (*pfs, dc):
        node.failure(room)  # as a scheduler reads it (pops SGLang's failure record)
    H.clear(cluster, scen, room)
