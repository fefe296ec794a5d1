"""A prefill and a decode worker process with the bootstrap server between them (the demo,
``kvxfer bench pd``, the real-model check)."""

from __future__ import annotations

from typing import Any, Dict, Generic, Optional, Tuple, Type, TypeVar

from kvxfer.pd_demo.worker import build_worker
from kvxfer.procs import Worker, post

W = TypeVar("W")


class Pair(Generic[W]):
    """Bootstrap server (a thread of this process) + one prefill and one decode process, each
    hosting ``cls(role, spec, bootstrap, opts)``; ``prefill`` / ``decode`` are proxies typed as
    ``cls``. ``opts["secret"]`` (str or bytes) is the run's secret: the bootstrap server's and
    both managers'. ``env``: environment variables the two processes start with. ``timeout``
    bounds every call; ``start_timeout`` the start-up (both processes boot at once)."""

    def __init__(
        self,
        cls: Type[W],
        spec: dict,
        opts: dict,
        *,
        timeout: float,
        start_timeout: float = 120.0,
        env: Optional[Dict[str, str]] = None,
    ) -> None:
        from kvxfer.disagg import BootstrapServer

        secret = opts["secret"]
        self.timeout = timeout
        self.bs = BootstrapServer(
            port=0, secret=secret.encode() if isinstance(secret, str) else secret
        ).start_in_thread()
        self.p, self.d = (
            Worker(
                build_worker,
                cls,
                role,
                spec,
                self.bs.address,
                opts,
                name=role,
                env=env,
                timeout=timeout,
            )
            for role in ("prefill", "decode")
        )
        try:
            self.p.launch()  # both boot at once (imports dominate the start-up)
            self.d.launch()
            self.p.ready(start_timeout)
            self.d.ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self.prefill: W = self.p.proxy(cls)
        self.decode: W = self.d.proxy(cls)

    def both(self, p_call: tuple, d_call: tuple) -> Tuple[Any, Any]:
        """``(proxy method, *args)`` on each side at once (decode's call first); returns
        (prefill's answer, decode's)."""
        d = post(*d_call)
        p = post(*p_call)
        return p.result(self.timeout), d.result(self.timeout)

    def close(self) -> None:
        for w in (self.p, self.d):
            w.close()
        self.bs.stop_thread()
