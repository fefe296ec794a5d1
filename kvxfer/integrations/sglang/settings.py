"""Where the SGLang backend's settings come from: the environment, read here and only here.

- ``KVXFER_SECRET``: the shared secret of the kvxfer engines of a prefill/decode pair
  (every prefill and decode rank of a deployment needs the same one); or
- ``KVXFER_SECRET_FILE``: a file holding it (surrounding whitespace stripped). The plugin's
  ``--kvxfer-secret-file PATH`` server argument sets this variable for the scheduler
  processes SGLang starts. Nothing else is accepted: there is no default secret.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Union

from kvxfer import config
from kvxfer.errors import InvalidArgument

SECRET_ENV = config.SECRET_ENV
SECRET_FILE_ENV = "KVXFER_SECRET_FILE"


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
