"""Every exception kvxfer raises on purpose, in one hierarchy rooted at KvxferError.

Pool and kernel errors are defined at the lowest layer (``kvxfer.kernels.errors``) and re-exported
here, so ``from kvxfer.errors import ...`` is the one place users need.
"""

from kvxfer.kernels.errors import (  # noqa: F401
    BackingError,
    CudaError,
    DoubleFree,
    IndexOutOfRange,
    InvalidArgument,
    KvxferError,
    OutOfMemory,
    ShapeMismatch,
    UnsupportedOperation,
)


class TransportError(KvxferError):
    """UCX reported a failure (status string and code in the message)."""


class PeerClosed(TransportError, ConnectionError):
    """The peer closed, died or became unreachable."""


class TransferTimeout(TransportError, TimeoutError):
    """A network wait ran past its deadline."""


class AuthenticationFailed(TransportError):
    """The peer failed the shared-secret challenge (or we did)."""


class IncompatiblePeer(TransportError):
    """The peer's protocol version or registered layout does not match ours."""


class IncompatibleLayout(InvalidArgument):
    """Two layouts of one descriptor group disagree (:func:`kvxfer.plan.check_compatible`);
    ``field`` names what differs (``count`` or ``item_lens``)."""

    def __init__(self, group: str, field: str, ours, theirs):
        super().__init__(f"group {group!r}: {field} differ (local {ours}, remote {theirs})")
        self.group, self.field, self.ours, self.theirs = group, field, ours, theirs


class ProtocolError(KvxferError):
    """A wire message is malformed, of an unknown type/version, or out of order."""


class VersionMismatch(ProtocolError, IncompatiblePeer):
    """The peer speaks another protocol version: a well-formed wire message or channel hello
    whose version is an int other than ours. The message names both versions (``ours``,
    ``theirs`` when known) and what to do. Also an :class:`IncompatiblePeer` (what the engine
    handshake has always raised for it) and a :class:`ProtocolError` (what ``wire.decode``
    raises)."""

    def __init__(self, msg: str, ours=None, theirs=None) -> None:
        super().__init__(msg)
        self.ours, self.theirs = ours, theirs


class UnknownGroup(InvalidArgument):
    """A descriptor group name that was never registered."""


class TransferAborted(KvxferError):
    """The transfer (or request) was aborted by either side."""


class Closed(KvxferError):
    """The engine, manager or handle has been closed."""


class WorkerDied(KvxferError):
    """A worker process (:mod:`kvxfer.procs`) exited before answering a call."""


class RemoteError(KvxferError):
    """A call into a worker process (:mod:`kvxfer.procs`) raised there: ``kind`` (the child's
    exception type name), ``msg`` and the child's traceback ``tb``."""

    def __init__(self, kind: str, msg: str, tb: str, worker: str = "") -> None:
        super().__init__(f"{kind}: {msg}\n--- traceback in {worker or 'the worker'} ---\n{tb}")
        self.kind, self.msg, self.tb = kind, msg, tb

    def __reduce__(self):
        return (type(self), (self.kind, self.msg, self.tb))
