"""Worker processes driven through typed proxies (the demo, the benchmarks, the tests).

A :class:`Worker` is a *spawn*-context process (a forked child cannot reuse an initialised UCX
context). In the child, ``build(*args)`` returns the object it hosts, or a dict of named
objects; the parent calls their methods through a proxy typed as the hosted class::

    w = Worker(EngineNode, spec, name="A").start()
    node = w.proxy(EngineNode)            # typed as EngineNode: IDEs and mypy see signatures
    node.fill("main", "kv", 1)            # a typo is an AttributeError here, not in the child
    node.write(..., timeout=120)          # ``timeout=`` bounds this call; it is not passed on

Rules:
- every wait is bounded (``timeout=`` of a call, else the proxy's); a call that is not answered
  in time raises :class:`TimeoutError` (a late answer is discarded, never mistaken for the next);
- an exception in the child comes back as one :class:`~kvxfer.errors.RemoteError` carrying the
  child's exception type name, message and traceback; the child keeps serving;
- a child that dies raises :class:`~kvxfer.errors.WorkerDied` at the next wait; one killed by a
  fatal signal (SIGSEGV, SIGABRT, ...) first writes every thread's Python stack to its stderr
  (:mod:`faulthandler`, enabled when the child starts), so a native crash names where it was;
- a call not answered in time names where the child is: the :class:`TimeoutError` carries
  every thread's Python stack of the child (:meth:`Worker.stacks`: :data:`STACKS_SIGNAL`, which
  :mod:`faulthandler` answers from its C handler, so a child deadlocked in Python or native code
  answers too); :func:`live_workers` lists the workers of this process that may still run (a
  test harness dumps them before its own timeout kills the test);
- :func:`post` starts a call without waiting (two workers at once), :class:`Pending` collects it;
- ports are never fixed here: hosted objects bind port 0 and report what they got.

The child serves one call at a time, on its main thread. :func:`wait_idle` lets child code wait
until the call in progress has been answered (e.g. before it stops its own process).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any, Callable, Dict, Generic, Iterator, Optional, Type, TypeVar, cast

from kvxfer.errors import RemoteError, WorkerDied

__all__ = [
    "Worker",
    "Pending",
    "post",
    "wait_idle",
    "live_workers",
    "RemoteError",
    "WorkerDied",
    "STACKS_SIGNAL",
]

T = TypeVar("T")
R = TypeVar("R")

_CTX = mp.get_context("spawn")
#: child side: set while no call is being served (the last reply has been sent)
_IDLE = threading.Event()
_IDLE.set()
#: the signal on which a child writes every thread's Python stack to its stacks file
#: (:meth:`Worker.stacks`)
STACKS_SIGNAL = signal.SIGUSR1
#: child side: the open stacks file (faulthandler writes to its descriptor; kept open)
_STACKS_FILE: Any = None
#: parent side: the workers launched by this process (weakly held; :func:`live_workers`)
_LAUNCHED: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def wait_idle(timeout: float) -> bool:
    """Child side: wait (bounded) until the call being served has been answered."""
    return _IDLE.wait(timeout)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in state T/t (/proc/PID/task/*/stat); a thread
    that ended meanwhile does not count."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state not in "Tt":
            return False
    return bool(tids)


# ====================================================================== child side
@contextlib.contextmanager
def scoped_env(values: Dict[str, str]) -> Iterator[None]:
    """The environment variables ``values`` set for the block (a child started or an object
    made there reads them), restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _StacksFile:
    """Parent side: the file a worker's child writes its stacks to (:meth:`Worker.stacks`),
    read through the parent's own descriptor. Made here; its path is unlinked once the child
    holds it open (so a parent that dies abruptly leaves no file behind) and at the latest
    by :meth:`close` (idempotent; also when the worker is collected)."""

    def __init__(self) -> None:
        self.fd, self.path = tempfile.mkstemp(prefix="kvxfer-stacks-", suffix=".txt")

    def unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def size(self) -> int:
        return os.fstat(self.fd).st_size if self.fd >= 0 else -1

    def read(self, start: int) -> str:
        size = self.size()
        return (
            ""
            if size <= start
            else os.pread(self.fd, size - start, start).decode("utf-8", "replace")
        )

    def close(self) -> None:
        self.unlink()
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _error(exc: BaseException) -> tuple:
    return ("err", type(exc).__name__, str(exc), traceback.format_exc())


