"""The one CUDA driver layer of kvxfer: cuda-bindings' driver API, looked up on first use.

Every driver call of the library goes through here: the VMM backing
(:mod:`kvxfer.pools.backing.cuda`, :mod:`kvxfer.pools.backing.share`), the offload pool's
mapped host memory, and the transfer engine's pointer queries, legacy IPC export/import and
device-lane copies. It is torch-free and lives in ``kernels``, like :mod:`.errors`, only because
every package may import downwards.

Invariants
- Importing this module imports no CUDA package. cuda-bindings (``cuda.bindings.driver``, or
  the older ``cuda.cuda``; the extra ``kvxfer[cuda]``, and a dependency of UCXX's RMM) is
  imported on the first call, once, with the driver library. Without either every query
  answers None and never raises; the calls that must act (:func:`ipc_open`,
  :func:`memcpy_dtod_async`, :func:`memcpy_batch_async`, :func:`driver`) raise
  :class:`CudaError` (code ``CudaError.NO_DRIVER``). ``cuMemcpyBatchAsync`` (CUDA >= 12.8) is
  called through the pointer ``cuGetProcAddress`` gives for the driver's newest ABI of it.
- The queries never initialise the driver (no ``cuInit``): in a process where nothing has
  used CUDA yet they answer None, and a parent that only probed its memory can still fork
  children that use CUDA. :func:`driver` (the VMM backing's entry) initialises it.
- Pointers, sizes and stream handles go in and come out as Python ints.
- Short driver calls that never wait for the device (an event's record and query, a
  kernel launch, the context push / pop around it) keep the GIL (:func:`proc` with
  ``keep_gil``: ``ctypes.PYFUNCTYPE``): releasing it for a microsecond-long call hands it to
  any Python thread that wants it, and a thread busy in the interpreter gives it back only at
  the switch interval (bench/results/launch-h200.md). Calls that can wait (synchronize, a
  batch copy that may block on a full queue) release it. ``$KVXFER_NATIVE_GIL=release``
  makes every call release it, and the UCX calls of :mod:`kvxfer.transport` that keep it
  too (the A/B of bench/results/native-gil.md); read when a call is looked up.
- :func:`ipc_export` works on any thread (it makes the memory's primary context current for
  its one context-bound call) and answers only for memory the driver reports legacy-IPC capable
  (``cudaMalloc``-style; not CUDA VMM); the blob is :data:`IPC_BLOB_BYTES` bytes: the
  64-byte ``CUipcMemHandle`` of the whole allocation, then the little-endian u64 offset of
  ``addr`` inside it, so the importer can rebuild ``addr``'s image.
- :func:`vmm_extents` / :func:`vmm_export` (the device lane into CUDA VMM memory,
  :mod:`kvxfer.engine.vmm_share`) work on any thread like :func:`ipc_export`; extents come
  from ``cuMemGetAddressRange``, which reports one mapping of VMM memory, while the pointer
  range attributes (:func:`alloc_range`) report the whole reservation.
- :func:`ipc_open` / :func:`ipc_close` / :func:`memcpy_dtod_async` need a current CUDA
  context on the calling thread (the caller enters ``torch.cuda.device``); an import in the
  exporting process itself fails (the driver refuses it) and is reported as
  :class:`CudaError`, not a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
from typing import Any, Iterator, List, Optional, Tuple

from kvxfer.kernels.errors import CudaError, InvalidArgument

IPC_HANDLE_BYTES = 64
IPC_BLOB_BYTES = IPC_HANDLE_BYTES + 8
# CUmemorytype values
MEMORYTYPE_HOST, MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED = 1, 2, 4
#: cuIpcOpenMemHandle flag: enable peer access lazily (the import may be on another GPU)
_LAZY_ENABLE_PEER_ACCESS = 1

_loaded: list = []  # [cuda-bindings driver module or None] once looked up
_why_not = ""  # why _loaded holds None
_initialised = False
_OK: Any = None  # CUresult.CUDA_SUCCESS once loaded


def bindings() -> Any:
    """The cuda-bindings driver module with its library loaded (the driver not initialised),
    or None without cuda-bindings or without a driver library; looked up once."""
    if not _loaded:
        _loaded.append(_load())
    return _loaded[0]


def _load() -> Any:
    global _why_not, _OK
    try:
        from cuda.bindings import driver as cu  # cuda-bindings >= 12.6, 13.x
    except ImportError:
        try:
            from cuda import cuda as cu  # older cuda-python (removed in 13.0)
        except ImportError:
            _why_not = "no cuda-bindings package (pip install 'kvxfer[cuda]')"
            return None
    try:
        cu.cuDriverGetVersion()  # loads the driver library; needs no cuInit
    except Exception as exc:  # noqa: BLE001 - library not found, wrong driver, ...
        _why_not = f"no CUDA driver library ({type(exc).__name__}: {exc})"
        return None
    _OK = cu.CUresult.CUDA_SUCCESS
    return cu


def driver() -> Any:
    """The cuda-bindings driver module, initialised (``cuInit``). Raises :class:`CudaError`
    without cuda-bindings, without a driver library, or when ``cuInit`` fails."""
    global _initialised
    cu = bindings()
    if cu is None:
        raise CudaError("loading the CUDA driver", CudaError.NO_DRIVER, _why_not)
    if not _initialised:
        check(cu.cuInit(0), "cuInit")
        _initialised = True
    return cu


def error_text(err: Any) -> str:
    """``NAME (code) description`` of a CUresult, for messages."""
    name = getattr(err, "name", None) or str(err)
    try:
        res = bindings().cuGetErrorString(err)
        msg = res[1].decode() if isinstance(res[1], bytes) else str(res[1])
    except Exception:  # noqa: BLE001
        msg = ""
    try:
        code: Any = int(err)
    except Exception:  # noqa: BLE001
        code = "?"
    return f"{name} ({code}) {msg}".rstrip()


def check(res: tuple, what: str) -> Any:
    """Unpack a cuda-bindings result tuple: None, its one value, or a tuple of its values.
    Raises :class:`CudaError` naming ``what`` when the CUresult is not success."""
    err = res[0]
    if err != _OK:
        raise CudaError(what, int(err), error_text(err))
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def _attr(name: str, addr: int) -> Optional[int]:
    """Pointer attribute ``CU_POINTER_ATTRIBUTE_<name>`` of ``addr`` as an int; None when the
    driver does not answer (no driver, not initialised, unknown pointer)."""
    cu = bindings()
    if cu is None:
        return None
    err, value = cu.cuPointerGetAttribute(
        getattr(cu.CUpointer_attribute, "CU_POINTER_ATTRIBUTE_" + name), addr
    )
    return None if err != _OK else int(value)


def alloc_range(addr: int) -> Optional[Tuple[int, int]]:
    """``(base, size)`` of the CUDA allocation holding ``addr``; None for non-device
    memory or without a driver (needs no current context)."""
    base = _attr("RANGE_START_ADDR", addr)
    size = _attr("RANGE_SIZE", addr) if base is not None else None
    return (base, size) if size else None


def ipc_capable(addr: int) -> Optional[bool]:
    """Whether the driver reports ``addr``'s allocation legacy-IPC capable (False for CUDA
    VMM memory, which UCX can reach only by emulated PUTs); None when not device memory."""
    if alloc_range(addr) is None:
        return None
    v = _attr("IS_LEGACY_CUDA_IPC_CAPABLE", addr)
    return None if v is None else bool(v)


def device_ordinal(addr: int) -> Optional[int]:
    """CUDA device ordinal of device memory at ``addr`` (None when unknown)."""
    if alloc_range(addr) is None:
        return None
    return _attr("DEVICE_ORDINAL", addr)


def memory_type(addr: int) -> Optional[int]:
    """``CU_MEMORYTYPE_*`` of ``addr`` as the driver sees it (``MEMORYTYPE_HOST`` for
    page-locked host memory); None when the driver does not know the pointer."""
    return _attr("MEMORY_TYPE", addr) if addr else None


def kernel_device(addr: int) -> Optional[int]:
    """Ordinal of the CUDA device whose kernels should read ``addr``: device memory (plain or
    VMM) and managed memory; None for host memory (pageable or page-locked), for pointers
    the driver does not know, and without a driver."""
    if memory_type(addr) not in (MEMORYTYPE_DEVICE, MEMORYTYPE_UNIFIED):
        return None
    return _attr("DEVICE_ORDINAL", addr)


def device_pointer(host_addr: int) -> Optional[int]:
    """The address at which kernels reach the mapped page-locked host memory at
    ``host_addr`` (``cudaHostRegisterMapped``; under UVA the host address itself), or None
    when it is not mapped or there is no driver. Needs a current CUDA context (any CUDA
    runtime call, e.g. ``cudaHostRegister``, makes one)."""
    return (_attr("DEVICE_POINTER", host_addr) or None) if host_addr else None


def ipc_export(addr: int) -> Optional[bytes]:
    """IPC blob for the device memory at ``addr`` (see module doc), or None when it is not
    legacy-IPC-capable device memory or the driver refuses."""
    rng = alloc_range(addr)
    if rng is None or not ipc_capable(addr):
        return None
    cu = bindings()
    with _primary_context(addr):
        err, handle = cu.cuIpcGetMemHandle(rng[0])
    if err != _OK:
        return None
    return pack_blob(ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES), addr - rng[0])


def vmm_extents(addr: int, length: int) -> Optional[Tuple[List[Tuple[int, int]], int]]:
    """``([(base, size), ...], granularity)``: the physical allocations (``cuMemCreate``
    extents) mapped over ``[addr, addr + length)``, in address order, and their allocation
    granularity, when every byte of it is CUDA VMM memory whose allocations were made
    exportable as POSIX file descriptors; else None (not VMM memory, a hole, another handle
    type, no driver). Works on any thread (the memory's primary context is made current)."""
    cu = bindings()
    if cu is None or length <= 0 or ipc_capable(addr) is not False:
        return None
    posix_fd = int(cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    out: List[Tuple[int, int]] = []
    gran = 0
    a, end = addr, addr + length
    with _primary_context(addr):
        while a < end:
            err, base, size = cu.cuMemGetAddressRange(a)  # one mapping (not the reservation)
            if err != _OK or not int(base) <= a < int(base) + int(size):
                return None
            err, handle = cu.cuMemRetainAllocationHandle(a)
            if err != _OK:
                return None
            try:
                err, prop = cu.cuMemGetAllocationPropertiesFromHandle(handle)
                if err != _OK or not int(prop.requestedHandleTypes) & posix_fd:
                    return None
                err, g = cu.cuMemGetAllocationGranularity(prop, minimum)
                if err != _OK:
                    return None
            finally:
                cu.cuMemRelease(handle)
            gran = max(gran, int(g))
            out.append((int(base), int(size)))
            a = int(base) + int(size)
    return out, gran


def vmm_export(addr: int) -> int:
    """A new POSIX file descriptor (the caller closes it) of the VMM allocation mapped at
    ``addr`` (``cuMemExportToShareableHandle``). Works on any thread. Raises CudaError."""
    cu = bindings()
    if cu is None:
        raise CudaError("cuMemExportToShareableHandle", CudaError.NO_DRIVER, _why_not)
    posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    with _primary_context(addr):
        handle = check(cu.cuMemRetainAllocationHandle(addr), "cuMemRetainAllocationHandle")
        try:
            fd = check(cu.cuMemExportToShareableHandle(handle, posix_fd, 0), "cuMemExport")
        finally:
            cu.cuMemRelease(handle)
    return int(fd)


@contextlib.contextmanager
def _primary_context(addr: int) -> Iterator[None]:
    """The primary context of ``addr``'s device current on this thread for the block (the
    caller's own afterwards): a thread the runtime never bound (an event loop's) has none,
    and the driver then refuses context-bound calls such as ``cuIpcGetMemHandle``."""
    with device_context(_attr("DEVICE_ORDINAL", addr)):
        yield


@contextlib.contextmanager
def device_context(ordinal: Optional[int]) -> Iterator[None]:
    """Device ``ordinal``'s primary context current on this thread for the block, the
    caller's own (or none) afterwards; a no-op for None or when the driver refuses (the
    call inside then reports its own error). For driver calls on threads the CUDA runtime
    may never have bound (an event loop's): ``cuIpcOpenMemHandle`` there fails with
    CUDA_ERROR_INVALID_CONTEXT otherwise."""
    cu = bindings()
    if ordinal is None or cu is None:
        yield
        return
    err, dev = cu.cuDeviceGet(int(ordinal))
    if err != _OK:
        yield
        return
    err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
    if err != _OK:
        yield
        return
    try:
        (err,) = cu.cuCtxPushCurrent(ctx)
        try:
            yield
        finally:
            if err == _OK:
                cu.cuCtxPopCurrent()
    finally:
        cu.cuDevicePrimaryCtxRelease(dev)


def pack_blob(handle: bytes, offset: int) -> bytes:
    """The handle's 64 raw bytes (NULs included), then ``offset`` as little-endian u64."""
    return bytes(handle) + struct.pack("<Q", offset)


def unpack_blob(blob: bytes) -> Tuple[bytes, int]:
    """``(64 handle bytes, offset)`` of a blob; :class:`InvalidArgument` for a wrong size."""
    if len(blob) != IPC_BLOB_BYTES:
        raise InvalidArgument(f"IPC blob of {len(blob)} bytes, expected {IPC_BLOB_BYTES}")
    return bytes(blob[:IPC_HANDLE_BYTES]), struct.unpack("<Q", bytes(blob[IPC_HANDLE_BYTES:]))[0]


def ipc_open(blob: bytes, device: Optional[int] = None) -> Tuple[int, int]:
    """Map a peer's blob into this process (on device ``device``: its primary context is
    made current for the call, see :func:`device_context`): ``(image of the peer's addr,
    mapped base)``; the base is what :func:`ipc_close` takes. Raises CudaError /
    InvalidArgument."""
    raw, offset = unpack_blob(blob)
    cu = bindings()
    if cu is None:
        raise CudaError("cuIpcOpenMemHandle", CudaError.NO_DRIVER, _why_not)
    handle = cu.CUipcMemHandle()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    with device_context(device):
        res = cu.cuIpcOpenMemHandle(handle, _LAZY_ENABLE_PEER_ACCESS)
    base = int(check(res, "cuIpcOpenMemHandle"))
    return base + offset, base


def ipc_close(base: int, device: Optional[int] = None) -> None:
    """Unmap what :func:`ipc_open` mapped at ``base`` (on ``device``, as there); raises
    CudaError."""
    cu = bindings()
    if cu is not None:
        with device_context(device):
            res = cu.cuIpcCloseMemHandle(base)
        check(res, "cuIpcCloseMemHandle")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cuMemcpyDtoDAsync`` on ``stream`` (a CUstream handle, 0 = legacy default).

    The device lane's hot path (one call per run of a few-run write): one cuda-bindings call,
    no other work; its cost per call: see bench/results/driver-calls-h200.md
    (``bench/gpu/driver_calls.py``)."""
    cu = bindings()
    if cu is None:
        raise CudaError("cuMemcpyDtoDAsync", CudaError.NO_DRIVER, _why_not)
    (err,) = cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream)
    if err != _OK:
        raise CudaError("cuMemcpyDtoDAsync", int(err), error_text(err))


#: CUresult CUDA_ERROR_INVALID_CONTEXT (a context-bound call on a thread with no current
#: context) and CUDA_ERROR_NOT_READY (an event's work still running)
_INVALID_CONTEXT, _NOT_READY = 201, 600


def bind_context(ordinal: int) -> None:
    """Make device ``ordinal``'s primary context current on this thread if none is (what the
    CUDA runtime does on a thread's first call): for driver calls that need one on threads
    the runtime never bound. Raises :class:`CudaError`."""
    cu = driver()
    if int(check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent") or 0):  # a NULL CUcontext is truthy
        return
    dev = check(cu.cuDeviceGet(int(ordinal)), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    try:
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    finally:  # the runtime (torch) holds the primary context for the process's life
        cu.cuDevicePrimaryCtxRelease(dev)


def _bound(call, ordinal: int, *args) -> Any:
    """``call(*args)`` (a cuda-bindings function); once more after :func:`bind_context` when
    this thread had no current context."""
    res = call(*args)
    if res[0] == _INVALID_CONTEXT:
        bind_context(ordinal)
        res = call(*args)
    return res


class Event:
    """A CUDA event through the driver (``CU_EVENT_DISABLE_TIMING``), with the methods of
    ``torch.cuda.Event`` that kvxfer uses — :meth:`record`, :meth:`query`,
    :meth:`synchronize`, :meth:`wait` — at the cost of one driver call each and without
    torch's stream objects (their construction costs tens of µs of host time per call on the
    H200 host: bench/results/offload-host-h200.md).

    Streams are CUstream handles as ints, or objects with a ``cuda_stream`` int (torch
    streams), so ``torch_stream.wait_event(event)`` works. On a thread with no current
    context a call binds device ``ordinal``'s primary context first (:func:`bind_context`).
    :meth:`close` (also at garbage collection) destroys it; a closed event must not be used.
    Raises :class:`CudaError`."""

    def __init__(self, ordinal: int) -> None:
        self.ordinal = int(ordinal)
        cu = driver()
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._ev = check(_bound(cu.cuEventCreate, self.ordinal, flags), "cuEventCreate")
        self._h = int(self._ev)  # the CUevent handle, for the ctypes calls
        self._query = _event_fn("cuEventQuery", ctypes.c_void_p)
        self._record = _event_fn("cuEventRecord", ctypes.c_void_p, ctypes.c_void_p)

    def record(self, stream) -> None:
        """Record on ``stream`` (its work queued so far)."""
        s = getattr(stream, "cuda_stream", stream)
        if self._record is not None:
            err = self._record(self._h, s)
            if err == _INVALID_CONTEXT:
                bind_context(self.ordinal)
                err = self._record(self._h, s)
        else:
            err = int(_bound(bindings().cuEventRecord, self.ordinal, self._ev, s)[0])
        if err:
            raise CudaError("cuEventRecord", int(err), error_text(bindings().CUresult(err)))

    def query(self) -> bool:
        """Whether the recorded work completed (True for an event never recorded)."""
        if self._query is not None:
            err = self._query(self._h)
        else:
            err = int(bindings().cuEventQuery(self._ev)[0])
        if err == 0:
            return True
        if err == _NOT_READY:
            return False
        raise CudaError("cuEventQuery", int(err), error_text(bindings().CUresult(err)))

    def synchronize(self) -> None:
        """Block this thread until the recorded work completed."""
        (err,) = bindings().cuEventSynchronize(self._ev)
        if err != _OK:
            raise CudaError("cuEventSynchronize", int(err), error_text(err))

    def wait(self, stream) -> None:
        """Make ``stream``'s later work wait (device-side) for the recorded work."""
        s = getattr(stream, "cuda_stream", stream)
        (err,) = bindings().cuStreamWaitEvent(s, self._ev, 0)
        if err != _OK:
            raise CudaError("cuStreamWaitEvent", int(err), error_text(err))

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        ev, self._ev = getattr(self, "_ev", None), None
        cu = bindings()
        if ev is not None and cu is not None:
            with device_context(self.ordinal):
                cu.cuEventDestroy(ev)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass


class StreamLink:
    """Orders CUDA streams after one another's queued work with ONE reusable driver event:
    :meth:`order` is ``cuEventRecord`` on the waited stream + ``cuStreamWaitEvent`` on the
    waiter, two driver calls and no torch objects (torch's ``current_stream`` +
    ``wait_stream`` cost tens of µs of host time per call: bench/results/offload-host-h200.md).

    Invariants: a wait captures the event's state when it is queued, so the event is reusable
    right after :meth:`order` returns; not thread-safe (one owner thread, as an offload
    manager); contexts as :class:`Event`. :meth:`close` (also at garbage collection) destroys
    the event."""

    def __init__(self, ordinal: int) -> None:
        self._event = Event(ordinal)

    def order(self, waiter: int, waited: int) -> None:
        """Work queued on ``waiter`` after this call starts after the work queued on
        ``waited`` before it; a no-op for the same stream. Raises :class:`CudaError`."""
        if waiter != waited:
            self._event.record(waited)
            self._event.wait(waiter)

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        self._event.close()


#: ``$KVXFER_NATIVE_GIL``: ``keep`` (default: short native calls keep the GIL) or ``release``
NATIVE_GIL_ENV = "KVXFER_NATIVE_GIL"


def keeps_gil() -> bool:
    """Whether :func:`proc` makes ``keep_gil`` calls that keep the GIL (the module doc)."""
    return os.environ.get(NATIVE_GIL_ENV, "keep").strip().lower() != "release"


def proc(name: str, version: int, *argtypes: Any, keep_gil: bool = False) -> Any:
    """The driver's entry point ``name`` (base name, ABI of CUDA ``version``, e.g. 4000 for
    ``cuLaunchKernel``) as a ctypes function returning the CUresult as an int, or None without
    a driver or when the driver has no such call. One ctypes call costs about a microsecond
    of host time, less than a cuda-bindings call (no argument objects). ``keep_gil``: a call
    that never waits for the device, made without releasing the GIL (unless
    ``$KVXFER_NATIVE_GIL=release``)."""
    cu = bindings()
    if cu is None:
        return None
    res = cu.cuGetProcAddress(name.encode(), int(version), 0)
    pfn = int(res[1]) if res[0] == _OK and res[1] else 0
    proto = ctypes.PYFUNCTYPE if keep_gil and keeps_gil() else ctypes.CFUNCTYPE
    return proto(ctypes.c_int, *argtypes)(pfn) if pfn else None


#: name -> (ctypes function or None) of the event calls :class:`Event` makes (looked up once)
_event_fns: dict = {}


def _event_fn(name: str, *argtypes: Any) -> Any:
    """``cuEventQuery`` / ``cuEventRecord`` through :func:`proc`, keeping the GIL; None when
    the driver does not give them (then :class:`Event` uses cuda-bindings)."""
    if name not in _event_fns:
        _event_fns[name] = proc(name, 2000, *argtypes, keep_gil=True)
    return _event_fns[name]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (cuda.h, CUDA >= 12.8): access order, two ``CUmemLocation``
    hints (type, id), flags."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_type", ctypes.c_int),
        ("src_loc_id", ctypes.c_int),
        ("dst_loc_type", ctypes.c_int),
        ("dst_loc_id", ctypes.c_int),
        ("flags", ctypes.c_uint),
    ]


