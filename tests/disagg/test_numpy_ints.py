"""numpy integers are ints everywhere the API takes an int (schedulers compute page counts,
aux rows and room ids with numpy): accepted, and stored as plain ints (msgpack-able)."""

import asyncio

import msgpack
import numpy as np
import pytest

from kvxfer import BootstrapServer, KVArgs, KVManager, KVPoll, KVReceiver, KVSender, Timeouts
from kvxfer.argcheck import as_int
from kvxfer.config import EngineConfig
from kvxfer.disagg.aux import MetadataBuffer
from kvxfer.errors import InvalidArgument
from kvxfer.procs import run_in_child

pytestmark = pytest.mark.timeout(60)
I64 = np.int64


def test_as_int():
    assert as_int(I64(3), "x") == 3 and type(as_int(np.uint16(3), "x")) is int
    for bad in (True, np.bool_(True), 3.0, "3", None):
        with pytest.raises(InvalidArgument):
            as_int(bad, "x")
    with pytest.raises(InvalidArgument, match="x=-1 must be >= 0"):
        as_int(I64(-1), "x", 0)


def _args(kv, aux, **kw):
    ap, al, ai = aux.buf_infos()
    return KVArgs(
        kv_data_ptrs=[int(kv.ctypes.data)],
        kv_data_lens=[kv.nbytes],
        kv_item_lens=[64],
        aux_data_ptrs=ap,
        aux_data_lens=al,
        aux_item_lens=ai,
        dtype="uint8",
        **kw,
    )


def test_numpy_scalars_in_kvargs_and_config():
    kv, aux = np.zeros(64 * 8, np.uint8), MetadataBuffer(4, 64)
    a = _args(kv, aux, page_size=I64(2), tp_rank=I64(0), tp_size=I64(1), dp_rank=I64(0))
    assert type(a.page_size) is int and type(a.tp_size) is int
    msgpack.packb(a.fingerprint())  # plain ints only
    cfg = EngineConfig(secret=b"s", port=I64(0), device_min_ops=I64(4))
    assert type(cfg.port) is int and type(cfg.device_min_ops) is int


def test_sender_init_takes_numpy_ints():
    run_in_child(_flow_main)


def _flow_main():
    asyncio.run(_flow())


async def _flow():
    t = Timeouts(bootstrap_s=5, waiting_s=5, transfer_s=5, heartbeat_interval_s=0.2)
    bs = BootstrapServer(port=0, secret=b"np")
    await bs.start()
    pk, dk = np.arange(64 * 8, dtype=np.uint8), np.zeros(64 * 8, np.uint8)
    pa, da = MetadataBuffer(4, 64), MetadataBuffer(4, 64)
    p = await KVManager(
        _args(pk, pa), "prefill", bootstrap_addr=bs.address, timeouts=t, secret=b"np"
    ).start()
    d = await KVManager(_args(dk, da), "decode", timeouts=t, secret=b"np").start()
    try:
        recv = KVReceiver(d, bs.address, I64(11))
        recv.init()
        send = KVSender(p, bs.address, I64(11))
        send.init(I64(2), I64(1))  # refused before: InvalidArgument
        pa.set_output(1, 99)
        recv.send_metadata(np.array([5, 6]), I64(3))
        send.send(np.array([0, 7], dtype=np.int32))
        assert await recv.wait(10) == KVPoll.Success
        assert np.array_equal(dk[5 * 64 : 7 * 64], np.concatenate([pk[:64], pk[7 * 64 :]]))
        assert da.first_token(3) == 99
        with pytest.raises(InvalidArgument, match="num_kv_indices"):
            KVSender(p, bs.address, 12).init(np.float64(2), 0)
    finally:
        await d.close()
        await p.close()
        await bs.close()
