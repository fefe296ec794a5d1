"""The fixed host cost of planning one request's write (issues 15/16), on CPU, no GPU.

Two real engines over UCX loopback in one process (prefill ``A`` -> decode ``B``), groups
as a realistic per-layer pool registers them: ``kv`` (8 descriptors = 4 layers x K/V of
``--pages`` pages, 16-token pages of 4 KV heads x 128 dims bf16: 16 KiB items), ``kvp``
(the same pool under a 2 -> 1 heterogeneous TP: prefill items hold 4 of 8 heads, decode
items all 8, NHD rows), ``state`` (2 descriptors of 64 slots) and ``aux`` (64 rows).
Measured (median of ``--iters`` calls, µs, each call timed on its own):

* ``engine.*``: :meth:`WritePlanner.plan` as ``Peer.write`` calls it (its ``write ->
  planned`` stage), for a 1-page request (ItemWrites of one kv page, one state slot, one
  aux row: the disagg form, numpy ids of the kv/state and lists for aux), a 1000-page
  ItemWrite request (kv contiguous on both sides, + state + aux: 10 PUTs), the same with
  scattered pages, a 1000-page PatternWrite request (2 -> 1 NHD, as the device lane
  takes it: validated, not expanded) and the ItemWrite a 2 -> 1 MLA room's sending replica
  plans for 1000 pages (whole latent pages; group ``mla``);
* ``write.1page.pre_post``: a real ``Peer.write`` of the 1-page request with notify; its
  ``write -> planned`` part as the stage trace computes it (call -> ``t0``);
* ``disagg.*``: prefill's per-chunk work before ``Peer.write`` (``loop -> plan`` and the
  items ``_write`` adds): the page map's whole pages, the ``TpPair.write`` of kv (+ state)
  for a 2 -> 1 NHD room (PatternWrite), for a 2 -> 1 MLA room (whole latent pages from one
  replica: RawWrite) and the equal-TP ItemWrite;
* ``hop.task``: ``loop.create_task`` of a coroutine -> its first line runs (an idle loop):
  the ``plan -> write`` stage's floor.

Run (``--json`` for a machine-readable dump)::

    PYTHONPATH=. python bench/plan_cost.py [--iters 2000] [--pages 1000] [--json]

Before / after on a shared box: run it alternately against both trees (``PYTHONPATH=<tree>``)
and compare medians of the runs (bench/results/plan-cpu.md does).

Results: bench/results/plan-cpu.md."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np

from kvxfer.config import EngineConfig
from kvxfer.disagg import tp_plan
from kvxfer.disagg.page_map import RoomPages
from kvxfer.disagg.tp_rooms import TpPair
from kvxfer.engine import ItemWrite, PatternWrite, TransferEngine
from kvxfer.engine.writeplan import WritePlanner

PAGE = 16
HEADS = 8  # KV heads of the model
HEAD_BYTES = 256  # 128 dims x bf16
DESCS = 8  # 4 layers x K/V
POOL_PAGES = 1200
STATE = (2, 64, 4096)  # descriptors, slots, bytes per slot
AUX = (64, 64)  # rows, bytes per row
MLA_ITEM = PAGE * 576 * 2  # a 16-token page of the MLA latent (576 bf16 per token)


def timed(cases: Dict[str, Callable[[], Any]], iters: int, rounds: int) -> Dict[str, float]:
    """Median µs of ``iters`` calls of each case (after a warm-up of ``iters // 10``), the
    cases interleaved in ``rounds`` rounds (a load spike on a shared box hits them alike)."""
    samples: Dict[str, List[float]] = {k: [] for k in cases}
    pc = time.perf_counter
    for fn in cases.values():
        for _ in range(max(1, iters // 10)):
            fn()
    for _ in range(rounds):
        for name, fn in cases.items():
            out = samples[name]
            for _ in range(max(1, iters // rounds)):
                t0 = pc()
                fn()
                out.append(pc() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in samples.items()}


def _buf(n: int, keep: List[np.ndarray]) -> int:
    b = np.zeros(n, np.uint8)  # calloc: untouched pages are not faulted in
    keep.append(b)
    return b.ctypes.data


def register(e: TransferEngine, kvp_item: int, keep: List[np.ndarray]) -> None:
    item = PAGE * (HEADS // 2) * HEAD_BYTES
    size = POOL_PAGES * item
    e.register("kv", [_buf(size, keep) for _ in range(DESCS)], [size] * DESCS, [item] * DESCS)
    psize = POOL_PAGES * kvp_item
    e.register(
        "kvp",
        [_buf(psize, keep) for _ in range(DESCS)],
        [psize] * DESCS,
        [kvp_item] * DESCS,
        item_lens_may_differ=True,
    )
    n, slots, sb = STATE
    e.register("state", [_buf(slots * sb, keep) for _ in range(n)], [slots * sb] * n, [sb] * n)
    rows, rb = AUX
    e.register("aux", [_buf(rows * rb, keep)], [rows * rb], [rb])
    msize = POOL_PAGES * MLA_ITEM
    e.register(
        "mla",
        [_buf(msize, keep) for _ in range(DESCS)],
        [msize] * DESCS,
        [MLA_ITEM] * DESCS,
        item_lens_may_differ=True,  # as the PD manager registers kv with a TP shape
    )


def nhd_pair() -> TpPair:
    """Prefill rank 0 of TP 2 -> decode rank 0 of TP 1, NHD kv items (the ``kvp`` group)."""
    src = [tp_plan.nhd_item(PAGE, HEAD_BYTES, HEADS, 2)] * DESCS
    dst = [tp_plan.nhd_item(PAGE, HEAD_BYTES, HEADS, 1)] * DESCS
    return TpPair(0, 2, 0, 1, {"kv": src}, {"kv": dst}, PAGE, PAGE)


def mla_pair() -> TpPair:
    """MLA 2 -> 1: the latent page is replicated (whole items from one replica)."""
    geo = [tp_plan.replicated_item(MLA_ITEM)] * DESCS
    return TpPair(0, 2, 0, 1, {"kv": geo}, {"kv": geo}, PAGE, PAGE)


async def run(a: argparse.Namespace) -> Dict[str, float]:
    keep: List[np.ndarray] = []
    cfg = dict(secret=b"plan-cost", warn_slow_lanes=False)
    pre = TransferEngine(EngineConfig(name="prefill", **cfg))  # type: ignore[arg-type]
    dec = TransferEngine(EngineConfig(name="decode", **cfg))  # type: ignore[arg-type]
    register(pre, PAGE * (HEADS // 2) * HEAD_BYTES, keep)
    register(dec, PAGE * HEADS * HEAD_BYTES, keep)
    await pre.start()
    await dec.start()
    got: asyncio.Queue = asyncio.Queue()
    dec.on_message(lambda p, payload: got.put_nowait(payload))
    peer = await pre.connect(*dec.address)
    res: Dict[str, float] = {}
    print(f"(lanes {','.join(peer.lanes)}; device lane: {peer.device_lane})")
    try:
        res.update(engine_cases(a, peer, pre.config.stage_min_ops))
        res.update(await write_cases(a, peer, got))
        res.update(disagg_cases(a))
        res.update(await hop_cases(a))
    finally:
        await peer.close()
        await pre.close()
        await dec.close()
    return res


def engine_cases(a: argparse.Namespace, peer: Any, stage_min_ops: int) -> Dict[str, float]:
    n, it = a.pages, a.iters
    planner = peer._planner
    patterned = WritePlanner(  # as Peer builds it when the device lane covers the group
        peer._groups, peer._remote, "decode", lambda g: False, lambda g: True
    )
    rng = np.random.default_rng(0)
    one = np.array([7], np.int64)

    def one_page():
        return [
            ItemWrite("kv", one, one + 3),
            ItemWrite("state", one[:1] % 64, one[:1] % 64),
            ItemWrite("aux", [5], [9]),
        ]

    src = np.arange(100, 100 + n, dtype=np.int64)
    dst = np.arange(50, 50 + n, dtype=np.int64)
    sc_src = rng.permutation(POOL_PAGES)[:n].astype(np.int64)
    sc_dst = rng.permutation(POOL_PAGES)[:n].astype(np.int64)
    tail = [ItemWrite("state", np.array([3]), np.array([4])), ItemWrite("aux", [5], [9])]
    contig = [ItemWrite("kv", src, dst)] + tail
    scattered = [ItemWrite("kv", sc_src, sc_dst)] + tail
    runs = nhd_pair().pattern_runs("kv", 0)
    pattern = [PatternWrite("kvp", src, dst, runs)] + tail
    mla, salt = mla_pair(), 0
    while mla.write("kv", src, dst, salt) is None:  # the salt whose replica is rank 0
        salt += 1
    kv = mla.write("kv", src, dst, salt)
    mla_item = [ItemWrite("mla", kv.src_items, kv.dst_items)] + tail
    out = timed(
        {
            "engine.1page": lambda: planner.plan(one_page(), stage_min_ops),
            f"engine.item{n}.contig": lambda: planner.plan(contig, stage_min_ops),
            f"engine.item{n}.scattered": lambda: planner.plan(scattered, stage_min_ops),
            f"engine.pattern{n}.device": lambda: patterned.plan(pattern, stage_min_ops),
            f"engine.mla{n}.item": lambda: planner.plan(mla_item, stage_min_ops),
        },
        it,
        a.rounds,
    )
    ops = len(planner.plan(contig, stage_min_ops)[0])
    print(f"(item{n}.contig: {ops} PUTs; pattern: {runs.runs_per_item} runs per item)")
    return out


async def write_cases(a: argparse.Namespace, peer: Any, got: asyncio.Queue) -> Dict[str, float]:
    """A real 1-page ``Peer.write`` + notify; the part before posting as the trace gets it."""
    one = np.array([7], np.int64)
    ws = [
        ItemWrite("kv", one, one + 3),
        ItemWrite("state", np.array([1]), np.array([2])),
        ItemWrite("aux", [5], [9]),
    ]
    pre, total = [], []
    for i in range(a.iters // 2 + 50):
        t_call = time.monotonic_ns()
        st = await peer.write(ws, notify=b"n")
        t_ret = time.monotonic_ns()
        await got.get()
        if i >= 50:
            pre.append((t_ret - t_call) / 1e3 - (st.post_s + st.complete_s) * 1e6)
            total.append((t_ret - t_call) / 1e3)
    return {
        "write.1page.pre_post": statistics.median(pre),
        "write.1page.total": statistics.median(total),
    }


def disagg_cases(a: argparse.Namespace) -> Dict[str, float]:
    n, it = a.pages, a.iters
    src = np.arange(100, 100 + n, dtype=np.int64)
    dst = np.arange(50, 50 + n, dtype=np.int64)
    st_s, st_d = np.array([3], np.int64), np.array([4], np.int64)
    pm = RoomPages.make(
        num_src=n,
        num_dst=n,
        src_page_size=PAGE,
        dst_page_size=PAGE,
        prefix=0,
        tokens=None,
        geom=None,
        exact=False,
        who="room 1",
    )
    nhd, mla = nhd_pair(), mla_pair()
    room = [0]

    def equal():
        s, d = pm.whole_pages(src, 0, dst)
        return [ItemWrite("kv", s, d), ItemWrite("state", st_s, st_d)]

    def tp(pair: TpPair, pattern: bool) -> Callable[[], Any]:
        def f():
            room[0] += 1
            s, d = pm.whole_pages(src, 0, dst)
            return pair.write("kv", s, d, room[0], pattern=pattern)

        return f

    def room_pages():
        return RoomPages.make(
            num_src=n,
            num_dst=n,
            src_page_size=PAGE,
            dst_page_size=PAGE,
            prefix=0,
            tokens=None,
            geom=None,
            exact=False,
            who="room 1",
            tp=nhd,
            salt=1,
        )

    return timed(
        {
            f"disagg.page_map{n}": room_pages,
            f"disagg.equal{n}": equal,
            f"disagg.tp2to1.nhd{n}.pattern": tp(nhd, True),
            f"disagg.tp2to1.mla{n}": tp(mla, False),
        },
        it,
        a.rounds,
    )


async def hop_cases(a: argparse.Namespace) -> Dict[str, float]:
    loop = asyncio.get_running_loop()
    hops = []

    async def body(t0: float) -> None:
        hops.append(time.perf_counter() - t0)

    for _ in range(a.iters):
        t = loop.create_task(body(time.perf_counter()))
        await t
    return {"hop.task": statistics.median(hops) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--pages", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds of the cases")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    res = asyncio.run(run(a))
    if a.json:
        print(json.dumps(res))
        return
    width = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k:<{width}}  {v:9.1f} µs")


if __name__ == "__main__":
    main()
