"""NoteBox (the receiving end of chained notifications) and the sender's chain rule, with a
stand-in transport: early buffering before the peer attaches, Bye's count wait (bounded),
size limit, unregistering once."""

import asyncio

import pytest

from kvxfer.engine.notes import MAX_NOTE_BYTES, NoteBox, chainable

pytestmark = pytest.mark.timeout(30)


class _FakeTransport:
    def __init__(self):
        self.listening = {}
        self.unlistened = []

    def note_listen(self, cb):
        self.listening[42] = cb
        return 42

    def note_unlisten(self, token):
        self.unlistened.append(token)
        self.listening.pop(token, None)


def test_early_notifications_reach_the_sink_first_and_in_order():
    t = _FakeTransport()
    box = NoteBox(t)
    assert box.token == 42
    t.listening[42](b"a")
    t.listening[42](b"b")
    got = []
    box.attach(got.append)
    t.listening[42](b"c")
    assert got == [b"a", b"b", b"c"] and box.received == 3


def test_oversized_notification_dropped():
    t = _FakeTransport()
    box = NoteBox(t)
    got = []
    box.attach(got.append)
    t.listening[42](bytes(MAX_NOTE_BYTES + 1))
    assert got == [] and box.dropped == 1 and box.received == 0


def test_bye_count_wait_is_bounded_and_woken():
    async def go():
        t = _FakeTransport()
        box = NoteBox(t)
        box.attach(lambda p: None)
        t.listening[42](b"1")
        assert await box.wait_for(1, 0.01)  # already there
        assert not await box.wait_for(2, 0.05)  # never comes: bounded
        loop = asyncio.get_running_loop()
        loop.call_soon(t.listening[42], b"2")  # arrives while waiting
        assert await box.wait_for(2, 5.0)
        box.close()
        box.close()
        assert t.unlistened == [42]  # once
        assert not await box.wait_for(3, 0.01)  # closed: nothing more comes

    asyncio.run(go())


def test_chain_rule():
    assert chainable(7, b"x", staged=False, posted=True)
    assert not chainable(0, b"x", staged=False, posted=True)  # peer takes AppMessages only
    assert not chainable(7, None, staged=False, posted=True)
    assert not chainable(7, b"x", staged=True, posted=True)  # the scatter plan goes first
    assert not chainable(7, b"x", staged=False, posted=False)  # nothing on the endpoint
    assert not chainable(7, bytes(MAX_NOTE_BYTES + 1), staged=False, posted=True)
