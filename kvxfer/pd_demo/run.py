"""`kvxfer demo`: a prefill worker hands N requests to a decode worker over UCX loopback.

The parent starts a bootstrap server (in-process thread) and spawns one prefill and one
decode process (:mod:`kvxfer.pd_demo.worker`) holding the synthetic model of
:mod:`kvxfer.pd_demo.model`. Decode pre-allocates pages, a Mamba slot and an aux row per
request with the real allocators and sends its metadata; prefill computes each request in
chunks (deterministic content written through the pool kernels) and sends every chunk as it is
ready, then the state and the aux row. Decode verifies every token row of every page, every
state tensor of the slot and the first token byte for byte, frees everything, and both sides
check that their allocators are full again and no room is left.

Latency = decode's ``Success`` minus prefill's last ``send()`` of the request (the request is
fully computed: what disaggregation adds to time-to-first-token). GB/s = bytes moved / wall
time from the first send to the last ``Success`` (pipelined with prefill's compute, so a lower
bound on the transfer rate). Exit status 1 when any request failed or did not verify.
"""

from __future__ import annotations

import argparse
import random
import secrets
import sys
import time
from typing import List, Optional, Type, TypeVar

from kvxfer import clitools
from kvxfer.errors import InvalidArgument
from kvxfer.pd_demo.pair import Pair
from kvxfer.pd_demo.spec import DTYPES, KV_LAYOUTS, MAMBA_LAYOUTS, ModelSpec
from kvxfer.pd_demo.worker import PDWorker

W = TypeVar("W", bound=PDWorker)
REQUIRED_KEYS = (
    "requests",
    "failed",
    "verified",
    "bytes",
    "gbps",
    "p50_ms",
    "p99_ms",
    "ops_per_request",
    "lanes",
)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    d = ModelSpec()
    ap.add_argument("--kv-layout", choices=KV_LAYOUTS, default=d.kv_layout)
    ap.add_argument("--mamba-layout", choices=MAMBA_LAYOUTS, default=d.mamba_layout)
    ap.add_argument("--attn-layers", type=int, default=d.attn_layers)
    ap.add_argument("--mamba-layers", type=int, default=d.mamba_layers)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--head-dim", type=int, default=d.head_dim)
    ap.add_argument(
        "--page-size",
        "--prefill-page-size",
        dest="page_size",
        type=int,
        default=d.page_size,
        help="tokens per KV page (prefill's; decode's too unless --decode-page-size)",
    )
    ap.add_argument(
        "--decode-page-size",
        type=int,
        default=None,
        help="decode's page size when it differs from prefill's (docs/shapes.md)",
    )
    ap.add_argument(
        "--decode-prefix",
        type=int,
        default=0,
        help="decode already holds each request's first K tokens (its prefix cache; capped "
        "at the request's length); prefill sends only the rest",
    )
    ap.add_argument(
        "--pool-tokens", type=int, default=d.pool_tokens, help="KV pool capacity per worker, tokens"
    )
    ap.add_argument("--mamba-slots", type=int, default=d.mamba_slots)
    ap.add_argument(
        "--ssm-heads", type=int, default=d.ssm_heads, help="Mamba heads (split under TP)"
    )
    ap.add_argument("--aux-rows", type=int, default=d.aux_rows)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype)
    ap.add_argument(
        "--device",
        default="cpu",
        help="torch device of both workers' pools (cpu, cuda, cuda:1, ...)",
    )
    ap.add_argument(
        "--error-mode",
        choices=("peer", "none"),
        default="none",
        help="engine error mode: none (shared-memory cma lanes on host memory) or "
        "peer (UCX peer error handling: tcp lanes on host memory)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="give up when no request finishes for this many seconds",
    )


def spec_from_args(a) -> ModelSpec:
    return ModelSpec(
        kv_layout=a.kv_layout,
        mamba_layout=a.mamba_layout,
        attn_layers=a.attn_layers,
        mamba_layers=a.mamba_layers,
        heads=a.heads,
        head_dim=a.head_dim,
        page_size=a.page_size,
        pool_tokens=a.pool_tokens,
        mamba_slots=a.mamba_slots,
        ssm_heads=a.ssm_heads,
        aux_rows=a.aux_rows,
        dtype=a.dtype,
        device=a.device,
    )


