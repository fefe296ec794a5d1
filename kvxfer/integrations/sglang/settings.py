"""Where the SGLang backend's settings come from: the environment, read here and only here.

- ``KVXFER_SECRET``: the shared secret of the kvxfer engines of a prefill/decode pair
  (every prefill and decode rank of a deployment needs the same one); or
- ``KVXFER_SECRET_FILE``: a file holding it (surrounding whitespace stripped). The plugin's
  ``--kvxfer-secret-file PATH`` server argument sets this variable for the scheduler
  processes SGLang starts. Nothing else is accepted: there is no default secret.
- ``KVXFER_SGL_TP_STAGE_MIN_OPS``: heterogeneous attention TP without a device lane
  (another host): a chunk's head-slice write of more PUTs than this goes staged (gather into
  registered staging memory, one PUT per landing-slot chunk, scatter at decode); default
  :data:`TP_STAGE_MIN_OPS`, 0: never (then no staging memory is allocated either).
- ``KVXFER_HOST_COPY``: ``auto`` | ``off``, the engines' host lane
  (:attr:`kvxfer.config.EngineConfig.host_copy`), read when a manager is built
  (:func:`host_copy`).

SGLang's own settings that bound what kvxfer can promise are read by the manager (from
``sglang.srt.environ.envs``) and judged here: :func:`release_risk`.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Mapping, Optional, Tuple, Union

from kvxfer import config
from kvxfer.errors import InvalidArgument

SECRET_ENV = config.SECRET_ENV
SECRET_FILE_ENV = "KVXFER_SECRET_FILE"
TP_STAGE_ENV = "KVXFER_SGL_TP_STAGE_MIN_OPS"
#: kvxfer.disagg's default (``KVManager(tp_stage_min_ops=...)``)
TP_STAGE_MIN_OPS = 256
#: the kv group's staging memory for staged head slices (per rank: 4 landing slots, one
#: granted per peer, and one staging slot; each capped at the group's size)
TP_STAGE_ENGINE = dict(
    stage_groups=("kv",), stage_slot_bytes=16 << 20, stage_slots=4, stage_peer_slots=1
)


def tp_stage_min_ops(env: Optional[Mapping[str, str]] = None) -> int:
    """``KVXFER_SGL_TP_STAGE_MIN_OPS`` from ``env`` (default ``os.environ``): an int >= 0;
    InvalidArgument otherwise."""
    env = os.environ if env is None else env
    raw = env.get(TP_STAGE_ENV, "").strip()
    if not raw:
        return TP_STAGE_MIN_OPS
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgument(f"{TP_STAGE_ENV}={raw!r}: expected an integer >= 0")
    return value


def host_copy(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """``KVXFER_HOST_COPY`` from ``env`` (default ``os.environ``), read per manager (the
    engine config's own default is read once per process); None when unset. EngineConfig
    validates the value."""
    env = os.environ if env is None else env
    raw = env.get("KVXFER_HOST_COPY", "").strip().lower()
    return raw or None


def resolve_secret(env: Optional[Mapping[str, str]] = None) -> bytes:
    """The engine secret from ``env`` (default ``os.environ``); InvalidArgument when absent.
    Only the file source is ours; the value is checked by :func:`kvxfer.config.resolve_secret`
    like every other secret."""
    env = os.environ if env is None else env
    value: Union[str, bytes] = env.get(SECRET_ENV, "")
    if not value:
        path = env.get(SECRET_FILE_ENV, "")
        if not path:
            raise InvalidArgument(
                f"the kvxfer transfer backend needs a shared secret: set {SECRET_ENV} (or "
                f"{SECRET_FILE_ENV}, or pass --kvxfer-secret-file) to the same value on every "
                "prefill and decode server"
            )
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as exc:
            raise InvalidArgument(f"{SECRET_FILE_ENV}={path!r}: {exc}") from None
        if not value:
            raise InvalidArgument(f"{SECRET_FILE_ENV}={path!r} is empty")
    return config.resolve_secret(value, "the kvxfer transfer backend")


DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
DEFERRED_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"


def release_risk(deferred: bool, timeout_s: float) -> Optional[Tuple[int, str]]:
    """What a decode rank should say at start about SGLang's release of a failed room's
    pages: ``(logging level, message)``, or None when SGLang waits for prefill's drained
    ack indefinitely. ``deferred``: the manager's ``enable_deferred_decode_kv_release``
    (SGLang's ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` and this backend's
    support); ``timeout_s``: ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``.

    kvxfer's prefill acks an abort only once no write of the room is in flight, but SGLang
    frees the pages itself without that ack: at once when deferred release is off
    (WARNING: any failure mid-write), after ``timeout_s`` on device destinations when it is
    on (INFO: only a prefill stalled that long, e.g. SIGSTOP or a hung host, then resuming
    over a one-sided lane). docs/integrations.md, "Fenced aborts"."""
    if not deferred:
        return (
            logging.WARNING,
            f"{DEFERRED_ENV} is off: SGLang frees a failed room's decode pages at once, "
            "while a prefill write into them may still be in flight (one-sided lanes: "
            "cuda_ipc, RDMA); it can land in pages given to another request. Leave it on "
            "(SGLang's default): decode then holds the pages until prefill's drained ack.",
        )
    t = float(timeout_s)
    if t < math.inf:  # NaN too is never reached: SGLang's `now >= deadline` stays False
        return (
            logging.INFO,
            f"{DEFERRED_TIMEOUT_ENV}={t:g}: SGLang frees a failed room's device pages after "
            f"{t:g} s without prefill's drained ack; a prefill stalled longer (a frozen "
            "process, a hung host) that resumes can still write into them over a one-sided "
            "lane. Set it to inf to hold them until the ack.",
        )
    return None
