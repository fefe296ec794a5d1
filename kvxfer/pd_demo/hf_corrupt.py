"""Deliberate misplacements applied by the decode side of the real-model check right after a
request arrived (``--corrupt NAME``): the check must then report a mismatch, which shows it
would notice that kind of bug in the transfer or the layouts.

Attention is invariant under a permutation of whole (K, V) token rows -- keys carry their
position (RoPE is applied before caching) -- so ``swap_pages`` between two *full* pages or
``swap_tokens`` change only the summation order: the first decode step's logits then differ
in their last bits (the bitwise check), the tokens usually not. A swap that moves the empty
tail of a partial last page into the prompt, swapped heads, swapped or reordered Mamba
state and a wrong first token change the tokens themselves.
"""

from __future__ import annotations

import torch

from kvxfer.errors import InvalidArgument
from kvxfer.pd_demo.hf_spec import CORRUPTIONS


def corrupt_arrival(pmc, name: str, res: dict, prompt_len: int, first: int) -> int:
    """Apply corruption ``name`` to the request in ``res`` (pages, slot) of ``pmc``; returns
    the first token to use (changed only by ``first_token``)."""
    if name not in CORRUPTIONS:
        raise InvalidArgument(f"unknown corruption {name!r}; one of {sorted(CORRUPTIONS)}")
    pages, slot = res["pages"], res["slot"]
    if name == "first_token":
        return (first + 1) % pmc.model.config.vocab_size
    if name == "swap_pages":
        if pages.numel() < 2:
            raise InvalidArgument("swap_pages needs a request of at least two pages")
        a, b = int(pages[0]), int(pages[-1])
        for view in pmc.pool.get_item_views():  # every registered KV buffer
            view[[a, b]] = view[[b, a]]
    elif name in ("swap_heads", "swap_tokens"):
        _swap_rows(pmc, pmc.locs(pages, prompt_len), heads=name == "swap_heads")
    elif name in ("swap_state", "conv_window"):
        if slot is None:
            raise InvalidArgument(f"{name} needs a model with Mamba layers")
        ids = pmc.mamba_ids
        if name == "swap_state":
            if len(ids) < 2:
                raise InvalidArgument("swap_state needs two Mamba layers")
            a, b = (pmc.pool.mamba_layer_cache(i) for i in ids[:2])
            for x, y in zip([*a.conv, a.temporal], [*b.conv, b.temporal]):
                x[slot], y[slot] = y[slot].clone(), x[slot].clone()
        else:
            for i in ids:
                conv = pmc.pool.mamba_layer_cache(i).conv[0]
                conv[slot] = conv[slot].flip(-1).clone()
    else:
        raise InvalidArgument(f"{name} is applied at restore, not on arrival")
    return first


def _swap_rows(pmc, locs: torch.Tensor, heads: bool) -> None:
    """Exchange heads 0 and 1 of every token, or the first and last token's rows, through the
    pool's own read and store paths."""
    for lid in pmc.attn_ids:
        if pmc.mla:
            if heads:
                raise InvalidArgument("swap_heads needs a pool with at least two KV heads")
            k, v = pmc.pool.get_mla_kv_buffer(lid, locs)
        else:
            k, v = pmc.pool.get_kv_rows(lid, locs)
        if heads:
            if k.shape[1] < 2:
                raise InvalidArgument("swap_heads needs a pool with at least two KV heads")
            perm = torch.arange(k.shape[1])
            perm[[0, 1]] = perm[[1, 0]]
            k, v = k[:, perm], v[:, perm]
        else:
            perm = torch.arange(k.shape[0])
            perm[[0, -1]] = perm[[-1, 0]]
            k, v = k[perm], v[perm]
        if pmc.mla:
            pmc.pool.set_mla_kv_buffer(lid, locs, k.contiguous(), v.contiguous())
        else:
            pmc.pool.set_kv_buffer(lid, locs, k.contiguous(), v.contiguous())
