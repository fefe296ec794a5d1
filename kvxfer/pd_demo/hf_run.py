"""`kvxfer demo --model NAME`: a real ``transformers`` model split across a prefill and a decode
process generates exactly what it generates in one process.

The parent starts a bootstrap server and two worker processes
(:mod:`kvxfer.pd_demo.hf_worker`, spawn, real UCX on loopback, a fresh shared secret per
run). For every model, layout (:mod:`kvxfer.pd_demo.hf_spec`) and prompt length: prefill
runs the prompt forward and sends the request chunk by chunk (page-aligned chunks; the last
one with the Mamba state slot and the aux row holding the first token); decode waits for
``Success``, rebuilds the model's cache from its pages and slot through the pools' read
paths and generates greedily from the pools alone; after ``--retract-after`` steps it
offloads the request to host, restores it into different pages and slot, and goes on. The
single-process reference (the model's own cache) runs in the prefill process.

Heterogeneous TP (``--prefill-tp N --decode-tp M``, one of them dividing the other): one
process per rank and side, each its own ``KVManager`` on pools of its rank's real geometry
(its KV heads, its rows of each Mamba state tensor; MLA: the replicated latent) and
``KVArgs`` with its ``tp_rank`` / ``tp_size`` / ``total_kv_heads``, so the transfer is the
real heterogeneous-TP one. *Emulated*: the model itself does not run tensor-parallel. Every
prefill rank runs the whole model forward and stores (and sends) only its rank's share of the
cache; every decode rank receives only its share and reads it back from its pools; decode
rank 0 puts the ranks' shares (those bytes, nothing recomputed) into a whole-model cache and
generates from it. Checked in addition: the decode ranks' copies of anything replicated
(MLA latents, heads when TP exceeds them) and their aux rows' first tokens agree.

Checked per run: the generated token ids equal the reference's, and every decode step's
logits are bitwise equal to the reference's (so the first step's are). The default prompt
lengths with ``--page-size 8 --chunk-tokens 16`` are shorter than a page, exactly a page,
not a multiple of the page size, and four chunks. Exit status 1 on any mismatch, failed
transfer or leaked page / slot / row / room; the last line with ``--json`` is the report.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Dict, List, Optional

from kvxfer.errors import InvalidArgument
from kvxfer.pd_demo.hf_spec import CORRUPTIONS, MODELS, check_layout, check_tp, models_arg
from kvxfer.pd_demo.pair import Pair

DEFAULT_PROMPTS = (5, 8, 21, 50)


def start_hf_pair(
    spec: dict,
    opts: dict,
    timeout: float,
    start_timeout: float,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> Pair:
    """The :class:`~kvxfer.pd_demo.hf_worker.HFWorker` processes (``prefill_tp`` prefill and
    ``decode_tp`` decode ones), with a fresh secret (passed to every manager and exported to
    the workers) and transformers kept offline. A worker's TP rank and size are given per
    ``setup``, so the processes can run any ratio up to their numbers."""
    from kvxfer.pd_demo.hf_worker import HFWorker  # torch: while the workers boot is fine

    secret = os.urandom(16).hex()
    env = {
        "KVXFER_SECRET": secret,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
    }
    return Pair(
        HFWorker,
        spec,
        dict(opts, secret=secret),
        timeout=timeout,
        start_timeout=start_timeout,
        env=env,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )


def prompt_ids(length: int, seed: int, vocab: int) -> List[int]:
    rng = random.Random(seed * 1_000_003 + length)
    return [rng.randrange(vocab) for _ in range(length)]


def validate(
    models,
    layouts,
    prompts,
    n_tokens,
    retract_after,
    chunk_tokens,
    corrupt,
    page_size,
    pool_tokens,
    prefill_tp: int = 1,
    decode_tp: int = 1,
) -> List[tuple]:
    """Typed errors for arguments that cannot run; returns the (model, layout) plan."""
    plan = [(m, lay) for m in models for lay in (layouts or MODELS[m][2])]
    for m, lay in plan:
        check_layout(m, lay)
    for m in models:
        check_tp(m, prefill_tp, decode_tp)
    if page_size < 1 or pool_tokens < page_size or pool_tokens % page_size:
        raise InvalidArgument(
            f"--pool-tokens {pool_tokens} must be a positive multiple of --page-size {page_size}"
        )
    if chunk_tokens < 1 or chunk_tokens % page_size:
        raise InvalidArgument(
            f"--chunk-tokens {chunk_tokens} must be a positive multiple "
            f"of --page-size {page_size} (non-final chunks are "
            f"page-aligned)"
        )
    if not prompts or min(prompts) < 1 or n_tokens < 2:
        raise InvalidArgument("need prompts of >= 1 token and --new-tokens >= 2")
    if not 0 <= retract_after < n_tokens - 1:
        raise InvalidArgument(
            f"--retract-after {retract_after} must be in [0, {n_tokens - 1}) (0: no retract)"
        )
    if corrupt is not None and corrupt not in CORRUPTIONS:
        raise InvalidArgument(f"--corrupt {corrupt!r}: one of {', '.join(CORRUPTIONS)}")
    if corrupt == "restore_reversed" and not retract_after:
        raise InvalidArgument("--corrupt restore_reversed needs --retract-after > 0")
    if corrupt == "swap_ranks" and max(prefill_tp, decode_tp) < 2:
        raise InvalidArgument("--corrupt swap_ranks needs --prefill-tp or --decode-tp > 1")
    need = 2 * -(-(max(prompts) + n_tokens) // page_size) + 2
    if pool_tokens // page_size < need:
        raise InvalidArgument(
            f"--pool-tokens {pool_tokens} holds fewer than the {need} "
            f"pages a retract of the longest prompt needs"
        )
    return plan


class HFCheck:
    """A worker pair holding ``models`` (pools of ``page_size`` x ``pool_tokens``): run any
    number of checks on it with :meth:`run`, then :meth:`close` (or use ``with``).
    ``prefill_tp`` / ``decode_tp``: processes per side, the default TP sizes of :meth:`run`
    (which may run any smaller ratio on the first ranks).
    ``timeout`` bounds each transfer and command, ``start_timeout`` the workers' start-up
    (torch + transformers imports and model builds, slow on a loaded machine)."""

    def __init__(
        self,
        models: List[str],
        *,
        page_size: int = 8,
        pool_tokens: int = 1024,
        seed: int = 0,
        error_mode: str = "none",
        timeout: float = 60.0,
        start_timeout: float = 180.0,
        prefill_tp: int = 1,
        decode_tp: int = 1,
    ) -> None:
        self.models, self.page_size, self.pool_tokens = list(models), page_size, pool_tokens
        self.prefill_tp, self.decode_tp = prefill_tp, decode_tp
        self.seed, self.timeout = seed, timeout
        spec = {
            "page_size": page_size,
            "pool_tokens": pool_tokens,
            "mamba_slots": 4,
            "aux_rows": 4,
            "seed": seed,
            "models": self.models,
        }
        t0 = time.perf_counter()
        self.pair = start_hf_pair(
            spec,
            {"error_mode": error_mode, "deadline_s": timeout},
            timeout + 30,
            start_timeout,
            prefill_tp,
            decode_tp,
        )
        self.info = self.pair.prefill.info()
        self.startup_s = time.perf_counter() - t0
        self._room = 0

    def __enter__(self) -> "HFCheck":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pair.close()

    def run(
        self,
        models: Optional[List[str]] = None,
        *,
        layouts: Optional[List[str]] = None,
        prompts=DEFAULT_PROMPTS,
        n_tokens: int = 8,
        retract_after: int = 3,
        chunk_tokens: int = 16,
        corrupt: Optional[str] = None,
        prefill_tp: Optional[int] = None,
        decode_tp: Optional[int] = None,
    ) -> dict:
        """Every (model, layout, prompt length) at ``prefill_tp`` : ``decode_tp`` (default:
        the pair's sizes); returns the report (see :func:`main`)."""
        models = list(models or self.models)
        missing = [m for m in models if m not in self.models]
        if missing:
            raise InvalidArgument(f"models {missing} are not loaded in this pair")
        tp_p = self.prefill_tp if prefill_tp is None else prefill_tp
        tp_d = self.decode_tp if decode_tp is None else decode_tp
        if tp_p > self.prefill_tp or tp_d > self.decode_tp:
            raise InvalidArgument(
                f"TP {tp_p}:{tp_d} needs more processes than this pair's "
                f"{self.prefill_tp}:{self.decode_tp}"
            )
        plan = validate(
            models,
            layouts,
            prompts,
            n_tokens,
            retract_after,
            chunk_tokens,
            corrupt,
            self.page_size,
            self.pool_tokens,
            tp_p,
            tp_d,
        )
        if (tp_p, tp_d) != (1, 1):
            return self._run_tp(
                models, plan, prompts, n_tokens, retract_after, chunk_tokens, corrupt, tp_p, tp_d
            )
        t0 = time.perf_counter()
        pair, runs, pools, problems = self.pair, [], [], []
        for model in models:
            vocab = MODELS[model][1]["vocab_size"]
            refs = {
                n: pair.prefill.reference(
                    model, prompt_ids(n, self.seed, vocab), n_tokens, timeout=self.timeout
                )
                for n in prompts
            }
            for layout in [lay for m, lay in plan if m == model]:
                desc = pair.prefill.setup(model, layout, timeout=self.timeout)  # registers
                pair.decode.setup(model, layout, timeout=self.timeout)  # first
                pools.append(desc)
                for n in prompts:
                    self._room += 1
                    p, d = pair.both(
                        (
                            pair.prefill.prefill,
                            self._room,
                            prompt_ids(n, self.seed, vocab),
                            chunk_tokens,
                        ),
                        (pair.decode.decode, self._room, n, n_tokens, retract_after, corrupt),
                    )
                    runs.append(_compare(model, layout, n, refs[n], p, d))
                pt, dt = pair.both((pair.prefill.teardown,), (pair.decode.teardown,))
                for side, r in (("prefill", pt), ("decode", dt)):
                    if any(r["leaks"].values()) or r["live_rooms"] or r.get("host_handles"):
                        problems.append(f"{model}/{layout} {side} leaked: {r}")
                desc["lanes"] = pt["lanes"]
        return _report(
            models,
            pools,
            prompts,
            runs,
            problems,
            corrupt,
            self.info,
            self.startup_s,
            time.perf_counter() - t0,
            chunk_tokens,
            n_tokens,
            retract_after,
        )

    def _run_tp(
        self, models, plan, prompts, n_tokens, retract_after, chunk_tokens, corrupt, tp_p, tp_d
    ) -> dict:
        """:meth:`run` at heterogeneous TP: prefill ranks ``0..tp_p-1`` and decode ranks
        ``0..tp_d-1`` (module docstring)."""
        from kvxfer.procs import post

        t0, to = time.perf_counter(), self.timeout
        pair, runs, pools, problems = self.pair, [], [], []
        ps, ds = pair.prefills[:tp_p], pair.decodes[:tp_d]

        def each(calls):
            futs = [post(*c) for c in calls]
            return [f.result(pair.timeout) for f in futs]

        for model in models:
            vocab = MODELS[model][1]["vocab_size"]
            refs = {
                n: pair.prefill.reference(
                    model, prompt_ids(n, self.seed, vocab), n_tokens, timeout=to
                )
                for n in prompts
            }
            for layout in [lay for m, lay in plan if m == model]:
                descs = each([(x.setup, model, layout, r, tp_p) for r, x in enumerate(ps)])
                d_descs = each(  # after prefill registered
                    [(x.setup, model, layout, r, tp_d, r == 0) for r, x in enumerate(ds)]
                )
                desc = dict(descs[0], decode=d_descs[0])
                pools.append(desc)
                for n in prompts:
                    self._room += 1
                    prompt = prompt_ids(n, self.seed, vocab)
                    d_calls = [(x.receive, self._room, n) for x in ds]
                    swap = corrupt == "swap_ranks" and tp_p > 1  # else decode swaps
                    p_calls = [
                        (x.prefill, self._room, prompt, chunk_tokens, (r ^ 1) if swap else None)
                        for r, x in enumerate(ps)
                    ]
                    got = each(d_calls + p_calls)  # decode's first
                    dr, pr = got[:tp_d], got[tp_d:]
                    p = _merge(pr)
                    d = _merge(dr)
                    if d["state"] == "Success":
                        d = pair.decode.decode_shares(
                            self._room,
                            n,
                            [x["share"] for x in dr],
                            n_tokens,
                            retract_after,
                            None if swap else corrupt,
                            timeout=to,
                        )
                        if d["replicas_differ"] or len(set(d["first_tokens"])) != 1:
                            problems.append(
                                f"{model}/{layout} prompt {n}: decode ranks disagree: "
                                f"{d['replicas_differ']} replicated elements differ, first "
                                f"tokens {d['first_tokens']}"
                            )
                    runs.append(_compare(model, layout, n, refs[n], p, d))
                torn = each([(x.teardown,) for x in ps + ds])
                for i, r in enumerate(torn):
                    side = f"prefill{i}" if i < tp_p else f"decode{i - tp_p}"
                    if any(r["leaks"].values()) or r["live_rooms"] or r.get("host_handles"):
                        problems.append(f"{model}/{layout} {side} leaked: {r}")
                desc["lanes"] = sorted({ln for r in torn[:tp_p] for ln in r["lanes"]})
        return _report(
            models,
            pools,
            prompts,
            runs,
            problems,
            corrupt,
            self.info,
            self.startup_s,
            time.perf_counter() - t0,
            chunk_tokens,
            n_tokens,
            retract_after,
            tp=(tp_p, tp_d),
        )


def _merge(ranks: List[dict]) -> dict:
    """One side's answer from its ranks': the first rank's, with the first failure's state
    and error, and bytes / ops summed over the ranks."""
    out = dict(ranks[0])
    bad = [r for r in ranks if r["state"] != "Success"]
    if bad:
        out.update(state=bad[0]["state"], error=bad[0].get("error"))
    for k in ("bytes", "ops"):
        if k in out:
            out[k] = sum(int(r[k]) for r in ranks)
    return out


def _compare(model, layout, n, ref, p, d) -> dict:
    ok = p["state"] == d["state"] == "Success"
    tokens = d.get("tokens", [])
    logits = d.get("logits", [])
    return {
        "model": model,
        "layout": layout,
        "prompt_len": n,
        "transfer": d["state"],
        "error": p.get("error") or d.get("error"),
        "chunks": p["chunks"],
        "pages": p["pages"],
        "bytes": p["bytes"],
        "ops": p["ops"],
        "tokens": tokens,
        "reference": ref["tokens"],
        "tokens_match": ok and tokens == ref["tokens"],
        "logits_equal": ok and logits == ref["logits"],
        "first_logits_equal": ok and logits[:1] == ref["logits"][:1],
        "retract": {
            k: d[k]
            for k in (
                "retract_at",
                "old_pages",
                "new_pages",
                "old_slot",
                "new_slot",
                "offloaded_bytes",
            )
            if k in d
        },
    }


def _report(
    models,
    layouts,
    prompts,
    runs,
    problems,
    corrupt,
    info,
    t_up,
    run_s,
    chunk_tokens,
    n_tokens,
    retract_after,
    tp=(1, 1),
) -> dict:
    multi = len(models) > 1

    def key(r):
        return f"{r['model']}/{r['layout']}" if multi else r["layout"]

    generated: Dict[str, Dict[str, List[int]]] = {}
    for r in runs:
        generated.setdefault(key(r), {})[str(r["prompt_len"])] = r["tokens"]
    return {
        "model": ",".join(models),
        "layouts": list(generated),
        "prompts": list(prompts),
        "tokens_match": bool(runs) and all(r["tokens_match"] for r in runs),
        "logits_equal": bool(runs) and all(r["logits_equal"] for r in runs),
        "generated": generated,
        "runs": runs,
        "pools": layouts,
        "problems": problems,
        "corrupt": corrupt,
        "chunk_tokens": chunk_tokens,
        "new_tokens": n_tokens,
        "retract_after": retract_after,
        "prefill_tp": tp[0],
        "decode_tp": tp[1],
        "torch": info["torch"],
        "transformers": info["transformers"],
        "startup_s": t_up,
        "run_s": run_s,
    }


def report_ok(r: dict) -> bool:
    return r["tokens_match"] and r["logits_equal"] and not r["problems"]


def format_table(r: dict) -> str:
    tp = r.get("prefill_tp", 1), r.get("decode_tp", 1)
    ratio = f" at TP {tp[0]}:{tp[1]} (emulated TP model, real TP pools and transfer)"
    out = [
        f"kvxfer demo --model {r['model']}: prefill -> decode over UCX loopback"
        + (ratio if tp != (1, 1) else "")
        + " "
        f"(transformers {r['transformers']}, torch {r['torch']}, seeded random weights, "
        f"float32, CPU)",
        "",
    ]
    for p in r["pools"]:
        out.append(
            f"  {p['layout']:20s} {p['pool']}"
            + (f" + Mamba {p['mamba_pool']}" if p["mamba_pool"] else "")
            + f": {p['kv_entries']} KV descriptor(s), {p['page_bytes']} B/page of "
            f"{p['page_size']} tokens"
            + (
                f", {p['state_entries']} state descriptor(s), {p['slot_bytes']} B/slot"
                if p["state_entries"]
                else ""
            )
            + f"; lanes {','.join(p.get('lanes', [])) or '-'}"
            + (
                f"; per rank: prefill heads {_share(p)}, decode heads {_share(p['decode'])}"
                if "decode" in p
                else ""
            )
        )
    out += [
        "",
        f"  {'model':8s} {'layout':20s} {'prompt':>6s} {'chunks':>6s} {'bytes':>6s}  "
        f"{'retract at: pages, slot':31s} {'tokens':6s} {'logits':6s} generated",
    ]
    for x in r["runs"]:
        rt = x["retract"]
        moved = (
            f"{rt['retract_at']}: {_ids(rt['old_pages'])}->{_ids(rt['new_pages'])}"
            + (f", {rt['old_slot']}->{rt['new_slot']}" if rt.get("new_slot") else "")
            if rt
            else "-"
        )
        out.append(
            f"  {x['model']:8s} {x['layout']:20s} {x['prompt_len']:6d} {x['chunks']:6d} "
            f"{x['bytes']:6d}  {moved:31s} "
            f"{'match' if x['tokens_match'] else 'DIFFER':6s} "
            f"{'equal' if x['logits_equal'] else 'DIFFER':6s} {x['tokens']}"
        )
        if not x["tokens_match"]:
            out.append(
                f"  {'':8s} {'':20s} {'':6s} {'':6s} {'':6s}  {'reference:':31s} "
                f"{'':6s} {'':6s} {x['reference']}"
            )
        if x["error"]:
            out.append(f"    transfer {x['transfer']}: {x['error']}")
    out += [f"  {p}" for p in r["problems"]]
    n = len(r["runs"])
    verdict = (
        f"all {n} runs token-identical to the single-process run, every decode step's "
        f"logits bitwise equal"
        if report_ok(r)
        else f"MISMATCH: {sum(not x['tokens_match'] for x in r['runs'])} of {n} runs differ "
        f"in tokens, {sum(not x['logits_equal'] for x in r['runs'])} in logits"
    )
    if r["corrupt"]:
        verdict += f"  (deliberate corruption: {r['corrupt']})"
    out += ["", f"{verdict}  ({r['run_s']:.1f} s; worker start-up {r['startup_s']:.1f} s)"]
    return "\n".join(out)


def _share(desc: dict) -> str:
    """``"1 of 2 (1 B..."``: a rank pool's heads and its page bytes."""
    a, b = desc["heads"]
    return f"{b - a} ({desc['page_bytes']} B/page)"


def _ids(ids: List[int]) -> str:
    """``[4, 5, 6]`` -> ``"4-6"``; ids that are not a run stay a list."""
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return str(ids[0]) if len(ids) == 1 else f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", required=True, help=f"{', '.join(MODELS)}, a comma list, or 'all'")
    ap.add_argument(
        "--layouts",
        default="",
        help="comma list of layouts (default: each model's, see kvxfer.pd_demo."
        "hf_spec): nhd, hnd, page_major, mla, <kv>+envelope, <kv>+per_layer",
    )
    ap.add_argument(
        "--prompts", default=",".join(map(str, DEFAULT_PROMPTS)), help="prompt lengths, tokens"
    )
    ap.add_argument(
        "--new-tokens",
        type=int,
        default=8,
        help="tokens generated per prompt (the first comes from prefill)",
    )
    ap.add_argument(
        "--retract-after",
        type=int,
        default=3,
        help="decode steps before the request is offloaded and restored (0: never)",
    )
    ap.add_argument("--page-size", type=int, default=8)
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=16,
        help="tokens per sent chunk (a multiple of --page-size)",
    )
    ap.add_argument("--pool-tokens", type=int, default=1024)
    ap.add_argument(
        "--corrupt",
        choices=sorted(CORRUPTIONS),
        default=None,
        help="apply a deliberate misplacement on decode (the check must fail)",
    )
    ap.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="prefill TP ranks, one process each (heterogeneous TP: see the module doc)",
    )
    ap.add_argument("--decode-tp", type=int, default=1, help="decode TP ranks, one process each")
    ap.add_argument("--seed", type=int, default=0, help="weights and prompts")
    ap.add_argument("--error-mode", choices=("peer", "none"), default="none")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=180.0,
        help="seconds for the worker processes' start-up (imports; slow on a loaded machine)",
    )
    ap.add_argument(
        "--json",
        action="store_true",
        help="also print the report as one JSON object on the last line",
    )


