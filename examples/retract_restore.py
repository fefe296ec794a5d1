"""A decode worker under KV memory pressure retracts requests to host memory, restores them
later into different pages (and Mamba slots), and verifies every byte at the end.

Each request has a prompt and a target length; every token's K/V for every layer is a
deterministic random tensor written through the pool's real store path (Triton kernels on
CUDA, their torch reference on CPU). When a decode step needs a page and none is free, the
scheduler retracts the running request holding the most pages: ``OffloadManager.offload``
copies its pages (and Mamba slot) to the bounded host pool and the pages go back to the
allocator. Retracted requests come back first whenever their pages fit again; some are
aborted while retracted (``discard``: host memory back at once). A never-retracted shadow
pool receives the same writes; a finished request's tokens must read back from the worker's
pool byte for byte like the shadow's (the pool's own token-level ``get_cpu_copy`` is the
oracle), and so must its Mamba state. At the end the host pool must be empty.

    python examples/retract_restore.py [--kind mha|mha_hnd|page_major|mla|hybrid] [--device cuda]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from kvxfer.pools.mamba_alloc import MambaSlotAllocator  # noqa: E402
from kvxfer.pools.offload import OffloadManager  # noqa: E402

PS = 4  # tokens per page


def make_kv_pool(kind: str, num_pages: int, device: str):
    size = (num_pages - 1) * PS
    if kind in ("mha", "mha_hnd", "hybrid"):
        from kvxfer.pools.mha import MHATokenToKVPool

        return MHATokenToKVPool(
            size,
            PS,
            torch.bfloat16,
            2,
            16,
            1 if kind == "hybrid" else 3,
            device,
            layout="hnd" if kind == "mha_hnd" else "nhd",
        )
    if kind == "page_major":
        from kvxfer.pools.page_major import PageMajorMHATokenToKVPool

        return PageMajorMHATokenToKVPool(size, PS, torch.bfloat16, 2, 16, 3, device)
    if kind == "mla":
        from kvxfer.pools.mla import MLATokenToKVPool

        return MLATokenToKVPool(size, PS, torch.bfloat16, 32, 16, 3, device)
    raise SystemExit(f"unknown kind {kind!r}")


def make_worker_pool(kind: str, num_pages: int, device: str, mamba_slots: int):
    """(pool handed to the offload manager, its KV pool, its Mamba pool or None)."""
    kv = make_kv_pool(kind, num_pages, device)
    if kind != "hybrid":
        return kv, kv, None
    from kvxfer.pools.hybrid import HybridLinearKVPool
    from kvxfer.pools.mamba import MambaPool
    from kvxfer.pools.mamba_spec import MambaStateSpec

    spec = MambaStateSpec(
        conv_shapes=((32, 3),),
        temporal_shape=(2, 16, 8),
        conv_dtype=torch.bfloat16,
        temporal_dtype=torch.float32,
        layer_ids=(0, 2),
    )
    mamba = MambaPool(mamba_slots, spec, device, layout="envelope")
    return HybridLinearKVPool(kv, mamba, [1]), kv, mamba


class Request:
    def __init__(self, rid: int, prompt: int, target: int):
        self.rid, self.prompt, self.target = rid, prompt, target
        self.n = 0  # tokens in the KV cache
        self.pages: list[int] = []
        self.slot: list[int] = []
        self.handle = None
        self.shadow_base = 0  # token offset of this request in the shadow pool

    def token_ids(self, n: int) -> torch.Tensor:
        t = torch.tensor(self.pages, dtype=torch.int64)[:, None] * PS + torch.arange(PS)
        return t.reshape(-1)[:n]


def token_kv(kv_pool, rid: int, layer: int, pos: torch.Tensor, kind: str):
    """Deterministic K/V of (request, layer, positions) -- same bytes whenever regenerated."""
    g = torch.Generator().manual_seed(rid * 1000 + layer)
    if kind == "mla":
        full = torch.randn((64, 1, 48), generator=g).to(torch.bfloat16)
        return full[pos], None
    H, D = kv_pool.head_num, kv_pool.head_dim
    k = torch.randn((64, H, D), generator=g).to(torch.bfloat16)
    v = torch.randn((64, H, kv_pool.v_head_dim), generator=g).to(torch.bfloat16)
    return k[pos], v[pos]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--kind", default="hybrid", choices=["mha", "mha_hnd", "page_major", "mla", "hybrid"]
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument(
        "--device-pages", type=int, default=24, help="KV pages on the device (page 0 included)"
    )
    p.add_argument("--host-pages", type=int, default=40)
    p.add_argument(
        "--abort-every", type=int, default=3, help="abort every k-th retraction (0: never)"
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    dev = a.device
    rng = torch.Generator().manual_seed(a.seed)
    t_start = time.perf_counter()

    slots_n = 6
    pool, kv, mamba = make_worker_pool(a.kind, a.device_pages, dev, slots_n)
    shadow_pages = a.requests * (64 // PS) + 1
    _, shadow_kv, shadow_mamba = make_worker_pool(a.kind, shadow_pages, dev, a.requests + 1)
    pages = PagedTokenToKVPoolAllocator((a.device_pages - 1) * PS, PS, device="cpu")
    slots = MambaSlotAllocator(slots_n) if mamba is not None else None
    mgr = OffloadManager(
        pool, num_host_pages=a.host_pages, num_host_slots=slots_n if mamba is not None else 0
    )
    max_tokens = (a.device_pages - 2) * PS
    reqs = []
    for rid in range(a.requests):
        target = int(torch.randint(8, min(60, max_tokens) + 1, (1,), generator=rng))
        prompt = int(torch.randint(1, target, (1,), generator=rng))
        r = Request(rid, prompt, target)
        r.shadow_base = rid * 64 + PS  # the shadow pool never evicts
        reqs.append(r)
    layers = range(kv.start_layer, kv.start_layer + kv.layer_num)

    def write(r: Request, start: int, stop: int) -> None:
        pos = torch.arange(start, stop)
        for lay in layers:
            k, v = token_kv(kv, r.rid, lay, pos, a.kind)
            kv.set_kv_buffer(
                lay, r.token_ids(stop)[start:].to(dev), k.to(dev), None if v is None else v.to(dev)
            )
            shadow_kv.set_kv_buffer(
                lay, (r.shadow_base + pos).to(dev), k.to(dev), None if v is None else v.to(dev)
            )
        if mamba is not None:  # a recurrent state update per step: new = old / 2 + x
            g = torch.Generator().manual_seed(r.rid * 7919 + stop)
            for t, s in zip(
                mamba.conv + [mamba.temporal], shadow_mamba.conv + [shadow_mamba.temporal]
            ):
                x = torch.randn(t[:, 0].shape, generator=g).to(t.dtype).to(dev)
                t[:, r.slot[0]] = t[:, r.slot[0]] / 2 + x
                s[:, r.rid + 1] = s[:, r.rid + 1] / 2 + x

    def grow(r: Request, new_n: int) -> bool:
        need = -(-new_n // PS) - len(r.pages)
        if need > 0:
            got = pages.alloc_pages(need)
            if got is None:
                return False
            r.pages += got.tolist()
        return True

    stats = collections.Counter()
    waiting = collections.deque(reqs)
    running: list[Request] = []
    retracted: collections.deque[Request] = collections.deque()

    def retract(victim: Request) -> None:
        victim.handle = mgr.offload(victim.pages, victim.slot)
        victim.handle.order_before()  # later writes into those pages wait for the copy
        stats["retracted"] += 1
        stats["offloaded_bytes"] += victim.handle.nbytes
        stats["max_host_bytes"] = max(stats["max_host_bytes"], mgr.host.used_bytes)
        pages.free_pages(torch.tensor(victim.pages))
        if victim.slot:
            slots.free(victim.slot)
        victim.pages, victim.slot = [], []
        running.remove(victim)
        if a.abort_every and stats["retracted"] % a.abort_every == 0:
            mgr.abort(victim.handle)  # the client went away: host memory back at once
            stats["aborted"] += 1
        else:
            retracted.append(victim)

    def finish(r: Request) -> None:
        got = kv.get_cpu_copy(r.token_ids(r.n))
        want = shadow_kv.get_cpu_copy(torch.arange(r.n) + r.shadow_base)
        for x, y in zip(got.tensors, want.tensors):
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                raise SystemExit(f"request {r.rid}: KV bytes differ after retract/restore")
            stats["verified_bytes"] += x.numel() * x.element_size()
        if mamba is not None:
            for t, s in zip(
                mamba.conv + [mamba.temporal], shadow_mamba.conv + [shadow_mamba.temporal]
            ):
                if not torch.equal(
                    t[:, r.slot[0]].cpu().view(torch.uint8), s[:, r.rid + 1].cpu().view(torch.uint8)
                ):
                    raise SystemExit(f"request {r.rid}: Mamba state differs after restore")
                stats["verified_bytes"] += t[:, 0].numel() * t.element_size()
            slots.free(r.slot)
        pages.free_pages(torch.tensor(r.pages))
        running.remove(r)
        stats["finished"] += 1

    steps = 0
    while waiting or running or retracted:
        steps += 1
        if steps > 10_000:
            raise SystemExit("scheduler made no progress")
        # 1. bring retracted requests back first, into whatever pages are free now
        while retracted:
            r = retracted[0]
            if pages.available_pages() < r.handle.num_pages + 1 or (
                slots is not None and slots.available_size() < 1
            ):
                break
            r.pages = pages.alloc_pages(r.handle.num_pages).tolist()
            r.slot = slots.alloc(1) if slots is not None else []
            mgr.restore(r.handle, r.pages, r.slot).order_before()
            stats["restored"] += 1
            retracted.popleft()
            running.append(r)
        # 2. admit new requests (prefill the prompt)
        while waiting and not retracted:
            r = waiting[0]
            if pages.available_pages() < -(-r.prompt // PS) + 1 or (
                slots is not None and slots.available_size() < 1
            ):
                break
            waiting.popleft()
            r.slot = slots.alloc(1) if slots is not None else []
            if mamba is not None:  # a fresh request starts from zero state
                for t in mamba.conv + [mamba.temporal]:
                    t[:, r.slot[0]] = 0
            assert grow(r, r.prompt)
            write(r, 0, r.prompt)
            r.n = r.prompt
            running.append(r)
        # 3. one decode step for every running request; retract under memory pressure
        for r in list(running):
            if r not in running:
                continue
            while not grow(r, r.n + 1):
                retract(max(running, key=lambda x: (len(x.pages), x.rid)))
                if r not in running:
                    break
            if r not in running:
                continue
            write(r, r.n, r.n + 1)
            r.n += 1
            if r.n == r.target:
                finish(r)
    mgr.close()
    if not mgr.host.is_empty:
        raise SystemExit(f"host pool not empty at the end: {mgr.host!r}")
    wall = time.perf_counter() - t_start
    print(
        f"retract_restore [{a.kind} on {dev}]: {a.requests} requests, {steps} steps, "
        f"{stats['retracted']} retractions ({stats['offloaded_bytes'] / 1024:.0f} KiB offloaded, "
        f"peak host {stats['max_host_bytes'] / 1024:.0f} KiB), {stats['restored']} restores, "
        f"{stats['aborted']} aborted while retracted, {stats['finished']} finished with "
        f"{stats['verified_bytes'] / 1024:.0f} KiB verified byte for byte; host pool empty; "
        f"{wall:.1f} s"
    )
    if stats["finished"] + stats["aborted"] != a.requests or not stats["restored"]:
        raise SystemExit("expected every request to finish or be aborted, and some restores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
