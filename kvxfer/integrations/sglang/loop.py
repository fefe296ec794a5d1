"""EngineLoop: one kvxfer TransferEngine on a private event-loop thread.

SGLang's schedulers and control threads are synchronous; they hand work to the loop with
:meth:`EngineLoop.call_soon` (never blocks) or :meth:`EngineLoop.run` (blocks, bounded).
Every task the backend creates on the loop is owned by its creator and ends before
:meth:`EngineLoop.close` returns (the engine's close closes peers, so pending writes end).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

from kvxfer.config import EngineConfig
from kvxfer.errors import Closed, TransferTimeout

Groups = Dict[str, Tuple[Sequence[int], Sequence[int], Sequence[int]]]


class EngineLoop:
    def __init__(self, config: EngineConfig) -> None:
        from kvxfer.engine import TransferEngine

        self.config = config
        self.engine = TransferEngine(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name=f"kvxfer-{config.name or 'engine'}")
        self._thread.start()
        self._closed = False

    def __repr__(self) -> str:
        return f"EngineLoop({self.config.name}, {self.engine.address})"

    @property
    def address(self) -> Optional[Tuple[str, int]]:
        return self.engine.address

    def start(self, groups: Groups) -> Tuple[str, int]:
        """Register ``{name: (ptrs, lens, item_lens)}`` and start listening."""
        for name, (ptrs, lens, items) in groups.items():
            self.engine.register(name, list(ptrs), list(lens), list(items))
        return self.run(self.engine.start(), self.config.connect_timeout_s)

    def in_loop(self) -> bool:
        return threading.get_ident() == self._thread.ident

    def call_soon(self, fn: Callable, *args) -> None:
        if self._closed:
            raise Closed(f"{self!r} is closed")
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro, timeout: float):
        """Run ``coro`` on the loop from another thread; bounded by ``timeout`` (+1 s)."""
        if self._closed:
            coro.close()
            raise Closed(f"{self!r} is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout + 1.0)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TransferTimeout(f"{self!r}: call did not finish within {timeout:g} s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Close the engine (peers, listener, registrations) and stop the thread; idempotent."""
        if self._closed:
            return
        try:
            self.run(self.engine.close(), timeout)
        finally:
            self._closed = True
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.loop.close()
