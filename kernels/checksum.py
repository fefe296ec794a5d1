"""Per-item checksums over raw byte ranges in ONE launch (the transfer integrity check).

An *item* is what a transfer moves as a unit: a KV page, a state slot, a metadata row. It
spans the same item index in every buffer (*descriptor*) of its group: ``2 * L``
descriptors for per-layer K/V pools, one for a page-major pool. Its checksum is defined on
the *item stream*: the item's bytes of descriptor 0, zero-padded to a multiple of 4 bytes,
then those of descriptor 1, and so on; word ``p`` of the stream is the little-endian
``uint32`` at bytes ``[4p, 4p + 4)``. With all arithmetic modulo ``2**32``::

    key(p)     = p * 0x9E3779B1 + 0x7F4A7C15
    h(p, v)    = fmix(v ^ key(p)),  fmix(x): x *= 0x85EBCA6B; x ^= x >> 13;
                                             x *= 0xC2B2AE35; x ^= x >> 16
    checksum   = sum over p of h(p, word_p)

Why this function: it is memory-bound on a GPU (about ten integer operations per 4-byte
word, no tables, no carries between words), and because each term is a *bijection* of its
word for a fixed position, changing any single word always changes the checksum (no
probabilistic miss), while a word's contribution depends on where it sits: swapped or
shifted tokens, heads, layers (descriptor order) and pages give unrelated checksums (a miss
has probability about ``2**-32`` per item). A plain sum or xor of the words would not see
reordering at all. The sum is associative and commutative, so an item may be cut into
tiles (and its descriptors handled by different backends) whose partial sums simply add.

The kernel reads a *task table*, int64 ``[T, 4] = (address, nbytes, out index, first
word position)``, one row per tile of one (item, descriptor) range
(:func:`item_tasks` builds it), and atomically adds each tile's partial sum into
``out[out index]`` (int32 bit patterns of the uint32 sums); with ``per_task=True`` it
stores task ``i``'s partial sum in ``out[i]`` instead (no atomics, no zeroing: the caller
adds the partials per item on the host, :func:`add_partials`). Addresses are whatever the
kernel can dereference: device pointers (CPU addresses under the Triton interpreter).

Invariants:

* a table launched with ``align=A`` (1, 4 or 16) has every address and size a multiple of
  ``A``; ``A == 1`` reads bytes and assembles the words, so any range works;
* a tile starts at a multiple of 16 bytes inside its range, and its position column is the
  stream position of its first word, so tiling never changes the result;
* ``out`` is zeroed by the caller (unless ``per_task``); ``T == 0`` is a no-op.

:func:`checksum_rows` is the vectorised numpy path used for host memory (and by kvxfer for
host buffers); :func:`checksum_items_reference` is the deliberately plain oracle.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvxfer.kernels import dispatch
from kvxfer.kernels.errors import IndexOutOfRange, InvalidArgument, ShapeMismatch

__all__ = [
    "ALGORITHM",
    "ALIGNMENTS",
    "BLOCK_WORDS",
    "TILE_BYTES",
    "add_partials",
    "checksum_items_reference",
    "task_alignment",
    "checksum_rows",
    "checksum_tasks",
    "item_checksums",
    "item_checksums_host",
    "item_tasks",
    "kernel_runnable",
    "word_offsets",
]

#: name of the function above (peers compare it before they compare checksums)
ALGORITHM = "mix32-sum-v1"
ALIGNMENTS = (1, 4, 16)
#: words one program reads per loop iteration (4 KiB)
BLOCK_WORDS = 1024
NUM_WARPS = 4
#: bytes per task (one program each); a multiple of 16
TILE_BYTES = 64 << 10

_K0, _K1, _M1, _M2 = 0x9E3779B1, 0x7F4A7C15, 0x85EBCA6B, 0xC2B2AE35
_MASK = 0xFFFFFFFF
_HOST_CHUNK_WORDS = 1 << 16  # numpy temporaries of 256 KiB: they stay in cache


@triton.jit
def _mix(v, pos):
    x = v ^ (pos.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _checksum_tasks_kernel(
    tasks, out, ALIGN: tl.constexpr, BLOCK: tl.constexpr, PER_TASK: tl.constexpr
):
    """Program i adds the checksum terms of task i's words into ``out[task[2]]`` (or, with
    ``PER_TASK``, stores their sum in ``out[i]``)."""
    pid = tl.program_id(0).to(tl.int64)
    row = tasks + pid * 4
    addr = tl.load(row)
    nbytes = tl.load(row + 1)
    idx = tl.load(row + 2)
    pos0 = tl.load(row + 3)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.uint32)
    if ALIGN >= 4:
        src = addr.to(tl.pointer_type(tl.uint32))
        nwords = nbytes // 4
        if ALIGN == 16:
            src = tl.multiple_of(src, 16)
            nwords = tl.multiple_of(nwords, 4)
        for i in range(0, tl.cdiv(nwords, BLOCK)):
            w = i * BLOCK + offs
            m = w < nwords
            v = tl.load(src + w, mask=m, other=0)
            acc += tl.where(m, _mix(v, pos0 + w), 0)
    else:
        src = addr.to(tl.pointer_type(tl.uint8))
        nwords = tl.cdiv(nbytes, 4)
        for i in range(0, tl.cdiv(nwords, BLOCK)):
            w = i * BLOCK + offs
            b = w.to(tl.int64) * 4
            v = tl.load(src + b, mask=b < nbytes, other=0).to(tl.uint32)
            v |= tl.load(src + b + 1, mask=b + 1 < nbytes, other=0).to(tl.uint32) << 8
            v |= tl.load(src + b + 2, mask=b + 2 < nbytes, other=0).to(tl.uint32) << 16
            v |= tl.load(src + b + 3, mask=b + 3 < nbytes, other=0).to(tl.uint32) << 24
            acc += tl.where(w < nwords, _mix(v, pos0 + w), 0)
    total = tl.sum(acc, axis=0).to(tl.int32, bitcast=True)
    if PER_TASK:
        tl.store(out + pid, total)
    else:
        tl.atomic_add(out + idx, total)


def kernel_runnable(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tables on ``device`` (CUDA, or the interpreter)."""
    return device.type == "cuda" or dispatch.is_interpreted(_checksum_tasks_kernel)