def start_pair(
    spec: ModelSpec, opts: dict, cls: Type[W], prefill_tp: int = 1, decode_tp: int = 1
) -> Pair[W]:
    """The demo's pair of ``cls`` workers (:class:`PDWorker` or a subclass) with a fresh secret
    (one process per TP rank of each side); calls are bounded by ``opts["deadline_s"]`` +
    30 s."""
    opts = dict(opts, secret=secrets.token_bytes(32))  # one per run: bootstrap + both managers
    return Pair(
        cls,
        spec.as_dict(),
        opts,
        timeout=float(opts.get("deadline_s", 120.0)) + 30.0,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
    )


def merge_ranks(results: List[dict]) -> dict:
    """One side's per-rank results (``PDWorker.prefill`` / ``decode``) as one: a room
    succeeded when it did on every rank (its times: the latest rank's), stats and leaks
    summed. One rank's result is returned as it is."""
    if len(results) == 1:
        return results[0]
    rooms: dict = {}
    for rank, res in enumerate(results):
        for room, rec in res["rooms"].items():
            out = rooms.setdefault(room, dict(rec, problems=[]))
            if rec.get("state") != "Success" and out.get("state") == "Success":
                out.update(state=rec.get("state"), exc=rec.get("exc"))
            for k in ("t_send", "t_done", "chunks"):
                if k in rec:
                    out[k] = max(out.get(k, rec[k]), rec[k])
            out["problems"] += [f"rank {rank}: {p}" for p in rec.get("problems", [])]
    stats = {k: sum(r["stats"][k] for r in results) for k in results[0]["stats"] if k != "lanes"}
    stats["lanes"] = sorted({x for r in results for x in r["stats"]["lanes"]})
    leaks = {k: sum(r["leaks"][k] for r in results) for k in results[0]["leaks"]}
    return {
        "rooms": rooms,
        "stats": stats,
        "leaks": leaks,
        "live_rooms": sum(r["live_rooms"] for r in results),
    }


def make_requests(n: int, seed: int, min_len: int, max_len: int) -> List[tuple]:
    rng = random.Random(seed)
    rooms = rng.sample(range(1, 1 << 62), n)  # room 0: the warm-up
    return [(room, rng.randint(min_len, max_len)) for room in rooms]


def percentile(xs: List[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))]


