"""The prefill side's choice of form for a heterogeneous-TP pair's state slices
(``PrefillSide._state_part``): a PatternWrite in the kv pages' device-lane launch only where
the kv pages take one and the peer says the state's rows join it (``Peer.joins_launch``);
otherwise the slices' runs, as before. ``tp_pattern="always"`` keeps the pattern (the
engine expands it where there is no lane). The peer and the pair are stand-ins recording
what they were asked; the decision is the real code."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvxfer.disagg.prefill_side import PrefillSide
from kvxfer.engine.types import ItemWrite, PatternWrite

pytestmark = pytest.mark.timeout(30)

RUNS = [([0], [0], [8])]


class Pair:
    """A TpPair stand-in: ``write`` gives a PatternWrite when asked for one, else a
    marker for the runs' RawWrite; records the ``pattern`` flags."""

    def __init__(self) -> None:
        self.asked: list = []

    def write(self, group, src, dst, salt, pattern=False):
        self.asked.append((group, pattern))
        return PatternWrite(group, src, dst, RUNS) if pattern else ("runs", group)


class Peer:
    def __init__(self, lane: bool, joins: bool) -> None:
        self.lane, self.joins = lane, joins
        self.questions: list = []

    def can_pattern(self, group: str) -> bool:
        return self.lane

    def joins_launch(self, main, extra) -> bool:
        self.questions.append(([w.group for w in main], extra.group))
        return self.joins


def _decide(kv, mode="auto", lane=True, joins=True):
    side = PrefillSide.__new__(PrefillSide)  # only its mgr's tp_pattern is read
    side.mgr = SimpleNamespace(tp_pattern=mode)
    link = SimpleNamespace(tp=Pair(), peer=Peer(lane, joins))
    r = SimpleNamespace(dst_state=np.array([3]), room=7)
    got = side._state_part(r, link, kv, np.array([1]))
    return got, link


KV_PATTERN = [PatternWrite("kv", [1], [2], RUNS)]


def test_state_joins_the_kv_launch_where_its_rows_fit():
    (st,), link = _decide(KV_PATTERN)
    assert isinstance(st, PatternWrite) and st.group == "state"
    assert link.peer.questions == [(["kv"], "state")]


def test_state_that_would_widen_the_launch_goes_as_its_runs():
    (st,), link = _decide(KV_PATTERN, joins=False)
    assert st == ("runs", "state")
    assert link.tp.asked == [("state", True), ("state", False)]


def test_no_kv_launch_no_lane_for_the_state_or_forced_patterns():
    kv_runs = [ItemWrite("kv", [1], [2])]
    (st,), link = _decide(kv_runs)  # the kv pages take no launch: nothing to join
    assert st == ("runs", "state") and not link.peer.questions
    (st,), link = _decide(KV_PATTERN, lane=False)  # the state's group has no lane
    assert st == ("runs", "state") and not link.peer.questions
    (st,), link = _decide(KV_PATTERN, mode="always", lane=False, joins=False)
    assert isinstance(st, PatternWrite) and not link.peer.questions
