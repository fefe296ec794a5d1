"""``kvxfer bench <name> ...``: benchmarks, one module per name under :mod:`kvxfer.bench`.

Each module exposes ``main(argv) -> int``; it is imported only when asked for, so a
benchmark that needs CUDA or UCX does not get in the way of the others.
"""

from __future__ import annotations

import importlib
import sys

# name -> one-line description; the implementation is kvxfer.bench.<name>:main(argv)
BENCHES = {
    "kernels": "Triton kernels vs torch copy_ of the same bytes (GB/s, ratio)",
    "transfer": "KV transfer bandwidth / latency over UCX vs raw UCX and memcpy",
    "pd": "prefill/decode worker pair: end-to-end request transfer",
    "offload": "offload / restore of retracted requests to host memory",
    "layerwise": "layer-wise streaming vs whole-chunk sends, end to end",
}


def _usage() -> str:
    lines = ["usage: kvxfer bench {" + ",".join(BENCHES) + "} [options]", ""]
    lines += [f"  {name:10s} {text}" for name, text in BENCHES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"kvxfer bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(
            f"kvxfer bench {name}: not available in this build yet "
            f"(module {module_name} is missing)",
            file=sys.stderr,
        )
        return 2
    return int(module.main(rest) or 0)
