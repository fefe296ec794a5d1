"""Shared setup for the fastplan unit tests (test_fastplan_unit, test_fastplan_ids_unit): a
local/remote group pair resolved into a fastplan.GroupPair, and the reference ops that
kvxfer.plan.plan_items gives for the same ids, in the planner's order (callers that treat a
write's ops as a set sort them).

Addresses are fake (nothing is registered): each descriptor's local base is ``stride * (i + 1)``,
its remote base ``0x90 * stride + stride * i``."""

import numpy as np

from kvxfer import plan
from kvxfer.engine import fastplan
from kvxfer.engine.writeplan import WritePlanner


def group_pair(item_lens=(64, 32, 16), n_local=12, n_remote=9, stride=0x10000):
    """(local group, remote group, GroupPair, memh, ridx) for descriptors of ``item_lens`` bytes
    a item, ``n_local`` items a local descriptor and ``n_remote`` a remote one; descriptor i has
    memory handle 100 + i and remote index i."""
    lg = plan.make_group(
        "g",
        [stride * (i + 1) for i in range(len(item_lens))],
        [il * n_local for il in item_lens],
        list(item_lens),
    )
    rg = plan.make_group(
        "g",
        [0x90 * stride + stride * i for i in range(len(item_lens))],
        [il * n_remote for il in item_lens],
        list(item_lens),
    )
    memh = list(range(100, 100 + len(item_lens)))
    ridx = list(range(len(item_lens)))
    return lg, rg, fastplan.GroupPair.make(lg, rg, memh, ridx), memh, ridx


def reference_ops(lg, rg, memh, ridx, src, dst):
    """plan_items' ops for ``src`` -> ``dst`` as (laddr, raddr, nbytes, memh, ridx) tuples, in
    plan_items' order (descriptor-major, runs by source id)."""
    ops = plan.plan_items(lg, rg, src, dst)
    d = ops.desc.astype(int)
    return list(
        zip(
            ops.laddr.tolist(),
            ops.raddr.tolist(),
            ops.nbytes.tolist(),
            [memh[i] for i in d],
            [ridx[i] for i in d],
        )
    )


class _Side:
    def __init__(self, groups, base):
        self.groups = {n: g for n, g in groups.items()}
        self.desc_memh = {n: np.arange(g.count, dtype=np.uint64) + base for n, g in groups.items()}
        self.desc_region = {
            n: np.arange(g.count, dtype=np.uint64) + base for n, g in groups.items()
        }


def _group(name, d, items, il, base):
    return plan.make_group(
        name, [base + i * items * il for i in range(d)], [items * il] * d, [il] * d
    )


def planner_of_three(can_stage=False, can_pattern=False, host_pattern=False, native=None):
    """(WritePlanner, local side, remote side) of three groups (kv: 8 descriptors of 256-byte
    items, st: 2 of 64, aux: 1 of 32) at fake addresses; ``native``: its ``plan_items``."""
    local = _Side(
        {
            "kv": _group("kv", 8, 120, 256, 1 << 30),
            "st": _group("st", 2, 16, 64, 1 << 36),
            "aux": _group("aux", 1, 8, 32, 1 << 38),
        },
        10,
    )
    remote = _Side(
        {
            "kv": _group("kv", 8, 130, 256, 1 << 31),
            "st": _group("st", 2, 16, 64, 1 << 37),
            "aux": _group("aux", 1, 8, 32, 1 << 39),
        },
        0,
    )
    return (
        WritePlanner(
            local,
            remote,
            "peer",
            lambda g: can_stage,
            lambda g: can_pattern,
            lambda g: host_pattern,
            native,
        ),
        local,
        remote,
    )
