"""kvxfer.engine.early: notes posted at most once, only when ready and live, failures kept
for their write, chains not taken still retrieved."""

import asyncio
import gc

import pytest

from kvxfer.engine.early import EarlyNotes
from kvxfer.errors import PeerClosed

pytestmark = pytest.mark.timeout(30)


class Copy:
    """A copy done after ``after`` polls; records each poll's spin."""

    def __init__(self, after: int) -> None:
        self.after, self.spins = after, []

    def __call__(self, spin_s: float) -> bool:
        self.spins.append(spin_s)
        return len(self.spins) >= self.after


def test_drain_posts_ready_notes_once_in_order_and_keeps_the_rest():
    notes, posted = EarlyNotes(), []
    a, b, c = Copy(1), Copy(3), Copy(2)
    na = notes.add(a, lambda: posted.append("a") or "chain-a")
    nb = notes.add(b, lambda: posted.append("b") or "chain-b")
    nc = notes.add(c, lambda: posted.append("c") or "chain-c")
    assert len(notes) == 3
    assert notes.drain(spin_s=1e-6) == 1 and posted == ["a"] and len(notes) == 2
    assert a.spins == [1e-6]
    assert notes.drain() == 1 and posted == ["a", "c"] and len(notes) == 1
    assert notes.drain() == 1 and posted == ["a", "c", "b"] and len(notes) == 0
    assert notes.drain() == 0 and notes.posted == 3
    assert len(a.spins) == 1 and len(b.spins) == 3 and len(c.spins) == 2  # none polled after
    assert (na.take(), nb.take(), nc.take()) == ("chain-a", "chain-b", "chain-c")


def test_a_note_taken_or_retired_is_never_posted():
    notes, posted = EarlyNotes(), []
    taken = notes.add(Copy(1), lambda: posted.append("taken"))
    retired = notes.add(Copy(1), lambda: posted.append("retired"))
    assert taken.take() is None  # its write resumed first: it posts itself
    retired.retire()
    assert notes.drain() == 0 and posted == [] and len(notes) == 0


def test_a_failure_to_post_is_raised_by_take():
    notes = EarlyNotes()

    def post():
        raise PeerClosed("gone")

    note = notes.add(Copy(1), post)
    assert notes.drain() == 1  # handed over (and failed): never posted again
    with pytest.raises(PeerClosed, match="gone"):
        note.take()
    assert notes.drain() == 0


def test_a_note_added_while_draining_is_kept_after_the_others():
    notes, order = EarlyNotes(), []

    def post_first():
        order.append("first")
        notes.add(Copy(1), lambda: order.append("added"))

    notes.add(Copy(1), post_first)
    notes.add(Copy(5), lambda: order.append("late"))
    assert notes.drain() == 1 and order == ["first"] and len(notes) == 2
    assert notes.drain() == 1 and order == ["first", "added"]


def test_a_chain_posted_but_not_taken_has_its_outcome_retrieved():
    """A write that ended (e.g. timed out) after a drain posted its chain: the chain's
    failure is retrieved (no "exception was never retrieved" at collection)."""

    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        notes = EarlyNotes()
        chain = [loop.create_future()]
        note = notes.add(Copy(1), lambda: chain[0])
        notes.drain()
        note.retire()
        chain[0].set_exception(PeerClosed("gone"))
        await asyncio.sleep(0)
        del chain[0], note, notes
        gc.collect()
        await asyncio.sleep(0)
        assert seen == []

    asyncio.run(main())
