"""Every tunable of the transfer engine, in one place.

Environment variables are read here and nowhere else, once per process
(:func:`env_defaults`), and only as *defaults*: a value passed to :class:`EngineConfig`
always wins.

- ``KVXFER_ERROR_MODE`` = ``peer`` | ``none`` — default of :attr:`EngineConfig.error_mode`.
- ``KVXFER_CONNECT_TIMEOUT_S``, ``KVXFER_TRANSFER_TIMEOUT_S`` — default deadlines.
- ``KVXFER_PROGRESS_MODE`` = ``thread`` | ``thread-polling`` — default of
  :attr:`EngineConfig.progress_mode`.
- ``KVXFER_FLUSH_PROGRESS`` = ``auto`` | ``spin`` | ``event`` — default of
  :attr:`EngineConfig.flush_progress`.
- ``KVXFER_DEVICE_COPY`` = ``auto`` | ``off`` — default of :attr:`EngineConfig.device_copy`.
- ``KVXFER_HOST_COPY`` = ``auto`` | ``off`` — default of :attr:`EngineConfig.host_copy`.
- ``KVXFER_HOST_MIN_OPS`` = an int — default of :attr:`EngineConfig.host_min_ops`.
- ``KVXFER_OWN_WORKER`` = ``auto`` (``1``) | ``off`` (``0``) — default of
  :attr:`EngineConfig.own_worker`.
- ``KVXFER_DEVICE_MIN_OPS`` = an int — default of :attr:`EngineConfig.device_min_ops`.
- ``KVXFER_DEVICE_SMALL_OPS`` = an int — default of :attr:`EngineConfig.device_small_ops`.
- ``KVXFER_DEVICE_MIN_BYTES`` = an int — default of :attr:`EngineConfig.device_min_bytes`.
- ``KVXFER_NOTIFY_ORDER`` = ``1`` | ``0`` — default of :attr:`EngineConfig.notify_order`.
- ``KVXFER_DIRECT_PAGES`` = an int >= 0 — default of ``KVManager(direct_pages=)`` and of the
  SGLang backend's direct sends (:func:`direct_pages`; read when a manager is built).
- ``KVXFER_POLL_TAKES`` = ``1`` | ``0`` — default of ``KVManager(poll_takes=)``
  (:func:`poll_takes`; read when a manager is built).
- ``KVXFER_NATIVE_TAKES`` = ``1`` | ``0`` — default of ``KVManager(native_takes=)``
  (:func:`native_takes`; read when a manager is built).
- ``KVXFER_NATIVE_PLAN`` = ``1`` | ``0`` — whether a peer plans writes of ItemWrites in the
  native extension (1, the default) or in Python only (0, the A/B; :func:`native_plan`, read
  when a peer is made).
- ``KVXFER_LEG_DIRECT_PAGES`` = an int >= 0 — a lower guest bound for sends to several
  decode peers (unset: none, :data:`LEG_DIRECT_PAGES`; read by :func:`direct_limit` per
  send, for A/B runs).
- ``KVXFER_HOST_PACK_BYTES`` = an int >= 0 — the host lane's packing threshold
  (:func:`host_pack_bytes`; read when the host lane's module is imported; 0: never pack).
- ``KVXFER_HOST_SPLIT_BYTES`` = an int >= 0 — the least bytes of each part a large host-lane
  write is cut into, one part per host-lane thread (:func:`host_split_bytes`; read when the
  host lane's module is imported; 0: never cut).
- ``KVXFER_HOST_SPLIT_PARTS`` = an int >= 0 — into how many parts at most (0, the default:
  half the CPUs, at most the host-lane threads; :func:`host_split_parts`).
- ``KVXFER_HOST_PATTERNS`` = ``1`` | ``0`` — whether the host lane copies a PatternWrite
  from its pattern (1, the default) or the planner expands it into runs first (0, the A/B);
  :func:`host_patterns`, read when the host lane's module is imported.
- ``KVXFER_MALLOC`` = ``keep`` | ``default`` — whether a process that starts an engine keeps
  freed heap memory for reuse (:func:`malloc_policy`, :mod:`kvxfer.memtune`; opt-in).
- ``KVXFER_SECRET`` — the shared secret of a ``KVManager``, ``BootstrapServer`` or bootstrap
  client built without ``secret=``, read when it is built (:func:`resolve_secret`; never part
  of :func:`env_defaults`, which ``kvxfer info`` prints). There is no built-in default:
  without either, they refuse to start.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from kvxfer.argcheck import as_int
from kvxfer.errors import InvalidArgument

#: ``peer``: every endpoint uses UCX peer error handling; host memory then moves over tcp
#: (UCX excludes shared-memory lanes from error-handled endpoints), CUDA memory keeps cuda_ipc.
#: ``none``: control messages still run on error-handled endpoints, but RMA goes over a second
#: endpoint with error handling off plus an error handler (made by the native extension),
#: which keeps shared-memory (cma) lanes for host memory, faster than tcp there (see
#: bench/results/transfer-cpu.md). A peer dying mid-transfer is reported as PeerClosed in
#: both modes (see docs/engine.md).
ERROR_MODES = ("peer", "none")

#: How UCXX's progress thread waits. ``thread``: it sleeps on the worker's event fd (no idle CPU;
#: transports that do not signal the fd, such as cuda_ipc completions, are noticed late).
#: ``thread-polling``: it spins (one busy core per process; lowest completion latency).
PROGRESS_MODES = ("thread", "thread-polling")

#: Who keeps the UCX worker progressing while a write's flush is in flight. ``spin``: a native
#: poller thread of the transport wakes UCXX's progress thread every few µs
#: (ucp_worker_signal) until the flush completes (one mostly-busy core
#: only while flushes are pending; it backs off to short sleeps while none completes).
#: ``event``: UCXX's progress thread alone; it sleeps on the worker's event fd with a timeout,
#: and CUDA-IPC completions never signal that fd, so every CUDA flush then lasts until the next
#: timeout tick (docs/engine.md; flush latencies in bench/results/transfer-h200-flush.md).
#: ``auto``: ``spin`` for peers where either side registered non-host (CUDA) memory, else
#: ``event`` (host lanes signal the fd; a spinning core would only steal CPU from the peer).
FLUSH_PROGRESS = ("auto", "spin", "event")

#: Same-host CUDA->CUDA writes (kvxfer.engine.devcopy). ``auto``: the peer's CUDA regions are
#: mapped with legacy CUDA IPC and each write's runs are copied by one kernel launch (or a
#: few copy-engine memcpys) instead of one UCX PUT per run; ``off``: always UCX.
DEVICE_COPY = ("auto", "off")

#: Same-host host-memory writes of many runs (kvxfer.engine.hostcopy). ``auto``: a peer on
#: this host that offered it (and proved it is the process it claims) gets a write's runs as
#: a few process_vm_writev calls (inline up to 1 MiB, else on a host-lane thread) instead of
#: one UCX PUT (one cma system call) per run; ``off``: always UCX, and this engine offers no
#: lane to its peers.
HOST_COPY = ("auto", "off")

#: Default of EngineConfig.host_min_ops (kvxfer.engine.hostcopy.lane_wanted; lane vs PUTs by
#: runs: bench/results/host-lane-cpu.md).
HOST_MIN_OPS = 64

#: Default of EngineConfig.device_min_bytes: 0 (off): a write of few large runs is faster as
#: cuda_ipc PUTs than through the lane's launch path (bench/results/lane-copy-h200.md).
DEVICE_MIN_BYTES = 0

#: Default of EngineConfig.device_min_ops (kvxfer.engine.devcopy.lane_wanted has the rule;
#: lane vs PUTs by runs and bytes per run: bench/results/lane-rule-h200.md).
DEVICE_MIN_OPS = 32

#: Where RMA runs (docs/engine.md, "Own worker"). ``auto``: on kvxfer's own UCP context and
#: worker (progressed only by kvxfer's threads, no hop to UCXX's progress thread per
#: completion) for error_mode "none", and for "peer" when every registered descriptor is CUDA
#: device memory (an address-made endpoint with peer error handling keeps cuda_ipc there, but
#: gets no RMA lane for host memory: UCX would emulate the PUTs over active messages, slower
#: than the channel's tcp lanes, and which closing the link does not stop);
#: ``off``: never (RMA on UCXX's context and worker, or the channel's endpoint for "peer").
OWN_WORKER = ("auto", "off")


@functools.lru_cache(maxsize=1)
def env_defaults() -> dict:
    """The environment's defaults, read once."""
    env = os.environ
    out = {}
    if env.get("KVXFER_ERROR_MODE"):
        out["error_mode"] = env["KVXFER_ERROR_MODE"].strip().lower()
    if env.get("KVXFER_PROGRESS_MODE"):
        out["progress_mode"] = env["KVXFER_PROGRESS_MODE"].strip().lower()
    if env.get("KVXFER_FLUSH_PROGRESS"):
        out["flush_progress"] = env["KVXFER_FLUSH_PROGRESS"].strip().lower()
    if env.get("KVXFER_OWN_WORKER"):
        raw = env["KVXFER_OWN_WORKER"].strip().lower()
        out["own_worker"] = {"1": "auto", "on": "auto", "0": "off"}.get(raw, raw)
    if env.get("KVXFER_DEVICE_COPY"):
        out["device_copy"] = env["KVXFER_DEVICE_COPY"].strip().lower()
    if env.get("KVXFER_HOST_COPY"):
        out["host_copy"] = env["KVXFER_HOST_COPY"].strip().lower()
    if env.get("KVXFER_HOST_MIN_OPS"):
        out["host_min_ops"] = int(env["KVXFER_HOST_MIN_OPS"])
    if env.get("KVXFER_DEVICE_MIN_OPS"):
        out["device_min_ops"] = int(env["KVXFER_DEVICE_MIN_OPS"])
    if env.get("KVXFER_DEVICE_SMALL_OPS"):
        out["device_small_ops"] = int(env["KVXFER_DEVICE_SMALL_OPS"])
    if env.get("KVXFER_DEVICE_MIN_BYTES"):
        out["device_min_bytes"] = int(env["KVXFER_DEVICE_MIN_BYTES"])
    if env.get("KVXFER_NOTIFY_ORDER"):
        out["notify_order"] = env["KVXFER_NOTIFY_ORDER"].strip() not in ("0", "false", "off")
    for key, name in (
        ("connect_timeout_s", "KVXFER_CONNECT_TIMEOUT_S"),
        ("transfer_timeout_s", "KVXFER_TRANSFER_TIMEOUT_S"),
    ):
        if env.get(name):
            try:
                out[key] = float(env[name])
            except ValueError:
                raise InvalidArgument(f"{name}={env[name]!r} is not a number") from None
    return out


