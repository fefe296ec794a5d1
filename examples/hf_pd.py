"""A real transformers model (tiny, seeded random weights, CPU) split across a prefill and a
decode process over UCX loopback generates exactly what it generates in one process: token
ids equal, every decode step's logits bitwise equal, also after a retract to host and a
restore into different pages and slot. Same as ``kvxfer demo --model ...``. With
``--prefill-tp N --decode-tp M``: one process per TP rank, each rank's pools and transfer
the real heterogeneous-TP ones, the model itself run whole in every process (emulated TP).

    python examples/hf_pd.py --model llama|bamba|deepseek|all [--layouts nhd,hnd,...]
                             [--prompts 5,8,21,50] [--prefill-tp 1 --decode-tp 2]
                             [--corrupt swap_heads|swap_ranks] [--json] [--help]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer.pd_demo.hf_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
