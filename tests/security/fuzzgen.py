"""Seeded generator of malformed, oversized and wrong-typed control messages.

(``hypothesis`` is not in the project's environment; this is a plain ``random.Random``
generator, so a failing case is reproduced from its seed and index.)

Each payload starts from a well-formed message of the target protocol (``TEMPLATES``) and
breaks it in one of these ways: a field of the wrong type (bool or float for an int, str for
bytes, containers for scalars, ints past 64 bits...), a field missing or added, another tag or
version (``True``, ``1.0``, ``"1"``, 2...), a truncated or extended encoding, random msgpack
of random shape, random bytes, or a message just past the receiver's size limit. Well-formed
messages with meaningless values (unknown slots, ids out of range, wrong nonce lengths) are
part of the mix: they must be refused by the checks behind decoding.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Dict, List

import msgpack

V = 4  # kvxfer.wire.PROTOCOL_VERSION (asserted by the tests)

_BAD_VERSIONS = [True, False, 4.0, "4", b"\x04", 0, 1, 3, 5, -1, None, [4], {"v": 4}, (1 << 64) - 1]


def _ints(rng: random.Random) -> int:
    return rng.choice(
        [
            0,
            1,
            -1,
            7,
            255,
            1 << 31,
            (1 << 63) - 1,
            -(1 << 63),
            (1 << 64) - 1,
            rng.randrange(-1 << 40, 1 << 40),
        ]
    )


def rand_value(rng: random.Random, depth: int = 0):
    """A random msgpack-able value (depth-limited)."""
    kinds = ["none", "bool", "int", "float", "str", "bytes"]
    if depth < 3:
        kinds += ["list", "map"]
    k = rng.choice(kinds)
    if k == "none":
        return None
    if k == "bool":
        return rng.random() < 0.5
    if k == "int":
        return _ints(rng)
    if k == "float":
        return rng.choice([0.0, 1.0, -1.5, float("inf"), float("nan"), 1e300])
    if k == "str":
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 40)))
    if k == "bytes":
        return rng.randbytes(rng.choice([0, 1, 8, 31, 32, 33, 100]))
    if k == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {
        str(rand_value(rng, depth + 1))[:20]: rand_value(rng, depth + 1)
        for _ in range(rng.randrange(0, 6))
    }


def wrong_type(rng: random.Random, value):
    """A value of another wire type than ``value`` (bools and floats for ints included)."""
    if isinstance(value, bool):
        options = [1, 0, "true", None, 1.0]
    elif isinstance(value, int):
        options = [True, False, float(value), str(value), None, [value], (1 << 64) - 1, -(1 << 63)]
    elif isinstance(value, (bytes, bytearray)):
        options = [value.hex() if value else "x", list(value)[:8], None, 5, True]
    elif isinstance(value, str):
        options = [value.encode(), 3, None, [value], {"s": value}, True]
    elif isinstance(value, list):
        options = [{"0": 1}, "list", None, 7, [rand_value(rng) for _ in range(3)]]
    elif isinstance(value, dict):
        options = [[1, 2], "map", None, 7, {"x": rand_value(rng)}]
    else:
        options = [1, "x", b"x", [None]]
    return rng.choice(options)


def _templates() -> Dict[str, List[Callable[[random.Random], dict]]]:
    def hello(r):
        return {
            "t": "kx.hello",
            "v": V,
            "engine_id": r.randbytes(16).hex(),
            "name": "x",
            "nonce": r.randbytes(32),
            "hostname": "h",
            "stage": False,
        }

    def hello_ack(r):
        return {
            "t": "kx.hello_ack",
            "v": V,
            "engine_id": "e",
            "name": "n",
            "nonce": r.randbytes(32),
            "proof": r.randbytes(32),
            "hostname": "h",
            "stage": r.random() < 0.5,
        }

    def proof(r):
        return {"t": "kx.proof", "v": V, "proof": r.randbytes(r.choice([0, 32, 64]))}

    def reject(r):
        return {
            "t": "kx.reject",
            "v": V,
            "kind": r.choice(["auth", "protocol", "x"]),
            "reason": "r",
        }

    def layout(r):
        return layout_body(r)

    def app(r):
        return {"t": "kx.app", "v": V, "payload": r.randbytes(r.randrange(0, 64))}

    def staged(r):
        return {
            "t": "kx.staged",
            "v": V,
            "group": r.choice(["kv", "nope", ""]),
            "slot": _ints(r),
            "offset": _ints(r),
            "nbytes": _ints(r),
            "dst": r.randbytes(8 * r.randrange(0, 4) + r.choice([0, 0, 3])),
        }

    def slot_free(r):
        return {"t": "kx.slot_free", "v": V, "group": r.choice(["kv", "nope"]), "slot": _ints(r)}

    def slot_abandon(r):
        tag = r.choice(["kx.slot_abandon", "kx.slot_reclaimed"])
        return {"t": tag, "v": V, "group": r.choice(["kv", "nope"]), "slot": _ints(r)}

    def bye(r):
        return {"t": "kx.bye", "v": V, "reason": "bye"}

    def ready(r):
        return {"t": "kx.ready", "v": V}

    return {
        "engine": [
            hello,
            hello_ack,
            proof,
            reject,
            layout,
            app,
            staged,
            slot_free,
            slot_abandon,
            bye,
            ready,
        ]
    }


def layout_body(r: random.Random, keys=None) -> dict:
    """A Layout of one or two 8 KiB regions. ``keys``: real packed remote keys to use (the
    receiver hands them to libucp, which parses them unchecked: see docs/SECURITY.md);
    without, random bytes (fine for anything that stops before unpacking them)."""
    n = r.choice([1, 2])
    bases = [0x10000 * (i + 1) for i in range(n)]
    region_keys = [
        keys[i % len(keys)] if keys else r.randbytes(r.choice([1, 16, 200])) for i in range(n)
    ]
    return {
        "t": "kx.layout",
        "v": V,
        "groups": {
            "kv": {
                "ptrs": [bases[0], bases[0] + 0x1000],
                "lens": [0x1000, 0x1000],
                "item_lens": [256, 256],
                "regions": [0, 0],
            }
        },
        "region_bases": bases,
        "region_lens": [0x2000] * n,
        "region_keys": region_keys,
        "region_types": ["host"] * n,
        "address": None,
        "landing": r.choice(
            [
                None,
                {"kv": {"region": 0, "base": bases[0], "slot_bytes": 512, "slots": [0, 1]}},
                {"nope": {}},
            ]
        ),
        "non_ipc": r.choice([None, ["kv"], ["zz"]]),
        "region_ipc": r.choice([None, [b""] * n, [b"x"] * n]),
        # a host-lane offer: none, one naming this process or pid 1 (never a lane: the
        # nonce does not read back), malformed ones
        "host_lane": r.choice(
            [
                None,
                {"pid": os.getpid(), "ns": 0, "addr": 0x1000},
                {"pid": 1, "ns": 1, "addr": r.getrandbits(64)},
                {"pid": 0, "ns": 0, "addr": 0},
                {"pid": 1},
                [1, 2, 3],
            ]
        ),
    }


def _mutate(r: random.Random, body: dict) -> dict:
    body = dict(body)
    fields = [k for k in body if k not in ("t", "v")]
    how = r.randrange(9)
    if how == 0 and fields:
        k = r.choice(fields)
        body[k] = wrong_type(r, body[k])
    elif how == 1 and fields:
        del body[r.choice(fields)]
    elif how == 2:
        body[r.choice(["extra", "t2", "", "x" * 40])] = rand_value(r)
    elif how == 3:
        body["v"] = r.choice(_BAD_VERSIONS)
    elif how == 4:
        body["t"] = r.choice(
            [None, 1, True, b"kx.hello", "kx.nope", "bs.register", "", "kx.hello" * 20]
        )
    elif how == 5:
        body.pop(r.choice(["t", "v"]), None)
    elif how == 6 and fields:  # nested damage inside containers
        k = r.choice(fields)
        if isinstance(body[k], dict) and body[k]:
            inner = dict(body[k])
            ik = r.choice(list(inner))
            inner[ik] = wrong_type(r, inner[ik])
            body[k] = inner
        elif isinstance(body[k], list) and body[k]:
            lst = list(body[k])
            lst[r.randrange(len(lst))] = wrong_type(r, lst[0])
            body[k] = lst
        else:
            body[k] = rand_value(r)
    elif how == 7 and fields:  # well-formed but meaningless values
        k = r.choice(fields)
        v = body[k]
        body[k] = (
            _ints(r)
            if isinstance(v, int) and not isinstance(v, bool)
            else r.randbytes(r.choice([0, 31, 33]))
            if isinstance(v, bytes)
            else v
        )
    # how == 8: well-formed as is (semantic checks behind decoding must refuse or accept it)
    return body


def _encode(r: random.Random, body, limit: int) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    how = r.randrange(20)
    if how == 0:
        return raw[: r.randrange(0, max(1, len(raw)))]  # truncated
    if how == 1:
        return raw + r.randbytes(r.randrange(1, 16))  # trailing garbage
    if how == 2:
        return r.randbytes(r.randrange(0, 256))  # noise
    if how == 3:
        return msgpack.packb(rand_value(r), use_bin_type=True)  # random shape
    if how == 4 and r.random() < 0.2:  # just past the limit
        return msgpack.packb(dict(body, pad=bytes(limit + 1)), use_bin_type=True)
    if how == 5:  # deep nesting
        return b"\x91" * r.randrange(100, 3000) + b"\xc0"
    return raw


def engine_payloads(r: random.Random, n: int, authenticated: bool) -> List[bytes]:
    """``n`` engine control messages for a target before (limit: the pre-authentication
    cap) or after authentication."""
    from_templates = _templates()["engine"]
    limit = (64 << 10) if not authenticated else (1 << 20)
    return [_encode(r, _mutate(r, r.choice(from_templates)(r)), limit) for _ in range(n)]


def layout_payloads(r: random.Random, n: int, keys) -> List[bytes]:
    """Malformed Layouts whose remote keys are ``keys`` (real ones) wherever they survive."""
    return [_encode(r, _mutate(r, _mutate(r, layout_body(r, keys))), 1 << 20) for _ in range(n)]


# -------------------------------------------------------------------------- bootstrap
def _bs_templates():
    def register(r):
        return {
            "t": "bs.register",
            "v": V,
            "name": "p",
            "host": "127.0.0.1",
            "port": r.choice([1, 8000, 65535, 0, 70000]),
            "tp_rank": r.randrange(0, 3),
            "tp_size": r.choice([1, 2, 4]),
            "dp_rank": r.randrange(0, 3),
            "pp_rank": r.choice([0, 0, 1]),
            "fingerprint": {"page_size": 16},
        }

    def unregister(r):
        return {"t": "bs.unregister", "v": V, "name": "p", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0}

    def lookup(r):
        return {"t": "bs.lookup", "v": V, "dp_rank": r.randrange(0, 3)}

    def reply(r):
        return {"t": "bs.reply", "v": V, "ok": True, "error": "", "entries": []}

    def challenge(r):
        return {"t": "bs.challenge", "v": V, "nonce": r.randbytes(32)}

    return [register, unregister, lookup, reply, challenge]


def bootstrap_bodies(r: random.Random, n: int) -> List[bytes]:
    """Inner (sealed) bodies: what an authenticated client could send."""
    t = _bs_templates()
    return [_encode(r, _mutate(r, r.choice(t)(r)), 32 << 10) for _ in range(n)]


def bootstrap_frames(r: random.Random, n: int) -> List[bytes]:
    """Whole unauthenticated frames (length prefix included): malformed outer messages,
    wrong MACs, lying length prefixes, oversized frames."""
    t = _bs_templates()
    out = []
    for _ in range(n):
        if r.random() < 0.4:
            body = {
                "t": "bs.sealed",
                "v": V,
                "nonce": r.randbytes(r.choice([32, 32, 31])),
                "body": msgpack.packb(r.choice(t)(r), use_bin_type=True),
                "mac": r.randbytes(r.choice([32, 0])),
            }
            raw = _encode(r, _mutate(r, body) if r.random() < 0.5 else body, 32 << 10)
        else:
            raw = _encode(r, _mutate(r, r.choice(t)(r)), 32 << 10)
        how = r.randrange(10)
        n_decl = (
            len(raw)
            if how < 7
            else r.choice([0, len(raw) + 5, max(0, len(raw) - 3), 1 << 30, (32 << 10) + 1])
        )
        out.append(n_decl.to_bytes(4, "big") + raw)
    return out
