"""Cross-process writes into a VMM-backed (post-capture) pool (issue 4), CUDA only.

The parent owns post-capture pools (POSIX-FD handles forced); a spawned child imports their
extents over a Unix socket (SCM_RIGHTS) and writes into them with plain device copies. The
parent checks every byte, and the child measures the copy rate into the imported pool against
a same-process copy between ordinary ``cudaMalloc`` tensors (UCX PUT into VMM memory falls back
to ~0.7 GB/s emulation; the target is >= 0.8x the cuda_ipc rate of ordinary memory).

Run on the GPU machine:
``KVXFER_TEST_DEVICE=cuda python -m pytest -q -s tests/gpu/test_vmm_share.py``
(``bench/gpu/backing.sh`` does it and keeps the ``vmm-share`` lines).
"""

import socket

import pytest
import torch

from kvxfer.kernels.errors import BackingError
from kvxfer.pools.mha import MHATokenToKVPool
from kvxfer.pools.page_major import PageMajorMHATokenToKVPool
from kvxfer.procs import Worker, post

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(300),
]

DEV = "cuda:0"
PS = 16
MiB = 1 << 20
POSIX_FD = {"handle_types": ("posix_fd",)}


def _pattern(n: int, seed: int, device) -> torch.Tensor:
    """Deterministic bytes, identical in every process on the same GPU model."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def _rate(fn, nbytes: int, iters: int) -> float:
    """GB/s (1e9 bytes/s, bytes counted once) of ``fn`` timed with CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return nbytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


