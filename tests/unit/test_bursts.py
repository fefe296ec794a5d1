"""kvxfer.disagg.bursts: which sends of a scheduler belong to a burst (every case of the
rule: the same room or another, a poll between or not, a scheduler that never polled or
not for POLLER_S)."""

import itertools

import pytest

from kvxfer.disagg.bursts import POLLER_S, Bursts

pytestmark = pytest.mark.timeout(10)
T = 1000.0  # a monotonic clock reading


def test_first_call_is_never_a_burst():
    assert not Bursts().burst(1, T, now=T)


@pytest.mark.parametrize(
    "same_room, polled_between, age, want",
    [
        (sr, pb, age, (not sr) and (not pb) and age < POLLER_S)
        for sr, pb, age in itertools.product(
            (False, True), (False, True), (0.0, POLLER_S / 2, POLLER_S, 2 * POLLER_S)
        )
    ],
)
def test_second_call(same_room, polled_between, age, want):
    b = Bursts()
    b.burst(1, T, now=T)
    polled = T + 1e-6 if polled_between else T
    assert b.burst(1 if same_room else 2, polled, now=polled + age) is want


def test_a_scheduler_that_never_polled_has_no_bursts():
    b = Bursts()
    assert [b.burst(r, 0.0, now=T) for r in (1, 2, 3, 1, 2)] == [False] * 5


def test_a_long_burst_and_the_poll_that_ends_it():
    b = Bursts()
    assert not b.burst(1, T, now=T)  # the batch's first send
    assert all(b.burst(r, T, now=T + 1e-3) for r in range(2, 50))
    assert not b.burst(50, T + 0.01, now=T + 0.01)  # polled: the next batch starts
    assert b.burst(51, T + 0.01, now=T + 0.011)


def test_repeated_room_breaks_no_state():
    """A room's next chunk (or its next decode leg) between two rooms' sends."""
    b = Bursts()
    b.burst(1, T, now=T)
    assert not b.burst(1, T, now=T)
    assert b.burst(2, T, now=T)
    assert not b.burst(2, T, now=T)
    assert b.burst(1, T, now=T)
