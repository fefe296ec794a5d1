"""Loading UCX (UCXX first, then the native ``_rma`` extension, so that both use one
libucp) and mapping UCX failures to kvxfer's error hierarchy. The rest of the UCX transport
(:mod:`.ucx`, :mod:`.ucx_channel`, :mod:`.ucx_rma`) builds on these."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, Type

from kvxfer.errors import PeerClosed, TransportError


def ucx_log_to_stderr() -> None:
    """UCX prints its log (warnings included) on stdout unless told otherwise, which breaks
    machine-readable output (``--json``) and tables. Point it at stderr unless the user chose
    a destination. libucs reads this once, when it is loaded: call before ``import ucxx``."""
    os.environ.setdefault("UCX_LOG_FILE", "stderr")


def load_ucx():
    """Import ucxx (which loads libucp from the libucx wheel) and then our extension, so
    both use the same libucp. Returns ``(ucxx, _rma)``."""
    ucx_log_to_stderr()
    import ucxx  # must come first

    try:
        from kvxfer.transport import _rma
    except ImportError as exc:  # pragma: no cover - build guidance
        raise TransportError(
            "the native RMA extension kvxfer.transport._rma is not built; run "
            "`python setup.py build_ext --inplace` or `pip install --no-build-isolation -e .`"
        ) from exc
    return ucxx, _rma


_NATIVE: Dict[str, Any] = {}  # name -> the extension's function, or None: not available


def native_helper(name: str) -> Optional[Callable[..., Any]]:
    """The native extension's function ``name`` (UCX loaded first, as :func:`load_ucx`), or
    None where UCX or the extension (or that function, an older build) is missing: its
    callers then keep to their Python path. Resolved once per name."""
    if name not in _NATIVE:
        try:
            _NATIVE[name] = getattr(load_ucx()[1], name)
        except (ImportError, AttributeError, TransportError):
            _NATIVE[name] = None
    return _NATIVE[name]


def status_error(rma, status: int, what: str) -> TransportError:
    """The kvxfer error for a UCS status: PeerClosed when it means the peer is gone or
    unreachable, TransportError otherwise."""
    text = rma.status_string(status)
    peerish = {
        rma.UCS_ERR_CONNECTION_RESET,
        rma.UCS_ERR_ENDPOINT_TIMEOUT,
        rma.UCS_ERR_UNREACHABLE,
        rma.UCS_ERR_NOT_CONNECTED,
        rma.UCS_ERR_CANCELED,
    }
    cls = PeerClosed if status in peerish else TransportError
    return cls(f"{what}: {text} ({status})")


def ucx_error_types(ucxx) -> Tuple[Type[BaseException], ...]:
    """The exception types UCXX raises for a failed request (to catch and map)."""
    return (ucxx.exceptions.UCXError,)