#: default of ``KVManager(direct_pages=)`` and of the SGLang backend: a send of up to this
#: many pages runs on the caller's thread as the engine loop's guest when that loop is idle
#: (kvxfer.loop_thread.LoopThread.call); ``$KVXFER_DIRECT_PAGES`` overrides it, 0: never.
#: Large sends gain most (the loop's wake-up, and host steps on a thread that had slept,
#: leave a large request's path: bench/results/issue15-status.md, fifth update); the bound
#: only keeps the plan of a huge send off the caller's thread
DIRECT_PAGES = 65536
DIRECT_PAGES_ENV = "KVXFER_DIRECT_PAGES"


def _setting(value: Optional[int], env: str, default: int, what: str) -> int:
    """``value``, else ``$env`` (an int), else ``default``: an int >= 0 (InvalidArgument
    otherwise, naming ``what`` or the variable)."""
    if value is None:
        raw = os.environ.get(env, "").strip()
        try:
            value = int(raw) if raw else default
        except ValueError:
            raise InvalidArgument(f"{env}={raw!r} is not an int") from None
    return as_int(value, what, 0)


#: a lower guest bound for a send to several decode peers at once (a room's legs, one-to-many
#: heterogeneous TP), None: none, such a send is a guest up to ``direct_pages`` like any.
#: History (bench/results/tp-pattern-h200.md): 16 pages from the fifth session (multi-leg
#: sends were slower as guests then), kept in the eighth (no longer slower once native calls
#: kept the GIL: 3 of 6 pairs either way); dropped in the ninth, where the guest was faster
#: in 3 of 3 pairs by 236-348 µs (1 -> 2 HND, `tp-h200/s43/call6`: the hand-over to the loop
#: alone is 110-140 µs of wake-up, the legs' own steps no slower).
#: ``$KVXFER_LEG_DIRECT_PAGES`` sets one (read by :func:`direct_limit`, for A/B runs)
LEG_DIRECT_PAGES: Optional[int] = None
LEG_DIRECT_PAGES_ENV = "KVXFER_LEG_DIRECT_PAGES"


