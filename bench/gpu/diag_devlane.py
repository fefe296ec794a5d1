"""Diagnostic (GPU machine): where a device-lane write spends its host time. Two processes,
CUDA pools. The initiator has 1 or 4 engines (like ``kvxfer bench transfer``: peer/none x
device_copy auto/off); the first one (device lane on, device_min_ops=1) writes either items
only or a 1-op raw UCX write before each item write (as the benchmark does). Prints the
planner's time, the launch time (wall and the thread's CPU), the GPU time after the launch
and the whole write, in microseconds. DIAG_QUICK=1: one initiator engine, item writes only."""

import gc
import os
import sys
import time

from kvxfer.bench.transfer import SECRET, BenchNode, _groups
from kvxfer.procs import Worker


class DiagNode(BenchNode):
    def diag(self, key, peer_id, pattern, nogc):
        import numpy as np

        from kvxfer.engine import ItemWrite, RawWrite, devcopy

        sync = self.engines[key]
        peer = sync.peers()[peer_id]._peer
        steps = {}
        orig = devcopy.DeviceLane.launch

        def timed_launch(self_, *a):
            c0, t0 = time.thread_time(), time.perf_counter()
            ev = orig(self_, *a)
            t1, c1 = time.perf_counter(), time.thread_time()
            ev.synchronize()
            steps.setdefault("launch", []).append(t1 - t0)
            steps.setdefault("launch cpu", []).append(c1 - c0)
            steps.setdefault("gpu", []).append(time.perf_counter() - t1)
            return ev

        devcopy.DeviceLane.launch = timed_launch
        planner = peer._planner
        orig_plan = planner.plan

        def timed_plan(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig_plan(*a, **k)
            finally:
                steps.setdefault("plan", []).append(time.perf_counter() - t0)

        planner.plan = timed_plan
        if nogc:
            gc.disable()
        rng = np.random.default_rng(0)
        raw = [RawWrite("pm", 0, 0, 1 << 20)]
        cases = {
            "pm 256p contiguous (1 run)": [ItemWrite("pm", list(range(256)), list(range(256)))],
            "pm 2048p random (2047 runs)": [
                ItemWrite("pm", rng.permutation(2048).tolist(), rng.permutation(2048).tolist())
            ],
            "kv 16p random (256 runs)": [
                ItemWrite(
                    "kv", rng.permutation(2048)[:16].tolist(), rng.permutation(2048)[:16].tolist()
                )
            ],
        }
        out = {}
        for name, w in cases.items():
            steps.clear()
            tot = []

            async def go(w=w, tot=tot):
                for _ in range(6):
                    if pattern == "raw+items":
                        await peer.write(raw)
                    t0 = time.perf_counter()
                    await peer.write(w)
                    tot.append(time.perf_counter() - t0)

            sync._run(go(), 120)
            out[name] = {k: [round(x * 1e6) for x in v[1:]] for k, v in steps.items()}
            out[name]["write"] = [round(x * 1e6) for x in tot[1:]]
        devcopy.DeviceLane.launch = orig
        del planner.plan  # the class's method again
        gc.enable()
        return out


def main():
    groups = _groups(8, 64 << 10, 2048)
    cfg = dict(secret=SECRET, transfer_timeout_s=120.0, warn_slow_lanes=False)
    target = Worker(
        DiagNode,
        {"engines": {"t": {"config": dict(cfg, name="t"), "groups": groups, "device": "cuda"}}},
        name="target",
    )
    try:
        port = target.start(120).proxy(DiagNode).ports()["t"]
        quick = bool(os.environ.get("DIAG_QUICK"))  # one initiator engine, items only
        for n_eng in (1,) if quick else (1, 4):
            keys = [("peer", "auto"), ("peer", "off"), ("none", "auto"), ("none", "off")][:n_eng]
            init = Worker(
                DiagNode,
                {
                    "engines": {
                        f"{m}/{d}": {
                            "config": dict(
                                cfg,
                                name=f"i-{m}-{d}",
                                error_mode=m,
                                device_copy=d,
                                device_min_ops=1,
                            ),
                            "groups": groups,
                            "device": "cuda",
                        }
                        for m, d in keys
                    }
                },
                name="init",
            )
            try:
                node = init.start(120).proxy(DiagNode)
                pids = {
                    f"{m}/{d}": node.connect(f"{m}/{d}", "127.0.0.1", port)["ok"] for m, d in keys
                }
                runs = (("items", False),) if quick else None
                for pattern, nogc in runs or (
                    ("items", False),
                    ("raw+items", False),
                    ("raw+items", True),
                ):
                    res = node.diag("peer/auto", pids["peer/auto"], pattern, nogc, timeout=300)
                    for k, v in res.items():
                        print(
                            f"engines={n_eng} {pattern:9s} gc={'off' if nogc else 'on '} {k}: {v}",
                            flush=True,
                        )
            finally:
                init.close()
    finally:
        target.close()


if __name__ == "__main__":
    sys.exit(main())
