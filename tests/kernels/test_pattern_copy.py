"""The pattern copy kernel (one per-item run pattern x many item pairs, one launch) against
its torch oracle: NHD head rows, HND head blocks, page-major rows, long runs cut into tiles,
several descriptors with different item sizes, unaligned runs; bad tables rejected."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kernels_testlib import DEVICE, gen

from kvxfer.kernels import pattern_copy
from kvxfer.kernels.errors import InvalidArgument, ShapeMismatch
from kvxfer.kernels.pattern_copy import (
    class_items,
    copy_pattern,
    copy_pattern_reference,
    pattern_rows,
    row_alignment,
)


def _case(runs, src_item, dst_item, n_src, n_dst, pairs, tile=1 << 16, seed=0):
    """Descriptors laid end to end in one flat buffer per side; returns (kernel, oracle)."""
    g = gen(seed)
    nd = len(runs)
    s_off = np.cumsum([0] + [src_item[d] * n_src for d in range(nd)])[:-1]
    d_off = np.cumsum([0] + [dst_item[d] * n_dst for d in range(nd)])[:-1]
    src = torch.randint(0, 256, (int(s_off[-1] + src_item[-1] * n_src),), generator=g)
    src = src.to(torch.uint8).to(DEVICE)
    dst = torch.randint(0, 256, (int(d_off[-1] + dst_item[-1] * n_dst),), generator=g)
    dst = dst.to(torch.uint8).to(DEVICE)
    want = dst.clone()
    rel = pattern_rows(s_off, d_off, np.array(src_item), np.array(dst_item), runs, tile)
    items = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    copy_pattern_reference(src.cpu(), want_cpu := want.cpu(), rel, items)
    rows = pattern_rows(
        s_off + src.data_ptr(),
        d_off + dst.data_ptr(),
        np.array(src_item),
        np.array(dst_item),
        runs,
        tile,
    )
    align = row_alignment(rows)
    copy_pattern(
        torch.from_numpy(rows).to(DEVICE),
        torch.from_numpy(items).to(DEVICE),
        align,
        host_rows=rows,
    )
    return dst.cpu(), want_cpu


def _heads_in_rows(page, heads, head_b, lo, hi):
    """NHD: heads [lo, hi) of every token row of one page, into a full-width row."""
    i = np.arange(page, dtype=np.int64)
    row = heads * head_b
    return i * row + lo * head_b, i * row + lo * head_b, np.full(page, (hi - lo) * head_b)


@pytest.mark.parametrize("page,heads,head_b", [(16, 8, 256), (4, 4, 6), (3, 2, 16)])
def test_nhd_half_heads(page, heads, head_b):
    so, do, n = _heads_in_rows(page, heads, head_b, 0, heads // 2)
    # prefill item holds only its half of the heads: its rows are half as wide
    so = np.arange(page, dtype=np.int64) * (heads // 2) * head_b
    item_s, item_d = page * heads // 2 * head_b, page * heads * head_b
    runs = [(so, do, n), (so, do + n, n)]  # desc 1: the other half's position
    pairs = [(0, 5), (3, 1), (1, 0), (7, 7)]
    got, want = _case(runs, [item_s, item_s], [item_d, item_d], 8, 9, pairs)
    assert torch.equal(got, want)


def test_hnd_blocks_and_long_runs_cut():
    page, head_b = 64, 256
    block = page * head_b  # 16 KiB per head, cut into 4 KiB tiles
    runs = [(np.array([0]), np.array([2 * block]), np.array([2 * block]))]
    pairs = [(k, 9 - k) for k in range(10)]
    got, want = _case(runs, [2 * block], [4 * block], 10, 10, pairs, tile=4096)
    assert torch.equal(got, want)


def test_many_rows_per_program_and_uneven_lengths():
    rng = np.random.default_rng(3)
    runs = []
    for _d in range(3):
        starts = np.sort(rng.choice(np.arange(0, 4000, 40), 30, replace=False))
        n = rng.integers(1, 40, starts.size)
        runs.append((starts, starts[::-1].copy(), n))
    pairs = [(i, (i * 7) % 11) for i in range(11)]
    got, want = _case(runs, [4096] * 3, [4096] * 3, 11, 11, pairs)
    assert torch.equal(got, want)


def test_empty_descriptor_and_no_items():
    runs = [
        (np.zeros(0), np.zeros(0), np.zeros(0)),
        (np.array([16]), np.array([0]), np.array([32])),
    ]
    got, want = _case(runs, [64, 64], [64, 64], 2, 2, [(1, 0)])
    assert torch.equal(got, want)
    rows = pattern_rows(np.zeros(2), np.zeros(2), np.full(2, 64), np.full(2, 64), runs)
    none = torch.zeros((0, 2), dtype=torch.int64, device=DEVICE)
    assert copy_pattern(torch.from_numpy(rows).to(DEVICE), none, 16, host_rows=rows) == 0


def test_bad_tables_are_refused():
    rows = np.array([[16, 32, 48, 64, 64]], dtype=np.int64)
    items = torch.zeros((1, 2), dtype=torch.int64, device=DEVICE)
    t = torch.from_numpy(rows).to(DEVICE)
    with pytest.raises(InvalidArgument):
        copy_pattern(t, items, 32, host_rows=rows)  # 32 is not a valid alignment
    skew = rows + np.array([[1, 0, 0, 0, 0]])
    with pytest.raises(InvalidArgument):
        copy_pattern(torch.from_numpy(skew).to(DEVICE), items, 16, host_rows=skew)
    with pytest.raises(ShapeMismatch):
        copy_pattern(t[:, :4].contiguous(), items, 16, host_rows=rows[:, :4])
    with pytest.raises(ShapeMismatch):
        copy_pattern(t, items.to(torch.int32), 16, host_rows=rows)
    zero = rows * np.array([[1, 1, 0, 1, 1]])
    with pytest.raises(InvalidArgument):
        copy_pattern(torch.from_numpy(zero).to(DEVICE), items, 16, host_rows=zero)
    assert row_alignment(rows) == 16 and row_alignment(skew) == 1
    # the checks a cached table passes once (its launch shape kept with it)
    for bad, align in ((rows, 32), (skew, 16), (zero, 16)):
        with pytest.raises(InvalidArgument):
            pattern_copy.checked_shape(bad, align)
    assert pattern_copy.checked_shape(rows, 16) == (512, 16, 1)
    wide = np.array([[0, 0, 5000, 0, 0]], dtype=np.int64) * 16
    assert pattern_copy.checked_shape(wide, 16) == (4096, 2, 4)


def test_joins_launch_only_where_the_launch_stays_as_it_is():
    def table(rows, length, align=16):
        t = np.zeros((rows, 5), dtype=np.int64)
        t[:, 0] = t[:, 1] = np.arange(rows) * 4096 + align
        t[:, 2], t[:, 3], t[:, 4] = length, 8192, 8192
        return t

    def joins(main, extra):
        stats = pattern_copy.launch_stats
        return pattern_copy.joins_launch([stats(t) for t in main], stats(extra))

    assert pattern_copy.launch_stats(table(8, 256)) == (8, 512, 16)
    base = [table(8, 256), table(3, 128)]  # the widest 8 rows, 512-byte block, 16-aligned
    assert joins(base, table(8, 512))
    assert joins(base, table(0, 4096))  # nothing to add
    assert not joins(base, table(9, 256))  # a wider span
    assert not joins(base, table(2, 1024))  # a longer block
    assert not joins(base, table(2, 256, align=8))  # narrower
    assert joins([table(8, 4096)], table(2, 60000))  # both 4096
    assert not joins([table(8, 256), table(2, 256, align=4)], table(1, 16, align=2))
    assert joins([table(8, 256), table(2, 2048, align=4)], table(1, 1024, align=4))
    # the stats of a concatenation are those the launch takes: widest, longest, narrowest
    both = np.concatenate([table(8, 256), table(2, 2048, align=4)])
    assert pattern_copy.launch_stats(both)[1:] == (2048, 4)


def test_several_patterns_in_one_launch():
    """Piece classes of a 16 -> 64 write: each pattern its own runs and its own pairs, one
    launch over the concatenated rows (items ``(s, t, lo, hi)``); the same bytes as the
    patterns applied one by one, nothing else written."""
    g = gen(5)
    nd, src_item, dst_item, n_src, n_dst = 2, 512, 2048, 12, 5
    rng = np.random.default_rng(5)
    pats = []  # (runs per descriptor, pairs): slot b of the larger page, 16 B rows
    for b in range(4):
        so = np.arange(0, src_item, 64, dtype=np.int64)
        runs = [(so, so + b * src_item, np.full(so.size, 48 - 16 * (b % 2))) for _ in range(nd)]
        s = rng.choice(n_src, 3, replace=False)
        pats.append((runs, np.stack([s, rng.choice(n_dst, 3, replace=False)], 1)))
    # one partial piece: a single short run in one descriptor, the other empty; its bytes
    # in a gap of slot 1's runs (32 of every 64 B): as in a real write, no destination byte
    # is written twice (the launch runs its classes in no order)
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    pats.append(([(np.array([16]), np.array([544]), np.array([32])), empty], np.array([[11, 4]])))
    src = torch.randint(0, 256, (nd * src_item * n_src,), generator=g).to(torch.uint8).to(DEVICE)
    dst = torch.randint(0, 256, (nd * dst_item * n_dst,), generator=g).to(torch.uint8).to(DEVICE)
    s_off, d_off = np.arange(nd) * src_item * n_src, np.arange(nd) * dst_item * n_dst
    want = dst.cpu().clone()
    tables, bounds, parts = [], [0], []
    for runs, pairs in pats:
        rel = pattern_rows(s_off, d_off, np.full(nd, src_item), np.full(nd, dst_item), runs)
        copy_pattern_reference(src.cpu(), want, rel, pairs)  # one pattern at a time
        tables.append(
            pattern_rows(
                s_off + src.data_ptr(),
                d_off + dst.data_ptr(),
                np.full(nd, src_item),
                np.full(nd, dst_item),
                runs,
            )
        )
        bounds.append(bounds[-1] + len(tables[-1]))
        parts.append((pairs[:, 0], pairs[:, 1]))
    rows = np.ascontiguousarray(np.concatenate(tables))
    items = class_items(parts, bounds)
    assert items.shape == (13, 4) and items[-1].tolist() == [11, 4, bounds[-2], bounds[-1]]
    span = max(b - a for a, b in zip(bounds, bounds[1:]))
    t_rows, t_items = torch.from_numpy(rows).to(DEVICE), torch.from_numpy(items).to(DEVICE)
    copy_pattern(t_rows, t_items, row_alignment(rows), host_rows=rows, span=span)
    assert torch.equal(dst.cpu(), want)
    with pytest.raises(InvalidArgument):  # the widest range must be given
        copy_pattern(t_rows, t_items, row_alignment(rows), host_rows=rows)


def test_native_launch_reads_the_clock_only_for_stamps(monkeypatch):
    """``copy_pattern_native``'s diagnostics: five stamps when asked, no clock read at all
    on the launch path otherwise (the driver stood in for: a ring, a kernel)."""
    from types import SimpleNamespace

    reads = []
    monkeypatch.setattr(
        pattern_copy, "time", SimpleNamespace(perf_counter=lambda: reads.append(1) or len(reads))
    )
    launched = []
    kernel = SimpleNamespace(launch=lambda *a, **k: launched.append(a))
    monkeypatch.setattr(pattern_copy, "_native_kernel", lambda *a: kernel)
    ring = SimpleNamespace(
        ordinal=0,
        ctx=SimpleNamespace(enter=lambda: False, leave=lambda pushed: None),
        take=lambda n: (0, np.zeros(n, np.int64), 4096),
        done=lambda slot, stream: "event",
    )
    rows = np.array([[0, 0, 64, 64, 64], [64, 64, 64, 64, 64]], dtype=np.int64)
    pairs = np.array([[0, 1], [2, 3]], dtype=np.int64)
    assert pattern_copy.copy_pattern_native(ring, 8, rows, pairs, 16, 7) == "event"
    assert reads == [] and len(launched) == 1
    stamps: list = []
    pattern_copy.copy_pattern_native(ring, 8, rows, pairs, 16, 7, stamps=stamps)
    assert stamps == [1, 2, 3, 4, 5] and len(pattern_copy.NATIVE_PARTS) == 5