def direct_limit(direct_pages: int, peers: int) -> int:
    """The most pages a send to ``peers`` decode peers runs as the loop's guest, given the
    manager's ``direct_pages`` (0: none): ``direct_pages``, for several peers at most
    ``$KVXFER_LEG_DIRECT_PAGES`` when set (:data:`LEG_DIRECT_PAGES`)."""
    if peers <= 1:
        return direct_pages
    legs = _setting(None, LEG_DIRECT_PAGES_ENV, direct_pages, "leg_direct_pages")
    return min(direct_pages, legs)


def direct_pages(value: Optional[int] = None) -> int:
    """``value``, else ``$KVXFER_DIRECT_PAGES``, else :data:`DIRECT_PAGES`: an int >= 0
    (InvalidArgument otherwise). Read when a manager is built."""
    return _setting(value, DIRECT_PAGES_ENV, DIRECT_PAGES, "direct_pages")


#: default of ``KVManager(coalesce_after=)``: a room's last chunk that finds this many writes
#: of its manager in flight to its decode peer waits and goes with the others that finish
#: meanwhile as one write (kvxfer.disagg.coalesce); ``$KVXFER_COALESCE_AFTER`` overrides it,
#: 0: never. Figures: bench/results/coalesce.md
COALESCE_AFTER = 2
COALESCE_AFTER_ENV = "KVXFER_COALESCE_AFTER"