#: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, CU_MEM_LOCATION_TYPE_DEVICE / _HOST
_ORDER_STREAM, _LOC_DEVICE, _LOC_HOST = 1, 1, 2
_batch: list = []  # [(ctypes function, takes failIdx) or None] once looked up
_attrs: dict = {}  # (src_host, dst_host, device) -> (byref attributes, byref index 0), read-only
_batch_why = ""


def _batch_fn() -> Any:
    """``(ctypes function, has failIdx)`` of ``cuMemcpyBatchAsync`` as the driver exports it
    for the newest ABI it has (CUDA 13: no ``failIdx``; 12.8-12.9: with it), or None."""
    global _batch_why
    if _batch:
        return _batch[0]
    cu = bindings()
    fn = None
    if cu is None:
        _batch_why = _why_not
    else:
        version = int(check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        want = 13000 if version >= 13000 else 12080
        p, z = ctypes.c_void_p, ctypes.c_size_t
        fail = want < 13000
        args = [p, p, p, z, p, p, z] + ([p] if fail else []) + [p]
        call = proc("cuMemcpyBatchAsync", want, *args) if version >= 12080 else None
        if call is None:
            _batch_why = f"the driver (version {version}) has no cuMemcpyBatchAsync"
        else:
            fn = (call, fail)
    _batch.append(fn)
    return fn


def batch_available() -> bool:
    """Whether :func:`memcpy_batch_async` can run here (driver >= 12.8, looked up once)."""
    return _batch_fn() is not None


def memcpy_batch_async(
    dst, src, nbytes, stream: int, device: int = 0, src_host: bool = False, dst_host: bool = False
) -> None:
    """One ``cuMemcpyBatchAsync`` of ``len(dst)`` copies on ``stream`` (a CUstream handle;
    not the legacy default stream): ``dst``, ``src``, ``nbytes`` are uint64 numpy arrays of
    one length (read during the call only), the copies unordered among themselves and
    ordered in the stream as a whole. One attribute set for all: source accessed in stream
    order; location hints device ``device``, or host memory for a side marked ``*_host``
    (pinned memory, by its UVA address). Raises CudaError (code ``NO_DRIVER`` without the
    call) / InvalidArgument."""
    import numpy as np

    arrs = [
        a.view(np.uint64)  # addresses and sizes are >= 0: the same bits, no copy
        if isinstance(a, np.ndarray) and a.dtype == np.int64 and a.flags.c_contiguous
        else np.ascontiguousarray(a, dtype=np.uint64)
        for a in (dst, src, nbytes)
    ]
    n = arrs[0].size
    if arrs[1].size != n or arrs[2].size != n or n == 0:
        raise InvalidArgument(f"memcpy_batch_async: lengths {[a.size for a in arrs]}")
    got = _batch_fn()
    if got is None:
        raise CudaError("cuMemcpyBatchAsync", CudaError.NO_DRIVER, _batch_why)
    fn, fail = got
    key = (bool(src_host), bool(dst_host), int(device))
    attrs = _attrs.get(key)
    if attrs is None:  # (attributes, attribute index 0) built once per kind of copy
        attrs = _attrs[key] = (
            ctypes.byref(
                _MemcpyAttributes(
                    _ORDER_STREAM,
                    _LOC_HOST if src_host else _LOC_DEVICE,
                    0 if src_host else device,
                    _LOC_HOST if dst_host else _LOC_DEVICE,
                    0 if dst_host else device,
                    0,
                )
            ),
            ctypes.byref(ctypes.c_size_t(0)),
        )
    ptrs = [a.ctypes.data for a in arrs]
    if fail:
        failed = ctypes.c_size_t(0)
        err = fn(*ptrs, n, attrs[0], attrs[1], 1, ctypes.byref(failed), stream)
    else:
        err = fn(*ptrs, n, attrs[0], attrs[1], 1, stream)
    if err != 0:
        raise CudaError("cuMemcpyBatchAsync", int(err), error_text(bindings().CUresult(err)))
