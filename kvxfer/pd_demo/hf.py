"""A real ``transformers`` model on the pools: build it, store its cache into pages and a state
slot through the pools' store paths, rebuild its cache from them through their read paths.

* :func:`build_model`: a tiny model of :data:`~kvxfer.pd_demo.hf_spec.MODELS` with seeded
  random weights, float32, eval mode (same seed -> same weights in every process).
* :func:`reference`: the single-process greedy run (the model's own ``DynamicCache``) every
  disaggregated run is compared with.
* :class:`PagedModelCache`: one worker's pools for one model and layout, built from the shapes
  of a one-token probe forward (so the pools fit whatever the model caches), its allocators
  and aux rows. Storing: attention layer ``l``'s K/V rows (``[B, H, T, D]`` in the model's
  cache; post-RoPE keys; for MLA the normalised latent and the roped key) go to token ids
  ``pages_to_tokens(pages)[t]`` with ``set_kv_buffer`` / ``set_mla_kv_buffer``; Mamba layer
  ``l``'s conv window (last ``kernel - 1`` columns: the first of the model's ``kernel``
  columns is never read by the next step) and SSM state go to ``mamba_layer_cache(l)``'s
  row ``slot``. Loading is the inverse (``get_kv_rows`` / ``get_mla_kv_buffer``) into a fresh
  ``DynamicCache``.
* :func:`decode_step`: one greedy step on a cache loaded from the pools, whose new token row
  and new state are stored back -- the pools are decode's only cache.
* Heterogeneous TP (``tp=(rank, size)``): the pools hold TP rank ``rank``'s share of the
  model's cache in that rank's real geometry -- KV heads ``owned(rank, size, heads)`` (MLA:
  the latent, replicated), each Mamba conv part (``x | B | C``) and the SSM heads split over
  ``size`` -- and the ``KVArgs`` state the TP shape, so the transfer is the real
  heterogeneous-TP one. The model itself runs whole in every process (emulated TP): a rank
  stores only its share of the cache it computed. :meth:`PagedModelCache.read_share` reads a
  rank's share back; :meth:`PagedModelCache.write_shares` puts every rank's share into a
  whole-model (``tp`` 1) cache, the one decode generates from.

Bitwise equality with :func:`reference` holds when both processes run the same ops on the same
bytes with the same thread count (the workers use one thread).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from kvxfer.pd_demo.hf_spec import MODELS, check_layout, split_layout


def build_model(name: str, seed: int = 0):
    """The tiny ``transformers`` model ``name`` with weights drawn from ``seed``."""
    import transformers

    cfg_name, kwargs, _ = MODELS[name]
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, cfg_name.replace("Config", "ForCausalLM"))(config)
    return model.to(torch.float32).eval()


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _is_attention(layer) -> bool:
    return hasattr(layer, "keys")


@torch.no_grad()
def prefill(model, prompt: List[int]) -> Tuple[object, int]:
    """Forward the prompt; returns (the model's cache, the greedy first token)."""
    cache = _new_cache(model)
    out = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    return cache, int(out.logits[0, -1].argmax())


@torch.no_grad()
def reference(model, prompt: List[int], n_tokens: int) -> Tuple[List[int], List[bytes]]:
    """Single-process greedy generation of ``n_tokens`` (the first from the prompt forward);
    returns the tokens and the raw float32 logits of each of the ``n_tokens - 1`` decode
    steps."""
    cache, tok = prefill(model, prompt)
    tokens, logits = [tok], []
    for _ in range(n_tokens - 1):
        out = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        row = out.logits[0, -1]
        logits.append(row.numpy().tobytes())
        tok = int(row.argmax())
        tokens.append(tok)
    return tokens, logits


class PagedModelCache:
    """Pools + allocators + aux rows holding one model's requests in ``layout``; as TP rank
    ``tp[0]`` of ``tp[1]``: only that rank's share (module docstring).

    Invariant: ``heads`` is ``[lo, hi)`` of the model's KV heads the pool holds (MLA: ``(0,
    1)``, the replicated latent); ``conv_rows`` the model's conv channels held, in pool row
    order; ``ssm_heads`` ``[lo, hi)`` of the SSM heads held. At ``tp == (0, 1)`` they cover
    everything."""

    def __init__(
        self,
        model,
        name: str,
        layout: str,
        *,
        page_size: int,
        pool_tokens: int,
        mamba_slots: int = 8,
        aux_rows: int = 16,
        tp: Tuple[int, int] = (0, 1),
    ) -> None:
        from kvxfer.disagg import KVArgs, MetadataBuffer
        from kvxfer.pools import MHATokenToKVPool, MLATokenToKVPool, PageMajorMHATokenToKVPool
        from kvxfer.pools.allocator import PagedTokenToKVPoolAllocator
        from kvxfer.pools.mamba_alloc import MambaSlotAllocator

        check_layout(name, layout)
        self.model, self.layout, self.ps = model, layout, page_size
        kv_layout, mamba_layout = split_layout(layout)
        self.mla = kv_layout == "mla"
        probe, _ = prefill(model, [0])
        self.attn_ids = [i for i, lay in enumerate(probe.layers) if _is_attention(lay)]
        self.mamba_ids = [i for i, lay in enumerate(probe.layers) if not _is_attention(lay)]
        k0, v0 = probe.layers[self.attn_ids[0]].keys, probe.layers[self.attn_ids[0]].values
        dtype, n_attn = k0.dtype, len(self.attn_ids)
        self.tp = rank, size = int(tp[0]), int(tp[1])
        self.total_heads = int(k0.shape[1])
        self._conv_parts: Tuple[int, ...] = ()
        self._ssm_total = 0
        if self.mamba_ids:
            m0 = probe.layers[self.mamba_ids[0]]
            conv, ssm = m0.conv_states[0], m0.recurrent_states[0]
            self._conv_parts = conv_parts(model.config)
            self._ssm_total = int(ssm.shape[1])
            assert sum(self._conv_parts) == conv.shape[1], (self._conv_parts, conv.shape)
        share = self.share_of(rank)
        self.heads, self.conv_rows, self.ssm_heads = (
            share["heads"],
            share["conv_rows"],
            share["ssm_heads"],
        )
        h = self.heads[1] - self.heads[0]
        common = (pool_tokens, page_size, dtype)
        if self.mla:  # keys: latent [B, 1, T, R]; values: roped key [B, 1, T, Dr]
            kv = MLATokenToKVPool(*common, k0.shape[-1], v0.shape[-1], n_attn)
        elif kv_layout == "page_major":
            kv = PageMajorMHATokenToKVPool(
                *common, h, k0.shape[-1], n_attn, v_head_dim=v0.shape[-1]
            )
        else:
            kv = MHATokenToKVPool(
                *common,
                h,
                k0.shape[-1],
                n_attn,
                v_head_dim=v0.shape[-1],
                layout=kv_layout,
            )
        self.kv_pool, self.mamba = kv, None
        if self.mamba_ids:
            from kvxfer.pools.hybrid import HybridLinearKVPool
            from kvxfer.pools.mamba import MambaPool, MambaStateSpec

            self.conv_kernel = conv.shape[-1]
            spec = MambaStateSpec(
                conv_shapes=((len(self.conv_rows), self.conv_kernel - 1),),
                temporal_shape=(self.ssm_heads[1] - self.ssm_heads[0], *ssm.shape[2:]),
                conv_dtype=conv.dtype,
                temporal_dtype=ssm.dtype,
                layer_ids=tuple(self.mamba_ids),
                conv_parts=(tuple(n // size for n in self._conv_parts),),
            )
            self.mamba = MambaPool(mamba_slots, spec, layout=mamba_layout)
            self.pool = HybridLinearKVPool(kv, self.mamba, self.attn_ids)
        else:
            self.pool = kv  # every layer is attention: pool layer id = model id
        self.pages = PagedTokenToKVPoolAllocator(pool_tokens, page_size)
        self.slots = MambaSlotAllocator(mamba_slots) if self.mamba else None
        self.aux = MetadataBuffer(aux_rows, 64)
        self.kv_args = KVArgs.from_pools(
            self.pool,
            aux=self.aux,
            state_pool=self.pool if self.mamba else None,
            tp_rank=rank,
            tp_size=size,
            total_kv_heads=self.total_heads,
        )
        self._full = self.counts()

    # ------------------------------------------------------------------ bookkeeping
    def counts(self) -> dict:
        return {
            "pages": self.pages.available_pages(),
            "aux": self.aux.available(),
            "slots": self.slots.available_size() if self.slots else 0,
        }

    def leaks(self) -> dict:
        now = self.counts()
        return {k: self._full[k] - now[k] for k in now}

    def describe(self) -> dict:
        a = self.kv_args
        return {
            "layout": self.layout,
            "kv_entries": len(a.kv_data_ptrs),
            "state_entries": len(a.state_data_ptrs),
            "page_bytes": sum(a.kv_item_lens),
            "slot_bytes": sum(a.state_item_lens),
            "attn_layers": self.attn_ids,
            "mamba_layers": self.mamba_ids,
            "page_size": self.ps,
            "pool": type(self.kv_pool).__name__,
            "mamba_pool": self.mamba.layout if self.mamba else None,
            "tp": list(self.tp),
            "heads": list(self.heads),
        }

    def alloc(self, n_tokens: int) -> Optional[dict]:
        """Pages for ``n_tokens``, a state slot (hybrid) and an aux row; None if short."""
        n = -(-n_tokens // self.ps)
        if (
            self.pages.available_pages() < n
            or not self.aux.available()
            or (self.slots is not None and not self.slots.available_size())
        ):
            return None
        return {
            "pages": self.pages.alloc_pages(n),
            "row": self.aux.alloc(),
            "slot": self.slots.alloc(1)[0] if self.slots is not None else None,
        }

    def free(self, res: dict) -> None:
        if res.get("pages") is not None and res["pages"].numel():
            self.pages.free_pages(res["pages"])
        if res.get("slot") is not None:
            self.slots.free([res["slot"]])
        if res.get("row") is not None:
            self.aux.free(res["row"])

    def locs(self, pages: torch.Tensor, n_tokens: int) -> torch.Tensor:
        return self.pages.pages_to_tokens(pages)[:n_tokens]

    def share_of(self, rank: int) -> dict:
        """Where TP rank ``rank`` (of this cache's TP size) sits in the model: ``heads``
        ``[lo, hi)`` of the KV heads (MLA: ``(0, 1)``, replicated), ``conv_rows`` (each conv
        part ``x | B | C`` split on its own, in pool row order), ``ssm_heads`` ``[lo, hi)``."""
        from kvxfer.disagg.tp_plan import owned

        size = self.tp[1]
        rows: List[int] = []
        base = 0
        for n in self._conv_parts:
            a, b = owned(rank, size, n)
            rows += range(base + a, base + b)
            base += n
        return {
            "heads": (0, 1) if self.mla else owned(rank, size, self.total_heads),
            "conv_rows": rows,
            "ssm_heads": owned(rank, size, self._ssm_total) if self._ssm_total else (0, 0),
        }

    # ------------------------------------------------------------------ store / load
    def store_rows(
        self, cache, locs: torch.Tensor, lo: int, hi: int, rank: Optional[int] = None
    ) -> None:
        """Token positions ``[lo, hi)`` of every attention layer of ``cache`` (this rank's
        heads; ``rank``: another rank's, a deliberate misplacement) -> ``locs[lo:hi]``."""
        a, b = self.heads if rank is None else self.share_of(rank)["heads"]
        for lid in self.attn_ids:
            lay = cache.layers[lid]
            k = lay.keys[0, a:b, lo:hi].transpose(0, 1).contiguous()  # [n, h, D]
            v = lay.values[0, a:b, lo:hi].transpose(0, 1).contiguous()
            if self.mla:
                self.pool.set_mla_kv_buffer(lid, locs[lo:hi], k, v)
            else:
                self.pool.set_kv_buffer(lid, locs[lo:hi], k, v)

    def store_state(self, cache, slot: int, rank: Optional[int] = None) -> None:
        """Every Mamba layer's conv window and SSM state of ``cache`` (this rank's rows;
        ``rank``: another rank's) -> state ``slot``."""
        share = self.share_of(self.tp[0] if rank is None else rank)
        rows, (a, b) = torch.tensor(share["conv_rows"]), share["ssm_heads"]
        for lid in self.mamba_ids:
            lay, mc = cache.layers[lid], self.pool.mamba_layer_cache(lid)
            mc.conv[0][slot] = lay.conv_states[0][0, rows, 1:]
            mc.temporal[slot] = lay.recurrent_states[0][0, a:b]

    def load(self, locs: torch.Tensor, slot: Optional[int]):
        """A ``DynamicCache`` holding the tokens at ``locs`` (in order) and state ``slot``
        (a whole-model cache only: ``tp`` 1)."""
        assert self.tp[1] == 1, "load() needs the whole model's cache"
        cache = _new_cache(self.model)
        for lid in self.attn_ids:
            if self.mla:
                k, v = self.pool.get_mla_kv_buffer(lid, locs)
            else:
                k, v = self.pool.get_kv_rows(lid, locs)
            cache.layers[lid].update(
                k.transpose(0, 1).unsqueeze(0).contiguous(),
                v.transpose(0, 1).unsqueeze(0).contiguous(),
            )
        for lid in self.mamba_ids:
            mc, lay = self.pool.mamba_layer_cache(lid), cache.layers[lid]
            window = torch.nn.functional.pad(mc.conv[0][slot], (1, 0)).unsqueeze(0)
            lay.update_conv_state(window, conv_kernel_size=self.conv_kernel)
            lay.update_recurrent_state(mc.temporal[slot].unsqueeze(0).clone())
        return cache

    # ------------------------------------------------------------------ TP shares
    def read_share(self, locs: torch.Tensor, slot: Optional[int]) -> Dict[str, list]:
        """This rank's share of the tokens at ``locs`` and state ``slot``, read through the
        pools' read paths: ``k`` / ``v`` per attention layer (``[n, h, D]``), ``conv`` /
        ``ssm`` per Mamba layer (this rank's rows), and where they sit in the whole model
        (``heads``, ``conv_rows``, ``ssm_heads``)."""
        out: Dict[str, list] = {"k": [], "v": [], "conv": [], "ssm": []}
        for lid in self.attn_ids:
            if self.mla:
                k, v = self.pool.get_mla_kv_buffer(lid, locs)
            else:
                k, v = self.pool.get_kv_rows(lid, locs)
            out["k"].append(k.clone())
            out["v"].append(v.clone())
        for lid in self.mamba_ids if slot is not None else ():
            mc = self.pool.mamba_layer_cache(lid)
            out["conv"].append(mc.conv[0][slot].clone())
            out["ssm"].append(mc.temporal[slot].clone())
        out.update(heads=list(self.heads), conv_rows=self.conv_rows, ssm_heads=list(self.ssm_heads))
        return out

    def write_shares(
        self, shares: Sequence[Dict[str, list]], locs: torch.Tensor, slot: Optional[int]
    ) -> int:
        """Put every rank's share (:meth:`read_share`) into this whole-model cache at ``locs``
        / ``slot``: each share's heads and state rows where they sit in the model. Returns the
        number of elements where two replicas of the same head / latent / row differ (0 when
        every rank got the same bytes for what it replicates); raises InvalidArgument when
        the shares leave a head or a state row uncovered."""
        from kvxfer.errors import InvalidArgument

        assert self.tp[1] == 1, "write_shares() fills a whole-model cache"
        if not shares:
            raise InvalidArgument("write_shares() needs at least one rank's share")
        differ = 0
        n_conv, n_ssm = len(self.conv_rows), self.ssm_heads[1]

        def place(full, covered, idx, part):
            nonlocal differ
            seen = covered[idx]
            if seen.any():
                differ += int((full[:, idx][:, seen] != part[:, seen]).sum())
            full[:, idx] = part
            covered[idx] = True

        for i, lid in enumerate(self.attn_ids):
            k0, v0 = shares[0]["k"][i], shares[0]["v"][i]
            n, heads = k0.shape[0], 1 if self.mla else self.total_heads
            k = torch.zeros((n, heads, *k0.shape[2:]), dtype=k0.dtype)
            v = torch.zeros((n, heads, *v0.shape[2:]), dtype=v0.dtype)
            covered = torch.zeros(heads, dtype=torch.bool)
            for sh in shares:
                idx = torch.arange(*sh["heads"])
                place(k, covered.clone(), idx, sh["k"][i])  # v marks the heads covered
                place(v, covered, idx, sh["v"][i])
            if not covered.all():
                raise InvalidArgument(f"layer {lid}: the shares cover heads {covered.tolist()}")
            if self.mla:
                self.pool.set_mla_kv_buffer(lid, locs, k, v)
            else:
                self.pool.set_kv_buffer(lid, locs, k, v)
        for i, lid in enumerate(self.mamba_ids if slot is not None else ()):
            mc = self.pool.mamba_layer_cache(lid)
            conv, ssm = torch.zeros_like(mc.conv[0][slot]), torch.zeros_like(mc.temporal[slot])
            c_cov = torch.zeros(n_conv, dtype=torch.bool)
            s_cov = torch.zeros(n_ssm, dtype=torch.bool)
            for sh in shares:  # rows on dim 0: place along dim 0 via a transposed view
                place(conv.T, c_cov, torch.tensor(sh["conv_rows"]), sh["conv"][i].T)
                place(
                    ssm.movedim(0, 1),
                    s_cov,
                    torch.arange(*sh["ssm_heads"]),
                    sh["ssm"][i].movedim(0, 1),
                )
            if not (c_cov.all() and s_cov.all()):
                raise InvalidArgument(f"layer {lid}: the shares leave state rows uncovered")
            mc.conv[0][slot] = conv
            mc.temporal[slot] = ssm
        return differ


def conv_parts(config) -> Tuple[int, ...]:
    """Row counts of the parts a Mamba2 conv state is made of, ``x | B | C`` (each split
    over TP ranks on its own)."""
    groups_state = config.mamba_n_groups * config.mamba_d_state
    return (config.mamba_expand * config.hidden_size, groups_state, groups_state)


@torch.no_grad()
def decode_step(
    pmc: PagedModelCache, pages: torch.Tensor, slot: Optional[int], n_cached: int, token: int
) -> torch.Tensor:
    """Feed ``token`` at position ``n_cached`` on the cache loaded from ``pages`` / ``slot``
    (which must already cover position ``n_cached``); store its K/V row and the new state
    back. Returns the step's logits ``[vocab]``."""
    locs = pmc.locs(pages, n_cached + 1)
    cache = pmc.load(locs[:n_cached], slot)
    out = pmc.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
    pmc.store_rows(cache, locs, n_cached, n_cached + 1)
    if slot is not None:
        pmc.store_state(cache, slot)
    return out.logits[0, -1]
