"""A prefill and a decode worker process with the bootstrap server between them (the demo,
``kvxfer bench pd``, the real-model check); under heterogeneous TP one process per TP rank
of each side."""

from __future__ import annotations

from typing import Any, Dict, Generic, List, Optional, Tuple, Type, TypeVar

from kvxfer.pd_demo.worker import build_worker
from kvxfer.procs import Worker, post

W = TypeVar("W")


class Pair(Generic[W]):
    """Bootstrap server (a thread of this process) + one prefill and one decode process, each
    hosting ``cls(role, spec, bootstrap, opts)``; ``prefill`` / ``decode`` are proxies typed as
    ``cls``. ``opts["secret"]`` (str or bytes) is the run's secret: the bootstrap server's and
    both managers'. ``env``: environment variables the two processes start with. ``timeout``
    bounds every call; ``start_timeout`` the start-up (both processes boot at once).

    ``prefill_tp`` / ``decode_tp``: one process per TP rank of each side (``spec`` gains the
    rank's ``tp_rank`` / ``tp_size``); ``prefill`` / ``decode`` are then rank 0's proxies,
    ``prefills`` / ``decodes`` every rank's, and :meth:`each` calls a method on all."""

    def __init__(
        self,
        cls: Type[W],
        spec: dict,
        opts: dict,
        *,
        timeout: float,
        start_timeout: float = 120.0,
        env: Optional[Dict[str, str]] = None,
        prefill_tp: int = 1,
        decode_tp: int = 1,
    ) -> None:
        from kvxfer.disagg import BootstrapServer

        secret = opts["secret"]
        self.timeout = timeout
        self.bs = BootstrapServer(
            port=0, secret=secret.encode() if isinstance(secret, str) else secret
        ).start_in_thread()
        tps = {"prefill": prefill_tp, "decode": decode_tp}
        hetero = prefill_tp != 1 or decode_tp != 1

        def worker(role: str, rank: int) -> Worker:
            s = dict(spec, tp_rank=rank, tp_size=tps[role]) if hetero else spec
            name = f"{role}{rank}" if hetero else role
            return Worker(
                build_worker,
                cls,
                role,
                s,
                self.bs.address,
                opts,
                name=name,
                env=env,
                timeout=timeout,
            )

        self.ps: List[Worker] = [worker("prefill", r) for r in range(prefill_tp)]
        self.ds: List[Worker] = [worker("decode", r) for r in range(decode_tp)]
        self.p, self.d = self.ps[0], self.ds[0]
        try:
            for w in self.ps + self.ds:  # all boot at once (imports dominate the start-up)
                w.launch()
            for w in self.ps + self.ds:
                w.ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self.prefills: List[W] = [w.proxy(cls) for w in self.ps]
        self.decodes: List[W] = [w.proxy(cls) for w in self.ds]
        self.prefill: W = self.prefills[0]
        self.decode: W = self.decodes[0]

    def both(self, p_call: tuple, d_call: tuple) -> Tuple[Any, Any]:
        """``(proxy method, *args)`` on each side at once (decode's call first); returns
        (prefill's answer, decode's)."""
        d = post(*d_call)
        p = post(*p_call)
        return p.result(self.timeout), d.result(self.timeout)

    def each(self, p_call: Optional[tuple], d_call: Optional[tuple]) -> Tuple[List[Any], List[Any]]:
        """``(method name, *args)`` on every rank of each side at once (decode's first;
        None: not that side); returns (prefill ranks' answers, decode ranks')."""
        ds = [post(getattr(x, d_call[0]), *d_call[1:]) for x in self.decodes] if d_call else []
        ps = [post(getattr(x, p_call[0]), *p_call[1:]) for x in self.prefills] if p_call else []
        return [f.result(self.timeout) for f in ps], [f.result(self.timeout) for f in ds]

    def close(self) -> None:
        for w in getattr(self, "ps", []) + getattr(self, "ds", []):
            w.close()
        self.bs.stop_thread()