# -- the child: imports shares and writes into them ---------------------------------------------
class VmmWriter:
    """Hosted in the child: imports shares and writes into them."""

    def __init__(self) -> None:
        self.imports: list = []
        torch.zeros(1, device=DEV)  # CUDA context before the parent counts

    def import_share(self, path) -> dict:
        from kvxfer.pools.backing.share import recv_share

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(60)
            s.connect(path)
            imp = recv_share(s, timeout=60)
        self.imports.append(imp)
        return {
            "spans": imp.span_bytes,
            "device": str(imp.device),
            "generation": imp.generation,
            "info": imp.info(),
        }

    def fill(self, k, seed) -> None:
        imp = self.imports[k]
        for i, t in enumerate(imp.tensors):
            t.copy_(_pattern(t.numel(), seed + i, imp.device))
        torch.cuda.synchronize(imp.device)

    def bench(self, k, seed, iters) -> dict:
        imp = self.imports[k]
        dst = imp.tensors[0]
        n = dst.numel()
        src = _pattern(n, seed, imp.device)
        plain = torch.empty_like(src)
        vmm = _rate(lambda: dst.copy_(src), n, iters)
        d2d = _rate(lambda: plain.copy_(src), n, iters)
        # page-granular scatter (one index_copy_ launch) of half the pages, reversed
        items = imp.item_views()[0]
        pages = torch.arange(items.shape[0] - 1, 0, -2, device=imp.device)
        rows = src[: pages.numel() * items.shape[1]].view(-1, items.shape[1])
        moved = rows.numel()
        scatter = _rate(lambda: items.index_copy_(0, pages, rows), moved, iters)
        items.index_copy_(0, pages, rows)  # the bytes the parent checks
        torch.cuda.synchronize(imp.device)
        return {
            "bytes": n,
            "vmm_gbps": vmm,
            "d2d_gbps": d2d,
            "scatter_gbps": scatter,
            "page_bytes": items.shape[1],
            "pages": pages.tolist(),
        }

    def trim(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the parent counts device memory

    def close(self) -> list:
        for imp in self.imports:
            imp.close()
            imp.close()  # idempotent
        self.trim()
        return [imp.closed for imp in self.imports]


# -- the parent ----------------------------------------------------------------------------------
def _pool(cls, size, extent_mib, **kw):
    opts = {**POSIX_FD, "max_extent_bytes": extent_mib * MiB}
    try:
        return cls(
            size,
            PS,
            torch.bfloat16,
            layer_num=kw.pop("layers"),
            device=DEV,
            post_capture_active=True,
            backing_options=opts,
            **kw,
        )
    except BackingError as exc:  # no cuda-bindings, no VMM, no POSIX-FD handles
        pytest.skip(f"no POSIX-FD VMM backing here: {exc}")


def _share(writer, srv, pool, generation):
    from kvxfer.pools.backing.share import send_share

    pending = post(writer.import_share, srv.getsockname())
    conn, _ = srv.accept()
    with conn:
        send_share(conn, pool.backing, generation=generation, timeout=60)
    return pending.result(90)


def _free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(0)[0]


def _check_filled(pool, seed):
    for i, v in enumerate(pool.backing.byte_views()):
        assert torch.equal(v, _pattern(v.numel(), seed + i, v.device)), f"buffer {i}"


def _check_benched(pool, r, seed):
    """The bytes the child's bench left: the whole pattern, then half the pages rewritten."""
    raw = pool.backing.byte_views()[0]
    pb = r["page_bytes"]
    expect = _pattern(raw.numel(), seed, raw.device)
    items = expect.view(-1, pb).clone()
    pages = torch.tensor(r["pages"], device=raw.device)
    items[pages] = expect[: pages.numel() * pb].view(-1, pb)
    assert torch.equal(raw, items.view(-1))


def test_child_writes_into_vmm_pool_at_device_copy_rate(tmp_path):
    w = Worker(VmmWriter, name="vmm-share-writer")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    nhd = pm = None
    try:
        writer = w.start(timeout=120).proxy(VmmWriter)
        # per-layer NHD pool: 4 buffers, several extents each (small max_extent_bytes)
        nhd = _pool(MHATokenToKVPool, 64 * 1024, 4, layers=2, head_num=4, head_dim=64)
        # page-major pool for the rate: pages of 4 layers x 16 tokens x 8 heads x 128 x bf16 x K/V
        pm = _pool(PageMajorMHATokenToKVPool, 4096 * PS, 256, layers=4, head_num=8, head_dim=128)
        srv.bind(str(tmp_path / "share.sock"))
        srv.listen(1)
        srv.settimeout(60)
        nhd.finalize_backing(40_000)
        pm.finalize_backing(2048 * PS)  # 512 MiB of 1 GiB reserved
        ptrs = [nhd.get_contiguous_buf_infos()[0], pm.get_contiguous_buf_infos()[0]]

        got = _share(writer, srv, nhd, generation=1)
        assert got["spans"] == nhd.get_contiguous_buf_infos()[1] and got["generation"] == 1
        got_pm = _share(writer, srv, pm, generation=7)
        assert got_pm["spans"] == pm.get_contiguous_buf_infos()[1]
        print(f"vmm-share import: {got['info']} / {got_pm['info']}")

        writer.fill(0, 100, timeout=60)
        _check_filled(nhd, 100)

        r = writer.bench(1, 5, 20, timeout=120)
        _check_benched(pm, r, 5)
        ratio = r["vmm_gbps"] / r["d2d_gbps"]
        print(
            f"vmm-share: {r['bytes'] / MiB:.0f} MiB copy into the peer's VMM pool "
            f"{r['vmm_gbps']:.1f} GB/s; same-process ordinary D2D {r['d2d_gbps']:.1f} GB/s "
            f"(ratio {ratio:.2f}); page scatter ({r['page_bytes'] // 1024} KiB pages, "
            f"index_copy_) {r['scatter_gbps']:.1f} GB/s; issue target 0.8 x 1100 GB/s "
            f"cuda_ipc = 880 GB/s: {'met' if r['vmm_gbps'] >= 880 else 'NOT met'}"
        )
        # the emulated UCX lane is ~0.7 GB/s: anything near device-copy speed proves the path
        assert ratio >= 0.3, r

        assert [nhd.get_contiguous_buf_infos()[0], pm.get_contiguous_buf_infos()[0]] == ptrs

        # lifetimes: the physical memory lives until both sides released it. Deltas of the
        # device's free memory around the teardown only (everything lazily initialised --
        # kernel modules, providers -- is loaded by now in both processes)
        shared = nhd.post_capture_backed_bytes + pm.post_capture_backed_bytes
        writer.trim(timeout=60)
        free0 = _free()
        nhd.close()
        pm.close()
        free1 = _free()
        assert writer.close(timeout=60) == [True, True]
        free2 = _free()
        print(
            f"vmm-share teardown: {shared / MiB:.0f} MiB exported; owner closed -> "
            f"{(free1 - free0) / MiB:.0f} MiB returned; importer closed too -> "
            f"{(free2 - free0) / MiB:.0f} MiB returned"
        )
        assert free1 - free0 <= 64 * MiB  # the importer still holds it all
        assert abs(free2 - free0 - shared) <= 64 * MiB  # both released: every byte back
    finally:
        w.close()
        srv.close()
        for p in (nhd, pm):
            if p is not None:
                p.close()


def test_export_refuses_unshareable_backing():
    from kvxfer.kernels.errors import UnsupportedOperation
    from kvxfer.pools.backing.share import export_buffers

    pool = None
    try:
        pool = MHATokenToKVPool(
            1024,
            PS,
            torch.bfloat16,
            2,
            64,
            1,
            DEV,
            post_capture_active=True,
            backing_options={"handle_types": ("none",)},
        )
    except BackingError as exc:
        pytest.skip(f"no VMM backing here: {exc}")
    try:
        with pytest.raises(UnsupportedOperation, match="POSIX-FD"):
            export_buffers(pool.backing)
    finally:
        pool.close()