def main(argv: Optional[List[str]] = None, check: Optional[HFCheck] = None) -> int:
    """``check``: an open :class:`HFCheck` to run on (its page size, pool and seed apply)
    instead of starting a pair."""
    ap = argparse.ArgumentParser(prog="kvxfer demo", description=__doc__.splitlines()[0])
    add_args(ap)
    a = ap.parse_args(argv)
    try:
        models = models_arg(a.model)
        prompts = [int(x) for x in a.prompts.split(",") if x.strip()]
        layouts = [x.strip() for x in a.layouts.split(",") if x.strip()] or None
        if check is None:
            validate(
                models,
                layouts,
                prompts,
                a.new_tokens,
                a.retract_after,
                a.chunk_tokens,
                a.corrupt,
                a.page_size,
                a.pool_tokens,
                a.prefill_tp,
                a.decode_tp,
            )
        kw = dict(
            layouts=layouts,
            prompts=prompts,
            n_tokens=a.new_tokens,
            retract_after=a.retract_after,
            chunk_tokens=a.chunk_tokens,
            corrupt=a.corrupt,
            prefill_tp=a.prefill_tp,
            decode_tp=a.decode_tp,
        )
        if check is not None:
            report = check.run(models, **kw)
        else:
            with HFCheck(
                models,
                page_size=a.page_size,
                pool_tokens=a.pool_tokens,
                seed=a.seed,
                error_mode=a.error_mode,
                timeout=a.timeout,
                start_timeout=a.start_timeout,
                prefill_tp=a.prefill_tp,
                decode_tp=a.decode_tp,
            ) as own:
                report = own.run(models, **kw)
    except (InvalidArgument, ValueError) as exc:
        ap.error(str(exc))
    print(format_table(report), flush=True)
    if a.json:
        print(json.dumps(report, sort_keys=True), flush=True)
    return 0 if report_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
