"""Prefill and decode in two network namespaces joined by a veth pair: the soak's workers
(:mod:`.soak`, no aborts) with UCX over TCP on the veth addresses only.

The prefill worker enters namespace A and hosts the bootstrap server on A's veth address; the
decode worker enters namespace B. Each runs with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set
to its end of the pair, and its engine listens on its veth address: those two addresses are
the only ones any worker targets (the report lists the UCX lanes that carried data).

``impair``: ``tc qdisc ... netem delay 10ms 2ms loss 1%`` on both ends. Kernels built without
netem get the closest available stand-in instead, named in the report: 1% of TCP segments
dropped at random in each direction (nftables ``numgen random``) and the link rate-limited
(``tc tbf``) so queues, and with them delays, build up. Requests must complete or fail
cleanly (a typed error, everything released, no late write, no corruption).

Where namespaces cannot be made (not root, no ``ip``, no permission) the scenario returns
``{"skipped": reason}``. ``python -m kvxfer.testing.reliability netns [--impair] --json``
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional

NETNS_TIMEOUTS = dict(
    bootstrap_s=30.0,
    waiting_s=60.0,
    transfer_s=60.0,
    heartbeat_interval_s=0.5,
    heartbeat_timeout_s=30.0,
    abort_ack_s=15.0,
)
NETEM = "delay 10ms 2ms loss 1%"


class Unavailable(RuntimeError):
    """Namespaces (or the requested impairment) cannot be made here; the message says why."""


def _sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise subprocess.CalledProcessError(r.returncode, cmd, r.stdout, r.stderr)
    return r.stdout


class VethPair:
    """Namespaces ``kvx-p<tag>`` / ``kvx-d<tag>``, veth ``kvxp<tag>`` <-> ``kvxd<tag>`` with
    10.231.x.1 / 10.231.x.2; removed on exit (deleting a namespace deletes its veth end)."""

    def __init__(self, impair: bool = False) -> None:
        tag = str(os.getpid() % 100000)
        self.ns = (f"kvx-p{tag}", f"kvx-d{tag}")
        self.dev = (f"kvxp{tag}", f"kvxd{tag}")
        sub = os.getpid() % 250 + 1
        self.ip = (f"10.231.{sub}.1", f"10.231.{sub}.2")
        self.impair = impair
        self.impairment: Optional[str] = None
        self._made: List[str] = []

    def __enter__(self) -> "VethPair":
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root (euid != 0)")
        if shutil.which("ip") is None:
            raise Unavailable("iproute2's `ip` is not installed")
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
                self._made.append(ns)
            _sh("ip", "link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, ip in zip(self.ns, self.dev, self.ip):
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as exc:
            self.__exit__()
            raise Unavailable(f"cannot make namespaces + veth: {_why(exc)}") from None
        if self.impair:
            try:
                self.impairment = self._impair()
            except Unavailable:
                self.__exit__()
                raise
        return self

    def _impair(self) -> str:
        try:
            for ns, dev in zip(self.ns, self.dev):
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "netem",
                    *NETEM.split(),
                )
            return f"tc netem {NETEM} (each direction)"
        except (subprocess.CalledProcessError, OSError) as exc:
            netem_err = _why(exc)
        if shutil.which("nft") is None or shutil.which("tc") is None:
            raise Unavailable(
                f"tc netem unavailable ({netem_err}) and no nft/tc for the stand-in impairment"
            )
        try:
            for ns, dev in zip(self.ns, self.dev):
                _sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    "200mbit",
                    "burst",
                    "64kb",
                    "latency",
                    "50ms",
                )
                nft = ["ip", "netns", "exec", ns, "nft"]
                _sh(*nft, "add", "table", "inet", "kvx")
                _sh(
                    *nft,
                    "add",
                    "chain",
                    "inet",
                    "kvx",
                    "out",
                    "{ type filter hook output priority 0 ; }",
                )
                _sh(
                    *nft,
                    "add",
                    "rule",
                    "inet",
                    "kvx",
                    "out",
                    "meta",
                    "l4proto",
                    "tcp",
                    "numgen",
                    "random",
                    "mod",
                    "100",
                    "<",
                    "1",
                    "counter",
                    "drop",
                )
        except (subprocess.CalledProcessError, OSError) as exc:
            raise Unavailable(
                f"tc netem unavailable ({netem_err}); stand-in failed too: {_why(exc)}"
            ) from None
        return (
            f"netem unavailable in this kernel ({netem_err}); stand-in: nftables drops 1% "
            "of TCP segments at random + tc tbf 200 Mbit/s (each direction)"
        )

    def dropped(self) -> Optional[str]:
        """What the impairment dropped so far (tc / nft counters), as reported by the tools."""
        if not self.impairment:
            return None
        out = []
        for ns, dev in zip(self.ns, self.dev):
            try:
                if self.impairment.startswith("tc netem"):
                    st = _sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev)
                    line = next((l.strip() for l in st.splitlines() if "dropped" in l), "?")
                else:
                    st = _sh(
                        "ip", "netns", "exec", ns, "nft", "list", "chain", "inet", "kvx", "out"
                    )
                    line = next((l.strip() for l in st.splitlines() if "counter" in l), "?")
            except (subprocess.CalledProcessError, OSError) as exc:
                line = _why(exc)
            out.append(f"{dev}: {line}")
        return "; ".join(out)

    def __exit__(self, *exc) -> None:
        for ns in self._made:
            subprocess.run(("ip", "netns", "del", ns), capture_output=True, timeout=30)
        self._made = []


def _why(exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"`{' '.join(exc.cmd)}`: {(exc.stderr or '').strip() or exc.returncode}"
    return str(exc)


def run_netns(
    requests: int = 500, impair: bool = False, seed: int = 0, abort_rate: float = 0.0
) -> dict:
    """The soak between two namespaces; ``{"skipped": reason}`` where they cannot be made."""
    from kvxfer.testing.reliability.soak import run_soak

    try:
        net = VethPair(impair).__enter__()
    except Unavailable as exc:
        return {
            "scenario": "netns-impaired" if impair else "netns",
            "ok": None,
            "skipped": str(exc),
        }
    try:
        ucx = lambda dev: {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}  # noqa: E731
        placement = {
            "prefill": dict(
                netns=net.ns[0], host=net.ip[0], serve_bootstrap=True, env=ucx(net.dev[0])
            ),
            "decode": dict(netns=net.ns[1], host=net.ip[1], env=ucx(net.dev[1])),
        }
        out = run_soak(
            requests=requests,
            seed=seed,
            abort_rate=abort_rate,
            timeouts=NETNS_TIMEOUTS,
            placement=placement,
            deadline_s=120.0,
        )
        out["dropped"] = net.dropped()
    finally:
        net.__exit__()
    lanes_ok = bool(out["lanes"]) and all(
        l.split("/")[-1].split(".")[0] in net.dev for l in out["lanes"]
    )
    c = out["counts"]
    # under impairment a request may also fail, as long as it fails cleanly: a typed error
    # on both sides (a room never released is counted by "unreleased" / "hung")
    must_be_zero = [k for k in c if not (impair and k == "unexpected_outcomes")]
    out.update(
        scenario="netns-impaired" if impair else "netns",
        namespaces=list(net.ns),
        addresses=list(net.ip),
        devices=list(net.dev),
        impairment=net.impairment or "none",
        lanes_on_veth_only=lanes_ok,
        ok=lanes_ok and not any(c[k] for k in must_be_zero),
    )
    return out