def coalesce_after(value: Optional[int] = None) -> int:
    """``value``, else ``$KVXFER_COALESCE_AFTER``, else :data:`COALESCE_AFTER`: an int >= 0
    (InvalidArgument otherwise). Read when a manager is built."""
    return _setting(value, COALESCE_AFTER_ENV, COALESCE_AFTER, "coalesce_after")


#: default of ``KVManager(poll_takes=)``: 1, a ``poll()`` of a room that is not terminal
#: first handles the notifications and completions that already reached the process, on
#: the polling thread as the manager loop's guest when that loop waits for events (the
#: loop's wake-up leaves the path of a scheduler that polls); ``$KVXFER_POLL_TAKES``
#: overrides it, 0: never (figures: bench/results/issue15-status.md, seventh update)
POLL_TAKES = 1
POLL_TAKES_ENV = "KVXFER_POLL_TAKES"


def poll_takes(value: Optional[int] = None) -> bool:
    """``value``, else ``$KVXFER_POLL_TAKES``, else :data:`POLL_TAKES`, as a bool (an int
    >= 0 is accepted; InvalidArgument otherwise). Read when a manager is built."""
    return bool(_setting(value, POLL_TAKES_ENV, POLL_TAKES, "poll_takes"))


#: default of ``KVManager(native_takes=)``: 1, the transport's native receive thread (its
#: completion queue's thread on kvxfer's own worker) handles the Done and flush completions
#: it just received as the manager loop's guest when that loop waits for events, instead of
#: waking the loop for them (the thread hop of every request's receipt);
#: ``$KVXFER_NATIVE_TAKES`` overrides it, 0: never (bench/results/issue15-status.md)
NATIVE_TAKES = 1
NATIVE_TAKES_ENV = "KVXFER_NATIVE_TAKES"


def native_takes(value: Optional[int] = None) -> bool:
    """``value``, else ``$KVXFER_NATIVE_TAKES``, else :data:`NATIVE_TAKES`, as a bool (an
    int >= 0 is accepted; InvalidArgument otherwise). Read when a manager is built."""
    return bool(_setting(value, NATIVE_TAKES_ENV, NATIVE_TAKES, "native_takes"))


#: whether a peer's planner plans a write made only of ItemWrites in one native call
#: (``_rma.plan_items``; kvxfer.engine.writeplan): 1; ``$KVXFER_NATIVE_PLAN`` 0: Python
#: planners only, the same plan (bench/results/native-plan-cpu.md)
NATIVE_PLAN = 1
NATIVE_PLAN_ENV = "KVXFER_NATIVE_PLAN"


def native_plan() -> bool:
    """``$KVXFER_NATIVE_PLAN``, else :data:`NATIVE_PLAN`, as a bool (an int >= 0 is
    accepted; InvalidArgument otherwise). Read when a peer is made."""
    return bool(_setting(None, NATIVE_PLAN_ENV, NATIVE_PLAN, "native_plan"))


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity (the CPU count where there is none),
    capped by its cgroup's CPU bandwidth limit rounded up (:func:`cgroup_cpu_limit`: a
    container's CPU limit), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return n


