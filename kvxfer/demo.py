"""`kvxfer demo`: the prefill/decode worker-pair demo (:mod:`kvxfer.pd_demo`) by default;
``kvxfer demo --pools`` runs the pools demo (:mod:`kvxfer.pools_demo`), ``--model`` the
real-model check (routed by :mod:`kvxfer.pd_demo.run`)."""

from __future__ import annotations

import sys

from kvxfer.pools_demo import pools_main, pools_summary

__all__ = ["main", "pools_main", "pools_summary"]


def main(argv: list[str] | None = None) -> int:
    """``kvxfer demo [--pools | --model NAME] ...``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--pools" in argv:
        argv.remove("--pools")
        return pools_main(argv)
    from kvxfer.pd_demo import main as pd_main

    return pd_main(argv)


if __name__ == "__main__":
    sys.exit(main())
