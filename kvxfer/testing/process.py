"""Helpers for multi-process tests and benchmarks over real UCX.

- :class:`Child` runs ``target(inbox, outbox, *args)`` in a *spawn*-context process (a
  forked child cannot reuse an initialised UCX context). Every wait is bounded; a child
  that raised has its traceback re-raised in the parent as :class:`ChildError`.
- :func:`serve` turns a child into a command server: the parent calls
  ``child.call("name", *args)`` and gets the handler's return value (or its traceback).
Ports are always 0 and reported back through the queue.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from typing import Any, Callable, Dict, Optional


class ChildError(RuntimeError):
    """A child process raised; the message holds its traceback."""


def _child_main(target, inbox, outbox, args):
    try:
        target(inbox, outbox, *args)
    except BaseException:  # report everything, then exit non-zero
        outbox.put(("fatal", traceback.format_exc()))
        raise SystemExit(1)


class Child:
    def __init__(self, target: Callable, *args, name: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.name = name or getattr(target, "__name__", "child")
        self._env = env or {}
        self.proc = ctx.Process(target=_child_main, args=(target, self.inbox, self.outbox, args),
                                name=self.name, daemon=True)

    def start(self, timeout: float = 60.0) -> Any:
        """Start and return the child's first message (e.g. its port)."""
        saved = {k: os.environ.get(k) for k in self._env}
        os.environ.update(self._env)
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return self.get(timeout)

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self.outbox.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if not self.proc.is_alive():
                    raise ChildError(f"{self.name} exited with code {self.proc.exitcode} "
                                     "without reporting") from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name}: no answer within {timeout} s") from None
                continue
            if kind == "fatal":
                raise ChildError(f"{self.name} failed:\n{value}")
            if kind == "err":
                raise ChildError(f"{self.name} command failed:\n{value}")
            return value

    def call(self, cmd: str, *args, timeout: float = 60.0) -> Any:
        self.inbox.put((cmd, args))
        return self.get(timeout)

    def kill(self) -> None:
        if self.proc.pid is None:  # never started (e.g. a sibling failed first)
            return
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self, timeout: float = 20.0) -> None:
        """Ask a :func:`serve` child to exit; kill it if it does not in time."""
        if self.proc.pid is not None and self.proc.is_alive():
            try:
                self.call("exit", timeout=timeout)
            except (ChildError, TimeoutError):
                pass
            self.proc.join(timeout)
        self.kill()


def serve(inbox, outbox, handlers: Dict[str, Callable]) -> None:
    """Run commands ``(name, args)`` until ``exit``; reply ``("ok", value)`` or
    ``("err", traceback)`` (the server keeps serving after a failed command)."""
    while True:
        cmd, args = inbox.get()
        if cmd == "exit":
            outbox.put(("ok", None))
            return
        try:
            outbox.put(("ok", handlers[cmd](*args)))
        except Exception:
            outbox.put(("err", traceback.format_exc()))
