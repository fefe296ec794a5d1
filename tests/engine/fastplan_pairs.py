"""Shared setup for the fastplan unit tests (test_fastplan_unit, test_fastplan_ids_unit): a
local/remote group pair resolved into a fastplan.GroupPair, and the reference ops that
kvxfer.plan.plan_items gives for the same ids, in the planner's order (callers that treat a
write's ops as a set sort them).

Addresses are fake (nothing is registered): each descriptor's local base is ``stride * (i + 1)``,
its remote base ``0x90 * stride + stride * i``."""

from kvxfer import plan
from kvxfer.engine import fastplan


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
