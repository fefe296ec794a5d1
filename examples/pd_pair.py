"""A prefill worker hands N requests (KV pages, Mamba state, first token) to a decode worker
over UCX loopback; decode verifies every byte. Same as ``kvxfer demo`` / ``make demo``.

    python examples/pd_pair.py [--requests 64] [--kv-layout page_major|per_layer|mla]
                               [--mamba-layout envelope|per_layer|none] [--json] [--help]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer.pd_demo import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
