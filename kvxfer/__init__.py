"""kvxfer: KV-cache transfer for disaggregated LLM serving.

``import kvxfer`` stays cheap: the public names below load their modules on first access
(no UCX, torch or numpy import until then).
"""

__version__ = "0.1.0"

_LAZY = {
    "KVArgs": "kvxfer.disagg.kv_args",
    "KVPoll": "kvxfer.disagg.poll",
    "KVManager": "kvxfer.disagg.manager",
    "KVSender": "kvxfer.disagg.sender",
    "KVReceiver": "kvxfer.disagg.receiver",
    "BootstrapServer": "kvxfer.disagg.bootstrap",
    "MetadataBuffer": "kvxfer.disagg.aux",
    "Timeouts": "kvxfer.disagg.manager",
    "DisaggMode": "kvxfer.disagg.manager",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
