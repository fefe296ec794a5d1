"""``Worker.freeze`` / ``stopped``: a frozen worker is stopped in every thread, not only its
main one (a group stop reaches a busy thread only when it next runs)."""

import threading

import pytest

from kvxfer import procs
from kvxfer.procs import Worker

pytestmark = pytest.mark.timeout(60)


class Spinner:
    """Hosted in the worker: a thread that never leaves the interpreter."""

    def spin(self) -> None:
        def loop() -> None:
            n = 0
            while True:
                n += 1

        threading.Thread(target=loop, daemon=True).start()

    def threads(self) -> int:
        return threading.active_count()


def test_freeze_returns_once_every_thread_is_stopped():
    w = Worker(Spinner, name="spinner").start()
    try:
        p = w.proxy(Spinner)
        p.spin()
        assert p.threads() >= 2
        assert not procs._all_threads_stopped(w.pid)  # the spinner runs
        for _ in range(5):
            w.freeze()  # asserts stopped(): every thread, the spinner too
            assert procs._all_threads_stopped(w.pid)
            w.resume()
            assert p.threads() >= 2  # alive again, answering
        assert not procs._all_threads_stopped(w.pid)
    finally:
        w.resume()
        w.close()


def test_a_gone_process_is_not_stopped():
    w = Worker(Spinner, name="spinner").start()
    pid = w.pid
    w.close()
    assert not procs._all_threads_stopped(pid)


class Crasher:
    """Hosted in the worker: a method that dies of SIGSEGV in native code."""

    def crash(self) -> None:
        import ctypes

        ctypes.string_at(0)  # reads address 0: SIGSEGV


def test_a_worker_that_dies_of_a_fatal_signal_leaves_its_python_stack(capfd):
    """A native crash in a worker is WorkerDied in the parent, and the child's stderr (the
    parent's, inherited) holds every thread's Python stack, down to the crashing call."""
    from kvxfer.errors import WorkerDied

    w = Worker(Crasher, name="crasher").start()
    try:
        with pytest.raises(WorkerDied, match="exitcode=-11"):
            w.proxy(Crasher).crash(timeout=30)
    finally:
        w.close()
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err, err
    assert "in crash" in err, err


class Wedged:
    """Hosted in the worker: a call that never returns."""

    def wedged_here(self) -> None:
        threading.Event().wait()


def test_a_call_not_answered_in_time_names_where_the_child_is():
    """The TimeoutError of an unanswered call carries the child's Python stacks (its
    faulthandler answers STACKS_SIGNAL whatever the thread holds); the worker serves on."""
    import os

    w = Worker(Wedged, name="wedged").start()
    try:
        p = w.proxy(Wedged)
        assert w in procs.live_workers()
        with pytest.raises(TimeoutError) as exc:
            p.wedged_here(timeout=1)
        text = str(exc.value)
        assert "wedged's threads now (faulthandler)" in text, text
        assert "in wedged_here" in text and "_child_main" in text, text
        again = w.stacks()  # a second dump: only what it wrote this time
        assert again.count("in wedged_here") == 1, again
        assert not os.path.exists(w._stacks.path)  # unlinked once the child held it open
    finally:
        w.kill()  # (close() would wait for the wedged call first)
    assert w._stacks.fd == -1  # the parent's descriptor closed with the worker
    assert w not in procs.live_workers() and w.stacks() == ""


def test_a_stopped_worker_is_not_asked_for_its_stacks():
    """A frozen child cannot answer the signal: stacks() says so at once ("")."""
    w = Worker(Spinner, name="frozen").start()
    try:
        w.freeze()
        assert w.stacks(timeout=30) == ""
        w.resume()
        assert "in _child_main" in w.stacks()
    finally:
        w.close()
