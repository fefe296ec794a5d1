"""One prefill or decode process of the real-model check (:mod:`kvxfer.pd_demo.hf_run`).

Started by :func:`kvxfer.pd_demo.worker.build_worker` (spawn, one torch thread) and driven
through a typed proxy (:class:`kvxfer.pd_demo.pair.Pair`); it keeps its models across commands and one
:class:`~kvxfer.pd_demo.hf.PagedModelCache` + :class:`~kvxfer.disagg.KVManager` per
``setup(model, layout)`` (a new setup closes the previous manager; a prefill manager
re-registering replaces its bootstrap entry).

* prefill ``prefill(room, prompt, chunk_tokens)``: forward the prompt, then per page-aligned
  chunk store its tokens' K/V into the request's pages and ``send()`` them; the last chunk
  also stores the Mamba state into the slot and the first token into the aux row. Waits for
  the room's ``on_done`` and frees everything.
* decode ``decode(room, prompt_len, n_tokens, retract_after, corrupt)``: allocate, announce,
  wait for ``Success``; then generate greedily from the pools alone
  (:func:`~kvxfer.pd_demo.hf.decode_step`), growing the page list; after ``retract_after``
  steps offload the request to host (:class:`~kvxfer.pools.offload.OffloadManager`), take *new*
  pages and a new slot, zero and free the old ones, restore, continue.
* either side ``reference(model, prompt, n)``: the single-process greedy run.

Heterogeneous TP (``setup(model, layout, tp_rank, tp_size)``; one process per rank, each its
own :class:`~kvxfer.disagg.KVManager` on pools of its rank's geometry): every prefill rank
runs ``prefill`` (the whole model forward, only its share stored and sent); every decode rank
runs ``receive(room, prompt_len)``, which waits for ``Success`` and returns its share as read
back from its pools (the bytes that moved through kvxfer); decode rank 0 (``gather=True`` at
setup: it also holds a whole-model cache) runs ``decode_shares(room, shares, ...)``, which
puts every rank's share into that cache and generates from it as ``decode`` does. Running the
model whole in every process and gathering the shares for generation is the emulated part;
the pools' geometry, the TP shapes and the transfer are the real heterogeneous-TP ones.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import List, Optional

import torch

from kvxfer.pd_demo.hf import PagedModelCache, build_model, decode_step, prefill, reference
from kvxfer.pd_demo.worker import SchedulerError

log = logging.getLogger(__name__)


class HFWorker:
    def __init__(self, role: str, spec: dict, bootstrap: str, opts: dict) -> None:
        self.role, self.spec, self.bootstrap, self.opts = role, spec, bootstrap, opts
        self.deadline_s = float(opts.get("deadline_s", 60.0))
        self.models: dict = {}
        self.pmc: Optional[PagedModelCache] = None
        #: the cache decode generates from: ``pmc`` at equal TP, a whole-model one when
        #: gathering a heterogeneous-TP rank's shares
        self.gen: Optional[PagedModelCache] = None
        self.mgr = None
        self.offload = None
        self.done_q: "queue.SimpleQueue" = queue.SimpleQueue()
        for name in spec.get("models", ()):  # at start-up, both processes at once
            self._model(name)

    def _model(self, name: str):
        if name not in self.models:
            self.models[name] = build_model(name, int(self.spec.get("seed", 0)))
        return self.models[name]

    def info(self) -> dict:
        import transformers

        return {
            "role": self.role,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }

    # ------------------------------------------------------------------ setup
    def setup(
        self, model: str, layout: str, tp_rank: int = 0, tp_size: int = 1, gather: bool = False
    ) -> dict:
        """Pools + manager for ``model`` in ``layout`` as TP rank ``tp_rank`` of ``tp_size``;
        ``gather`` (decode): also a whole-model cache that :meth:`decode_shares` fills."""
        from kvxfer.disagg import KVManager

        self._close_layout()
        s = self.spec

        def cache(tp):
            return PagedModelCache(
                self._model(model),
                model,
                layout,
                page_size=s["page_size"],
                pool_tokens=s["pool_tokens"],
                mamba_slots=s["mamba_slots"],
                aux_rows=s["aux_rows"],
                tp=tp,
            )

        self.pmc = cache((tp_rank, tp_size))
        self.gen = cache((0, 1)) if gather else self.pmc
        tp = f"-tp{tp_rank}of{tp_size}" if tp_size > 1 or gather else ""
        self.mgr = KVManager(
            self.pmc.kv_args,
            self.role,
            bootstrap_addr=self.bootstrap if self.role == "prefill" else None,
            secret=self.opts["secret"].encode(),
            error_mode=self.opts.get("error_mode", "peer"),
            name=f"hf-{self.role}-{model}-{layout}{tp}",
        ).start_background()
        if self.role == "decode" and (gather or tp_size == 1):
            from kvxfer.pools.offload import OffloadManager

            self.offload = OffloadManager(
                self.gen.pool,
                num_host_pages=s["pool_tokens"] // s["page_size"],
                num_host_slots=2 if self.gen.mamba else 0,
            )
        return self.pmc.describe()

    def _close_layout(self) -> dict:
        out = {}
        if self.mgr is not None:
            leaks = self.pmc.leaks()
            if self.gen is not None and self.gen is not self.pmc:
                leaks = {k: v + self.gen.leaks()[k] for k, v in leaks.items()}
            out = {
                "leaks": leaks,
                "live_rooms": len(self.mgr.rooms),
                "lanes": sorted(self.mgr.stats["lanes"]),
            }
            self.mgr.close_background()
            self.mgr = None
        if self.offload is not None:
            out["host_handles"] = len(self.offload.live_handles)
            self.offload.close()
            self.offload = None
        return out

    def teardown(self) -> dict:
        return self._close_layout()

    def close(self) -> None:
        self._close_layout()

    # ------------------------------------------------------------------ plumbing
    def _on_done(self, room: int):
        q = self.done_q

        def cb(state, exc) -> None:  # manager loop thread: hand over
            q.put((room, int(state), None if exc is None else f"{type(exc).__name__}: {exc}"))

        return cb

    def _wait(self, room: int) -> tuple:
        try:
            got = self.done_q.get(timeout=self.deadline_s)
        except queue.Empty:
            raise SchedulerError(
                f"{self.role}: room {room} not done within {self.deadline_s}s"
            ) from None
        assert got[0] == room, (got, room)  # one room at a time
        return got

    def _settle(self, h) -> tuple:
        """``(state, error)`` once the room's ``on_done`` ran: its pages are ours again. A room
        not done within the deadline is aborted first; if even that does not finish, this
        raises and the caller keeps the pages (leaked, never rewritten under a transfer)."""
        try:
            _, state, exc = self._wait(h.room)
        except SchedulerError as e:
            h.abort()
            _, state, exc = self._wait(h.room)
            exc = f"{e}; aborted ({exc})"
        return state, exc

    def _stats(self) -> dict:
        return {k: v for k, v in self.mgr.stats.items() if k != "lanes"}

    # ------------------------------------------------------------------ reference
    def reference(self, model: str, prompt: List[int], n_tokens: int) -> dict:
        t0 = time.perf_counter()
        tokens, logits = reference(self._model(model), prompt, n_tokens)
        return {"tokens": tokens, "logits": logits, "s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, room: int, prompt: List[int], chunk_tokens: int, store_rank: Optional[int] = None
    ) -> dict:
        """``store_rank``: store TP rank ``store_rank``'s share instead of ours (the
        ``swap_ranks`` misplacement)."""
        from kvxfer.disagg import KVPoll, KVSender

        pmc, ps, n = self.pmc, self.pmc.ps, len(prompt)
        res = pmc.alloc(n)
        if res is None:
            raise SchedulerError(f"prefill: no room for a {n}-token prompt")
        st0, h, settled = self._stats(), None, False
        try:
            cache, first = prefill(pmc.model, prompt)
            h = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
            h.init(int(res["pages"].numel()), res["row"])
            locs = pmc.locs(res["pages"], n)
            chunks = 0
            for lo in range(0, n, chunk_tokens):
                hi = min(lo + chunk_tokens, n)
                pmc.store_rows(cache, locs, lo, hi, store_rank)
                state = None
                if hi == n:
                    if res["slot"] is not None:
                        pmc.store_state(cache, res["slot"], store_rank)
                        state = [res["slot"]]
                    pmc.aux.set_output(res["row"], first)
                h.send(res["pages"][lo // ps : -(-hi // ps)], state)
                chunks += 1
            state, exc = self._settle(h)
            settled = True
        finally:
            if settled or h is None:
                pmc.free(res)
        st = {k: v - st0.get(k, 0) for k, v in self._stats().items()}
        return {
            "state": KVPoll(state).name,
            "error": exc,
            "first_token": first,
            "chunks": chunks,
            "pages": int(res["pages"].numel()),
            "bytes": int(st["bytes"]),
            "ops": int(st["ops"]),
        }

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        room: int,
        prompt_len: int,
        n_tokens: int,
        retract_after: int = 0,
        corrupt: Optional[str] = None,
    ) -> dict:
        from kvxfer.disagg import KVPoll

        pmc = self.pmc
        res = pmc.alloc(prompt_len)
        if res is None:
            raise SchedulerError(f"decode: no room for a {prompt_len}-token prompt")
        out, held, settled = {"room": room, "retracted": False}, [], False
        try:
            state, exc = self._receive(room, res, held)
            settled = True
            out.update(state=KVPoll(state).name, error=exc)
            if state != KVPoll.Success:
                return out
            first = pmc.aux.first_token(res["row"])
            pmc.aux.free(res.pop("row"))
            out.update(self._generate(res, prompt_len, first, n_tokens, retract_after, corrupt))
            return out
        finally:
            if settled or not held:
                pmc.free(res)

    def _receive(self, room: int, res: dict, held: list) -> tuple:
        """Announce ``res`` for ``room`` and wait for its end: ``(state, error)``. ``held``
        gets the receiver once it exists: from then on ``res`` may be written into until
        the room settled (the caller frees ``res`` only if this returned or ``held`` is
        empty)."""
        from kvxfer.disagg import KVReceiver

        h = KVReceiver(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        held.append(h)
        h.init()
        h.send_metadata(res["pages"], res["row"], None if res["slot"] is None else [res["slot"]])
        return self._settle(h)

    def receive(self, room: int, prompt_len: int) -> dict:
        """Heterogeneous TP, every decode rank: receive ``room`` into this rank's pools; on
        ``Success`` read this rank's share of it back from the pools
        (:meth:`~kvxfer.pd_demo.hf.PagedModelCache.read_share`, plus ``first``: the aux
        row's token) and free the request. Returns the transfer's state, error and the
        share (None unless ``Success``)."""
        from kvxfer.disagg import KVPoll

        pmc = self.pmc
        res = pmc.alloc(prompt_len)
        if res is None:
            raise SchedulerError(f"decode: no room for a {prompt_len}-token prompt")
        held, settled = [], False
        try:
            state, exc = self._receive(room, res, held)
            settled = True
            sh = None
            if state == KVPoll.Success:
                sh = pmc.read_share(pmc.locs(res["pages"], prompt_len), res["slot"])
                sh["first"] = pmc.aux.first_token(res["row"])
            return {"state": KVPoll(state).name, "error": exc, "share": sh}
        finally:
            if settled or not held:
                pmc.free(res)

    def decode_shares(
        self,
        room: int,
        prompt_len: int,
        shares: List[dict],
        n_tokens: int,
        retract_after: int = 0,
        corrupt: Optional[str] = None,
    ) -> dict:
        """Heterogeneous TP, decode rank 0 (``gather``): put every decode rank's share of
        ``room`` into the whole-model cache and generate from it as :meth:`decode` does.
        ``replicas_differ``: elements where two ranks' copies of a replicated head, latent or
        state row disagree; ``first_tokens``: each rank's aux row."""
        gen = self.gen
        res = gen.alloc(prompt_len)
        if res is None:
            raise SchedulerError(f"decode: no room for a {prompt_len}-token prompt")
        gen.aux.free(res.pop("row"))
        try:
            out = {
                "room": room,
                "retracted": False,
                "state": "Success",
                "error": None,
                "first_tokens": [sh["first"] for sh in shares],
            }
            first = shares[0]["first"]
            if corrupt == "swap_ranks" and len(shares) > 1:  # data of one rank, place of other
                data = ("k", "v", "conv", "ssm")
                a = dict(shares[0], **{x: shares[1][x] for x in data})
                b = dict(shares[1], **{x: shares[0][x] for x in data})
                shares = [a, b, *shares[2:]]
            differ = gen.write_shares(shares, gen.locs(res["pages"], prompt_len), res["slot"])
            out["replicas_differ"] = differ
            out.update(self._generate(res, prompt_len, first, n_tokens, retract_after, corrupt))
            return out
        finally:
            gen.free(res)

    def _generate(
        self,
        res: dict,
        prompt_len: int,
        first: int,
        n_tokens: int,
        retract_after: int,
        corrupt: Optional[str],
    ) -> dict:
        """Greedy generation from the pools alone (``self.gen``: the request in ``res``),
        growing its page list; retract / corrupt as :meth:`decode` documents."""
        from kvxfer.pd_demo.hf_corrupt import corrupt_arrival

        pmc, out = self.gen, {}
        if corrupt and corrupt not in ("restore_reversed", "swap_ranks"):
            first = corrupt_arrival(pmc, corrupt, res, prompt_len, first)
        tokens, logits, n = [first], [], prompt_len
        for step in range(n_tokens - 1):
            if retract_after and step == retract_after:
                out.update(self._retract(res, n, reverse=corrupt == "restore_reversed"))
            if n % pmc.ps == 0:  # position n starts a new page
                res["pages"] = torch.cat([res["pages"], self._alloc_pages(1)])
            row = decode_step(pmc, res["pages"], res["slot"], n, tokens[-1])
            n += 1
            logits.append(row.numpy().tobytes())
            tokens.append(int(row.argmax()))
        out.update(tokens=tokens, logits=logits, pages=int(res["pages"].numel()))
        return out

    def _alloc_pages(self, n: int) -> torch.Tensor:
        pages = self.gen.pages.alloc_pages(n)
        if pages is None:
            raise SchedulerError(f"decode: out of pages ({n} needed)")
        return pages

    def _retract(self, res: dict, n_cached: int, reverse: bool) -> dict:
        """Offload the running request, move it to new pages / slot, restore, in place."""
        pmc, off = self.gen, self.offload
        old_pages, old_slot = res["pages"], res["slot"]
        slots = [] if old_slot is None else [old_slot]
        handle = off.offload(old_pages, slots)
        handle.order_before()
        # new pages / slot taken before the old ones are freed: they differ; the old ones are
        # zeroed (what a reuse would do), so reading them by mistake shows
        new_pages = self._alloc_pages(int(old_pages.numel()))
        new_slot = pmc.slots.alloc(1)[0] if old_slot is not None else None
        for view in pmc.pool.get_item_views():
            view[old_pages] = 0
        if old_slot is not None:
            for view in pmc.pool.get_state_item_views():
                view[old_slot] = 0
            pmc.slots.free(slots)
        pmc.pages.free_pages(old_pages)
        res["pages"], res["slot"] = new_pages, new_slot
        off.restore(
            handle,
            new_pages.flip(0) if reverse else new_pages,
            [] if new_slot is None else [new_slot],
        )
        handle.order_before()
        return {
            "retracted": True,
            "retract_at": n_cached,
            "old_pages": old_pages.tolist(),
            "new_pages": new_pages.tolist(),
            "old_slot": old_slot,
            "new_slot": new_slot,
            "offloaded_bytes": handle.nbytes,
        }
