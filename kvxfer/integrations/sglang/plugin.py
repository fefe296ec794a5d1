"""SGLang plugin (entry point ``kvxfer`` in group ``sglang.srt.plugins``): makes
``--disaggregation-transfer-backend kvxfer`` a backend with no patch to SGLang.

SGLang calls :func:`register` in every process before parsing arguments. It

1. admits the name ``kvxfer`` in the CLI choices (``add_disagg_transfer_backend_choices``);
2. hooks ``TransferBackend._missing_`` (through SGLang's hook registry) so that
   ``TransferBackend("kvxfer")`` - SGLang's closed Enum - returns one extra member, created
   once and cached like the built-in ones (every existing member keeps its identity);
3. wraps ``get_kv_class`` so that member maps to :mod:`kvxfer.integrations.sglang.conn`
   (imported on first use: loading the plugin imports neither kvxfer's engine nor UCX);
4. adds ``--kvxfer-secret-file PATH`` to the server arguments; when given, it is exported as
   ``KVXFER_SECRET_FILE`` to the scheduler processes SGLang starts (see :mod:`.settings`).

Idempotent: a second call changes nothing.
"""

from __future__ import annotations

import os

from kvxfer.integrations.sglang import BACKEND_NAME
from kvxfer.integrations.sglang.settings import SECRET_FILE_ENV

_UTILS = "sglang.srt.disaggregation.utils"
_done = False


def _missing(original, value):
    """``TransferBackend._missing_``: our value becomes a cached pseudo-member."""
    if value != BACKEND_NAME:
        return original(value)
    cls = original.__self__
    member = cls._value2member_map_.get(BACKEND_NAME)
    if member is None:
        member = object.__new__(cls)
        member._name_, member._value_ = "KVXFER", BACKEND_NAME
        cls._value2member_map_[BACKEND_NAME] = member
    return member


def _get_kv_class(original, transfer_backend, class_type):
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.base import KVArgs
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return KVArgs
    from kvxfer.integrations.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvxferKVManager,
        KVClassType.SENDER: conn.KvxferKVSender,
        KVClassType.RECEIVER: conn.KvxferKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvxferKVBootstrapServer,
    }.get(class_type)


def _add_cli_args(result, parser):
    parser.add_argument(
        "--kvxfer-secret-file",
        type=str,
        default=None,
        help="File holding the shared secret of the kvxfer transfer backend (the same on "
        "every prefill and decode server); alternative to the env var KVXFER_SECRET.",
    )


def register() -> None:
    global _done
    if _done:
        return
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    HookRegistry.register(f"{_UTILS}.TransferBackend._missing_", _missing, HookType.AROUND)
    HookRegistry.register(f"{_UTILS}.get_kv_class", _get_kv_class, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.from_cli_args", _from_cli_args_hook, HookType.BEFORE
    )
    _done = True


def _from_cli_args_hook(*args, **kw):
    """BEFORE ``ServerArgs.from_cli_args(cls, namespace)``: export the secret file's path
    to the environment the scheduler processes inherit."""
    ns = args[-1] if args else kw.get("args")
    path = getattr(ns, "kvxfer_secret_file", None)
    if path:
        os.environ[SECRET_FILE_ENV] = os.path.abspath(path)
    return None