def _close_all(objects: Dict[str, Any]) -> None:
    for obj in objects.values():
        close = getattr(obj, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                pass


def _child_main(conn, build: Callable[..., Any], args: tuple, stacks_path: str = "") -> None:
    """Build the hosted objects, report ready, then serve ``(seq, name, method, args, kwargs)``
    until ``exit`` (or the parent's end of the pipe closes). ``stacks_path``: where
    :data:`STACKS_SIGNAL` makes it write every thread's stack (:meth:`Worker.stacks`)."""
    global _STACKS_FILE
    if not faulthandler.is_enabled():  # a fatal signal dumps every thread's stack to stderr
        faulthandler.enable(all_threads=True)
    if stacks_path:  # (the parent made it, and unlinks it once this process is ready)
        _STACKS_FILE = open(stacks_path, "a")  # noqa: SIM115 (open for the process's life)
        faulthandler.register(STACKS_SIGNAL, file=_STACKS_FILE, all_threads=True)
        _STACKS_FILE.write(f"(pid {os.getpid()}: stacks on {STACKS_SIGNAL.name})\n")
        _STACKS_FILE.flush()  # (the parent signals only once this line is there)
    try:
        hosted = build(*args)
    except BaseException as exc:
        conn.send((0,) + _error(exc))
        return
    objects: Dict[str, Any] = hosted if isinstance(hosted, dict) else {"": hosted}
    conn.send((0, "ok", None))
    while True:
        try:
            req = conn.recv()
        except (EOFError, OSError):
            break
        seq = req[0]
        if req[1] is None:  # exit
            _close_all(objects)
            conn.send((seq, "ok", None))
            conn.close()
            os._exit(0)  # objects closed; skip the slow teardown
        _, name, method, a, kw = req
        _IDLE.clear()
        try:
            conn.send((seq, "ok", getattr(objects[name], method)(*a, **kw)))
        except BaseException as exc:
            conn.send((seq,) + _error(exc))
        finally:
            _IDLE.set()
    _close_all(objects)
    os._exit(0)


# ====================================================================== parent side
class Worker:
    """One spawned process hosting what ``build(*args)`` returns (see the module docstring).

    ``env``: environment variables the child starts with (set in this process around the
    spawn only). ``timeout``: the default bound of a call.
    """

    def __init__(
        self,
        build: Callable[..., Any],
        *args: Any,
        name: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout: float = 60.0,
    ) -> None:
        self.name: str = name or str(getattr(build, "__name__", "worker"))
        self.timeout = timeout
        self._env = dict(env or {})
        self._conn, child = _CTX.Pipe()
        self._child_end = child
        self._stacks = _StacksFile()
        weakref.finalize(self, self._stacks.close)
        self.proc = _CTX.Process(
            target=_child_main,
            args=(child, build, args, self._stacks.path),
            name=self.name,
            daemon=True,
        )
        self._seq = 0
        self._replies: Dict[int, tuple] = {}
        self._ready = False

    # -- life cycle --
    def launch(self) -> "Worker":
        """Start the process without waiting for it (boot several at once, then :meth:`ready`)."""
        with scoped_env(self._env):
            self.proc.start()
        self._child_end.close()
        _LAUNCHED.add(self)
        return self

    def ready(self, timeout: float = 120.0) -> "Worker":
        """Wait (bounded) until the hosted objects are built; raises what ``build`` raised."""
        if not self._ready:
            self._wait(0, timeout, "start-up")
            self._ready = True
            self._stacks.unlink()  # the child holds it open by now
        return self

    def start(self, timeout: float = 120.0) -> "Worker":
        """:meth:`launch` and :meth:`ready`."""
        return self.launch().ready(timeout)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None, f"{self.name} was never started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    # -- calls --
    def proxy(self, cls: Type[T], name: str = "", timeout: Optional[float] = None) -> T:
        """A proxy typed as ``cls`` for the hosted object ``name`` ("" when ``build``
        returned one object). Only public methods of ``cls`` can be called through it."""
        return cast(T, _Proxy(self, cls, name, self.timeout if timeout is None else timeout))

    def call(
        self,
        name: str,
        method: str,
        args: tuple = (),
        kwargs: Optional[dict] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """One call, answered within ``timeout``; proxies call this."""
        return self.send(name, method, args, kwargs).result(timeout)

    def send(
        self, name: str, method: str, args: tuple = (), kwargs: Optional[dict] = None
    ) -> "Pending":
        self._seq += 1
        try:
            self._conn.send((self._seq, name, method, args, kwargs or {}))
        except (BrokenPipeError, OSError) as exc:
            raise WorkerDied(f"{self.name} is gone ({self._exit_text()})") from exc
        return Pending(self, self._seq, f"{name + '.' if name else ''}{method}")

    def _exit_text(self) -> str:
        return f"pid {self.proc.pid}, alive={self.proc.is_alive()}, exitcode={self.proc.exitcode}"

    def _wait(self, seq: int, timeout: Optional[float], what: str) -> Any:
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while seq not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name}: no answer to {what} within {timeout} s ({self._exit_text()})"
                    + self._stacks_text()
                )
            if not self._conn.poll(min(left, 0.5)):
                if not self.proc.is_alive() and not self._conn.poll(0):
                    raise WorkerDied(
                        f"{self.name} died before answering {what} ({self._exit_text()})"
                    )
                continue
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                self.proc.join(5)
                raise WorkerDied(f"{self.name} died during {what} ({self._exit_text()})") from None
            if msg[0] >= seq:  # older ones: answers to calls that timed out
                self._replies[msg[0]] = msg[1:]
        msg = self._replies.pop(seq)
        if msg[0] == "err":
            _, kind, text, tb = msg
            raise RemoteError(kind, text, tb, worker=self.name)
        return msg[1]

    # -- signals --
    def kill(self) -> None:
        """SIGKILL and reap (a no-op when it never started or is gone); its stacks file is
        removed."""
        if self.proc.pid is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(10)
        self._stacks.close()

    def stacks(self, timeout: float = 5.0) -> str:
        """Every thread's Python stack in the child now, as :mod:`faulthandler` writes it
        ("" when it is not running, stopped, not yet past registering its handler, or wrote
        nothing within ``timeout``). The
        child's handler runs in C, whatever its threads hold; what it wrote is taken once
        it has stopped growing (two polls 20 ms apart)."""
        if self.proc.pid is None or not self.proc.is_alive() or _all_threads_stopped(self.pid):
            return ""
        try:
            start = self._stacks.size()
            if start <= 0:  # closed, or the child has not registered its handler yet
                return ""
            os.kill(self.pid, STACKS_SIGNAL)
            end, last = time.monotonic() + timeout, start
            while time.monotonic() < end:
                time.sleep(0.02)  # polling a file another process writes; bounded
                size = self._stacks.size()
                if size > start and size == last:
                    break
                last = size
            return self._stacks.read(start)
        except OSError:
            return ""

    def _stacks_text(self) -> str:
        """For an error: the child's stacks under a heading, or ""."""
        text = self.stacks()
        return f"\n{self.name}'s threads now (faulthandler):\n{text}" if text else ""

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the CLOCK_MONOTONIC time it was sent (comparable with the
        children's ``time.monotonic()``: one clock per host)."""
        t = time.monotonic()
        os.kill(self.pid, sig)
        return t

    def stopped(self, timeout: float = 20.0) -> bool:
        """Wait (bounded) until the process is stopped (SIGSTOP, by us or by itself): every
        one of its threads, not only the main one — a group stop reaches each thread when
        it next runs, so a busy thread may go on briefly after the main thread stopped."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if _all_threads_stopped(self.pid):
                return True
            time.sleep(0.01)
        return False

    def freeze(self) -> None:
        """SIGSTOP, and wait until it took effect."""
        os.kill(self.pid, signal.SIGSTOP)
        assert self.stopped(), f"{self.name} (pid {self.pid}) did not stop"

    def resume(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)

    # -- exit --
    def request_exit(self) -> Optional["Pending"]:
        """Ask it to close its objects and exit, without waiting (see :meth:`close`)."""
        if self.proc.pid is None or not self.proc.is_alive():
            return None
        self._seq += 1
        try:
            self._conn.send((self._seq, None))
        except OSError:
            return None
        return Pending(self, self._seq, "exit")

    def close(self, timeout: float = 30.0) -> None:
        """Exit cleanly (resumed first if stopped); SIGKILL when that takes over ``timeout``."""
        if self.proc.pid is not None and self.proc.is_alive():
            self.resume()
            pending = self.request_exit()
            try:
                if pending is not None:
                    pending.result(timeout)
            except (RemoteError, WorkerDied, TimeoutError):
                pass
            self.proc.join(10)
        self.kill()


def live_workers() -> "list[Worker]":
    """The workers this process launched whose process is still running."""
    return [w for w in list(_LAUNCHED) if w.proc.pid is not None and w.proc.is_alive()]


class Pending(Generic[R]):
    """The answer to a call sent with :func:`post` (or :meth:`Worker.send`)."""

    def __init__(self, worker: Worker, seq: int, what: str) -> None:
        self.worker, self.seq, self.what = worker, seq, what

    def result(self, timeout: Optional[float] = None) -> R:
        return cast(R, self.worker._wait(self.seq, timeout, self.what))


class _RemoteMethod:
    def __init__(self, worker: Worker, name: str, method: str, timeout: float) -> None:
        self.worker, self.name, self.method, self.timeout = worker, name, method, timeout

    def __call__(self, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        return self.worker.call(
            self.name, self.method, args, kwargs, self.timeout if timeout is None else timeout
        )


class _Proxy:
    def __init__(self, worker: Worker, cls: type, name: str, timeout: float) -> None:
        self._worker, self._cls, self._name, self._timeout = worker, cls, name, timeout

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_") or not callable(getattr(self._cls, method, None)):
            raise AttributeError(f"{self._cls.__name__} has no public method {method!r}")
        return _RemoteMethod(self._worker, self._name, method, self._timeout)

    def __repr__(self) -> str:
        return f"<proxy {self._cls.__name__} {self._name!r} in {self._worker.name}>"


def post(method: Callable[..., R], *args: Any, **kwargs: Any) -> Pending[R]:
    """Start ``proxy.method(*args, **kwargs)`` without waiting for it::

    p = post(prefill.run, reqs); d = post(decode.run, reqs)
    p_out, d_out = p.result(120), d.result(120)
    """
    if not isinstance(method, _RemoteMethod):
        raise TypeError(f"post() takes a proxy's method, not {method!r}")
    return method.worker.send(method.name, method.method, args, kwargs)


def run_in_child(fn: Callable[[], Any], timeout: float = 90.0) -> Any:
    """Run ``fn`` (picklable: a module-level function) in a fresh worker and return its result:
    UCX stays out of the calling process."""
    w = Worker(_Call, fn, name=getattr(fn, "__name__", "child")).start(timeout)
    try:
        return post(w.proxy(_Call).run).result(timeout)
    finally:
        w.close()


class _Call:
    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn

    def run(self) -> Any:
        return self.fn()