def parse_cpu_max(text: str) -> Optional[float]:
    """cgroup v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) in CPUs, or
    None for no limit or text that is not that."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    return parse_cfs(parts[0], parts[1])


def parse_cfs(quota: str, period: str) -> Optional[float]:
    """cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in CPUs, or None for no
    limit (a quota of -1) or values that are not positive integers."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def cgroup_cpu_limit(
    root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup"
) -> Optional[float]:
    """This process's CPU bandwidth limit in CPUs (the smallest found), or None: cgroup v2's
    ``cpu.max`` and v1's CFS quota, looked up under ``root`` at the process's cgroup path
    (``self_cgroup``) and at the hierarchy's top (what a container sees as its own)."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.strip("/")
        if hier == "0" and controllers == "":  # v2
            for d in {os.path.join(root, path), root}:
                text = _read(os.path.join(d, "cpu.max"))
                limit = None if text is None else parse_cpu_max(text)
                if limit is not None:
                    found.append(limit)
        elif "cpu" in controllers.split(","):  # v1
            for d in {
                os.path.join(root, controllers, path),
                os.path.join(root, "cpu", path),
                os.path.join(root, "cpu"),
            }:
                q = _read(os.path.join(d, "cpu.cfs_quota_us"))
                p = _read(os.path.join(d, "cpu.cfs_period_us"))
                limit = None if q is None or p is None else parse_cfs(q, p)
                if limit is not None:
                    found.append(limit)
    return min(found) if found else None


def _read(path: str) -> Optional[str]:
    """A small file's text, or None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


#: default of :data:`kvxfer.engine.hostcopy.PACK_RUN_BYTES` (the host lane packs a write's
#: local runs when they average at most this many bytes; bench/results/host-lane-cpu.md)
HOST_PACK_BYTES = 1024
HOST_PACK_BYTES_ENV = "KVXFER_HOST_PACK_BYTES"


def host_pack_bytes() -> int:
    """``$KVXFER_HOST_PACK_BYTES``, else :data:`HOST_PACK_BYTES`: an int >= 0 (0: never
    pack; InvalidArgument otherwise). Read when :mod:`kvxfer.engine.hostcopy` is imported."""
    return _setting(None, HOST_PACK_BYTES_ENV, HOST_PACK_BYTES, HOST_PACK_BYTES_ENV)


#: default of :data:`kvxfer.engine.hostcopy.SPLIT_BYTES` (a host-lane write is cut into parts
#: of at least this many bytes, one per host-lane thread; bench/results/host-lane-cpu.md)
HOST_SPLIT_BYTES = 16 << 20
HOST_SPLIT_BYTES_ENV = "KVXFER_HOST_SPLIT_BYTES"


def host_split_bytes() -> int:
    """``$KVXFER_HOST_SPLIT_BYTES``, else :data:`HOST_SPLIT_BYTES`: an int >= 0 (0: never
    cut; InvalidArgument otherwise). Read when :mod:`kvxfer.engine.hostcopy` is imported."""
    return _setting(None, HOST_SPLIT_BYTES_ENV, HOST_SPLIT_BYTES, HOST_SPLIT_BYTES_ENV)


HOST_SPLIT_PARTS_ENV = "KVXFER_HOST_SPLIT_PARTS"


def host_split_parts() -> int:
    """``$KVXFER_HOST_SPLIT_PARTS``: at most this many parts per host-lane write (0, the
    default: chosen from the CPUs, :func:`kvxfer.engine.hostcopy.split_parts`); an int >= 0
    (InvalidArgument otherwise). Read when :mod:`kvxfer.engine.hostcopy` is imported."""
    return _setting(None, HOST_SPLIT_PARTS_ENV, 0, HOST_SPLIT_PARTS_ENV)


HOST_PATTERNS_ENV = "KVXFER_HOST_PATTERNS"


def host_patterns() -> bool:
    """``$KVXFER_HOST_PATTERNS`` (``1``, the default, or ``0``; InvalidArgument otherwise):
    whether the host lane copies PatternWrites from their pattern
    (:meth:`kvxfer.engine.hostcopy.HostLane.start_patterns`) instead of having the planner
    expand them. Read when :mod:`kvxfer.engine.hostcopy` is imported."""
    value = os.environ.get(HOST_PATTERNS_ENV, "1").strip() or "1"
    if value not in ("0", "1"):
        raise InvalidArgument(f"{HOST_PATTERNS_ENV}={value!r}; expected 1 or 0")
    return value == "1"


#: values of ``$KVXFER_MALLOC`` (:func:`malloc_policy`)
MALLOC = ("default", "keep")
MALLOC_ENV = "KVXFER_MALLOC"


def malloc_policy() -> str:
    """``$KVXFER_MALLOC`` (``keep``: :func:`kvxfer.memtune.keep_heap` when an engine
    starts), else ``default`` (the C library's own policy); InvalidArgument for another
    value. Read when an engine starts."""
    value = os.environ.get(MALLOC_ENV, "default").strip().lower() or "default"
    if value not in MALLOC:
        raise InvalidArgument(f"{MALLOC_ENV}={value!r}; expected one of {MALLOC}")
    return value


