"""`kvxfer` command line: demo | bench ... | bootstrap | info.

Each subcommand imports its implementation lazily so `kvxfer info` works even where an
optional part (e.g. CUDA) is missing.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function"; each function takes the remaining argv list.
_COMMANDS = {
    "demo": ("kvxfer.demo", "main", "run the prefill/decode worker-pair demo on CPU + loopback"),
    "bench": ("kvxfer.bench", "main", "benchmarks: transfer | pd | offload | kernels"),
    "bootstrap": ("kvxfer.disagg.bootstrap", "main", "run a standalone bootstrap server"),
    "info": ("kvxfer.info", "main", "print versions, UCX transports and build facts"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="kvxfer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=sorted(_COMMANDS))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        for name, (_, _, text) in sorted(_COMMANDS.items()):
            print(f"  {name:10s} {text}")
        return 0
    cmd = parser.parse_args(argv[:1]).command
    module, func, _ = _COMMANDS[cmd]
    rc = getattr(importlib.import_module(module), func)(argv[1:])
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
