"""What the kernel's cross-process copy costs by which side is strided (issue 16's
many-to-one host rows): ``process_vm_writev`` / ``process_vm_readv`` between two processes
of this host, against numpy copies of the same bytes in one process, same run.

A many-to-one heterogeneous-TP request (prefill ranks of fewer heads each, NHD token rows)
puts each prefill rank's share of a token row at a fixed offset inside decode's row: runs
of ``--run`` bytes (512 B for the demo model at 2 -> 1) at a stride of two runs. Who copies
decides which side of the system call is strided:

- ``writev, remote strided``: prefill writes into decode's rows (a direct host-lane write);
- ``writev, local strided``: the one-to-many case (prefill's strided source, decode's rows
  whole);
- ``readv, local strided`` (1 and 2 threads): decode would read its rows from prefill's
  contiguous pages (a pull);
- ``writev, contiguous``: one run, equal TP's copy;
- numpy: the strided copy (what a staged scatter does) and a plain copy, in one process.

The kernel pins the pages of every *remote* iovec separately and walks the local iovecs as
an iterator, so the remote side's run count is what costs. Calls carry at most 1024 iovecs
per side (IOV_MAX), adjacent runs merged. p50 of ``--iters`` after a warm-up.

    .venv/bin/python bench/cma_floor.py [--mib 64] [--runs 512,1024,4096] [--iters 5]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import threading
import time
from functools import partial

import numpy as np

IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _iovs(addrs: np.ndarray, lens: np.ndarray):
    a = (_Iovec * len(addrs))()
    v = np.frombuffer(a, dtype=np.uint64).reshape(-1, 2)
    v[:, 0], v[:, 1] = addrs, lens
    return a


def _side(base: int, first: int, k: int, run: int, strided: bool):
    """The iovecs of runs ``[first, first + k)`` on one side: two runs apart when
    ``strided``, else one iovec for all of them."""
    if strided:
        offs = np.arange(first, first + k, dtype=np.uint64) * np.uint64(2 * run) + np.uint64(base)
        return _iovs(offs, np.full(k, run, dtype=np.uint64))
    return _iovs(np.array([base + first * run], dtype=np.uint64), np.array([run * k], np.uint64))


def _calls(laddr, raddr, n: int, run: int, l_strided: bool, r_strided: bool):
    """Prebuilt (local iovecs, remote iovecs, bytes) per call: ``n`` runs of ``run`` bytes;
    a strided side has runs two runs apart, a contiguous side one iovec per call."""
    out = []
    for i in range(0, n, IOV_MAX):
        k = min(IOV_MAX, n - i)
        out.append(
            (_side(laddr, i, k, run, l_strided), _side(raddr, i, k, run, r_strided), run * k)
        )
    return out


def _run(fn, pid: int, calls) -> None:
    for liov, riov, want in calls:
        got = fn(pid, liov, len(liov), riov, len(riov), 0)
        if got != want:
            e = ctypes.get_errno()
            raise OSError(e, f"copied {got} of {want} B: {os.strerror(e)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", default="512,1024,4096")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    if not sys.platform.startswith("linux"):
        print("process_vm_* is Linux only")
        return 1
    libc = ctypes.CDLL(None, use_errno=True)
    writev, readv = libc.process_vm_writev, libc.process_vm_readv
    for f in (writev, readv):
        f.restype = ctypes.c_ssize_t
    total = args.mib << 20
    # the peer: a forked child holding a strided and a contiguous buffer, touched
    peer_s = np.ones(2 * total, dtype=np.uint8)
    peer_c = np.ones(total, dtype=np.uint8)
    r_fd, w_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: keep the buffers mapped until the parent closes the pipe
        os.close(w_fd)
        os.read(r_fd, 1)
        os._exit(0)
    os.close(r_fd)
    local_s = np.zeros(2 * total, dtype=np.uint8)
    local_c = np.zeros(total, dtype=np.uint8)
    ls, lc = local_s.ctypes.data, local_c.ctypes.data
    rs, rc = peer_s.ctypes.data, peer_c.ctypes.data  # same addresses in the forked child
    print(f"{args.mib} MiB per copy, p50 of {args.iters} ms (GB/s); host CPUs {os.cpu_count()}")
    print()
    print(
        "| run B | writev, remote strided | writev, local strided | readv, local strided "
        "| readv, local strided, 2 threads | writev, contiguous | numpy strided copy "
        "| numpy copy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    try:
        for run in (int(x) for x in args.runs.split(",")):
            n = total // run
            half = n // 2
            w_rs = _calls(lc, rs, n, run, False, True)
            w_ls = _calls(ls, rc, n, run, True, False)
            r_ls = _calls(ls, rc, n, run, True, False)
            r_a = _calls(ls, rc, half, run, True, False)
            r_b = _calls(ls + 2 * run * half, rc + run * half, n - half, run, True, False)
            w_c = _calls(lc, rc, 1, total, False, False)
            cases = [
                partial(_run, writev, pid, w_rs),
                partial(_run, writev, pid, w_ls),
                partial(_run, readv, pid, r_ls),
                partial(_two, readv, pid, r_a, r_b),
                partial(_run, writev, pid, w_c),
                partial(_np_strided, local_s, local_c, run),
                partial(np.copyto, local_s[:total], local_c),
            ]
            cells = []
            for fn in cases:
                fn()  # warm-up (page faults, iovec arrays)
                ts = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                p50 = statistics.median(ts)
                cells.append(f"{p50 * 1e3:.1f} ({total / p50 / 1e9:.1f})")
            print(f"| {run} | " + " | ".join(cells) + " |")
    finally:
        os.close(w_fd)
        os.waitpid(pid, 0)
    return 0


def _two(fn, pid: int, a, b) -> None:
    """Both halves at once, one thread each (ctypes releases the GIL in the call)."""
    errs = []

    def go(calls):
        try:
            _run(fn, pid, calls)
        except OSError as exc:
            errs.append(exc)

    t = threading.Thread(target=go, args=(b,))
    t.start()
    go(a)
    t.join()
    if errs:
        raise errs[0]


def _np_strided(dst: np.ndarray, src: np.ndarray, run: int) -> None:
    """``src`` (contiguous) into every other ``run`` bytes of ``dst``: a staged scatter."""
    v = dst.reshape(-1, 2 * run)[:, :run]
    v[...] = src.reshape(-1, run)


if __name__ == "__main__":
    sys.exit(main())
