"""The prefill/decode worker-pair demo (``kvxfer demo``, ``make demo``,
``examples/pd_pair.py``): see :mod:`kvxfer.pd_demo.run`.

Modules: ``spec`` (torch-free model geometry), ``model`` (synthetic hybrid model: pools,
allocators, deterministic content, byte-exact verification), ``worker`` (one prefill or decode
process: a scheduler loop around a KVManager), ``run`` (parent: bootstrap server, the two
processes, the report), ``bench`` (the PD benchmark on the same workers).

The real-model check (``kvxfer demo --model``, ``examples/hf_pd.py``): ``hf_spec`` (tiny
model configs, layouts, corruptions; no torch), ``hf`` (model <-> pools: store and rebuild the
cache), ``hf_worker`` (prefill / decode process), ``hf_corrupt`` (deliberate misplacements),
``hf_run`` (parent, report, CLI).
"""

from kvxfer.pd_demo.run import REQUIRED_KEYS, main, run_demo

__all__ = ["REQUIRED_KEYS", "main", "run_demo"]
