"""Which lanes UCX gives an RMA endpoint made from a worker address, per error mode, worker
(UCXX's or kvxfer's own) and memory (host, CUDA): the question behind keeping error_mode
"peer" on the channel's endpoint (docs/engine.md, "Own worker"). Prints one line per case.

    python bench/peer_lanes.py [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio

from kvxfer.transport.ucx import UcxTransport
from kvxfer.transport.ucx_rma import parse_rma_lanes


async def main(device: str) -> None:
    buf = None
    if device != "cpu":
        import torch

        buf = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
    else:
        import numpy as np

        buf = np.zeros(1 << 20, dtype=np.uint8)
    for own in (False, True):
        t = UcxTransport(own_rma=own)
        acc: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_accept(ch, acc=acc):
            acc.set_result(ch)

        _, port = await t.listen("127.0.0.1", 0, on_accept)
        client = await t.connect("127.0.0.1", port, 10.0)
        await client.send(b"x", 5.0)
        server = await asyncio.wait_for(acc, 10.0)
        await server.recv(5.0)
        addr = buf.data_ptr() if device != "cpu" else buf.ctypes.data
        reg = t.register(addr, 1 << 20)
        worker = 0 if own else t.worker_handle
        for peer in (False, True):
            ep, ctx = t._cq.ep_create(worker, t.local_address(), 4242 + peer, peer)
            rkey = t.rma.rkey_unpack(ep, reg.packed_key())
            await t.flush_ep(ep, 5.0)
            lanes = parse_rma_lanes(t.rma.ep_info(ep))
            print(
                f"{device} memory ({reg.mem_type}), {'own' if own else 'UCXX'} worker, "
                f"error mode {'PEER' if peer else 'NONE'}: RMA lanes {lanes or 'none (AM only)'}"
            )
            t.rma.rkey_destroy(rkey)
            await t.close_bulk(ep, ctx, 4242 + peer, 5.0)
        reg.release()
        await asyncio.gather(client.close(2.0), server.close(2.0))
        await t.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    asyncio.run(main(ap.parse_args().device))