def run_demo(
    spec: ModelSpec,
    *,
    requests: int = 64,
    seed: int = 0,
    min_len: int = 1,
    max_len: int = 1024,
    chunk_tokens: int = 256,
    error_mode: str = "none",
    timeout: float = 120.0,
    window: int = 16,
    integrity: bool = False,
    decode_page_size: Optional[int] = None,
    decode_prefix: int = 0,
    prefill_tp: int = 1,
    decode_tp: int = 1,
    layerwise: bool = False,
    wait_decode: bool = False,
    decode_post_capture: bool = False,
    progress=None,
) -> dict:
    """Run the demo; returns the report (``REQUIRED_KEYS`` and more). ``progress``: a
    :class:`kvxfer.clitools.Progress` of 3 steps (workers up, warm-up, requests).
    ``decode_page_size`` (None: prefill's) and ``decode_prefix`` (tokens decode holds of
    each request, capped at its length): the shapes of docs/shapes.md. ``prefill_tp`` /
    ``decode_tp``: one worker process per TP rank of each side (heterogeneous TP; with the
    shapes above too: every decode rank writes its own prefix and checks it untouched).
    ``wait_decode`` (tests): prefill computes a request only once decode's metadata is
    attached to its KVSender (SGLang's bootstrap queue), so a layer-wise run streams every
    request rather than queueing chunks declared before decode was there.
    ``decode_post_capture``: decode's kv pool is backed after construction
    (:attr:`ModelSpec.post_capture`: on CUDA VMM memory, mapped by prefill's device lane)."""
    dps = spec.page_size if decode_page_size is None else decode_page_size
    if dps < 1 or spec.pool_tokens % dps or decode_prefix < 0:
        raise InvalidArgument(
            f"--decode-page-size {dps} must divide --pool-tokens {spec.pool_tokens}; "
            f"--decode-prefix {decode_prefix} must be >= 0"
        )
    if chunk_tokens < 1 or chunk_tokens % spec.page_size:
        raise InvalidArgument(
            f"--chunk-tokens {chunk_tokens} must be a positive multiple of "
            f"--page-size {spec.page_size} (non-final chunks are page-aligned)"
        )
    if not 1 <= min_len <= max_len:
        raise InvalidArgument(f"need 1 <= --min-len ({min_len}) <= --max-len ({max_len})")
    if -(-max_len // min(spec.page_size, dps)) > spec.pool_tokens // max(spec.page_size, dps):
        raise InvalidArgument(
            f"--max-len {max_len} tokens does not fit --pool-tokens {spec.pool_tokens}"
        )
    reqs = make_requests(requests, seed, min_len, max_len)
    t0 = time.perf_counter()
    if window < 1:
        raise InvalidArgument(f"--window {window} must be >= 1")
    if wait_decode and (prefill_tp, decode_tp) != (1, 1):
        raise InvalidArgument("wait_decode needs one rank on each side")
    if progress is not None:
        progress.show("starting the prefill and decode workers")
    pair = start_pair(
        spec,
        {
            "error_mode": error_mode,
            "deadline_s": timeout,
            "max_inflight": window,
            "integrity": integrity,
            "decode_page_size": decode_page_size,
            "decode_prefix": decode_prefix,
            "layerwise": layerwise,
            "wait_decode": wait_decode,
            "decode_post_capture": decode_post_capture,
        },
        PDWorker,
        prefill_tp,
        decode_tp,
    )
    t_up = time.perf_counter() - t0
    info = pair.prefill.info()
    if len(pair.decodes) > 1 or len(pair.prefills) > 1:  # what decode's ranks hold, summed
        d_infos = [x.info() for x in pair.decodes]
        for k in ("page_bytes", "slot_bytes", "aux_bytes"):
            info[k] = sum(i[k] for i in d_infos)
        info["bytes_page_size"] = dps  # page_bytes: decode's pages
    info["decode_page_size"] = dps
    info["decode_prefix"] = decode_prefix
    if progress is not None:
        progress.step("warm-up request")
    try:
        # one 1-page request first: connects decode to prefill (bootstrap lookup, handshake),
        # which a long-running pair pays once; it is verified like the others, not timed
        warm = [(0, 1)]
        wp, wd = _both(pair, ("prefill", warm, chunk_tokens), ("decode", warm))
        if not (
            wp["rooms"][0]["state"] == wd["rooms"][0]["state"] == "Success"
            and not wd["rooms"][0].get("problems")
        ):
            raise RuntimeError(
                f"warm-up request failed: prefill {wp['rooms'][0]}, decode {wd['rooms'][0]}"
            )
        if progress is not None:
            progress.step(f"{len(reqs)} requests")
        p, d = _both(pair, ("prefill", reqs, chunk_tokens), ("decode", reqs))
        if progress is not None:
            progress.step("done")
    finally:
        pair.close()
    report = summarize(
        spec, info, reqs, p, d, chunk_tokens, error_mode, window, t_up, time.perf_counter() - t0
    )
    report["integrity"] = integrity
    report["prefill_tp"], report["decode_tp"] = prefill_tp, decode_tp
    report["layerwise"] = layerwise
    return report


def _both(pair: Pair, p_call: tuple, d_call: tuple) -> tuple:
    """A call on every rank of both sides, each side's results merged (:func:`merge_ranks`)."""
    ps, ds = pair.each(p_call, d_call)
    return merge_ranks(ps), merge_ranks(ds)


def summarize(spec, info, reqs, p, d, chunk_tokens, error_mode, window, t_up, wall) -> dict:
    lat, failures, verified = [], [], 0
    for room, _ in reqs:
        pr, dr = p["rooms"].get(room, {}), d["rooms"].get(room, {})
        ok = pr.get("state") == "Success" and dr.get("state") == "Success"
        if ok and not dr.get("problems"):
            verified += 1
            lat.append((dr["t_done"] - pr["t_send"]) * 1e3)
        else:
            failures.append(
                {
                    "room": room,
                    "prefill": pr.get("state"),
                    "decode": dr.get("state"),
                    "error": pr.get("exc") or dr.get("exc"),
                    "problems": dr.get("problems", [])[:3],
                }
            )
    sends = [r["t_send"] for r in p["rooms"].values() if "t_send" in r]
    dones = [r["t_done"] for r in d["rooms"].values() if r.get("state") == "Success"]
    span = (max(dones) - min(sends)) if sends and dones else 0.0
    st = p["stats"]
    expected = sum(_kv_bytes(spec.page_size, info, n) for _, n in reqs) + len(reqs) * (
        info["slot_bytes"] + info["aux_bytes"]
    )
    leaks = {
        "prefill": dict(p["leaks"], rooms=p["live_rooms"]),
        "decode": dict(d["leaks"], rooms=d["live_rooms"]),
    }
    leaked = any(v for side in leaks.values() for v in side.values())
    return {
        "requests": len(reqs),
        "failed": len(reqs) - verified,
        "verified": verified,
        "bytes": int(st["bytes"]),
        "expected_bytes": int(expected),
        "gbps": st["bytes"] / span / 1e9 if span > 0 else 0.0,
        "p50_ms": percentile(lat, 50),
        "p99_ms": percentile(lat, 99),
        "max_ms": max(lat, default=0.0),
        "ops_per_request": st["ops"] / len(reqs) if reqs else 0.0,
        "ops": int(st["ops"]),
        "writes": int(st["writes"]),
        "lanes": st["lanes"],
        "chunked_requests": sum(1 for r in p["rooms"].values() if r.get("chunks", 0) > 1),
        "chunks": sum(r.get("chunks", 0) for r in p["rooms"].values()),
        "tokens": sum(n for _, n in reqs),
        "leaks": leaks,
        "leaked": leaked,
        "failures": failures[:10],
        "span_s": span,
        "startup_s": t_up,
        "wall_s": wall,
        "model": spec.as_dict(),
        "chunk_tokens": chunk_tokens,
        "error_mode": error_mode,
        "window": window,
        "page_bytes": info["page_bytes"],
        "slot_bytes": info["slot_bytes"],
        "kv_entries": info["kv_entries"],
        "state_entries": info["state_entries"],
        "decode_page_size": info["decode_page_size"],
        "decode_prefix": info["decode_prefix"],
    }


def _kv_bytes(ps: int, info: dict, n: int) -> int:
    """KV bytes one request of ``n`` tokens moves: whole pages when the page sizes are equal
    and decode's prefix is page-aligned, else exactly the tokens past the prefix."""
    k = min(info["decode_prefix"], n)
    per = info.get("bytes_page_size", ps)  # the page size ``page_bytes`` is of
    if info["decode_page_size"] == ps and k % ps == 0:
        return (-(-n // ps) - k // ps) * info["page_bytes"] * ps // per
    return (n - k) * info["page_bytes"] // per


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(r: dict) -> str:
    s = r["model"]
    attn = (
        f"{s['attn_layers']} full-attention layers ({s['kv_layout']}, {r['kv_entries']} "
        f"descriptor{'s' * (r['kv_entries'] != 1)}, {_human(r['page_bytes'])}/page of "
        f"{s['page_size']} tokens)"
    )
    if r.get("decode_page_size", s["page_size"]) != s["page_size"] or r.get("decode_prefix"):
        attn += (
            f"; decode: {r['decode_page_size']}-token pages, holds the first "
            f"{r['decode_prefix']} tokens of each request"
        )
    mamba = (
        "no Mamba layers"
        if s["mamba_layout"] == "none"
        else f"{s['mamba_layers']} Mamba layers ({s['mamba_layout']}, {r['state_entries']} "
        f"descriptor{'s' * (r['state_entries'] != 1)}, {_human(r['slot_bytes'])}/slot)"
    )
    lk = r["leaks"]
    rows = [
        (
            "requests",
            f"{r['requests']}  ({r['tokens']} tokens; {r['chunked_requests']} chunked,"
            f" {r['chunks']} chunks of <= {r['chunk_tokens']} tokens)",
        ),
        (
            "verified",
            f"{r['verified']}  (every token row of every page, every state slot and "
            f"first token byte-exact)",
        ),
        ("failed", str(r["failed"])),
        ("bytes", f"{_human(r['bytes'])}  ({r['bytes']} B; expected {r['expected_bytes']} B)"),
        (
            "GB/s",
            f"{r['gbps']:.3f}  (bytes / {r['span_s'] * 1e3:.0f} ms from first send to "
            f"last Success)",
        ),
        ("latency p50", f"{r['p50_ms']:.2f} ms  (prefill's last send -> decode Success)"),
        ("latency p99", f"{r['p99_ms']:.2f} ms  (max {r['max_ms']:.2f} ms)"),
        (
            "ops/request",
            f"{r['ops_per_request']:.1f}  ({r['ops']} RMA ops in {r['writes']} writes)",
        ),
        ("lanes", f"{', '.join(r['lanes']) or '-'}  (error_mode={r['error_mode']})"),
        (
            "integrity",
            "on (every page, state slot and aux row checksummed on both sides before Success)"
            if r.get("integrity")
            else "off",
        ),
        (
            "streaming",
            "layer-wise (begin_chunk + layer_ready per kv layer)"
            if r.get("layerwise")
            else "whole chunks (send)",
        ),
        (
            "leaks",
            "none (allocators full, no live rooms on either side)"
            if not r["leaked"]
            else f"prefill {lk['prefill']}, decode {lk['decode']}",
        ),
        ("wall", f"{r['wall_s']:.2f} s  (of which {r['startup_s']:.2f} s process startup)"),
    ]
    tp = (r.get("prefill_tp", 1), r.get("decode_tp", 1))
    if tp != (1, 1):
        attn += f"; TP prefill {tp[0]} -> decode {tp[1]} (one process per rank)"
    out = [
        "kvxfer demo: prefill -> decode worker pair over UCX loopback",
        f"model: {attn} + {mamba}, {s['dtype']}",
        "",
    ]
    out += [f"  {k:12s} {v}" for k, v in rows]
    for f in r["failures"]:
        out.append(
            f"  FAILED room {f['room']}: prefill {f['prefill']}, decode {f['decode']}: "
            f"{f['error'] or '; '.join(f['problems'])}"
        )
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = clitools.parser("kvxfer demo", __doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-len", type=int, default=1, help="shortest prompt, tokens")
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt, tokens")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=256,
        help="chunked prefill: tokens per chunk (a multiple of --page-size)",
    )
    ap.add_argument(
        "--window",
        type=int,
        default=16,
        help="requests in flight per worker (decode announces at most this many ahead)",
    )
    ap.add_argument(
        "--pools",
        action="store_true",
        help="run the KV pools demo instead (kvxfer demo --pools --help)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="run the real-model check instead: a transformers model split "
        "across prefill and decode (kvxfer demo --model llama --help)",
    )
    ap.add_argument(
        "--integrity",
        action="store_true",
        help="KVManager(integrity=True) on both workers: per-item checksums "
        "compared before decode reports Success",
    )
    ap.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="prefill TP size: one worker process per rank (heterogeneous TP, docs/shapes.md)",
    )
    ap.add_argument("--decode-tp", type=int, default=1, help="decode TP size (as --prefill-tp)")
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="prefill streams each chunk layer by layer (KVSender.begin_chunk + "
        "layer_ready; docs/layerwise.md)",
    )
    ap.add_argument(
        "--decode-post-capture",
        action="store_true",
        help="decode's kv pool is reserved at construction and backed afterwards "
        "(finalize_backing; on CUDA VMM memory, which prefill's device lane maps)",
    )
    clitools.add_json_args(ap)
    add_model_args(ap)
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(x == "--model" or x.startswith("--model=") for x in argv):
        from kvxfer.pd_demo.hf_run import main as hf_main  # its own arguments

        return hf_main(argv)
    a = ap.parse_args(argv)
    if a.pools:
        from kvxfer.pools_demo import pools_main

        return pools_main([])
    try:
        if a.prefill_tp < 1 or a.decode_tp < 1:
            raise InvalidArgument("--prefill-tp and --decode-tp must be >= 1")
        spec = spec_from_args(a)
        # the model must split over both sides' TP sizes (checked by the workers' specs too)
        for tp in {a.prefill_tp, a.decode_tp}:
            ModelSpec(**dict(spec.as_dict(), tp_size=tp))
        with clitools.Progress(3, "demo", enabled=False if a.json else None) as pr:
            report = run_demo(
                spec,
                requests=a.requests,
                seed=a.seed,
                min_len=a.min_len,
                max_len=a.max_len,
                chunk_tokens=a.chunk_tokens,
                error_mode=a.error_mode,
                timeout=a.timeout,
                window=a.window,
                integrity=a.integrity,
                decode_page_size=a.decode_page_size,
                decode_prefix=a.decode_prefix,
                prefill_tp=a.prefill_tp,
                decode_tp=a.decode_tp,
                layerwise=a.layerwise,
                decode_post_capture=a.decode_post_capture,
                progress=pr,
            )
    except InvalidArgument as exc:
        ap.error(str(exc))
    print(format_table(report), flush=True)
    clitools.emit_json(a, report)
    ok = report["failed"] == 0 and report["verified"] == report["requests"] and not report["leaked"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
