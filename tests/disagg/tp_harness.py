"""Heterogeneous-TP nodes for the multi-process PD tests: one TP rank per node, its pools
holding the rank's share (``pd_harness._build_pool(..., tp=(rank, size, heads))``).

Content is defined over the *whole* model and each rank holds its share: per room and KV
layer, K and V of every token and every global head are integers (exact in bf16) drawn from a
generator seeded by the room; Mamba conv rows (parts ``x | B | C``) and temporal heads the
same per global row. A rank stores its heads / rows through the pool's own API
(``set_kv_buffer``; the state tensors), so the bytes sit where the pool's layout puts them.
Decode checks every byte of its pages and state slot against a scratch pool of its own shape
filled the same way (the bytes it would hold had it computed the request itself). MLA
latents are replicated: every rank holds the same page pattern."""

from __future__ import annotations

from typing import Dict

from pd_harness import Node, first_token, pattern

from kvxfer import procs


class TpNode(Node):
    """A :class:`pd_harness.Node` of one TP rank (``tp=(rank, size, total kv heads)``)."""

    def __init__(self, **kw) -> None:
        self._size = kw.get("size", 1024)
        self._scratch_pool = None
        super().__init__(**kw)

    def _scratch(self):
        if self._scratch_pool is None:
            from pd_harness import _build_pool

            self._scratch_pool = _build_pool(
                self.kind, self._size, self.pool.page_size, self.device, self.tp
            )[0]
        return self._scratch_pool

    def _fill(self, pool, room: int, pages, slot) -> None:
        """Store this rank's share of room ``room`` into ``pool`` at ``pages`` / ``slot``."""
        import torch

        from kvxfer.disagg.tp_plan import owned

        rank, tp, heads = self.tp
        ps = pool.page_size
        g = torch.Generator().manual_seed(room % (1 << 31))
        kvp = getattr(pool, "kv_pool", pool)
        n = len(pages)
        loc = (torch.as_tensor(pages)[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
        if self.kind == "mla":
            for e, v in enumerate(pool.get_item_views()):
                v[torch.as_tensor(pages).to(v.device)] = pattern(
                    room, list(range(n)), e, v.shape[1]
                ).to(v.device)
        else:
            a, b = owned(rank, tp, heads)
            for layer in range(kvp.layer_num):
                k, v = (
                    torch.randint(0, 200, (n * ps, heads, d), generator=g).to(torch.bfloat16)
                    for d in (kvp.head_dim, kvp.v_head_dim)
                )
                kvp.set_kv_buffer(
                    layer, loc.to(self.device), k[:, a:b].to(self.device), v[:, a:b].to(self.device)
                )
        mamba = getattr(pool, "mamba_pool", None)
        if mamba is None or slot is None:
            return
        parts = [(8, 4, 4)] + [(4,)]  # conv x | B | C, temporal heads (over all ranks)
        tensors = [*mamba.conv, mamba.temporal]
        for t, p in zip(tensors, parts):
            whole = torch.randint(0, 100, (t.shape[0], sum(p), *t.shape[3:]), generator=g)
            rows, base = [], 0
            for total in p:
                n_r = total // tp
                rows += list(range(base + rank * n_r, base + rank * n_r + n_r))
                base += total
            t[:, slot] = whole[:, rows].to(t.dtype).to(t.device)

    def p_open_tp(self, room: int, n: int) -> None:
        """Prefill: a request of ``n`` pages holding this rank's share; send with p_send."""
        from kvxfer.disagg import KVSender

        rec = self._alloc(room, n, True)
        self._fill(self.pool, room, rec["pages"].tolist(), rec["slot"])
        self.aux.set_output(rec["row"], first_token(room))
        self.rooms[room] = rec
        rec["h"] = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        rec["h"].init(n, rec["row"])

    def verify_tp(self, room: int) -> Dict[str, int]:
        """Bytes off in this decode rank's pages / slot / aux row of a successful room (all 0:
        byte-exact); frees the room's resources."""
        import torch

        rec = self.rooms[room]
        scratch = self._scratch()
        pages = rec["pages"].tolist()
        self._fill(scratch, room, pages, rec["slot"])
        out = {"kv": 0, "state": 0, "aux": 0}
        idx = torch.as_tensor(pages)
        for mine, want in zip(self.views, scratch.get_item_views()):
            out["kv"] += int((mine[idx.to(mine.device)] != want[idx.to(want.device)]).sum())
        if rec["slot"] is not None:
            for mine, want in zip(self.state_views, scratch.get_state_item_views()):
                out["state"] += int((mine[rec["slot"]] != want[rec["slot"]]).sum())
        out["aux"] = int(self.aux.first_token(rec["row"]) != first_token(room))
        if not rec.get("freed"):
            self._free(rec)
            rec["freed"] = True
        return out

    # -- token-keyed content (heterogeneous TP x page sizes x decode prefix) --
    def _fill_tokens(self, pool, room: int, pages, lo: int, hi: int) -> None:
        """Store this rank's share of tokens ``[lo, hi)`` of room ``room`` into ``pool``'s
        ``pages`` (page ``i`` holds tokens ``[i * P, +P)``): every (token, layer, K|V,
        global head, dim) value is a function of those alone (exact in bf16), so any page
        size and TP size holds the same values; MLA latents (replicated) are token-keyed
        bytes of the token geometry."""
        import torch

        from kvxfer.disagg.tp_plan import owned

        if hi <= lo:
            return
        ps = pool.page_size
        t = torch.arange(lo, hi)
        page = torch.as_tensor(pages, dtype=torch.int64)[t // ps]
        if self.kind == "mla":
            for e, (v, segs) in enumerate(zip(pool.get_item_views(), self.mgr.args.kv_segments)):
                at = 0
                for j, tb in enumerate(segs):
                    b = torch.arange(tb)[None, :]
                    val = ((room * 31 + e * 13 + j * 5 + 7 * t[:, None] + 3 * b) % 251).to(v.dtype)
                    seg = v[:, at : at + ps * tb].view(v.shape[0], ps, tb)  # one segment: a view
                    seg[page.to(v.device), (t % ps).to(v.device)] = val.to(v.device)
                    at += ps * tb
            return
        rank, tp, heads = self.tp
        a, b = owned(rank, tp, heads)
        kvp = getattr(pool, "kv_pool", pool)
        loc = (page * ps + t % ps).to(self.device)
        h = torch.arange(heads)[None, :, None]
        for layer in range(kvp.layer_num):
            k, v = (
                (
                    (room * 3 + layer * 7 + kv * 13 + t[:, None, None] * 5 + h * 11)
                    + torch.arange(d)[None, None, :]
                )
                % 199
                for kv, d in ((0, kvp.head_dim), (1, kvp.v_head_dim))
            )
            kvp.set_kv_buffer(
                layer,
                loc,
                k[:, a:b].to(torch.bfloat16).to(self.device),
                v[:, a:b].to(torch.bfloat16).to(self.device),
            )

    def _fill_state(self, pool, room: int, slot) -> None:
        """This rank's rows of the room's Mamba state (seeded by the room only)."""
        import torch

        mamba = getattr(pool, "mamba_pool", None)
        if mamba is None or slot is None:
            return
        rank, tp, _ = self.tp
        g = torch.Generator().manual_seed(room % (1 << 31) + 1)
        parts = [(8, 4, 4)] + [(4,)]  # conv x | B | C, temporal heads (over all ranks)
        for t, p in zip([*mamba.conv, mamba.temporal], parts):
            whole = torch.randint(0, 100, (t.shape[0], sum(p), *t.shape[3:]), generator=g)
            rows, base = [], 0
            for total in p:
                n_r = total // tp
                rows += list(range(base + rank * n_r, base + rank * n_r + n_r))
                base += total
            t[:, slot] = whole[:, rows].to(t.dtype).to(t.device)

    def p_open_tp_tokens(self, room: int, tokens: int) -> None:
        """Prefill: a request of ``tokens`` tokens (every slot of its pages holds content,
        those past ``tokens`` too: whole-page writes carry them); send with p_send."""
        from kvxfer.disagg import KVSender

        n = -(-tokens // self.pool.page_size)
        rec = self._alloc(room, n, True)
        rec["tokens"] = tokens
        pages = rec["pages"].tolist()
        self._fill_tokens(self.pool, room, pages, 0, n * self.pool.page_size)
        self._fill_state(self.pool, room, rec["slot"])
        self.aux.set_output(rec["row"], first_token(room))
        self.rooms[room] = rec
        rec["h"] = KVSender(self.mgr, self.bootstrap, room, on_done=self._on_done(room))
        rec["h"].init(n, rec["row"])

    def verify_tp_tokens(self, room: int, prefix: int, upto: int) -> Dict[str, int]:
        """Bytes off in this decode rank's pages (opened by ``d_open_tokens``: UNWRITTEN
        everywhere) after a successful room: tokens ``[prefix, upto)`` must hold this rank's
        share, every other byte (decode's own prefix, past the end) must be UNWRITTEN; state
        slot and aux row as prefill's. Frees the room's resources."""
        import torch
        from pd_harness import UNWRITTEN

        rec = self.rooms[room]
        scratch = self._scratch()
        pages = rec["pages"].tolist()
        idx = torch.as_tensor(pages, dtype=torch.int64)
        for w in scratch.get_item_views():
            w[idx.to(w.device)] = UNWRITTEN
        self._fill_tokens(scratch, room, pages, prefix, upto)
        self._fill_state(scratch, room, rec["slot"])
        out = {"kv": 0, "state": 0, "aux": 0}
        for mine, want in zip(self.views, scratch.get_item_views()):
            out["kv"] += int((mine[idx.to(mine.device)] != want[idx.to(want.device)]).sum())
        if rec["slot"] is not None:
            for mine, want in zip(self.state_views, scratch.get_state_item_views()):
                out["state"] += int((mine[rec["slot"]] != want[rec["slot"]]).sum())
        out["aux"] = int(self.aux.first_token(rec["row"]) != first_token(room))
        if not rec.get("freed"):
            self._free(rec)
            rec["freed"] = True
        return out

    def failure(self, room: int):
        """The KVReceiver's / KVSender's failure, as (type name, message), or None."""
        exc = self.rooms[room]["h"].failure_exception()
        return None if exc is None else (type(exc).__name__, str(exc))


def build_tp_nodes(nodes_spec: dict) -> Dict[str, TpNode]:
    """Worker entry (in the child): one :class:`TpNode` per ``{name: Node kwargs}``."""
    import logging
    import os

    import torch

    torch.set_num_threads(1)
    logging.basicConfig(level=os.environ.get("KVXFER_TEST_LOG", "WARNING"))
    nodes: Dict[str, TpNode] = {}
    try:
        for name, kw in nodes_spec.items():
            nodes[name] = TpNode(**kw)
    except BaseException:
        for node in nodes.values():
            node.close()
        raise
    return nodes


class TpWorker(procs.Worker):
    """A spawned process hosting TP-rank nodes; ``w[name]`` is a proxy typed as TpNode."""

    def __init__(self, nodes_spec: dict, name: str) -> None:
        super().__init__(build_tp_nodes, nodes_spec, name=name)
        self._nodes: Dict[str, TpNode] = {}
        self.launch()

    def __getitem__(self, name: str) -> TpNode:
        if name not in self._nodes:
            self._nodes[name] = self.proxy(TpNode, name)
        return self._nodes[name]
