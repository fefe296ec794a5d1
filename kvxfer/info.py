"""``kvxfer info``: versions, UCX transports, native extension and configuration facts.

Every probe is guarded: a missing optional part is reported, never fatal.
"""

from __future__ import annotations

import importlib
import os
import platform

from kvxfer import clitools, wire


def _version(mod: str) -> str:
    try:
        m = importlib.import_module(mod)
    except Exception as exc:  # ImportError, or a broken install
        return f"missing ({type(exc).__name__}: {exc})"
    return str(getattr(m, "__version__", "present"))


def _channel_wait() -> str:
    from kvxfer.transport.ucx_channel import channel_wait_mode

    try:
        return channel_wait_mode()
    except Exception as exc:  # InvalidArgument: reported, not fatal
        return f"invalid ({exc})"


def _malloc() -> str:
    """What an engine started in this environment does to the C library's heap policy."""
    from kvxfer.config import malloc_policy

    try:
        policy = malloc_policy()
    except Exception as exc:  # InvalidArgument: reported, not fatal
        return f"invalid ({exc})"
    if policy == "keep":
        return "keep (KVXFER_MALLOC): freed heap memory kept for reuse (kvxfer.memtune)"
    return "default (the C library's own; KVXFER_MALLOC=keep keeps freed heap memory)"


def collect() -> dict:
    import kvxfer
    from kvxfer.config import env_defaults
    from kvxfer.transport.ucx_lib import ucx_log_to_stderr

    ucx_log_to_stderr()  # before the version probe below imports ucxx

    out = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "kvxfer": kvxfer.__version__,
        # what must match across a deployment (docs/engine.md, Compatibility)
        "protocol": wire.PROTOCOL_VERSION,
        "channel_wait": _channel_wait(),
    }
    for mod in ("numpy", "msgpack", "torch", "triton", "ucxx", "libucx"):
        out[mod] = _version(mod)
    try:
        import torch

        out["cuda"] = (
            f"{torch.version.cuda}, {torch.cuda.device_count()} device(s)"
            if torch.cuda.is_available()
            else "not available"
        )
    except Exception:
        out["cuda"] = "unknown (no torch)"
    try:
        from kvxfer.transport.ucx_lib import load_ucx

        ucxx, rma = load_ucx()
        out["native_extension"] = f"built ({rma.__file__})"
        out["ucx"] = ".".join(map(str, rma.ucx_version()))
        out["ucx_transports"] = sorted(ucxx.get_active_transports())
    except Exception as exc:
        out["native_extension"] = f"unavailable: {exc}"
    out["env_defaults"] = env_defaults()
    out["malloc"] = _malloc()
    out["RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY"] = os.environ.get(
        "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY", "<unset> (wheel libucx: no verbs/rdmacm)"
    )
    return out


def main(argv=None) -> int:
    ap = clitools.parser("kvxfer info", __doc__)
    clitools.add_json_args(ap)
    args = ap.parse_args(argv)
    info = collect()
    if args.json or args.json_out:
        clitools.emit_json(args, info)
        if args.json:
            return 0
    for k, v in info.items():
        print(f"{k:38s} {', '.join(v) if isinstance(v, list) else v}")
    return 0
