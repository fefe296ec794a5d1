"""Transports for the engine: the contract (:mod:`.base`) and its UCX implementation
(:mod:`.ucx`: UCXX + the native ``_rma`` extension). Importing this package loads no UCX;
:func:`kvxfer.transport.ucx_lib.load_ucx` does, on first use."""

from kvxfer.transport.base import Channel, Region, RmaEndpoint, Transport

__all__ = ["Channel", "Region", "RmaEndpoint", "Transport"]
