"""``kvxfer bench pd``: the prefill/decode protocol end to end against the raw engine.

The implementation lives with the demo's workers (:mod:`kvxfer.pd_demo.bench`), so the benchmark
measures exactly the pools, kernels and protocol the demo verifies.
"""

from kvxfer.pd_demo.bench import main  # noqa: F401