# ---------------------------------------------------------------------- planning (numpy)
def word_offsets(item_lens: Sequence[int]) -> np.ndarray:
    """Stream position of each descriptor's first word: padded words of those before it."""
    words = -(-np.asarray(item_lens, dtype=np.int64).reshape(-1) // 4)
    return np.concatenate(([0], np.cumsum(words)[:-1])).astype(np.int64)


def item_tasks(
    ptrs: Sequence[int],
    item_lens: Sequence[int],
    pos0: Sequence[int],
    ids,
    tile_bytes: int = TILE_BYTES,
) -> np.ndarray:
    """Task rows ``(address, nbytes, out index, position)`` for items ``ids`` (out index =
    position in ``ids``) of the descriptors ``(ptrs[d], item_lens[d])`` whose first stream
    word is ``pos0[d]``; every range cut into tiles of at most ``tile_bytes``."""
    if int(tile_bytes) != tile_bytes or tile_bytes <= 0 or tile_bytes % 16:
        raise InvalidArgument(f"tile_bytes must be a positive multiple of 16, got {tile_bytes!r}")
    ptrs = np.asarray(ptrs, dtype=np.int64).reshape(-1)
    lens = np.asarray(item_lens, dtype=np.int64).reshape(-1)
    pos0 = np.asarray(pos0, dtype=np.int64).reshape(-1)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if not ptrs.shape == lens.shape == pos0.shape:
        raise ShapeMismatch(f"{ptrs.size} ptrs, {lens.size} item_lens, {pos0.size} positions")
    if lens.size and (lens <= 0).any():
        raise InvalidArgument(f"item_lens must be positive, got {lens.tolist()}")
    if ids.size and (ids < 0).any():
        raise IndexOutOfRange(f"item id {int(ids[ids < 0][0])} is negative")
    if ids.size == 0 or ptrs.size == 0:
        return np.zeros((0, 4), dtype=np.int64)
    tile = int(tile_bytes)
    k = -(-lens // tile)  # tiles per range, per descriptor
    d = np.repeat(np.arange(ptrs.size), k)  # descriptor of each tile slot
    off = (np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)) * tile
    out = np.empty((d.size, ids.size, 4), dtype=np.int64)  # [tile slot, item]: slot-major
    out[:, :, 0] = ptrs[d, None] + ids[None, :] * lens[d, None] + off[:, None]
    out[:, :, 1] = np.minimum(tile, lens[d] - off)[:, None]
    out[:, :, 2] = np.arange(ids.size)[None, :]
    out[:, :, 3] = (pos0[d] + off // 4)[:, None]
    return out.reshape(-1, 4)


def task_alignment(tasks: np.ndarray) -> np.ndarray:
    """The largest of :data:`ALIGNMENTS` that divides each task's address and size."""
    acc = tasks[:, 0] | tasks[:, 1] | 16
    low = acc & -acc
    return np.where(low >= 16, 16, np.where(low >= 4, 4, 1))


def _check_table(tasks: torch.Tensor, out: torch.Tensor) -> None:
    if not isinstance(tasks, torch.Tensor) or not isinstance(out, torch.Tensor):
        raise InvalidArgument("tasks and out must be torch.Tensors")
    if tasks.dtype != torch.int64 or tasks.dim() != 2 or tasks.shape[1] != 4:
        raise ShapeMismatch(f"tasks must be int64 [T, 4], got {tasks.dtype} {tuple(tasks.shape)}")
    if out.dtype != torch.int32 or out.dim() != 1:
        raise ShapeMismatch(f"out must be int32 [N], got {out.dtype} {tuple(out.shape)}")
    if not (tasks.is_contiguous() and out.is_contiguous()):
        raise InvalidArgument("tasks and out must be contiguous")
    if tasks.device != out.device:
        raise InvalidArgument(f"tasks on {tasks.device}, out on {out.device}")


def _check_host_tasks(host_tasks: np.ndarray, align: int, n_out: int, per_task: bool) -> None:
    if align not in ALIGNMENTS:
        raise InvalidArgument(f"align must be one of {ALIGNMENTS}, got {align!r}")
    if not host_tasks.size:
        return
    if (host_tasks[:, 1] < 0).any():
        raise InvalidArgument("task sizes must be >= 0")
    idx = host_tasks[:, 2]
    if per_task:
        if host_tasks.shape[0] > n_out:
            raise ShapeMismatch(f"{host_tasks.shape[0]} tasks, out has {n_out} entries")
    elif (idx < 0).any() or (idx >= n_out).any():
        bad = int(idx[(idx < 0) | (idx >= n_out)][0])
        raise IndexOutOfRange(f"task out index {bad} not in [0, {n_out})")
    if align > 1 and int(np.bitwise_or.reduce(host_tasks[:, :2], axis=None)) & (align - 1):
        bad = int(np.flatnonzero((host_tasks[:, :2] % align).any(axis=1))[0])
        raise InvalidArgument(
            f"task {bad} = {host_tasks[bad].tolist()} is not {align}-byte aligned"
        )


# ---------------------------------------------------------------------- launch
def checksum_tasks(
    tasks: torch.Tensor,
    out: torch.Tensor,
    align: int,
    *,
    host_tasks: np.ndarray | None = None,
    per_task: bool = False,
) -> int:
    """Add every task's checksum terms into ``out`` (int32, zeroed by the caller), on the
    current stream; with ``per_task``, store task ``i``'s partial sum in ``out[i]`` (``out``
    has at least ``T`` entries; the out index column is not read). Returns the number of
    programs launched (``T``).

    ``host_tasks``: the same table as numpy when ``tasks`` lives on a device (checked there,
    so nothing is read back)."""
    _check_table(tasks, out)
    if host_tasks is None:
        if tasks.device.type != "cpu":
            raise InvalidArgument("checksum_tasks on a device table needs host_tasks")
        host_tasks = tasks.numpy()
    if host_tasks.shape != tuple(tasks.shape):
        raise ShapeMismatch(f"host_tasks {host_tasks.shape} != tasks {tuple(tasks.shape)}")
    _check_host_tasks(host_tasks, align, int(out.numel()), per_task)
    t = int(tasks.shape[0])
    if t:
        dispatch.require_runnable(_checksum_tasks_kernel, tasks.device)
        with dispatch.launch_context(tasks.device):
            _checksum_tasks_kernel[(t,)](
                tasks, out, ALIGN=align, BLOCK=BLOCK_WORDS, PER_TASK=per_task, num_warps=NUM_WARPS
            )
    return t


def item_checksums(
    ptrs: Sequence[int],
    item_lens: Sequence[int],
    ids,
    *,
    device: torch.device,
    pos0: Sequence[int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checksums (int32 bit patterns, on ``device``) of items ``ids`` over descriptors whose
    memory the kernel on ``device`` can read: one launch per alignment class (one in the
    common case). ``pos0`` defaults to :func:`word_offsets` of ``item_lens``; ``out``, when
    given, is added to (partial sums of a group split between backends)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    device = torch.device(device)
    if pos0 is None:
        pos0 = word_offsets(item_lens)
    if out is None:
        out = torch.zeros(ids.size, dtype=torch.int32, device=device)
    elif out.numel() != ids.size:
        raise ShapeMismatch(f"out has {out.numel()} entries for {ids.size} items")
    tasks = item_tasks(ptrs, item_lens, pos0, ids)
    if not tasks.shape[0]:
        return out
    al = task_alignment(tasks)
    for a in sorted(set(al.tolist()), reverse=True):
        part = np.ascontiguousarray(tasks[al == a]) if (al != a).any() else tasks
        table = torch.from_numpy(part).to(device)
        checksum_tasks(table, out, int(a), host_tasks=part)
    return out


def add_partials(host_tasks: np.ndarray, partials: np.ndarray, n: int) -> np.ndarray:
    """uint32 ``[n]``: the per-task partial sums of a ``per_task`` launch added per item
    (out index column), modulo ``2**32``."""
    out = np.zeros(n, dtype=np.uint32)
    np.add.at(out, host_tasks[:, 2], np.asarray(partials).view(np.uint32))
    return out


# ---------------------------------------------------------------------- host path (numpy)
@functools.lru_cache(maxsize=256)
def _keys(pos0: int, n: int) -> np.ndarray:
    p = np.arange(pos0, pos0 + n, dtype=np.uint64)
    k = ((p * np.uint64(_K0) + np.uint64(_K1)) & np.uint64(_MASK)).astype(np.uint32)
    k.flags.writeable = False
    return k


def checksum_rows(rows: np.ndarray, pos0: int = 0, ids=None) -> np.ndarray:
    """Checksum terms of each row of ``rows`` (uint8 ``[n, nbytes]``: one range per item,
    first word at stream position ``pos0``), summed per row: uint32 ``[n]`` (or, with
    ``ids``, of the rows ``rows[ids]``). Vectorised and chunked: rows are gathered, padded
    and mixed about 256 KiB at a time, so the temporaries stay in cache."""
    rows = np.asarray(rows)
    if rows.dtype != np.uint8 or rows.ndim != 2:
        raise ShapeMismatch(f"rows must be uint8 [n, nbytes], got {rows.dtype} {rows.shape}")
    ids = np.arange(rows.shape[0]) if ids is None else np.asarray(ids, dtype=np.int64)
    nb = rows.shape[1]
    w = -(-nb // 4)
    key = _keys(int(pos0), w)
    out = np.empty(ids.size, dtype=np.uint32)
    step = max(1, _HOST_CHUNK_WORDS // max(1, w))
    m1, m2 = np.uint32(_M1), np.uint32(_M2)
    for lo in range(0, ids.size, step):
        chunk = rows[ids[lo : lo + step]]
        if nb % 4:
            chunk = np.concatenate(
                (chunk, np.zeros((chunk.shape[0], 4 * w - nb), dtype=np.uint8)), axis=1
            )
        x = chunk.view("<u4")
        x ^= key
        x *= m1
        x ^= x >> np.uint32(13)
        x *= m2
        x ^= x >> np.uint32(16)
        out[lo : lo + step] = x.sum(axis=1, dtype=np.uint32)
    return out


def _host_rows(ptr: int, item_len: int, ids: np.ndarray) -> np.ndarray:
    """The host buffer at ``ptr`` as ``[rows, item_len]`` uint8, up to the last of ``ids``
    (a view: nothing is copied)."""
    span = (int(ids.max()) + 1) * item_len
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(int(ptr)))
    return buf.reshape(-1, item_len)


def item_checksums_host(
    ptrs: Sequence[int], item_lens: Sequence[int], ids, pos0: Sequence[int] | None = None
) -> np.ndarray:
    """Checksums (uint32) of items ``ids`` over descriptors in host memory, read through
    their raw addresses (the caller guarantees the ids are inside every buffer)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if pos0 is None:
        pos0 = word_offsets(item_lens)
    out = np.zeros(ids.size, dtype=np.uint32)
    if ids.size == 0:
        return out
    if (ids < 0).any():
        raise IndexOutOfRange(f"item id {int(ids[ids < 0][0])} is negative")
    for p, n, q in zip(ptrs, item_lens, pos0):
        out += checksum_rows(_host_rows(int(p), int(n), ids), int(q), ids)
    return out


# ---------------------------------------------------------------------- oracle
def checksum_items_reference(views: Sequence[torch.Tensor], ids) -> np.ndarray:
    """The definition, spelled out: for each item, build its stream from ``views[d][id]``
    (one tensor per descriptor, items along dim 0, any dtype) and sum the mixed words with
    Python integers. uint32 ``[len(ids)]``."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    out = np.zeros(len(ids), dtype=np.uint32)
    for j, i in enumerate(ids):
        stream = b"".join(
            (lambda b: b + bytes(-len(b) % 4))(
                v[i].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            )
            for v in views
        )
        words = np.frombuffer(stream, dtype="<u4").astype(np.uint64)
        p = np.arange(words.size, dtype=np.uint64)
        x = words ^ ((p * _K0 + _K1) & _MASK)
        x = (x * _M1) & _MASK
        x ^= x >> 13
        x = (x * _M2) & _MASK
        x ^= x >> 16
        out[j] = int(x.sum()) & _MASK
    return out
