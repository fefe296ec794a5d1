"""Token / paged allocators and ReqToTokenPool: semantics, typed errors, seeded fuzzing."""

import random

import pytest
import torch
from testenv import DEVICE

from kvxfer.pools.allocator import (
    PagedTokenToKVPoolAllocator,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
)
from kvxfer.pools.errors import DoubleFree, IndexOutOfRange, InvalidArgument

pytestmark = pytest.mark.timeout(60)


def _pages(alloc, tokens):
    return sorted(set((tokens // alloc.page_size).tolist()))


# ---------------------------------------------------------------------------- ReqToTokenPool
def test_req_to_token_pool_basics():
    pool = ReqToTokenPool(4, 16, device=DEVICE)
    assert pool.req_to_token.shape == (5, 16)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.available_size() == 4
    slots = pool.alloc(3)
    assert slots == [1, 2, 3] and 0 not in slots
    assert pool.generation(1) == 1
    assert pool.alloc(2) is None and pool.available_size() == 1  # nothing changed
    pool.write((slots[0], slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
    assert pool.req_to_token[1, :3].tolist() == [7, 8, 9]
    pool.free([1])
    again = pool.alloc(2)
    assert sorted(again) == [1, 4]
    assert pool.generation(1) == 2  # reuse is visible through the generation counter
    pool.clear()
    assert pool.available_size() == 4 and pool.generation(1) == 0


def test_req_to_token_pool_bad_free_changes_nothing():
    pool = ReqToTokenPool(4, 8, device=DEVICE)
    pool.alloc(2)
    with pytest.raises(IndexOutOfRange, match="request slot 0"):
        pool.free([1, 0])
    with pytest.raises(IndexOutOfRange, match="request slot 5"):
        pool.free(5)
    with pytest.raises(DoubleFree, match="request slot 3"):
        pool.free([1, 3])
    with pytest.raises(DoubleFree, match="request slot 2"):
        pool.free([2, 2])
    assert pool.available_size() == 2
    pool.free([1, 2])
    assert pool.available_size() == 4


def test_req_to_token_pool_alloc_reqs_reuses_slots():
    class R:
        def __init__(self, idx=None):
            self.req_pool_idx = idx

    pool = ReqToTokenPool(3, 8, device=DEVICE)
    (keep,) = pool.alloc(1)
    reqs = [R(), R(keep), R()]
    assert pool.alloc_reqs(reqs) == [2, keep, 3]
    assert pool.alloc_reqs([R()]) is None
    pool.free_req(reqs[0])
    assert reqs[0].req_pool_idx is None
    with pytest.raises(DoubleFree):
        pool.free_req(reqs[0])


# ---------------------------------------------------------------------------- allocators
@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_hands_out_whole_pages_never_page_zero(page_size):
    a = PagedTokenToKVPoolAllocator(8 * page_size, page_size, device=DEVICE)
    assert a.available_size() == 8 * page_size
    t = a.alloc(3 * page_size)
    assert t.dtype == torch.int64 and t.device.type == torch.device(DEVICE).type
    assert t.tolist() == list(range(page_size, 4 * page_size))
    assert a.alloc(6 * page_size) is None  # OOM → None, nothing taken
    assert a.available_size() == 5 * page_size
    if page_size > 1:
        with pytest.raises(InvalidArgument, match="multiple of page_size"):
            a.alloc(page_size + 1)
    a.free(t[:1])  # freeing any token of a page frees the page
    assert a.available_size() == 6 * page_size


def test_token_allocator_is_page_size_one():
    a = TokenToKVPoolAllocator(5, device=DEVICE)
    t = a.alloc(5)
    assert sorted(t.tolist()) == [1, 2, 3, 4, 5]
    assert a.alloc(1) is None
    a.free(t[[1, 3]])
    assert sorted(a.alloc(2).tolist()) == [2, 4]


@pytest.mark.parametrize("page_size", [1, 4])
def test_bad_free_typed_and_nothing_changes(page_size):
    a = PagedTokenToKVPoolAllocator(8 * page_size, page_size, device=DEVICE)
    t = a.alloc(2 * page_size)
    before = (a.available_size(), a.is_allocated(list(range(9))).tolist())
    with pytest.raises(IndexOutOfRange, match="token id 0"):
        a.free(torch.cat([t, torch.tensor([0], device=t.device)]))
    with pytest.raises(IndexOutOfRange, match="page id 9"):
        a.free_pages([1, 9])
    with pytest.raises(IndexOutOfRange, match="page id 0"):
        a.free_pages([0])
    with pytest.raises(IndexOutOfRange):
        a.free(torch.tensor([-1]))
    with pytest.raises(DoubleFree, match="page 3"):
        a.free_pages([1, 3])
    with pytest.raises(DoubleFree, match="page 2 appears more than once"):
        a.free_pages([2, 2])
    with pytest.raises(InvalidArgument):
        a.free(torch.tensor([1.0]))
    assert (a.available_size(), a.is_allocated(list(range(9))).tolist()) == before
    a.free(t)
    with pytest.raises(DoubleFree):
        a.free(t)
    assert a.available_size() == 8 * page_size


def test_alloc_pages_and_free_pages_roundtrip():
    a = PagedTokenToKVPoolAllocator(40, 4, device=DEVICE)  # 10 pages
    p = a.alloc_pages(4)
    assert p.tolist() == [1, 2, 3, 4]
    q = a.alloc_pages(6)
    assert a.alloc_pages(1) is None
    assert a.alloc_pages(0).numel() == 0
    a.free_pages(p[[0, 2]])
    a.free_pages(q)
    assert a.available_size() == 8 * 4
    # released pages are merged sorted: a fresh allocation is contiguous again
    assert a.alloc_pages(7).tolist() == [1, 3, 5, 6, 7, 8, 9]
    assert a.pages_to_tokens(torch.tensor([2])).tolist() == [8, 9, 10, 11]


@pytest.mark.parametrize("kind", ["list", "numpy", "cpu tensor", "device tensor"])
def test_free_keeps_no_reference_to_the_callers_ids(kind):
    """Freed ids are copied: a caller reusing its id buffer after ``free_pages`` / ``free``
    changes nothing in the allocator (one id and several)."""
    import numpy as np

    a = PagedTokenToKVPoolAllocator(40, 4, device=DEVICE)  # 10 pages
    pages = a.alloc_pages(10).tolist()
    make = {
        "list": list,
        "numpy": lambda x: np.asarray(x, dtype=np.int64),
        "cpu tensor": lambda x: torch.tensor(x, dtype=torch.int64),
        "device tensor": lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE),
    }[kind]
    one, many = make([pages[0]]), make(pages[1:4])
    a.free_pages(one)
    a.free(a.pages_to_tokens(torch.tensor(pages[4:6])).to(DEVICE))
    a.free_pages(many)
    if kind != "list":
        one[0] = pages[9]  # would alias an allocated page
        many[:] = pages[9]
    assert sorted(a.alloc_pages(6).tolist()) == sorted(pages[:6])
    assert a.is_allocated(pages).tolist() == [True] * 10
    with pytest.raises(IndexOutOfRange):
        a.is_allocated([11])
    with pytest.raises(InvalidArgument):
        a.free_pages([1.5])


def test_free_group_defers_availability():
    a = PagedTokenToKVPoolAllocator(16, 2, device=DEVICE)
    t = a.alloc(8)
    a.free_group_begin()
    a.free(t[:2])
    a.free(t[2:4])
    with pytest.raises(DoubleFree):  # double free inside a group is still detected
        a.free(t[:1])
    assert a.available_size() == 8
    with pytest.raises(InvalidArgument):
        a.free_group_begin()
    a.free_group_end()
    assert a.available_size() == 12
    with pytest.raises(InvalidArgument):
        a.free_group_end()


def test_backup_restore_state():
    a = PagedTokenToKVPoolAllocator(16, 2, device=DEVICE)
    a.alloc(4)
    st = a.backup_state()
    t = a.alloc(6)
    a.restore_state(st)
    assert a.available_size() == 12
    assert a.alloc(6).tolist() == t.tolist()


# ---------------------------------------------------------------------------- extend / decode
def _extend_oracle(alloc_pages_fn, page_size, prefix, seq, last_loc):
    """Per-request reference of paged extend semantics (a test oracle; loops are fine here)."""
    n_new = [-(-s // page_size) - (-(-p // page_size)) for p, s in zip(prefix, seq)]
    pages = alloc_pages_fn(sum(n_new))
    out, k = [], 0
    for p, s, last in zip(prefix, seq, last_loc):
        for pos in range(p, s):
            if pos < -(-p // page_size) * page_size:
                out.append(last + 1 + (pos - p))
            else:
                if pos % page_size == 0:
                    cur = pages[k]
                    k += 1
                out.append(cur * page_size + pos % page_size)
    return out


def _run_extend(a, prefix, seq, last):
    lens = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    dev = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return a.alloc_extend(
        dev(prefix), lens(prefix), dev(seq), lens(seq), dev(last), sum(seq) - sum(prefix)
    )


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_alloc_extend_matches_oracle_and_decode_continues(page_size):
    rng = random.Random(1234 + page_size)
    a = PagedTokenToKVPoolAllocator(64 * page_size, page_size, device=DEVICE)
    shadow = PagedTokenToKVPoolAllocator(64 * page_size, page_size, device="cpu")
    # requests: existing prefixes that own their pages
    B = 5
    prefix = [rng.randrange(0, 3 * page_size + 2) for _ in range(B)]
    prefix[0] = 0
    seqs, lasts, owned = [], [], []
    for p in prefix:
        toks = []
        if p:
            t = a.alloc(-(-p // page_size) * page_size)
            shadow.alloc(-(-p // page_size) * page_size)
            toks = t[:p].tolist()
        owned.append(toks)
        lasts.append(toks[-1] if toks else -1)
        seqs.append(p + rng.randrange(0, 2 * page_size + 3))
    got = _run_extend(a, prefix, seqs, lasts)
    want = _extend_oracle(lambda n: shadow.alloc_pages(n).tolist(), page_size, prefix, seqs, lasts)
    assert got.tolist() == want
    # every token id is distinct and none lives in page 0
    all_tokens = [t for o in owned for t in o] + got.tolist()
    assert len(set(all_tokens)) == len(all_tokens)
    assert min(all_tokens) >= page_size
    # decode one token per request right after the extend
    pos = 0
    last_after = []
    for p, s, o in zip(prefix, seqs, owned):
        n = s - p
        last_after.append(got[pos + n - 1].item() if n else (o[-1] if o else -1))
        pos += n
    seq_dec = [s + 1 for s in seqs]
    dec = a.alloc_decode(
        torch.tensor(seq_dec, device=DEVICE),
        torch.tensor(seq_dec),
        torch.tensor(last_after, device=DEVICE),
    )
    want_dec = _extend_oracle(
        lambda n: shadow.alloc_pages(n).tolist(), page_size, seqs, seq_dec, last_after
    )
    assert dec.tolist() == want_dec


def test_alloc_extend_oom_and_bad_args_change_nothing():
    a = PagedTokenToKVPoolAllocator(16, 4, device=DEVICE)  # 4 pages
    before = a.available_size()
    assert _run_extend(a, [0, 0], [9, 8], [-1, -1]) is None
    assert a.available_size() == before
    with pytest.raises(InvalidArgument, match="seq_lens must be >= prefix_lens"):
        _run_extend(a, [5], [3], [7])
    with pytest.raises(InvalidArgument, match="extend_num_tokens"):
        a.alloc_extend(torch.tensor([0]), None, torch.tensor([4]), None, torch.tensor([-1]), 5)
    with pytest.raises(InvalidArgument, match="seq_lens >= 1"):
        a.alloc_decode(torch.tensor([0]), None, torch.tensor([3]))
    assert a.available_size() == before
    full = a.alloc(16)
    assert a.alloc_decode(torch.tensor([5]), None, torch.tensor([full[3].item()])) is None
    # a decode that stays in its page needs no free page even when none is left
    assert a.alloc_decode(torch.tensor([2]), None, torch.tensor([4])).tolist() == [5]


# ---------------------------------------------------------------------------- fuzz
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("page_size", [1, 4])
def test_fuzz_allocator_invariants(seed, page_size):
    rng = random.Random(seed * 100 + page_size)
    num_pages = 24
    a = PagedTokenToKVPoolAllocator(num_pages * page_size + page_size - 1, page_size, device=DEVICE)
    assert a.num_pages == num_pages
    held = {}  # handle -> set of pages
    pending_group = set()
    in_group = False
    next_handle = 0
    for _ in range(300):
        op = rng.random()
        free_pages_now = num_pages - sum(len(v) for v in held.values()) - len(pending_group)
        if op < 0.3:
            n = rng.randrange(0, 6)
            t = a.alloc(n * page_size)
            if n > free_pages_now:
                assert t is None
            else:
                pages = _pages(a, t)
                assert len(pages) == n and all(1 <= p <= num_pages for p in pages)
                for v in held.values():
                    assert not (set(pages) & v), "page handed out twice"
                held[next_handle] = set(pages)
                next_handle += 1
        elif op < 0.45:
            n = rng.randrange(0, 4)
            p = a.alloc_pages(n)
            if n > free_pages_now:
                assert p is None
            else:
                held[next_handle] = set(p.tolist())
                next_handle += 1
        elif op < 0.6:
            # extend a fresh request of random length from an empty prefix
            L = rng.randrange(0, 3 * page_size + 1)
            t = _run_extend(a, [0], [L], [-1])
            need = -(-L // page_size)
            if need > free_pages_now:
                assert t is None
            else:
                pages = _pages(a, t) if L else []
                assert len(pages) == need
                for v in held.values():
                    assert not (set(pages) & v)
                held[next_handle] = set(pages)
                next_handle += 1
        elif op < 0.85 and held:
            h = rng.choice(sorted(held))
            pages = held.pop(h)
            if pages:
                if rng.random() < 0.5:
                    a.free_pages(sorted(pages))
                else:
                    a.free(a.pages_to_tokens(torch.tensor(sorted(pages))).to(DEVICE))
            if in_group:
                pending_group |= pages
        elif op < 0.9:
            if in_group:
                a.free_group_end()
                pending_group = set()
            else:
                a.free_group_begin()
            in_group = not in_group
        elif held:
            # a bad free must raise and change nothing
            h = rng.choice(sorted(held))
            if held[h]:
                p = sorted(held[h])[0]
                before = a.available_size()
                with pytest.raises(DoubleFree):
                    a.free_pages([p, p])
                with pytest.raises(IndexOutOfRange):
                    a.free_pages([p, 0])
                assert a.available_size() == before
        used = sum(len(v) for v in held.values())
        assert a.available_size() == (num_pages - used - len(pending_group)) * page_size
    if in_group:
        a.free_group_end()
    for pages in held.values():
        if pages:
            a.free_pages(sorted(pages))
    assert a.available_size() == num_pages * page_size
    assert sorted(a.alloc_pages(num_pages).tolist()) == list(range(1, num_pages + 1))
