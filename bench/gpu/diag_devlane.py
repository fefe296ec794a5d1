"""Diagnostic (GPU machine): where a device-lane write spends its host time. Two processes,
CUDA pools, device_copy="auto"; times each step of DeviceLane.launch for a 1-run write,
a 2047-run page-major write and a 256-run per-layer write, with the default GIL switch
interval and with 10 us."""
import sys
import time

from kvxfer.bench.transfer import SECRET, BenchNode, _groups
from kvxfer.testing import Child, serve


class DiagNode(BenchNode):
    def cmd_diag(self, key, peer_id, switch):
        import numpy as np

        from kvxfer.engine import ItemWrite
        from kvxfer.engine import devcopy

        sys.setswitchinterval(switch)
        sync = self.engines[key]
        peer = sync.peers()[peer_id]._peer
        lane = peer._dev
        steps = {}
        orig_launch = devcopy.DeviceLane.launch

        def timed_launch(self_, *a):
            import cProfile
            import io
            import pstats

            t0 = time.perf_counter()
            if len(steps.get("launch", [])) == 3:
                pr = cProfile.Profile()
                ev = pr.runcall(orig_launch, self_, *a)
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(8)
                steps["profile"] = buf.getvalue().splitlines()[-14:]
            else:
                ev = orig_launch(self_, *a)
            steps.setdefault("launch", []).append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            ev.synchronize()
            steps.setdefault("gpu_after_launch", []).append(time.perf_counter() - t1)
            return ev

        devcopy.DeviceLane.launch = timed_launch
        rng = np.random.default_rng(0)
        cases = {"pm 512p contiguous (1 run)": [ItemWrite("pm", list(range(512)), list(range(512)))],
                 "pm 2048p random (2047 runs)": [ItemWrite("pm", rng.permutation(2048), rng.permutation(2048))],
                 "kv 16p random (256 runs)": [ItemWrite("kv", rng.permutation(2048)[:16], rng.permutation(2048)[:16])]}
        out = {}
        for name, w in cases.items():
            steps.clear()
            tot = []
            for _ in range(6):
                t0 = time.perf_counter()
                sync._run(peer.write(w), 60)
                tot.append(time.perf_counter() - t0)
            prof = steps.pop("profile", [])
            out[name] = {k: [round(x * 1e6) for x in v[1:]] for k, v in steps.items()}
            out[name]["profile"] = prof
            out[name]["total"] = [round(x * 1e6) for x in tot[1:]]
        devcopy.DeviceLane.launch = orig_launch
        out["lane"] = peer.device_lane
        return out


def diag_node(inbox, outbox, spec):
    node = DiagNode(spec)
    outbox.put(("ok", node.ports))
    try:
        serve(inbox, outbox, node.handlers())
    finally:
        node.close()


def main():
    groups = _groups(8, 64 << 10, 2048)
    cfg = dict(secret=SECRET, transfer_timeout_s=120.0, warn_slow_lanes=False)
    target = Child(diag_node, {"engines": {"t": {"config": dict(cfg, name="t"), "groups": groups,
                                                 "device": "cuda"}}}, name="target")
    init = Child(diag_node, {"engines": {"i": {"config": dict(cfg, name="i"), "groups": groups,
                                               "device": "cuda"}}}, name="init")
    try:
        port = target.start(120)["t"]
        init.start(120)
        pid = init.call("connect", "i", "127.0.0.1", port)["ok"]
        for switch in (0.005, 1e-5):
            print(f"### switch interval {switch}")
            for k, v in init.call("diag", "i", pid, switch, timeout=300).items():
                if isinstance(v, dict):
                    for line in v.pop("profile", []):
                        print("   ", line)
                print(f"{k}: {v}")
    finally:
        init.stop()
        target.stop()


if __name__ == "__main__":
    main()