#: environment variable holding the shared secret (see :func:`resolve_secret`)
SECRET_ENV = "KVXFER_SECRET"


def resolve_secret(secret, who: str) -> bytes:
    """The shared secret of ``who``: ``secret`` when given (bytes, or str as UTF-8), else the
    environment's ``KVXFER_SECRET``; :class:`InvalidArgument` when neither is set or it is
    empty. There is deliberately no default secret (a default known to everyone would let
    anyone who can reach a port authenticate)."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
        if secret is None:
            raise InvalidArgument(
                f"{who} needs a shared secret: pass secret=... or set {SECRET_ENV} (every "
                f"engine, manager and bootstrap server of one deployment uses the same one; "
                f"e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
            )
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)) or len(secret) == 0:
        raise InvalidArgument(f"{who}: the secret must be non-empty bytes or str")
    return bytes(secret)


@dataclass
class EngineConfig:
    """Configuration of one :class:`kvxfer.engine.TransferEngine`.

    ``secret`` is shared by every engine allowed to talk to this one (HMAC challenge-response
    in both directions before any memory key is exchanged). ``port=0`` picks a free port.
    Timeouts are in seconds and bound every network wait of the engine.
    """

    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    error_mode: Optional[str] = None  # None -> env KVXFER_ERROR_MODE or "peer"
    connect_timeout_s: Optional[float] = None  # None -> env or 10.0
    transfer_timeout_s: Optional[float] = None  # None -> env or 30.0
    name: str = ""
    #: grace for closing endpoints and sending the goodbye message on close()
    close_timeout_s: float = 2.0
    #: merge descriptors that merely touch into one registration (host memory always;
    #: CUDA memory only when they come from one allocation, see engine.groups)
    merge_adjacent: bool = True
    #: log a warning when bulk data to a same-host peer goes over tcp
    warn_slow_lanes: bool = True
    #: UCX options passed to ucxx.init() when this engine is the first UCX user in the
    #: process (e.g. {"TLS": "tcp"}); ignored, with a warning, if UCX is already initialised
    ucx_options: dict = field(default_factory=dict)
    #: UCXX progress mode (see PROGRESS_MODES); like ucx_options it takes effect only for the
    #: first UCX user in the process. None -> env KVXFER_PROGRESS_MODE or "thread".
    progress_mode: Optional[str] = None
    #: who progresses the worker during a flush (see FLUSH_PROGRESS).
    #: None -> env KVXFER_FLUSH_PROGRESS or "auto".
    flush_progress: Optional[str] = None
    #: same-host CUDA->CUDA writes by one copy launch (see DEVICE_COPY); also whether this
    #: engine exports IPC handles of its CUDA regions to peers (after authentication, like
    #: its memory keys). None -> env KVXFER_DEVICE_COPY or "auto".
    device_copy: Optional[str] = None
    #: same-host host-memory writes of many runs by process_vm_writev (see HOST_COPY); also
    #: whether this engine offers the lane to its peers (after authentication, like its
    #: memory keys). None -> env KVXFER_HOST_COPY or "auto".
    host_copy: Optional[str] = None
    #: a write takes the host lane only from this many runs up (fewer are as fast as PUTs,
    #: and a write that ends inline is never in flight, which keeps the disagg layer from
    #: coalescing small requests). None -> env KVXFER_HOST_MIN_OPS or HOST_MIN_OPS
    host_min_ops: Optional[int] = None
    #: where RMA runs (see OWN_WORKER). None -> env KVXFER_OWN_WORKER (0 = off) or "auto"
    own_worker: Optional[str] = None
    #: a write takes the device lane only from this many runs (PUTs) up: one lane launch
    #: costs more host time than one UCX PUT, so writes of few large runs are faster as PUTs
    #: and scattered writes of many runs faster as one launch (lane vs PUTs by runs and bytes
    #: per run with the native launch: bench/results/lane-rule-h200.md).
    #: None -> env KVXFER_DEVICE_MIN_OPS or DEVICE_MIN_OPS
    device_min_ops: Optional[int] = None
    #: a write of at most this many runs also takes the device lane: one copy-engine
    #: ``cuMemcpyDtoDAsync`` per run and an event polled inline, no kernel launch and no UCX
    #: flush; 0: never. Measured slower than PUTs for 1-page requests on the H200 (the A/B
    #: in bench/results/stages-h200.md), hence 0. None -> env KVXFER_DEVICE_SMALL_OPS or 0
    device_small_ops: Optional[int] = None
    #: a write of at least this many bytes also takes the device lane, whatever its run
    #: count (large requests: the copy engines or one kernel against UCX's cuda_ipc PUTs);
    #: 0: never (the default, see DEVICE_MIN_BYTES). None -> env KVXFER_DEVICE_MIN_BYTES
    device_min_bytes: Optional[int] = None
    #: notifying writes of a peer hand their notifications to UCX in call order: a write
    #: whose flush completed first waits for the previous notifying write's (concurrent
    #: cuda_ipc flushes complete out of order). False: each notification leaves when its own
    #: write completed (in-order delivery only for writes that do not overlap). None -> env
    #: KVXFER_NOTIFY_ORDER or True
    notify_order: Optional[bool] = None
    #: staged path (see kvxfer.engine.staging): an ItemWrite part that would need more than
    #: this many PUTs is gathered into a registered staging slot, PUT as one op per chunk into
    #: the peer's landing ring and scattered there before the notification; 0 disables staging
    #: (then no staging/landing memory is allocated). It trades a gather and a scatter for
    #: fewer PUTs, which pays only where the cost per PUT (a CPU post over cuda_ipc, a
    #: syscall over cma) bounds scattered pages. Off by default: where measured it is slower
    #: than the direct path (staged vs direct rows in bench/results/transfer-cpu.md); 256 is
    #: the value the benchmark tries.
    stage_min_ops: int = 0
    #: bytes of one staging / landing slot (capped at the group's size); a staged part larger
    #: than a slot moves in several chunks, pipelined over the slots granted by the peer
    stage_slot_bytes: int = 64 << 20
    #: landing slots per group on this engine (the ring advertised to peers)
    stage_slots: int = 8
    #: landing slots granted to each peer (at most ``stage_slots`` peers' worth are handed
    #: out; a peer granted none writes unstaged); also the local staging slots per group
    stage_peer_slots: int = 2
    #: stage host-memory groups too. Off by default: on host memory (cma) the gather and
    #: scatter memcpys cost more than the per-PUT syscalls they save (see
    #: bench/results/transfer-cpu.md); CUDA groups, where a PUT costs more host time, are
    #: where the staged path can pay
    stage_host_memory: bool = False
    #: strided slices (kvxfer.engine.slices, ``SliceWrite``): > 0 gives every staged group
    #: (host memory included: on CPU, gathering head slices beats tens of thousands of tiny
    #: PUTs, bench/results/tp-pd-cpu.md) staging and landing rings, so a ``SliceWrite`` can
    #: go to peers that do the same; it is also the threshold callers apply: a write whose
    #: direct plan needs more PUTs than this goes as a SliceWrite (the disagg layer's
    #: heterogeneous-TP kv writes: ``KVManager(tp_stage_min_ops=...)``). 0: no slice writes
    stage_slice_min_ops: int = 0
    #: the groups that get staging rings (None: every group; e.g. ``("kv",)`` keeps the
    #: rings off small groups such as aux rows)
    stage_groups: Optional[Tuple[str, ...]] = None
    #: refuse (IncompatiblePeer at the handshake) a same-host peer when either side would
    #: have to PUT into CUDA memory that is not legacy-IPC capable (CUDA VMM): UCX emulates
    #: such PUTs in software, far below the copy engines. Off: such groups only get a loud
    #: warning at start() (see kvxfer.engine.ipc and pools/backing/share.py)
    refuse_emulated_destinations: bool = False

    def __post_init__(self):
        env = env_defaults()
        if self.error_mode is None:
            self.error_mode = env.get("error_mode", "peer")
        if self.progress_mode is None:
            self.progress_mode = env.get("progress_mode", "thread")
        if self.progress_mode not in PROGRESS_MODES:
            raise InvalidArgument(
                f"EngineConfig.progress_mode={self.progress_mode!r}; expected one of {PROGRESS_MODES}"
            )
        if self.flush_progress is None:
            self.flush_progress = env.get("flush_progress", "auto")
        if self.flush_progress not in FLUSH_PROGRESS:
            raise InvalidArgument(
                f"EngineConfig.flush_progress={self.flush_progress!r}; expected one of {FLUSH_PROGRESS}"
            )
        if self.own_worker is None:
            self.own_worker = env.get("own_worker", "auto")
        if self.own_worker not in OWN_WORKER:
            raise InvalidArgument(
                f"EngineConfig.own_worker={self.own_worker!r}; expected one of {OWN_WORKER}"
            )
        if self.device_copy is None:
            self.device_copy = env.get("device_copy", "auto")
        if self.device_copy not in DEVICE_COPY:
            raise InvalidArgument(
                f"EngineConfig.device_copy={self.device_copy!r}; expected one of {DEVICE_COPY}"
            )
        if self.host_copy is None:
            self.host_copy = env.get("host_copy", "auto")
        if self.host_copy not in HOST_COPY:
            raise InvalidArgument(
                f"EngineConfig.host_copy={self.host_copy!r}; expected one of {HOST_COPY}"
            )
        if self.host_min_ops is None:
            self.host_min_ops = env.get("host_min_ops", HOST_MIN_OPS)
        if self.device_min_ops is None:
            self.device_min_ops = env.get("device_min_ops", DEVICE_MIN_OPS)
        if self.device_small_ops is None:
            self.device_small_ops = env.get("device_small_ops", 0)
        if self.device_min_bytes is None:
            self.device_min_bytes = env.get("device_min_bytes", DEVICE_MIN_BYTES)
        if self.notify_order is None:
            self.notify_order = env.get("notify_order", True)
        if not isinstance(self.notify_order, bool):
            raise InvalidArgument(f"EngineConfig.notify_order={self.notify_order!r} must be a bool")
        if self.connect_timeout_s is None:
            self.connect_timeout_s = env.get("connect_timeout_s", 10.0)
        if self.transfer_timeout_s is None:
            self.transfer_timeout_s = env.get("transfer_timeout_s", 30.0)
        if not isinstance(self.secret, (bytes, bytearray)) or len(self.secret) == 0:
            raise InvalidArgument("EngineConfig.secret must be non-empty bytes")
        self.secret = bytes(self.secret)
        if self.error_mode not in ERROR_MODES:
            raise InvalidArgument(
                f"EngineConfig.error_mode={self.error_mode!r}; expected one of {ERROR_MODES}"
            )
        self.port = as_int(self.port, "EngineConfig.port")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"EngineConfig.port={self.port!r} is not a TCP port")
        for name in ("connect_timeout_s", "transfer_timeout_s", "close_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v <= 0:
                raise InvalidArgument(f"EngineConfig.{name}={v!r} must be > 0")
        for name, low in (
            ("device_min_ops", 1),
            ("host_min_ops", 1),
            ("device_small_ops", 0),
            ("device_min_bytes", 0),
            ("stage_min_ops", 0),
            ("stage_slot_bytes", 1),
            ("stage_slots", 1),
            ("stage_peer_slots", 1),
            ("stage_slice_min_ops", 0),
        ):
            setattr(self, name, as_int(getattr(self, name), f"EngineConfig.{name}", low))
        if not isinstance(self.refuse_emulated_destinations, bool):
            raise InvalidArgument(
                f"EngineConfig.refuse_emulated_destinations="
                f"{self.refuse_emulated_destinations!r} must be a bool"
            )
        if not isinstance(self.stage_host_memory, bool):
            raise InvalidArgument(
                f"EngineConfig.stage_host_memory={self.stage_host_memory!r} must be a bool"
            )
        if self.stage_groups is not None:
            if isinstance(self.stage_groups, str) or not all(
                isinstance(g, str) for g in self.stage_groups
            ):
                raise InvalidArgument(
                    f"EngineConfig.stage_groups={self.stage_groups!r} must be group names"
                )
            self.stage_groups = tuple(self.stage_groups)
        if self.stage_peer_slots > self.stage_slots:
            raise InvalidArgument(
                f"EngineConfig.stage_peer_slots={self.stage_peer_slots} "
                f"exceeds stage_slots={self.stage_slots}"
            )


def own_worker(setting: str, error_mode: str, all_device_memory: bool) -> bool:
    """Whether an engine runs RMA on kvxfer's own UCP worker (see OWN_WORKER)."""
    return setting == "auto" and (error_mode == "none" or all_device_memory)


def spin_flushes(mode: str, local_types, remote_types) -> bool:
    """Whether flushes to a peer are progressed by the native poller: ``spin`` always,
    ``event`` never, ``auto`` when either side registered non-host (CUDA) memory."""
    if mode == "auto":
        return any(t != "host" for t in local_types) or any(t != "host" for t in remote_types)
    return mode == "spin"
