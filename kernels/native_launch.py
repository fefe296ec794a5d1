"""Launch a compiled Triton kernel with one driver call, its per-launch table in pinned memory.

A Triton launch from Python pays the binder (argument specialisation, cache lookup), torch's
device and stream contexts and, for a kernel driven by a task table, the table's upload: on
the H200 host 70–290 µs of host time per launch, more than the copies the device lane and the
offload manager launch (bench/results/lane-copy-h200.md). Here a kernel compiled once by
Triton is launched by ``cuLaunchKernel`` through ctypes, and its table is written straight
into a slot of page-locked, device-mapped host memory that the kernel reads over the bus: no
upload, no torch object, a few driver calls per launch.

Invariants
- :func:`compile_kernel` builds a :class:`NativeKernel` from ONE specialisation of a Triton
  kernel (the constexprs and ``num_warps`` given), compiled and loaded by Triton into device
  ``ordinal``'s primary context from 16-byte aligned sample pointers: every pointer passed to
  :meth:`NativeKernel.launch` must be 16-byte aligned too, and every integer argument of the
  same specialisation class as its sample (Triton specialises integers divisible by 16). It
  raises :class:`UnsupportedOperation` unless the compiled function's parameters
  (``cuFuncGetParamInfo``) are the runtime arguments with the sizes the caller expects,
  followed by 8-byte pointers only, the kernel needs no global or profile scratch memory and
  runs one CTA per program without cooperative or programmatic launch; callers then keep
  Triton's own launch. The parameters Triton appends (scratch pointers) are passed as 0.
- :meth:`NativeKernel.launch` and :class:`TableRing` make the device's primary context current
  for their calls when the thread has another one (or none), and restore it.
- :class:`TableRing` rewrites slot ``k`` only after the work recorded on slot ``k``'s event
  completed (queried; synchronised when every slot's launch is still running); its users
  record the event after a slot's launches even when one of them failed. The event a
  launch returns is its slot's: a holder may see it re-recorded by a LATER launch on the same
  stream, which completes after its own, so waiting on it never waits for less. One owner
  thread per ring.
- Importing this module imports neither torch nor Triton (:func:`compile_kernel` and
  :class:`TableRing` do).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, List, Optional, Tuple

import numpy as np

from kvxfer.kernels import cuda_driver
from kvxfer.kernels.errors import CudaError, UnsupportedOperation

#: set to "0" to keep Triton's own launch everywhere this module would be used (A/B runs)
NATIVE_ENV = "KVXFER_NATIVE_LAUNCH"
#: slots of a :class:`TableRing` (launches in flight before one waits for the oldest)
RING_SLOTS = 8
#: int64 words a slot holds at first (it grows to the largest table asked for)
RING_WORDS = 4096
#: the most parameters a compiled kernel may have (Triton appends two scratch pointers)
MAX_PARAMS = 32

_P, _U = ctypes.c_void_p, ctypes.c_uint
_EMPTY = np.zeros(0, dtype=np.int64)
_fns: dict = {}


def enabled() -> bool:
    """Whether native launches are allowed (``$KVXFER_NATIVE_LAUNCH`` is not "0")."""
    return os.environ.get(NATIVE_ENV, "1") != "0"


def _fn(name: str, version: int, *argtypes: Any) -> Any:
    """Driver entry point ``name`` (see :func:`cuda_driver.proc`), looked up once; raises
    :class:`UnsupportedOperation` when the driver lacks it. Every call made here is short
    and never waits for the device, so it keeps the GIL (``keep_gil``)."""
    f = _fns.get(name)
    if f is None:
        f = cuda_driver.proc(name, version, *argtypes, keep_gil=True)
        if f is None:
            raise UnsupportedOperation(f"the CUDA driver has no {name}")
        _fns[name] = f
    return f


def _check(err: int, what: str) -> None:
    if err:
        bind = cuda_driver.bindings()
        detail = cuda_driver.error_text(bind.CUresult(err)) if bind is not None else ""
        raise CudaError(what, int(err), detail)


class Context:
    """Device ``ordinal``'s primary context, made current around driver calls on threads
    whose current context is another (or none): :meth:`enter` returns whether it pushed,
    :meth:`leave` pops what it pushed. Two ctypes calls when it is already current."""

    def __init__(self, ordinal: int) -> None:
        cu = cuda_driver.driver()
        dev = cuda_driver.check(cu.cuDeviceGet(int(ordinal)), "cuDeviceGet")
        # retained for the process's life (the CUDA runtime holds it as long)
        ctx = cuda_driver.check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        self.ordinal = int(ordinal)
        self.handle = int(ctx)
        self._get = _fn("cuCtxGetCurrent", 4000, _P)
        self._push = _fn("cuCtxPushCurrent", 4000, _P)
        self._pop = _fn("cuCtxPopCurrent", 4000, _P)

    def enter(self) -> bool:
        """Make the context current on this thread if it is not; True when it was pushed.
        Thread-safe (kernels compiled once are shared by every thread of the process)."""
        cur = ctypes.c_void_p()
        _check(self._get(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value == self.handle:
            return False
        _check(self._push(self.handle), "cuCtxPushCurrent")
        return True

    def leave(self, pushed: bool) -> None:
        """Undo :meth:`enter` (pop when it pushed)."""
        if pushed:
            _check(self._pop(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")


class NativeKernel:
    """One compiled kernel specialisation, launched by ``cuLaunchKernel`` on a 1-D or 2-D
    grid.

    Build it with :func:`compile_kernel`. ``sizes``: the byte size of each parameter (4 or
    8). ``keep`` (Triton's compiled kernel) owns the loaded module and is held as long as
    this object."""

    def __init__(
        self, function: int, sizes: List[int], block: int, shared: int, ctx: Context, keep: Any
    ) -> None:
        self.function = int(function)
        self.sizes = list(sizes)
        self.nparams = len(self.sizes)
        self.block = int(block)
        self.shared = int(shared)
        self.ctx = ctx
        self._keep = keep
        self._launch = _fn("cuLaunchKernel", 4000, _P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P)
        self._local = threading.local()  # per thread: one cell per parameter, the void* array

    def _args(self) -> Tuple[list, Any]:
        a = getattr(self._local, "a", None)
        if a is None:
            cells = [ctypes.c_uint64() if n == 8 else ctypes.c_uint32() for n in self.sizes]
            argv = (ctypes.c_void_p * self.nparams)(*[ctypes.addressof(c) for c in cells])
            a = self._local.a = (cells, argv)
        return a

    def launch(self, grid: int, stream: int, *args: int, grid_y: int = 1) -> None:
        """Launch ``grid`` x ``grid_y`` programs on ``stream`` (a CUstream handle) with the
        leading parameters ``args`` (the rest 0). Raises :class:`CudaError`."""
        cells, argv = self._args()
        for c, v in zip(cells, args):
            c.value = v
        pushed = self.ctx.enter()
        try:
            err = self._launch(
                self.function, grid, grid_y, 1, self.block, 1, 1, self.shared, stream, argv, None
            )
        finally:
            self.ctx.leave(pushed)
        _check(err, "cuLaunchKernel")


def param_sizes(function: int) -> List[int]:
    """Byte size of each parameter of a loaded CUfunction (``cuFuncGetParamInfo``, CUDA
    >= 12.4). Raises :class:`UnsupportedOperation` without the call."""
    info = _fn("cuFuncGetParamInfo", 12040, _P, ctypes.c_size_t, _P, _P)
    off, size, sizes = ctypes.c_size_t(), ctypes.c_size_t(), []
    for i in range(MAX_PARAMS + 1):
        if info(function, i, ctypes.byref(off), ctypes.byref(size)):
            break  # CUDA_ERROR_INVALID_VALUE past the last parameter
        sizes.append(int(size.value))
    if len(sizes) > MAX_PARAMS:
        raise UnsupportedOperation(f"a kernel with more than {MAX_PARAMS} parameters")
    return sizes


def compile_kernel(
    jit_fn: Any,
    sample_args: tuple,
    ordinal: int,
    num_warps: int,
    arg_sizes: Optional[Tuple[int, ...]] = None,
    **constexprs: Any,
) -> NativeKernel:
    """Compile (Triton's cache: once per process and specialisation) and load ``jit_fn`` for
    device ``ordinal`` with ``sample_args`` (its runtime arguments: 16-byte aligned device
    tensors, and integers of the specialisation wanted: never 1, which Triton turns into a
    constant) and ``constexprs``. ``arg_sizes``: the byte size each runtime argument must
    have as a parameter (default: 8 each). Raises :class:`UnsupportedOperation` when this
    module cannot launch it (see the module's invariants) and :class:`CudaError` from the
    driver."""
    import torch

    want = list(arg_sizes or (8,) * len(sample_args))
    ctx = Context(ordinal)
    with torch.cuda.device(ordinal):
        compiled = jit_fn.warmup(*sample_args, grid=(1,), num_warps=num_warps, **constexprs)
        init = getattr(compiled, "_init_handles", None)
        if init is None:
            raise UnsupportedOperation("this Triton has no CompiledKernel._init_handles")
        init()
    md = compiled.metadata
    why = []
    for attr in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, attr, 0):
            why.append(f"{attr} {getattr(md, attr)}")
    if getattr(md, "num_ctas", 1) != 1:
        why.append(f"num_ctas {md.num_ctas}")
    if tuple(getattr(md, "cluster_dims", None) or (1, 1, 1)) not in ((1, 1, 1), (0, 0, 0)):
        why.append(f"cluster_dims {md.cluster_dims}")
    for attr in ("launch_cooperative_grid", "launch_pdl"):
        if getattr(md, attr, False):
            why.append(attr)
    function = int(compiled.function or 0)
    sizes = param_sizes(function) if function else []
    n = len(want)
    if not function or sizes[:n] != want or any(s != 8 for s in sizes[n:]):
        why.append(f"parameters of {sizes} bytes for arguments of {want}")
    if why:
        raise UnsupportedOperation(f"cannot launch {compiled.name} natively: {', '.join(why)}")
    block = int(md.num_warps) * int(getattr(md, "warp_size", 32))
    return NativeKernel(function, sizes, block, int(md.shared), ctx, compiled)


class TableRing:
    """Page-locked, device-mapped int64 tables for launches, a driver event per slot (see
    the module's invariants). :meth:`take` a slot, write its words, launch kernels that read
    them at its device address, then :meth:`done` records the slot's event."""

    def __init__(self, ordinal: int, slots: int = RING_SLOTS, words: int = RING_WORDS) -> None:
        self.ordinal = int(ordinal)
        self.ctx = Context(ordinal)
        self._events = [cuda_driver.Event(ordinal) for _ in range(int(slots))]
        self._words = -(-int(words) // 2) * 2  # slots start 16-byte aligned
        # one page-locked block for every slot at first: a page-locked allocation costs
        # hundreds of µs, far more than a launch (a larger table regrows the idle slots
        # together: _grow)
        host, flat, dev = self._alloc(int(slots) * self._words)
        w = self._words
        self._tables: List[Optional[Tuple[Any, np.ndarray, int]]] = [
            (host, flat[k * w : (k + 1) * w], dev + 8 * k * w) for k in range(int(slots))
        ]
        self._next = 0
        self.waits = 0  # takes that found their slot's launch still running
        self.grown = 0  # slots given a larger table (:meth:`_grow`)

    def _alloc(self, words: int) -> Tuple[Any, np.ndarray, int]:
        import torch

        host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        dev = cuda_driver.device_pointer(host.data_ptr())
        if not dev or dev % 16:
            raise UnsupportedOperation(f"pinned table at {host.data_ptr():#x} maps to {dev}")
        return host, host.numpy(), int(dev)

    def take(self, words: int) -> Tuple[int, np.ndarray, int]:
        """``(slot, host int64 words [>= words], device address)`` of the next slot, once
        the launch last recorded on it completed. Runs on: the owner thread (blocks while
        every slot's launch is still running). Raises :class:`UnsupportedOperation` once
        closed."""
        if not self._events:
            raise UnsupportedOperation("launch on a closed table ring")
        k = self._next
        self._next = (k + 1) % len(self._events)
        ev = self._events[k]
        if not ev.query():
            self.waits += 1
            ev.synchronize()
        if words <= 0:
            return k, _EMPTY, 0
        t = self._tables[k]
        if t is None or t[1].shape[0] < words:
            t = self._grow(k, int(words))
        return k, t[1], t[2]

    def _grow(self, k: int, words: int) -> Tuple[Any, np.ndarray, int]:
        """Give slot ``k`` (its launch done) a table of at least ``words``, and with it, in
        the same page-locked block, every other slot whose launch is done and whose table
        is smaller: one allocation (hundreds of µs) when a larger table first comes, not
        one per slot as each is taken (a large table outgrew every slot:
        bench/results/join-legs-h100.md). A slot still in flight keeps its table
        until it is taken again."""
        w = -(-words // 2) * 2  # (slots start 16-byte aligned)
        if w > self._words:  # a larger table than any before: at least double
            self._words = max(w, 2 * self._words)
        w = self._words
        idle = [
            j
            for j, t in enumerate(self._tables)
            if j == k or ((t is None or t[1].shape[0] < w) and self._events[j].query())
        ]
        host, flat, dev = self._alloc(len(idle) * w)
        for i, j in enumerate(idle):
            self._tables[j] = (host, flat[i * w : (i + 1) * w], dev + 8 * i * w)
        self.grown += len(idle)
        return self._tables[k]

    def done(self, slot: int, stream: int) -> "cuda_driver.Event":
        """Record slot ``slot``'s event on ``stream`` after the launches that read it; returns
        the event (query / synchronize like ``torch.cuda.Event``)."""
        ev = self._events[slot]
        ev.record(stream)
        return ev

    def close(self) -> None:
        """Wait for every slot's launch, then free the events and tables (idempotent)."""
        for ev in self._events:
            ev.synchronize()
            ev.close()
        self._events, self._tables = [], []
