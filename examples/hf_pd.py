"""A real transformers model (tiny, seeded random weights, CPU) split across a prefill and a
decode process over UCX loopback generates exactly what it generates in one process: token
ids equal, every decode step's logits bitwise equal, also after a retract to host and a
restore into different pages and slot. Same as ``kvxfer demo --model ...``.

    python examples/hf_pd.py --model llama|bamba|deepseek|all [--layouts nhd,hnd,...]
                             [--prompts 5,8,21,50] [--corrupt swap_heads] [--json] [--help]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvxfer.pd_demo.hf_run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
