"""EngineLoop: one kvxfer TransferEngine on a private event-loop thread.

SGLang's schedulers and control threads are synchronous; they hand work to the loop with
:meth:`EngineLoop.call_soon` (never blocks) or :meth:`EngineLoop.run` (blocks, bounded). The
thread is a :class:`kvxfer.loop_thread.LoopThread`.
Every task the backend creates on the loop is owned by its creator and ends before
:meth:`EngineLoop.close` returns (the engine's close closes peers, so pending writes end).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Dict, Optional, Sequence, Tuple

from kvxfer.config import EngineConfig
from kvxfer.errors import Closed
from kvxfer.loop_thread import LoopThread

Groups = Dict[str, Tuple[Sequence[int], Sequence[int], Sequence[int]]]


class EngineLoop:
    def __init__(self, config: EngineConfig) -> None:
        from kvxfer.engine import TransferEngine

        self.config = config
        self.engine = TransferEngine(config)
        self._lt = LoopThread(f"kvxfer-{config.name or 'engine'}")
        self._lt.start()
        self.loop = self._lt.loop
        self._closed = False

    def __repr__(self) -> str:
        return f"EngineLoop({self.config.name}, {self.engine.address})"

    @property
    def address(self) -> Optional[Tuple[str, int]]:
        return self.engine.address

    def start(self, groups: Groups, loose: Collection[str] = ()) -> Tuple[str, int]:
        """Register ``{name: (ptrs, lens, item_lens)}`` and start listening. Groups in
        ``loose`` may have other item sizes at a peer (heterogeneous TP: KV pages of other
        head counts; the backend checks the pair itself before any write)."""
        for name, (ptrs, lens, items) in groups.items():
            self.engine.register(
                name, list(ptrs), list(lens), list(items), item_lens_may_differ=name in loose
            )
        return self.run(self.engine.start(), self.config.connect_timeout_s)

    def in_loop(self) -> bool:
        return self._lt.in_loop()

    def call_soon(self, fn: Callable[..., Any], *args: Any, direct: bool = False) -> bool:
        """Run ``fn(*args)`` on the loop, in call order (:meth:`LoopThread.call`): handed
        over, or with ``direct`` (a short step, e.g. posting a small chunk's write) now on
        the calling thread as the loop's guest when the loop is idle; True when it ran
        direct. Runs on: any thread (SGLang's scheduler or control thread; on the loop's own
        thread it is handed over too)."""
        if self._closed:
            raise Closed(f"{self!r} is closed")
        return self._lt.call(fn, *args, direct=direct)

    @property
    def direct_calls(self) -> int:
        """How many :meth:`call_soon` calls ran direct, as the loop's guest."""
        return self._lt.direct_calls

    def take_arrived(self) -> bool:
        """Handle what already reached the engine's transport (a prefill's SglDone, a
        flush's completion) now, on the calling thread as the loop's guest, when the loop
        waits for events (:meth:`kvxfer.loop_thread.LoopThread.take_completions`; else the loop
        handles it on its wake-up); returns whether it did. One native read when nothing
        arrived. Runs on: any thread but the loop's (SGLang's scheduler, from ``poll()``)."""
        return not self._closed and self._lt.take_completions(self.engine.transport)

    def run(self, coro: Any, timeout: float) -> Any:
        """Run ``coro`` on the loop from another thread; bounded by ``timeout`` (+1 s).

        Runs on: any thread but the loop's (SGLang's scheduler or control thread)."""
        if self._closed:
            coro.close()
            raise Closed(f"{self!r} is closed")
        return self._lt.run(coro, timeout + 1.0)

    def close(self, timeout: float = 10.0) -> None:
        """Close the engine (peers, listener, registrations) and stop the thread; idempotent."""
        if self._closed:
            return
        try:
            self.run(self.engine.close(), timeout)
        finally:
            self._closed = True
            self._lt.stop(timeout)
